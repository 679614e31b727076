"""Streaming cue matcher: a byte-level Aho-Corasick DFA compiled to NumPy tables, fed token
pieces of many sequences per call by a Numba kernel.

Why bytes: the engine hands us each token's text piece as raw bytes, and a piece can end in the
middle of a cue or of a multi-byte UTF-8 character. A DFA over bytes carries its state across
pieces, so a split anywhere needs no buffering or re-scanning.

Per byte the kernel does one table lookup (the DFA already includes the failure links and
ASCII case folding), records the left context of that position in a small ring, and when the
DFA state ends some cue, checks the cue's word-boundary rule against the context recorded at
the cue's first byte. Cues ending in a word character wait for the next character (so "Wait"
does not fire inside "Waiting"); that is the only look-ahead. See docs/STAGES.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError
from saem_gguf.kernel_books import Book, KernelBooks, entry_point, i32_2d, i64_1d, i64_2d
from saem_gguf.stage.cues import BOUNDARY_MODES, MAX_CUE_BYTES, CueSet
from saem_gguf.stage.steps import check_pieces, step_slots

RING = 128  # > MAX_CUE_BYTES: the left context of a cue's first byte is still in the ring
RING_MASK = RING - 1
assert MAX_CUE_BYTES < RING

# Left-context levels (what precedes a position); a cue with boundary mode m may start where
# level <= m (modes in BOUNDARY_MODES order).
CTX_LINE, CTX_SENT, CTX_PUNCT, CTX_SPACE, CTX_WORD = 0, 1, 2, 3, 4

# Character classes.
CL_NEWLINE, CL_SPACE, CL_SENT, CL_CLAUSE, CL_TRANSP, CL_WORD, CL_SYMBOL = 0, 1, 2, 3, 4, 5, 6

# Per-sequence state columns; the left-context ring follows them.
S_DFA, S_CTX, S_POS, S_NEED, S_CP, S_PEND, S_NTOK, S_LAST = range(8)
N_STATE = 8
NO_BOUNDARY = -(1 << 62)  # "no previous boundary": the minimum stage length never blocks


def _ascii_classes() -> np.ndarray:
    cls = np.full(256, CL_SYMBOL, np.int8)
    for b in range(128):
        ch = chr(b)
        if ch.isalnum():
            cls[b] = CL_WORD
    cls[ord("\n")] = CL_NEWLINE
    for ch in " \t\r\v\f":
        cls[ord(ch)] = CL_SPACE
    for ch in ".!?":
        cls[ord(ch)] = CL_SENT
    for ch in ",;:":
        cls[ord(ch)] = CL_CLAUSE
    # Markup and quotes do not change the context: "**Wait**" and "- Wait" at a line start,
    # '"Wait' after a sentence, all keep the context of what came before them.
    for ch in "*_#>`\"'([{)]}-~|":
        cls[ord(ch)] = CL_TRANSP
    cls[128:] = CL_WORD  # non-ASCII bytes are classified per decoded code point instead
    return cls


_BYTE_CLASS = _ascii_classes()

# Non-ASCII code points that are not word characters (the rest are).
_CP_SENT = (0x3002, 0xFF01, 0xFF1F, 0xFF0E, 0x2026, 0xFF61)
_CP_CLAUSE = (0xFF0C, 0x3001, 0xFF1A, 0xFF1B, 0x2014, 0x2013, 0x2012, 0x2015, 0xFF64)
_CP_SPACE = (0x00A0, 0x1680, 0x202F, 0x205F, 0x3000, *range(0x2000, 0x200C))
_CP_NEWLINE = (0x0085, 0x2028, 0x2029)
_CP_TRANSP = (0x00AB, 0x00BB, *range(0x2018, 0x2020), 0x2039, 0x203A, *range(0x300C, 0x3012), 0xFF08, 0xFF09,
              0x00B7, 0x2022)


def _cp_table() -> tuple[np.ndarray, np.ndarray]:
    cps, cls = [], []
    for group, c in ((_CP_SENT, CL_SENT), (_CP_CLAUSE, CL_CLAUSE), (_CP_SPACE, CL_SPACE),
                     (_CP_NEWLINE, CL_NEWLINE), (_CP_TRANSP, CL_TRANSP)):
        for cp in group:
            cps.append(cp)
            cls.append(c)
    order = np.argsort(cps)
    return np.asarray(cps, np.int64)[order], np.asarray(cls, np.int8)[order]


_CP_KEYS, _CP_CLASS = _cp_table()


@dataclass
class MatcherTables:
    """The compiled automaton. ``delta`` is the complete DFA (failure links and ASCII case
    folding baked in); ``out_ptr``/``out_pat`` list, per state, the patterns that end there
    (longest first); a cue compiles to one pattern per case variant."""

    delta: np.ndarray  # int32 [n_state, 256]
    out_ptr: np.ndarray  # int32 [n_state + 1]
    out_pat: np.ndarray  # int32 [n_out]
    pat_len: np.ndarray  # int32 [n_pat] bytes
    pat_cue: np.ndarray  # int32 [n_pat]
    cue_mode: np.ndarray  # int8 [n_cue] max left-context level allowed
    cue_right: np.ndarray  # int8 [n_cue] 1: needs a non-word character after it
    cues: CueSet

    @property
    def n_state(self) -> int:
        return int(self.delta.shape[0])


def _fold_ascii(b: bytes) -> bytes:
    return b.lower() if b.isascii() else bytes(x + 32 if 65 <= x <= 90 else x for x in b)


def _variants(text: str) -> set[bytes]:
    # ASCII letters are folded inside the DFA; non-ASCII letters are not (folding multi-byte
    # characters per byte is not possible), so we compile the usual casings of the cue.
    forms = {text, text.lower(), text.upper(), text.capitalize(), text[:1].upper() + text[1:].lower(),
             text[:1].lower() + text[1:]}
    return {_fold_ascii(f.encode("utf-8")) for f in forms if f and len(f.encode("utf-8")) <= MAX_CUE_BYTES}


def compile_cues(cues: CueSet) -> MatcherTables:
    """Build the DFA for a cue set (Aho-Corasick; milliseconds for hundreds of cues)."""
    if len(cues) == 0:
        raise SaemError("cannot build a matcher from an empty cue set")
    goto: list[dict[int, int]] = [{}]
    outputs: list[list[int]] = [[]]
    pat_len: list[int] = []
    pat_cue: list[int] = []
    for ci, cue in enumerate(cues):
        for v in sorted(_variants(cue.text)):
            s = 0
            for b in v:
                nxt = goto[s].get(b)
                if nxt is None:
                    nxt = len(goto)
                    goto[s][b] = nxt
                    goto.append({})
                    outputs.append([])
                s = nxt
            outputs[s].append(len(pat_len))
            pat_len.append(len(v))
            pat_cue.append(ci)
    n = len(goto)
    fail = [0] * n
    delta = np.zeros((n, 256), np.int32)
    queue: deque[int] = deque()
    for b, s in goto[0].items():
        delta[0, b] = s
        queue.append(s)
    while queue:  # BFS: a state's failure target is always shallower, so already complete
        r = queue.popleft()
        outputs[r] = outputs[r] + outputs[fail[r]]
        delta[r] = delta[fail[r]]
        for b, s in goto[r].items():
            delta[r, b] = s
            fail[s] = int(delta[fail[r], b])
            queue.append(s)
    # Case folding: an upper-case ASCII byte behaves exactly like its lower-case twin.
    up = np.arange(65, 91)
    delta[:, up] = delta[:, up + 32]
    out_ptr = np.zeros(n + 1, np.int32)
    flat: list[int] = []
    for s in range(n):
        flat.extend(sorted(set(outputs[s]), key=lambda p: -pat_len[p]))
        out_ptr[s + 1] = len(flat)
    cue_mode = np.array([BOUNDARY_MODES.index(c.boundary) for c in cues], np.int8)
    cue_right = np.array([1 if (c.right_boundary and _ends_in_word_char(c.text)) else 0 for c in cues], np.int8)
    return MatcherTables(
        delta=delta,
        out_ptr=out_ptr,
        out_pat=np.asarray(flat, np.int32),
        pat_len=np.asarray(pat_len, np.int32),
        pat_cue=np.asarray(pat_cue, np.int32),
        cue_mode=cue_mode,
        cue_right=cue_right,
        cues=cues,
    )


def _ends_in_word_char(text: str) -> bool:
    return text[-1].isalnum()


# --------------------------------------------------------------------------------------------
# Kernel


@njit(cache=True, inline="always")
def _cp_class(cp, cp_keys, cp_class):
    lo = 0
    hi = cp_keys.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if cp_keys[mid] < cp:
            lo = mid + 1
        else:
            hi = mid
    if lo < cp_keys.shape[0] and cp_keys[lo] == cp:
        return cp_class[lo]
    return CL_WORD


@njit(cache=True, inline="always")
def _next_ctx(ctx, cl):
    if cl == CL_NEWLINE:
        return CTX_LINE
    if cl == CL_SPACE:
        return CTX_SPACE if ctx == CTX_WORD else ctx
    if cl == CL_SENT:
        return CTX_SENT
    if cl == CL_CLAUSE:
        return CTX_PUNCT
    if cl == CL_TRANSP:
        return ctx
    return CTX_WORD


@njit(cache=True, inline="always")
def _emit(st, i, cue, tok, min_stage, ev, n_ev):
    if tok - st[i, S_LAST] < min_stage:
        return n_ev  # too close to the previous boundary: the cue is dropped, not deferred
    st[i, S_LAST] = tok
    ev[0, n_ev] = i
    ev[1, n_ev] = cue
    ev[2, n_ev] = tok
    return n_ev + 1


@njit(cache=True)
def feed_kernel(delta, blob, st, seq_idx, buf, lens, min_stage, ev):
    """Feed piece j (the next lens[j] bytes of buf) to sequence seq_idx[j], in order.

    ``blob`` packs the small tables (see _pack_tables) and ``st`` holds each sequence's
    scalars followed by its left-context ring: few arguments keep the per-call dispatch cheap,
    which is most of the cost of a one-token-per-sequence decode step.
    Returns the number of events written to ev[:, :n], or -1 - j when seq_idx[j] is out of
    range.
    """
    o_ptr = blob[0]
    o_pat = blob[1]
    o_len = blob[2]
    o_cue = blob[3]
    o_mode = blob[4]
    o_right = blob[5]
    n_seq = st.shape[0]
    n_ev = 0
    q = 0
    for j in range(seq_idx.shape[0]):
        i = seq_idx[j]
        if i < 0 or i >= n_seq:
            return -1 - j
        tok = st[i, S_NTOK]
        s = st[i, S_DFA]
        ctx = st[i, S_CTX]
        pos = st[i, S_POS]
        need = st[i, S_NEED]
        cp = st[i, S_CP]
        pend = st[i, S_PEND]
        end = q + lens[j]
        while q < end:
            b = buf[q]
            q += 1
            st[i, N_STATE + (pos & RING_MASK)] = ctx
            s = delta[s, b]
            # Decode UTF-8 just enough to classify whole characters; malformed bytes count
            # as word characters, which can only suppress (never invent) a boundary.
            done = False
            cl = CL_WORD
            if b < 0x80:
                need = 0
                cl = _BYTE_CLASS[b]
                done = True
            elif b < 0xC0:
                if need > 0:
                    cp = (cp << 6) | (b & 0x3F)
                    need -= 1
                    if need == 0:
                        cl = _cp_class(cp, _CP_KEYS, _CP_CLASS)
                        done = True
                else:
                    done = True
            else:
                if b < 0xE0:
                    need = 1
                    cp = b & 0x1F
                elif b < 0xF0:
                    need = 2
                    cp = b & 0x0F
                else:
                    need = 3
                    cp = b & 0x07
            if done:
                if pend >= 0:
                    if cl != CL_WORD:
                        n_ev = _emit(st, i, pend, tok, min_stage, ev, n_ev)
                    pend = -1
                ctx = _next_ctx(ctx, cl)
            for o in range(blob[o_ptr + s], blob[o_ptr + s + 1]):
                p = blob[o_pat + o]
                c = blob[o_cue + p]
                start = pos - blob[o_len + p] + 1
                if start < 0:
                    continue
                if st[i, N_STATE + (start & RING_MASK)] > blob[o_mode + c]:
                    continue
                if blob[o_right + c] != 0:
                    pend = c
                else:
                    n_ev = _emit(st, i, c, tok, min_stage, ev, n_ev)
                break  # longest acceptable cue ending here wins
            pos += 1
        st[i, S_DFA] = s
        st[i, S_CTX] = ctx
        st[i, S_POS] = pos
        st[i, S_NEED] = need
        st[i, S_CP] = cp
        st[i, S_PEND] = pend
        st[i, S_NTOK] = tok + 1
    return n_ev


def _pack_tables(t: MatcherTables) -> np.ndarray:
    """One int64 array: 6 section offsets, then out_ptr, out_pat, pat_len, pat_cue,
    cue_mode, cue_right."""
    parts = [t.out_ptr, t.out_pat, t.pat_len, t.pat_cue, t.cue_mode, t.cue_right]
    offs, pos = [], 6
    for x in parts:
        offs.append(pos)
        pos += x.shape[0]
    return np.concatenate([np.asarray(offs, np.int64)] + [x.astype(np.int64) for x in parts])


# --------------------------------------------------------------------------------------------


@dataclass
class MatchEvents:
    """Transition events, in feed order: sequence slot, cue id, token index (the token whose
    piece completed the cue, or for cues that need a right boundary, the token that brought
    the character after it)."""

    seq: np.ndarray  # int64 [n]
    cue: np.ndarray  # int64 [n]
    token: np.ndarray  # int64 [n]

    def __len__(self) -> int:
        return len(self.seq)  # not .shape[0]: no tuple made per quiet step

    def tuples(self) -> list[tuple[int, int, int]]:
        return list(zip(self.seq.tolist(), self.cue.tolist(), self.token.tolist()))


def _frozen_empty() -> np.ndarray:
    a = np.empty(0, np.int64)
    a.flags.writeable = False
    return a


# Returned by every feed() that found nothing (the common case): no allocation per call.
_NO_EVENTS = MatchEvents(_frozen_empty(), _frozen_empty(), _frozen_empty())


_ONE_LENGTH = tuple(bytes((n,)) for n in range(256))  # a one-piece step's lengths, made once


def pack_pieces(pieces: Sequence[bytes]) -> tuple[bytes, bytes | np.ndarray]:
    """(all bytes, piece lengths) of a list of pieces. Lengths travel as a bytes object when
    every piece is shorter than 256 bytes (nearly always): building it is several times
    cheaper than a NumPy array, which matters at one token per call; a decode step's single
    piece takes its lengths from a table."""
    if len(pieces) == 1:
        piece = pieces[0]
        if type(piece) is bytes and len(piece) < 256:
            return piece, _ONE_LENGTH[len(piece)]
    try:
        buf = b"".join(pieces)
    except TypeError as e:
        raise SaemError(f"token pieces must be bytes (UTF-8), not text: {e}") from e
    try:
        lens = bytes(map(len, pieces))
    except ValueError:
        lens = np.fromiter(map(len, pieces), np.int64, len(pieces))
    return buf, lens


# The matcher's books (kernel_books): ``feed_kernel``'s arrays, in its order but the step's
MATCHER_BOOKS = (Book("delta", np.int32, 2), Book("blob", np.int64, 1), Book("state", np.int64, 2),
                 Book("ev", np.int64, 2))


@njit(cache=True)
def feed_entry(seq_idx, buf, lens, min_stage, tab):
    """``feed_kernel`` with its books from ``tab`` (``MATCHER_BOOKS``' table)."""
    return feed_kernel(i32_2d(tab, 0), i64_1d(tab, 1), i64_2d(tab, 2), seq_idx, buf, lens, min_stage, i64_2d(tab, 3))


class CueMatcher:
    """Per-sequence streaming matcher for a batch of ``n_seq`` sequence slots.

    ``feed(seq_idx, pieces)`` consumes one token piece per entry (a slot may appear several
    times, its pieces are then consumed in order) and returns the completed cues. Each slot
    counts its tokens from ``reset(slot, start_token)``; ``min_stage_tokens`` drops a cue that
    completes fewer than that many tokens after the slot's previous boundary (the slot's start
    counts as one unless ``start_is_boundary=False``).
    """

    def __init__(self, cues: CueSet | MatcherTables, n_seq: int = 1, min_stage_tokens: int = 0,
                 start_is_boundary: bool = True):
        if n_seq < 1:
            raise SaemError("n_seq must be >= 1")
        if min_stage_tokens < 0:
            raise SaemError("min_stage_tokens must be >= 0")
        self.tables = cues if isinstance(cues, MatcherTables) else compile_cues(cues)
        self.cues = self.tables.cues
        self.n_seq = int(n_seq)
        self.min_stage_tokens = int(min_stage_tokens)
        self.start_is_boundary = start_is_boundary
        self._blob = _pack_tables(self.tables)
        self.state = np.zeros((n_seq, N_STATE + RING), np.int64)
        self._ev = np.empty((3, 256), np.int64)
        self.room = 127  # piece bytes per call the event buffer has room for (see kernel_args)
        self._books = KernelBooks(MATCHER_BOOKS, {"delta": self.tables.delta, "blob": self._blob,
                                                  "state": self.state, "ev": self._ev})
        self._tab = self._books.table
        # bind_step's slots and feed_entry's compiled entry point for them (until then the
        # dispatcher itself)
        self._bound_seq: np.ndarray | None = None
        self._bound_entry = feed_entry
        for i in range(n_seq):
            self.reset(i)

    def bind_step(self, seq_idx: np.ndarray) -> None:
        """Later ``feed_checked`` calls with these very slots (int64 [B], kept) and pieces whose
        lengths pack as bytes (every piece under 256 bytes) call ``feed_entry``'s compiled entry
        point, untyped (kernel_books.entry_point): the engine's decode step, one call a token."""
        self._bound_entry = entry_point(feed_entry, seq_idx, b"", b"", self.min_stage_tokens, self._tab)
        self._bound_seq = seq_idx

    def reset(self, seq: int, start_token: int = 0) -> None:
        """Forget slot ``seq``'s text; its next piece is token ``start_token`` at a line start."""
        self._check_slot(seq)
        st = self.state[seq]
        st[:] = 0
        st[S_CTX] = CTX_LINE
        st[S_PEND] = -1
        st[S_NTOK] = start_token
        st[S_LAST] = start_token if self.start_is_boundary else NO_BOUNDARY

    def _check_slot(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise SaemError(f"sequence slot {seq} out of range 0..{self.n_seq - 1}")

    def n_tokens(self, seq: int) -> int:
        """Index of the next token slot ``seq`` will be fed."""
        return int(self.state[seq, S_NTOK])

    def last_boundary(self, seq: int) -> int:
        return int(self.state[seq, S_LAST])

    def mark_boundary(self, seq: int, token: int) -> None:
        """Record a boundary found elsewhere (implicit detector), for the minimum stage length."""
        self.state[seq, S_LAST] = token

    def feed(self, seq_idx, pieces: Sequence[bytes]) -> MatchEvents:
        seq_idx = step_slots(seq_idx)
        check_pieces(pieces, seq_idx.shape[0])
        return self.feed_checked(seq_idx, pieces)

    def feed_checked(self, seq_idx: np.ndarray, pieces: Sequence[bytes]) -> MatchEvents:
        """``feed`` for slots already int64 [len(pieces)] (``step_slots``): a caller that checked
        them once for several detectors spares the checks here."""
        buf, lens = pack_pieces(pieces)
        if len(buf) > self.room:
            self.kernel_args(len(buf))
        # the attributes, not kernel_args' tuple: after a decode each call and tuple costs
        # microseconds. The entry point only for the bound slots and bytes lengths: it would read
        # any other array as those types (buf is bytes in every case, the table always int64 [n, ROW])
        kernel = self._bound_entry if seq_idx is self._bound_seq and type(lens) is bytes else feed_entry
        n = kernel(seq_idx, buf, lens, self.min_stage_tokens, self._tab)
        if n <= 0:
            if n == 0:
                return _NO_EVENTS
            raise self.slot_error(seq_idx, n)
        return self.events(n)

    def kernel_args(self, n_bytes: int) -> tuple:
        """(delta, blob, state, ev): the arguments of ``feed_kernel`` but the step's slots,
        pieces and minimum stage length, for ``n_bytes`` bytes of pieces (the event buffer grown
        to what they can complete). For a caller that runs the kernel inside its own
        (stage.pair)."""
        # Each character completes at most one pending cue and one new cue.
        cap = 2 * n_bytes + 2
        if self._ev.shape[1] < cap:
            self._ev = np.empty((3, cap), np.int64)
            self.room = n_bytes
            self._books.set("ev", self._ev)
        return self.tables.delta, self._blob, self.state, self._ev

    def events(self, n: int) -> MatchEvents:
        """The ``n`` events the last kernel run wrote (a copy)."""
        ev = self._ev[:, :n].copy()
        return MatchEvents(ev[0], ev[1], ev[2])

    def slot_error(self, seq_idx: np.ndarray, code: int) -> SaemError:
        """The error of a kernel run that returned ``code`` (< 0: ``seq_idx[-1 - code]`` out of range)."""
        return SaemError(f"feed: sequence index {int(seq_idx[-1 - code])} out of range 0..{self.n_seq - 1}")

    def flush(self, seq: int) -> MatchEvents:
        """End of text for slot ``seq``: a cue waiting for its right boundary is confirmed
        (at the last token fed)."""
        self._check_slot(seq)
        st = self.state[seq]
        c = int(st[S_PEND])
        st[S_PEND] = -1
        tok = int(st[S_NTOK]) - 1
        if c < 0 or tok - int(st[S_LAST]) < self.min_stage_tokens:
            return _NO_EVENTS
        st[S_LAST] = tok
        return MatchEvents(np.array([seq], np.int64), np.array([c], np.int64), np.array([tok], np.int64))

    def match_sequence(self, pieces: Sequence[bytes], start_token: int = 0, slot: int = 0) -> MatchEvents:
        """All events of one whole text (reset, feed every piece, flush), using ``slot``."""
        self.reset(slot, start_token)
        ev = self.feed(np.full(len(pieces), slot, np.int64), pieces)
        fl = self.flush(slot)
        if len(fl):
            ev = MatchEvents(*(np.concatenate([a, b]) for a, b in zip(
                (ev.seq, ev.cue, ev.token), (fl.seq, fl.cue, fl.token))))
        return ev


def find_cues(cues: CueSet | MatcherTables, pieces: Sequence[bytes], start_token: int = 0,
              min_stage_tokens: int = 0) -> list[tuple[int, int]]:
    """(cue id, token index) of every cue in one text; no boundary at the text start."""
    m = CueMatcher(cues, 1, min_stage_tokens, start_is_boundary=False)
    ev = m.match_sequence(pieces, start_token)
    return list(zip(ev.cue.tolist(), ev.token.tolist()))
