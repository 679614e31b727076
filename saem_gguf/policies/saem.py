"""SAEM: stage-aware placement (paper, sections IV-V).

At each stage boundary, rank each layer's experts by their usage in the completed stage
(token-level counts aggregated over every sequence of the batch since the last placement),
make the top ``slots`` of each layer resident, and issue all copies at once (prefetch, layer 0
first). Between boundaries residency never changes. A non-resident expert runs in place on the
CPU unless moving it is faster (``miss_mode`` MISS_RULE, priced by pricing.price_layer: lower
latency wins, so the CPU wins at few tokens); a transferred expert goes through a temporary
slot and is not kept.

Boundaries, all decided causally from what has been generated:

* ``cue``: a stage event from the text (the stage detector's cue match), ignored when it comes
  fewer than ``min_gap_steps`` after the last placement (too little evidence to rank on);
* ``warmup``: once per batch, ``warmup_steps`` into decoding, from the batch's own routing.
  The paper ranks on the completed stage; for the first stage of a request that is the
  prompt (``begin_group`` uses the prefill routing when there is one, calibration otherwise)
  and this early re-rank stands in when the prompt is short or missing;
* ``refresh``: a stage longer than ``refresh_steps`` is split (a safety net for text with no
  cues; the paper's stages are at most ~7k tokens);
* ``implicit`` (``saem-implicit``): the routing shifted without a cue. When the simulator ran
  the stage detector (saem_gguf.stage, the default), its combined cue + routing-shift events
  are used (Jensen-Shannon shift of a sequence's routing; see docs/STAGES.md). Otherwise a
  built-in fallback fires when the hit fraction's moving average falls well below its mean
  since the last placement, and ranks the last ``implicit_window`` steps (the new stage's
  start) rather than the whole old stage.

``saem-strict`` is the paper's rule alone (cue boundaries only). ``saem-cue`` ranks a stage
that a cue opens by the calibrated routing of earlier stages opened by the same cue
(cue_profiles.py), with the completed stage as a small second term. The oracle (oracle.py)
shares this class's boundary schedule and ranks the next stage's true
counts.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np
from numba import njit

from saem_gguf.kernel_books import entry_point
from saem_gguf.policies.base import MISS_CPU, MISS_RULE, MISS_TRANSFER, Policy, PolicyContext
from saem_gguf.policies.cue_profiles import START
from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.state import CacheState, ResidencyChange, RoutingBlock, StepEvents


@dataclass
class SaemConfig:
    min_gap_steps: int = 16
    warmup_steps: int = 32  # 0 = off
    refresh_steps: int = 512  # 0 = off
    use_events: bool = True
    miss: str = "rule"  # rule | cpu | transfer
    implicit: bool = False
    implicit_window: int = 32
    detector_alpha: float = 0.1
    detector_drop: float = 0.2
    detector_min_steps: int = 32
    min_prefill_tokens: int = 16
    # saem-cue: a cue's calibrated profile is used when it holds this many tokens, and the
    # completed stage (or the prompt) is added with this weight (both as per-layer shares)
    cue_min_tokens: int = 16
    stage_weight: float = 0.25


_MISS = {"rule": MISS_RULE, "cpu": MISS_CPU, "transfer": MISS_TRANSFER}

# The built-in implicit-boundary detector's state (float64 array ``det``): the hit fraction's
# moving average against its mean since the last placement (used when no stage detector's
# routing-shift events are given: StepEvents.combined is None)
D_ALPHA = 0  # EWMA weight of the newest step's hit fraction
D_DROP = 1  # fire when EWMA < (1 - drop) * mean since the last placement
D_MIN_STEPS = 2  # steps after a placement before the detector may fire
D_STEPS = 3
D_MEAN = 4
D_EWMA = 5
N_DET = 6


def new_detector(alpha: float = 0.1, drop: float = 0.2, min_steps: int = 32) -> np.ndarray:
    d = np.zeros(N_DET, np.float64)
    d[D_ALPHA] = alpha
    d[D_DROP] = drop
    d[D_MIN_STEPS] = min_steps
    return d


def reset_detector(det: np.ndarray) -> None:
    det[D_STEPS] = 0.0
    det[D_MEAN] = 0.0
    det[D_EWMA] = 0.0


@njit(cache=True)
def stage_books(rows, slot_of, counts, on, det, ring, pos):
    """SAEM's books for one decode step: add the routing of ``rows`` int16 [B, L, K] (-1 rows:
    no token) to ``counts`` float64 [L, E]; with the built-in detector ``on``, write the step's
    counts to ``ring[pos]`` (ring float64 [W, L, E]) and feed its hit fraction under ``slot_of``
    (the residency the step ran with) to ``det`` (D_*). Returns (decoded: whether any row had a
    token, fired: whether the detector reports a drop). The ring and its position travel apart
    so that the caller makes no view per step (after a decode each NumPy call costs
    microseconds)."""
    L, E = counts.shape
    if on:
        ring[pos] = 0.0
    decoded = False
    n_acc = 0.0
    n_hit = 0.0
    for b in range(rows.shape[0]):
        if rows[b, 0, 0] < 0:
            continue
        decoded = True
        for l in range(L):
            for k in range(rows.shape[2]):
                e = rows[b, l, k]
                counts[l, e] += 1.0
                if on:
                    ring[pos, l, e] += 1.0
                    n_acc += 1.0
                    if slot_of[l, e] >= 0:
                        n_hit += 1.0
    if not on or n_acc == 0.0:
        return decoded, False
    h = n_hit / n_acc
    det[D_STEPS] += 1
    det[D_MEAN] += (h - det[D_MEAN]) / det[D_STEPS]
    det[D_EWMA] = h if det[D_STEPS] == 1 else det[D_EWMA] + det[D_ALPHA] * (h - det[D_EWMA])
    return decoded, det[D_STEPS] >= det[D_MIN_STEPS] and det[D_EWMA] < (1.0 - det[D_DROP]) * det[D_MEAN]


class SaemPolicy(Policy):
    name = "saem-stage"
    summary = ("SAEM's stage rule with a warm-up re-rank and long-stage refresh: rank by the completed stage at "
               "each boundary, no churn between, CPU vs transfer by latency")
    default_config = SaemConfig()

    def __init__(self, config: SaemConfig | None = None, **overrides) -> None:
        super().__init__()
        cfg = config or type(self).default_config
        self.cfg = SaemConfig(**{**cfg.__dict__, **overrides})
        if self.cfg.miss not in _MISS:
            raise ValueError(f"miss must be one of {sorted(_MISS)}")
        self.miss_mode = _MISS[self.cfg.miss]
        self.boundaries: list[tuple[int, str]] = []  # (global step, reason) of every placement

    # -- state ---------------------------------------------------------------------------

    def start(self, ctx: PolicyContext) -> CacheState:
        state = super().start(ctx)
        self._counts = np.zeros((ctx.n_layer, ctx.n_expert))
        self._since_plan = 0
        self._group_steps = 0
        self._warm_pending = False
        self._fired = False
        self._step = 0  # global index of the next decode step (one per observe)
        self._det = new_detector(self.cfg.detector_alpha, self.cfg.detector_drop, self.cfg.detector_min_steps)
        W = max(1, self.cfg.implicit_window)
        # the built-in detector's window of per-step counts (the new stage's start)
        self._ring = np.zeros((W, ctx.n_layer, ctx.n_expert)) if self.cfg.implicit else np.zeros((1, 1, 1))
        self._ring_pos = 0
        # read once: after a decode every property or method call per step costs microseconds
        self._wants_combined = self.uses_combined_events
        self._implicit = self.cfg.implicit
        self._bound_rows: np.ndarray | None = None  # bind_step's rows and stage_books' entry point for them
        self._bound_entry = stage_books
        return state

    def bind_step(self, routing_rows: np.ndarray) -> None:
        # the books are this policy's own C-ordered arrays, made in start: their types are fixed
        self._bound_entry = entry_point(stage_books, routing_rows, self.state.slot_of, self._counts, False, self._det,
                                        self._ring, 0)
        self._bound_rows = routing_rows

    def begin_group(self, block: RoutingBlock) -> ResidencyChange | None:
        self._group_steps = 0
        self._warm_pending = self.cfg.warmup_steps > 0
        return self._place(self._request_scores(block), "request")

    def _request_scores(self, block: RoutingBlock) -> np.ndarray:
        if block.prefill_counts is not None and block.prefill_tokens >= self.cfg.min_prefill_tokens:
            return block.prefill_counts
        return self.ctx.calib

    # -- boundary schedule (shared with the oracle) ---------------------------------------

    @property
    def uses_combined_events(self) -> bool:
        return self.cfg.implicit

    def _builtin_detector(self, events: StepEvents) -> bool:
        """The hit-fraction fallback runs when the policy wants routing-shift boundaries and no
        stage detector reports them (``_book`` and the adaptive ``observe`` test the same without
        the call)."""
        return self._implicit and events.combined is None

    def _boundary_after_step(self, builtin: bool, decoded: bool, fired: bool, events: StepEvents) -> str:
        """After ``stage_books`` ran on a step (``builtin``: with the built-in detector): the
        schedule's clocks move, and the boundary due after the step is returned ("" for none). A
        stage event counts when it is one this policy acts on: the combined cue + routing-shift
        detector's, when the policy uses it and it ran, else the cue detector's. One call per
        step, not three (after a decode each costs microseconds)."""
        if builtin:
            self._ring_pos = (self._ring_pos + 1) % self._ring.shape[0]
        self._fired = self._fired or fired
        self._since_plan += int(decoded)
        self._group_steps += int(decoded)
        self._step += 1
        cfg = self.cfg
        if self._fired:
            return "implicit"
        if cfg.use_events and self._since_plan >= cfg.min_gap_steps:
            combined = events.combined
            # events.rows: events.cue_event, without the property call
            acts = combined if combined is not None and self._wants_combined else events.rows
            if acts:
                return "cue" if events.rows else "implicit"
        if self._warm_pending and self._group_steps >= cfg.warmup_steps:
            return "warmup"
        if cfg.refresh_steps > 0 and self._since_plan >= cfg.refresh_steps:
            return "refresh"
        return ""

    # -- decisions -----------------------------------------------------------------------

    def observe(self, routing_rows: np.ndarray, events: StepEvents,
                link_budget: float = math.inf) -> ResidencyChange | None:
        reason = self._book(routing_rows, events)
        if not reason:
            return None
        return self._place(self._boundary_scores(events, reason), reason)

    def _book(self, routing_rows: np.ndarray, events: StepEvents) -> str:
        """The step's books (stage counts, the built-in detector, the schedule's clocks); returns
        the boundary due after the step ("" for none)."""
        builtin = self._implicit and events.combined is None  # _builtin_detector
        # the entry point only for the bound rows: it would read any other array as their type
        kernel = self._bound_entry if routing_rows is self._bound_rows else stage_books
        decoded, fired = kernel(routing_rows, self.state.slot_of, self._counts, builtin, self._det, self._ring,
                                self._ring_pos)
        return self._boundary_after_step(builtin, decoded, fired, events)

    def _boundary_scores(self, events: StepEvents, reason: str) -> np.ndarray:
        if reason == "implicit" and self._builtin_detector(events):
            return self._ring.sum(axis=0)
        return self._counts

    def _place(self, scores: np.ndarray, reason: str) -> ResidencyChange | None:
        change = self._apply_plan(plan_from_scores(self.state, scores, reason=reason))
        self._placed(reason)
        return change

    def _placed(self, reason: str) -> None:
        """The schedule after a placement before step ``self._step``: a new stage starts counting."""
        self.boundaries.append((self._step, reason))
        self._counts[:] = 0.0
        self._since_plan = 0
        self._fired = False
        if reason != "request":
            self._warm_pending = False
        reset_detector(self._det)


def _share(counts: np.ndarray) -> np.ndarray:
    """Per-layer shares of routing counts [L, E] (rows of zeros stay zero)."""
    tot = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, tot, out=np.zeros_like(counts, dtype=np.float64), where=tot > 0)


class SaemCuePolicy(SaemPolicy):
    name = "saem-cue"
    summary = "SAEM ranking a cue's stage by calibrated stages that cue opened, plus the completed stage"

    def _cue_share(self, cue: str) -> np.ndarray | None:
        c = (self.ctx.cue_counts or {}).get(cue)
        if c is None or c[0].sum() < self.cfg.cue_min_tokens * self.ctx.top_k:
            return None
        return _share(c)

    def _blend(self, shares: list[np.ndarray], rows: int, base: np.ndarray) -> np.ndarray:
        """The cue profiles of the ``len(shares)`` rows that opened a stage, out of ``rows``,
        and the completed stage's counts for the rest plus ``stage_weight``."""
        r = len(shares) / max(1, rows)
        return r * np.mean(shares, axis=0) + (1.0 - r + self.cfg.stage_weight) * _share(base)

    def _request_scores(self, block: RoutingBlock) -> np.ndarray:
        base = super()._request_scores(block)
        start = self._cue_share(START)
        return base if start is None else self._blend([start], 1, base)

    def _boundary_scores(self, events: StepEvents, reason: str) -> np.ndarray:
        base = super()._boundary_scores(events, reason)
        if reason != "cue":
            return base
        shares = [x for x in (self._cue_share(c) for c in events.named_cues()) if x is not None]
        if not shares:
            return base
        return self._blend(shares, events.n_rows, base)


class SaemStrictPolicy(SaemPolicy):
    name = "saem-strict"
    summary = "SAEM with cue boundaries only (no warm-up re-rank, no long-stage refresh): the paper's rule alone"
    default_config = SaemConfig(warmup_steps=0, refresh_steps=0)


class SaemImplicitPolicy(SaemPolicy):
    name = "saem-implicit"
    summary = "SAEM plus implicit boundaries detected from a drop of the hit fraction (routing shift without a cue)"
    default_config = SaemConfig(implicit=True)


class SaemNoCpuPolicy(SaemPolicy):
    name = "saem-nocpu"
    summary = "SAEM ablation: non-resident experts always transferred through a temporary slot"
    default_config = SaemConfig(miss="transfer")
