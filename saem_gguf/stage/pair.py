"""The engine's cue detector and its combined cue + routing-shift twin, fed in one pass.

For a policy that acts on both kinds of boundary (``Policy.uses_combined_events``) the engine runs
its cue detector and a twin of it that also detects routing shifts
(``StageDetector.fresh(use_implicit=True)``); the simulator replays the two as separate detectors
(simulator.detector_events). The two cue automata read the same bytes, so their states are the same
but for when each last reported a boundary, which drops a cue that completes within
``min_stage_tokens`` of it (the twin's also moves at routing shifts). Here one automaton pass finds
every candidate cue and each detector keeps its own boundary clock; only the twin runs the
routing-shift detector. A step is one kernel call (``pair_kernel``: the automaton, the clocks and
the routing-shift detector). ``feed`` returns what the two detectors' ``feed`` would return: the cue
detector's events, and whether the twin reported any (tests/test_stage_implicit.py checks it
against the two detectors; tests/test_parity.py against the simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError
from saem_gguf.kernel_books import (
    Book, KernelBooks, entry_point, f64_1d, f64_2d, i16_4d, i32_2d, i32_4d, i64_1d, i64_2d,
)
from saem_gguf.stage.detector import NO_EVENTS, StageDetector, StageEvent
from saem_gguf.stage.implicit import ImplicitDetector, new_stage_kernel, update_kernel
from saem_gguf.stage.matcher import CueMatcher, feed_kernel, pack_pieces
from saem_gguf.stage.steps import check_pieces, routing_rows, step_slots


@njit(cache=True)
def pair_kernel(seq_idx, buf, lens, experts, delta, blob, m_state, m_ev, cue_last, twin_last, min_stage, ist, cnt, fl,
                ring, prm, i_ev, scores):
    """One step of both detectors in one kernel call (after a decode each kernel call costs a
    few us before its work: docs/POLICIES_HISTORY.md, per-token cost).

    The step: slots ``seq_idx`` int64 [B], their pieces ``buf`` / ``lens`` (``pack_pieces``)
    and routing ``experts`` int16 [B, L, K]. The books: delta / blob / m_state / m_ev, the cue
    matcher's tables, state and event buffer (``CueMatcher.kernel_args``; the matcher keeps no
    minimum stage length); cue_last / twin_last int64 [n_seq], each slot's last boundary of the
    cue detector and of the twin; min_stage, their minimum stage length in tokens; ist / cnt /
    fl / ring / prm / i_ev / scores, the routing-shift detector's state, parameters and buffers
    (``ImplicitDetector.kernel_args``).

    A candidate cue far enough from the cue detector's last boundary is its event (written back
    to ``m_ev[:, :n_cue]`` in order); far enough from the twin's, the twin's (and the shift
    detector's stage restarts). Returns (n_cue, combined: whether the twin found a boundary, a
    cue's or a shift's), or (code, 0) with code < 0 for a slot out of range (the matcher's
    ``feed_kernel`` code)."""
    n = feed_kernel(delta, blob, m_state, seq_idx, buf, lens, 0, m_ev)
    if n < 0:
        return n, 0
    n_cue = 0
    combined = 0
    for j in range(n):
        s = m_ev[0, j]
        c = m_ev[1, j]
        t = m_ev[2, j]
        if t - cue_last[s] >= min_stage:
            cue_last[s] = t
            m_ev[0, n_cue] = s
            m_ev[1, n_cue] = c
            m_ev[2, n_cue] = t
            n_cue += 1
        if t - twin_last[s] >= min_stage:
            twin_last[s] = t
            combined = 1
            new_stage_kernel(s, t, ist, cnt, fl, ring)  # a cue restarts the routing statistics too
    k = update_kernel(ist, cnt, fl, ring, seq_idx, experts, prm, i_ev, scores)
    for j in range(k):
        twin_last[int(i_ev[0, j])] = int(i_ev[1, j])
        combined = 1
    return n_cue, combined


# The books of ``pair_kernel`` (kernel_books): its array arguments after the step's, in its
# order (after a decode each array argument costs about 0.6 us; these are 13)
PAIR_BOOKS = (
    Book("delta", np.int32, 2), Book("blob", np.int64, 1), Book("m_state", np.int64, 2), Book("m_ev", np.int64, 2),
    Book("cue_last", np.int64, 1), Book("twin_last", np.int64, 1), Book("ist", np.int64, 2),
    Book("cnt", np.int32, 4), Book("fl", np.float64, 2), Book("ring", np.int16, 4), Book("prm", np.float64, 1),
    Book("i_ev", np.float64, 2), Book("scores", np.float64, 1),
)


@njit(cache=True)
def pair_entry(seq_idx, buf, lens, experts, min_stage, tab):
    """``pair_kernel`` with its books from ``tab`` (``PAIR_BOOKS``' table)."""
    return pair_kernel(seq_idx, buf, lens, experts, i32_2d(tab, 0), i64_1d(tab, 1), i64_2d(tab, 2), i64_2d(tab, 3),
                       i64_1d(tab, 4), i64_1d(tab, 5), min_stage, i64_2d(tab, 6), i32_4d(tab, 7), f64_2d(tab, 8),
                       i16_4d(tab, 9), f64_1d(tab, 10), f64_2d(tab, 11), f64_1d(tab, 12))


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
        self._fetch_books(0)
        # bind_step's slots and rows, and pair_entry's compiled entry point for them
        self._bound_seq: np.ndarray | None = None
        self._bound_rows: np.ndarray | None = None
        self._bound_entry = pair_entry

    def bind_step(self, seq_idx: np.ndarray, experts: np.ndarray) -> None:
        """Later ``feed_checked`` calls with these very slots and rows (kept) and pieces whose
        lengths pack as bytes call ``pair_entry``'s compiled entry point, untyped
        (kernel_books.entry_point): the engine's decode step, whose rows are one view of the
        native routing sink."""
        self._bound_entry = entry_point(pair_entry, seq_idx, b"", b"", experts, self.min_stage, self._tab)
        self._bound_seq, self._bound_rows = seq_idx, experts

    def _fetch_books(self, n_bytes: int) -> None:
        """``pair_kernel``'s books as one table (``PAIR_BOOKS``), made once and again only when a
        step's pieces outgrow the matcher's event buffer (a step has at most ``n_seq`` tokens,
        which the shift detector's buffers hold from the start)."""
        delta, blob, m_state, m_ev = self.matcher.kernel_args(n_bytes)
        self._room = self.matcher.room  # of the event buffer in these books, not of a later one
        ist, cnt, fl, ring, prm, i_ev, scores = self.implicit.kernel_args(self.scale, self.n_seq)
        self._books = KernelBooks(PAIR_BOOKS, {
            "delta": delta, "blob": blob, "m_state": m_state, "m_ev": m_ev, "cue_last": self.cue_last,
            "twin_last": self.twin_last, "ist": ist, "cnt": cnt, "fl": fl, "ring": ring, "prm": prm, "i_ev": i_ev,
            "scores": scores})
        self._tab = self._books.table

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
        buf, lens = pack_pieces(pieces)
        if len(buf) > self._room:
            self._fetch_books(len(buf))
        # the entry point only for the bound arrays and bytes lengths (CueMatcher.feed_checked)
        kernel = (self._bound_entry if seq_idx is self._bound_seq and experts is self._bound_rows
                  and type(lens) is bytes else pair_entry)
        n_cue, combined = kernel(seq_idx, buf, lens, experts, self.min_stage, self._tab)
        if n_cue == 0:
            return NO_EVENTS, bool(combined)
        if n_cue < 0:
            raise self.matcher.slot_error(seq_idx, n_cue)
        cues = self.cues
        return ([StageEvent(s, t, "cue", c, cues[c].text, 0.0) for s, c, t in self.matcher.events(n_cue).tuples()],
                bool(combined))
