"""The engine's cue detector and its combined cue + routing-shift twin, fed in one pass.

For a policy that acts on both kinds of boundary (``Policy.uses_combined_events``) the engine runs
its cue detector and a twin of it that also detects routing shifts
(``StageDetector.fresh(use_implicit=True)``); the simulator replays the two as separate detectors
(simulator.detector_events). The two cue automata read the same bytes, so their states are the same
but for when each last reported a boundary, which drops a cue that completes within
``min_stage_tokens`` of it (the twin's also moves at routing shifts). Here one automaton pass finds
every candidate cue and each detector keeps its own boundary clock; only the twin runs the
routing-shift detector. ``feed`` returns what the two detectors' ``feed`` would return: the cue
detector's events, and whether the twin reported any (tests/test_stage_implicit.py checks it
against the two detectors; tests/test_parity.py against the simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from saem_gguf.errors import SaemError
from saem_gguf.stage.detector import NO_EVENTS, StageDetector, StageEvent
from saem_gguf.stage.implicit import ImplicitDetector
from saem_gguf.stage.matcher import CueMatcher
from saem_gguf.stage.steps import check_pieces, routing_rows, step_slots


class DetectorPair:
    """A cue-only ``detector`` (cues, the routing shape known, no routing-shift detection) and its
    combined twin, for ``detector.n_seq`` sequence slots."""

    def __init__(self, detector: StageDetector) -> None:
        if detector.matcher is None or detector.needs_routing or not detector.tracks_routing:
            raise SaemError("a detector pair needs a cue-only detector that knows the routing shape")
        cfg = detector.config
        self.n_seq = detector.n_seq
        self.cues = detector.cues
        self.shape = detector.shape
        self.min_stage = cfg.min_stage_tokens
        # every candidate cue (no minimum stage length): the clocks below drop those too close
        self.matcher = CueMatcher(detector.matcher.tables, self.n_seq, 0)
        self.cue_last = np.zeros(self.n_seq, np.int64)  # per slot, the cue detector's last boundary
        self.twin_last = np.zeros(self.n_seq, np.int64)  # the twin's (cues and routing shifts)
        L, E, K = detector.shape
        self.implicit = ImplicitDetector(self.n_seq, L, E, K, replace(cfg.implicit, min_stage_tokens=self.min_stage))
        self.scale = cfg.combined_scale  # cues are on: a shift must be this much stronger

    def reset(self, seq: int, start_token: int = 0) -> None:
        """A new sequence in slot ``seq``; its next token has index ``start_token``."""
        if not 0 <= seq < self.n_seq:
            raise SaemError(f"sequence slot {seq} out of range 0..{self.n_seq - 1}")
        self.matcher.reset(seq, start_token)
        self.cue_last[seq] = start_token
        self.twin_last[seq] = start_token
        self.implicit.reset(seq, start_token)

    def feed(self, seq_idx: np.ndarray, pieces: Sequence[bytes],
             experts: np.ndarray) -> tuple[Sequence[StageEvent], bool]:
        """Consume one token for each slot in ``seq_idx`` int64 [B] (distinct slots): its text piece
        and its experts [B, L, K]. Returns (the cue detector's boundaries, whether the twin found
        one)."""
        seq_idx = step_slots(seq_idx, distinct=True)
        B = seq_idx.shape[0]
        check_pieces(pieces, B)
        return self.feed_checked(seq_idx, pieces, routing_rows(experts, B, self.shape))

    def feed_checked(self, seq_idx: np.ndarray, pieces: Sequence[bytes],
                     experts: np.ndarray) -> tuple[Sequence[StageEvent], bool]:
        """``feed`` for a step already known to be what it takes (int64 [B] distinct slots, B
        pieces, int16 [B, L, K] rows): the engine's decode step, whose row it read itself, spares
        the checks."""
        events: list[StageEvent] | None = None
        combined = False
        candidates = self.matcher.feed_checked(seq_idx, pieces)
        if len(candidates):
            for s, c, t in candidates.tuples():
                if t - self.cue_last[s] >= self.min_stage:
                    self.cue_last[s] = t
                    events = events if events is not None else []
                    events.append(StageEvent(s, t, "cue", c, self.cues[c].text, 0.0))
                if t - self.twin_last[s] >= self.min_stage:
                    self.twin_last[s] = t
                    combined = True
                    self.implicit.new_stage(s, t)  # a cue restarts the routing statistics too
        shifts = self.implicit.update_checked(seq_idx, experts, self.scale)
        if len(shifts):
            combined = True
            for s, t in zip(shifts.seq.tolist(), shifts.token.tolist()):
                self.twin_last[s] = t
        return (NO_EVENTS if events is None else events), combined
