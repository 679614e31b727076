"""SAEM: stage-aware placement (paper, sections IV-V).

At each stage boundary, rank each layer's experts by their usage in the completed stage
(token-level counts aggregated over every sequence of the batch since the last placement),
make the top ``slots`` of each layer resident, and issue all copies at once (prefetch, layer 0
first). Between boundaries residency never changes. A non-resident expert runs in place on the
CPU unless moving it is faster (replay.fixed_layer: lower latency wins, so the CPU wins at
few tokens); a transferred expert goes through a temporary slot and is not kept.

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

from dataclasses import dataclass

import numpy as np

from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.accounting import Accounting
from saem_gguf.policies.base import Policy, PolicyContext
from saem_gguf.policies.state import CacheState, RoutingBlock, counts_between
from saem_gguf.policies.cue_profiles import START
from saem_gguf.policies.replay import D_ON, MISS_CPU, MISS_RULE, MISS_TRANSFER, new_detector, reset_detector, run_fixed


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
        self._miss = _MISS[self.cfg.miss]
        self.boundaries: list[tuple[int, str]] = []  # (global step, reason) of every placement

    # -- state ---------------------------------------------------------------------------

    def start(self, ctx: PolicyContext) -> CacheState:
        state = super().start(ctx)
        self._counts = np.zeros((ctx.n_layer, ctx.n_expert))
        self._since_plan = 0
        self._group_steps = 0
        self._warm_pending = False
        self._fired = False
        self._det = new_detector(self.cfg.implicit, self.cfg.detector_alpha, self.cfg.detector_drop,
                                 self.cfg.detector_min_steps)
        W = max(1, self.cfg.implicit_window)
        self._ring = np.zeros((W, ctx.n_layer, ctx.n_expert)) if self.cfg.implicit else None  # built-in detector
        self._ring_pos = 0
        return state

    def begin_group(self, block: RoutingBlock, state: CacheState, acct: Accounting) -> None:
        self._group_steps = 0
        self._warm_pending = self.cfg.warmup_steps > 0
        self._place(self._request_scores(block), block, 0, state, acct, "request")

    def _request_scores(self, block: RoutingBlock) -> np.ndarray:
        if block.prefill_counts is not None and block.prefill_tokens >= self.cfg.min_prefill_tokens:
            return block.prefill_counts
        return self.ctx.calib

    # -- boundary schedule (shared with the oracle) ---------------------------------------

    def _events(self, block: RoutingBlock) -> np.ndarray:
        """Stage events this policy acts on: cue events, or with ``implicit`` the stage
        detector's cue + routing-shift events when the block carries them."""
        if self.cfg.implicit and block.implicit_event_steps is not None:
            return block.implicit_event_steps
        return block.event_steps

    @property
    def uses_combined_events(self) -> bool:
        return self.cfg.implicit

    def _builtin_detector(self, block: RoutingBlock) -> bool:
        return self.cfg.implicit and block.implicit_event_steps is None

    def _has_event(self, block: RoutingBlock, s: int) -> bool:
        ev = self._events(block)
        i = int(np.searchsorted(ev, s))
        return i < ev.size and int(ev[i]) == s

    def _due(self, block: RoutingBlock, s: int) -> str:
        cfg = self.cfg
        if self._fired:
            return "implicit"
        if cfg.use_events and self._since_plan >= cfg.min_gap_steps and self._has_event(block, s):
            ev = block.event_steps
            i = int(np.searchsorted(ev, s))
            return "cue" if i < ev.size and int(ev[i]) == s else "implicit"
        if self._warm_pending and self._group_steps >= cfg.warmup_steps:
            return "warmup"
        if cfg.refresh_steps > 0 and self._since_plan >= cfg.refresh_steps:
            return "refresh"
        return ""

    def _next_check(self, block: RoutingBlock, s: int, s1: int) -> int:
        """First step after s at which _due could become true (implicit fires stop the kernel)."""
        cfg = self.cfg
        nxt = s1
        if cfg.use_events:
            ev = self._events(block)
            i = int(np.searchsorted(ev, s + 1))
            if i < ev.size:
                nxt = min(nxt, int(ev[i]))
        if self._warm_pending:
            nxt = min(nxt, s + max(1, cfg.warmup_steps - self._group_steps))
        if cfg.refresh_steps > 0:
            nxt = min(nxt, s + max(1, cfg.refresh_steps - self._since_plan))
        return max(nxt, s + 1)

    def next_boundary(self, block: RoutingBlock, s: int) -> int:
        """Step of the next placement if one is made at s (no implicit fires): what the oracle
        needs to know how far its "next stage" runs."""
        cfg = self.cfg
        nb = block.n_steps
        if cfg.use_events:
            ev = self._events(block)
            i = int(np.searchsorted(ev, s + max(1, cfg.min_gap_steps)))
            if i < ev.size:
                nb = min(nb, int(ev[i]))
        if self._warm_pending:
            nb = min(nb, s + max(1, cfg.warmup_steps - self._group_steps))
        if cfg.refresh_steps > 0:
            nb = min(nb, s + cfg.refresh_steps)
        return nb

    # -- replay --------------------------------------------------------------------------

    def run_steps(self, block: RoutingBlock, s0: int, s1: int, state: CacheState, acct: Accounting) -> None:
        s = s0
        cost = self.ctx.cost.array
        self._det[D_ON] = 1.0 if self._builtin_detector(block) else 0.0
        while s < s1:
            reason = self._due(block, s)
            if reason:
                self._place(self._boundary_scores(block, s, reason), block, s, state, acct, reason)
            nxt = min(self._next_check(block, s, s1), s1)
            stop = run_fixed(block.routing, s, nxt, block.step0, state.slot_of, state.ready_at, cost, self._miss,
                             acct.clock, acct.counters, self._det, acct.log, acct.log_n)
            self._observe(block, s, stop)
            if stop < nxt:
                self._fired = True
            s = stop

    def _observe(self, block: RoutingBlock, a: int, b: int) -> None:
        self._counts += counts_between(block.routing, a, b, self.ctx.n_expert)
        decoded = int(np.count_nonzero(block.n_tok[a:b]))  # the engine's next step has no token yet
        self._since_plan += decoded
        self._group_steps += decoded
        if self._ring is not None and self._det[D_ON] > 0:
            W = self._ring.shape[0]
            for s in range(max(a, b - W), b):
                self._ring[self._ring_pos] = counts_between(block.routing, s, s + 1, self.ctx.n_expert)
                self._ring_pos = (self._ring_pos + 1) % W

    def _boundary_scores(self, block: RoutingBlock, s: int, reason: str) -> np.ndarray:
        if reason == "implicit" and self._ring is not None and self._builtin_detector(block):
            return self._ring.sum(axis=0)
        return self._counts

    def _place(self, scores: np.ndarray, block: RoutingBlock, s: int, state: CacheState, acct: Accounting,
               reason: str) -> None:
        plan = plan_from_scores(state, scores, reason=reason)
        self.apply(plan, state, acct, block.step0 + s)
        self._placed(block, s, reason)

    def _placed(self, block: RoutingBlock, s: int, reason: str) -> None:
        """The schedule after a placement at step ``s``: a new stage starts counting."""
        self.boundaries.append((block.step0 + s, reason))
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

    def _boundary_scores(self, block: RoutingBlock, s: int, reason: str) -> np.ndarray:
        base = super()._boundary_scores(block, s, reason)
        if reason != "cue":
            return base
        shares = [x for x in (self._cue_share(c) for c in block.cues_at(s)) if x is not None]
        if not shares:
            return base
        return self._blend(shares, block.routing.shape[1], base)


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
