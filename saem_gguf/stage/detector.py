"""The engine-facing streaming stage detector: cue matcher + optional implicit detector.

One ``feed`` per decode step: the text piece (and, when the routing-shift detector runs, the
top-k expert ids [L, K]) of the token each active sequence just produced. A boundary is a cue,
or (with ``use_implicit``) a routing shift; with both on, the shift must be ``combined_scale``
times stronger, since cues already catch the explicit transitions. Either kind restarts the
other's stage, and one minimum stage length applies to both.

The detector keeps no routing histograms: the policies count the routing they rank by
themselves (policies/), so a cue-only detector reads no routing at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from saem_gguf.errors import SaemError
from saem_gguf.stage.cues import CueSet
from saem_gguf.stage.implicit import ImplicitConfig, ImplicitDetector
from saem_gguf.stage.matcher import CueMatcher
from saem_gguf.stage.steps import check_pieces, routing_rows, step_slots

if TYPE_CHECKING:
    from saem_gguf.stage.calibrate import Profile


@dataclass
class DetectorConfig:
    min_stage_tokens: int = 32  # no boundary within this many tokens of the previous one
    use_cues: bool = True
    use_implicit: bool = False
    implicit: ImplicitConfig = field(default_factory=ImplicitConfig)
    # With cues on, an implicit boundary needs a shift this many times the implicit thresholds.
    combined_scale: float = 1.5


class StageEvent(NamedTuple):
    seq: int
    token: int  # token index at which the boundary was detected; the new stage starts here
    source: str  # "cue" | "implicit"
    cue_id: int  # -1 for implicit
    cue: str  # cue text, "" for implicit
    score: float  # implicit: excess divergence when it fired; cue: 0.0


NO_EVENTS: tuple[StageEvent, ...] = ()  # what feed returns for a step without a boundary

class StageDetector:
    """Per-sequence stage detection for ``n_seq`` slots (one token per slot per ``feed``).

    The routing shape (``n_layer``, ``n_expert``, ``top_k``) is needed for implicit detection
    (``tracks_routing``: it is known, so ``fresh`` can make a twin that detects routing shifts);
    ``feed`` needs the experts of each token only when the routing-shift detector runs
    (``needs_routing``).
    """

    def __init__(self, n_seq: int, cues: CueSet | None = None, config: DetectorConfig | None = None, *,
                 n_layer: int = 0, n_expert: int = 0, top_k: int = 0):
        self.config = cfg = config or DetectorConfig()
        if cfg.min_stage_tokens < 0 or cfg.combined_scale <= 0:
            raise SaemError(f"bad detector config: {cfg}")
        if n_seq < 1:
            raise SaemError("n_seq must be >= 1")
        self.n_seq = n_seq
        self.matcher: CueMatcher | None = None
        if cfg.use_cues:
            if cues is None or len(cues) == 0:
                raise SaemError("use_cues needs a non-empty cue set")
            self.matcher = CueMatcher(cues, n_seq, cfg.min_stage_tokens)
        self.cues = cues
        self.tracks_routing = n_layer > 0
        if cfg.use_implicit and not self.tracks_routing:
            raise SaemError("implicit detection needs the routing shape (n_layer, n_expert, top_k)")
        if not cfg.use_cues and not cfg.use_implicit:
            raise SaemError("the detector needs cues, implicit detection, or both")
        self.implicit: ImplicitDetector | None = None
        self.shape = (n_layer, n_expert, top_k)
        if self.tracks_routing:
            if min(n_expert, top_k) < 1:
                raise SaemError(f"bad routing shape: n_layer={n_layer} n_expert={n_expert} top_k={top_k}")
            if cfg.use_implicit:
                icfg = replace(cfg.implicit, min_stage_tokens=cfg.min_stage_tokens)
                self.implicit = ImplicitDetector(n_seq, n_layer, n_expert, top_k, icfg)
        self._scale = cfg.combined_scale if (cfg.use_cues and cfg.use_implicit) else 1.0
        self._stage_start = np.zeros(n_seq, np.int64)

    @classmethod
    def from_profile(cls, profile: Profile, n_seq: int, *, use_implicit: bool | None = None,
                     track_routing: bool = True) -> StageDetector:
        """A detector configured by a calibration profile (its cues and thresholds)."""
        sig = profile.signature
        use_imp = profile.implicit is not None if use_implicit is None else use_implicit
        cfg = DetectorConfig(
            min_stage_tokens=int(profile.thresholds.get("min_stage_tokens", 32)),
            use_cues=len(profile.cues) > 0,
            use_implicit=use_imp,
            implicit=profile.implicit or ImplicitConfig(),
        )
        shape = dict(n_layer=sig.n_layer, n_expert=sig.n_expert, top_k=sig.n_expert_used) if (
            track_routing or use_imp) else {}
        return cls(n_seq, profile.cues if len(profile.cues) else None, cfg, **shape)

    def fresh(self, n_seq: int | None = None, use_implicit: bool | None = None) -> StageDetector:
        """A new detector with this one's cues, thresholds and routing shape (``use_implicit``
        overrides whether the routing-shift detector runs too): the engine runs a combined twin
        of its cue detector for policies that act on both, the simulator replays the same."""
        cfg = self.config if use_implicit is None else replace(self.config, use_implicit=use_implicit)
        L, E, K = self.shape
        return StageDetector(self.n_seq if n_seq is None else n_seq, self.cues, cfg, n_layer=L, n_expert=E, top_k=K)

    def reset(self, seq: int, start_token: int = 0) -> None:
        """A new sequence in slot ``seq``; its next token has index ``start_token``."""
        self._check_slot(seq)
        if self.matcher is not None:
            self.matcher.reset(seq, start_token)
        if self.implicit is not None:
            self.implicit.reset(seq, start_token)
        self._stage_start[seq] = start_token

    def _check_slot(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise SaemError(f"sequence slot {seq} out of range 0..{self.n_seq - 1}")

    @property
    def needs_routing(self) -> bool:
        """Whether ``feed`` reads the experts of each token (the routing-shift detector runs)."""
        return self.implicit is not None

    def feed(self, seq_idx, pieces: Sequence[bytes] | None = None,
             experts: np.ndarray | None = None) -> Sequence[StageEvent]:
        """Consume one token for each slot in ``seq_idx`` (distinct slots): its text piece and,
        when the routing-shift detector runs, its experts [B, L, K] (ignored otherwise). Returns
        the boundaries found (an empty tuple when none: nothing is allocated for a quiet step)."""
        # cue and routing events are merged per slot after both kernels ran
        seq_idx = step_slots(seq_idx, distinct=self.matcher is not None and self.implicit is not None)
        B = seq_idx.shape[0]
        if B == 0:
            return NO_EVENTS
        if self.matcher is not None:
            if pieces is None:
                raise SaemError("feed: this detector matches cues and needs the token pieces")
            check_pieces(pieces, B)
        if self.implicit is not None:
            experts = routing_rows(experts, B, self.shape)
        return self.feed_checked(seq_idx, pieces, experts)

    def bind_step(self, seq_idx: np.ndarray) -> None:
        """Later ``feed_checked`` calls with these very slots call the cue matcher's compiled
        entry point (CueMatcher.bind_step). The routing-shift detector's kernel keeps its
        dispatcher: the default detector matches cues only (with routing shifts, the engine's
        policies that use them run stage.pair, which binds)."""
        if self.matcher is not None:
            self.matcher.bind_step(seq_idx)

    def feed_checked(self, seq_idx: np.ndarray, pieces: Sequence[bytes] | None,
                     experts: np.ndarray | None) -> Sequence[StageEvent]:
        """``feed`` for a step already known to be what it takes (int64 [B] distinct slots, B >= 1,
        B pieces, int16 [B, L, K] rows when the routing-shift detector runs): the engine's decode
        step, whose row it read itself, spares the checks."""
        events: list[StageEvent] | None = None
        if self.matcher is not None:
            mev = self.matcher.feed_checked(seq_idx, pieces)
            if len(mev):
                events = []
                for s, c, t in mev.tuples():
                    events.append(StageEvent(s, t, "cue", c, self.cues[c].text, 0.0))
                    self._boundary(s, t)
        if self.implicit is not None:
            iev = self.implicit.update_checked(seq_idx, experts, self._scale)
            if len(iev):
                events = events if events is not None else []
                for s, t, x in zip(iev.seq.tolist(), iev.token.tolist(), iev.score.tolist()):
                    events.append(StageEvent(s, t, "implicit", -1, "", float(x)))
                    self._boundary(s, t, implicit=True)
                    if self.matcher is not None:
                        self.matcher.mark_boundary(s, t)
        return NO_EVENTS if events is None else events

    def _boundary(self, s: int, t: int, implicit: bool = False) -> None:
        self._stage_start[s] = t
        if self.implicit is not None and not implicit:
            self.implicit.new_stage(s, t)  # a cue restarts the routing statistics too

    def flush(self, seq: int) -> list[StageEvent]:
        """End of sequence: confirms a cue still waiting for its right boundary."""
        self._check_slot(seq)
        if self.matcher is None:
            return []
        out = []
        for s, c, t in self.matcher.flush(seq).tuples():
            out.append(StageEvent(s, t, "cue", c, self.cues[c].text, 0.0))
            self._boundary(s, t)
        return out

    def stage_start(self, seq: int) -> int:
        """Token index where slot ``seq``'s current stage began."""
        return int(self._stage_start[seq])
