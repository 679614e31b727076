"""Implicit stage-boundary detection from the routing itself (no lexical cue needed).

Per sequence we keep, per MoE layer, the expert histogram of the current stage split in two:
the *window* w (the last ``window`` tokens) and the *reference* r (the stage's tokens before
the window). A stage change shows up as the window's routing departing from the reference.

Statistic (docs/STAGES.md): per layer, the weighted Jensen-Shannon divergence of the two
histograms with weights proportional to their sizes, which equals the mutual information
between "window or reference" and "expert id":

    JS_pi(l) = H(c) - (Nw/N) H(w) - (Nr/N) H(r),  c = w + r, N = Nw + Nr  (routing slots)

N * JS_pi is half a G-test statistic; its small-sample bias is removed with the Miller-Madow
term (m_w + m_r - m_c - 1) / 2 (m = experts with a non-zero count), and the result is
normalised by the window size:

    D = mean_l (N * JS_pi(l) - (m_w,l + m_r,l - m_c,l - 1) / 2) / Nw

D approaches the KL divergence of the new routing from the old as the window fills with a new
stage. Some bias survives (the window is sparse: Nw = window * K slots over E experts), so the
detector thresholds the excess x = D - b over a per-sequence null level b, learnt from the
first ``baseline_warmup`` values and then followed slowly while x < low. All entropies are
sums of n*log(n) over counts, so a token updates them in O(L * K) table lookups, not O(L * E).

Hysteresis: a boundary fires when x > high for ``confirm`` consecutive tokens while armed and
at least ``min_stage_tokens`` after the previous boundary; the detector then disarms until x
falls below ``low``. At an implicit boundary the new stage is the window's tail since x began
to rise (older window tokens are dropped); at an external (cue) boundary the stage restarts
empty.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError
from saem_gguf.stage.steps import routing_rows, step_slots

# Per-sequence state columns (int64).
I_NTOK, I_LAST, I_HEAD, I_NW, I_NR, I_ARMED, I_ABOVE, I_BASEN, I_ONSET = range(9)
N_ISTATE = 9


@dataclass
class ImplicitConfig:
    window: int = 16  # tokens in the recent window
    min_ref: int = 32  # reference tokens needed before the statistic is tested
    # Thresholds on the excess x = D - null level (nats). Defaults suit a 48x128 top-8 model
    # (synthetic); calibrate() fits them from traces.
    high: float = 0.06  # x above this (``confirm`` tokens in a row) fires a boundary
    low: float = 0.04  # x below this re-arms the detector
    confirm: int = 2
    min_stage_tokens: int = 32  # no boundary within this many tokens of the previous one
    baseline_warmup: int = 16  # D values averaged into the null level before testing starts
    baseline_rate: float = 1.0 / 32  # how fast the null level follows drift while quiet
    onset_slack: int = 2  # window tokens kept before the rise of D when a boundary fires

    def validate(self) -> None:
        if (self.window < 1 or self.min_ref < 1 or self.confirm < 1 or self.min_stage_tokens < 0
                or self.baseline_warmup < 1 or not 0 <= self.baseline_rate <= 1):
            raise SaemError(f"bad implicit detector config: {self}")
        if not self.low <= self.high:
            raise SaemError(f"implicit detector needs low <= high, got low={self.low} high={self.high}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ImplicitConfig:
        if not isinstance(d, dict):
            raise SaemError("implicit detector config must be an object")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise SaemError(f"implicit detector config: unknown field(s) {sorted(unknown)}")
        try:
            floats = ("high", "low", "baseline_rate")
            cfg = cls(**{k: (float(v) if k in floats else int(v)) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise SaemError(f"implicit detector config: {e}") from e
        cfg.validate()
        return cfg


NLOGN_TABLE = 4096


def _dnlogn_table() -> np.ndarray:
    n = np.arange(NLOGN_TABLE + 1, dtype=np.float64)
    f = np.zeros(NLOGN_TABLE + 1)
    f[1:] = n[1:] * np.log(n[1:])
    return np.diff(f)


# (n+1) ln(n+1) - n ln n for n < NLOGN_TABLE: a count moving by one changes a sum of n ln n by
# one table entry. A module constant (frozen into the compiled kernels): window counts are
# always below the table size and stage counts mostly are.
_DNLOGN = _dnlogn_table()


@njit(cache=True, inline="always")
def _dnlogn(n):
    if n < NLOGN_TABLE:
        return _DNLOGN[n]
    return (n + 1) * math.log(n + 1) - n * math.log(n)


# Parameter vector passed to the kernel (one float64 array instead of ten scalars: fewer
# arguments make the per-call dispatch cheaper).
P_WINDOW, P_MIN_REF, P_HIGH, P_LOW, P_CONFIRM, P_MIN_STAGE, P_WARMUP, P_RATE, P_SLACK, P_DETECT = range(10)


@njit(cache=True)
def _score(fl, ist, L, K):
    """D for one sequence (see module docstring). fl: [sw(L), sr(L), sc(L), base]; ist: state
    then nz [w(L), r(L), c(L)]."""
    Nw = ist[I_NW] * K
    Nr = ist[I_NR] * K
    N = Nw + Nr
    const = N * math.log(N)
    if Nw > 0:
        const -= Nw * math.log(Nw)
    if Nr > 0:
        const -= Nr * math.log(Nr)
    acc = 0.0
    z = N_ISTATE
    for l in range(L):
        # N * JS_pi = sum w ln w + sum r ln r - sum c ln c + N ln N - Nw ln Nw - Nr ln Nr,
        # minus the Miller-Madow bias (m_w + m_r - m_c - 1) / 2.
        mm = 0.5 * (ist[z + l] + ist[z + L + l] - ist[z + 2 * L + l] - 1)
        acc += (fl[l] + fl[L + l] - fl[2 * L + l] + const) - mm
    return acc / (L * Nw)


@njit(cache=True)
def _stage_reset(i, ist, cnt, fl, keep_window):
    """Start a new stage for sequence i: empty, or made of the current window."""
    L, E = cnt.shape[2], cnt.shape[3]
    z = N_ISTATE
    for l in range(L):
        fl[i, L + l] = 0.0
        for e in range(E):
            cnt[i, 1, l, e] = 0
        ist[i, z + L + l] = 0
        if keep_window:
            fl[i, 2 * L + l] = fl[i, l]
            ist[i, z + 2 * L + l] = ist[i, z + l]
        else:
            fl[i, l] = 0.0
            fl[i, 2 * L + l] = 0.0
            ist[i, z + l] = 0
            ist[i, z + 2 * L + l] = 0
            for e in range(E):
                cnt[i, 0, l, e] = 0
    ist[i, I_NR] = 0
    if not keep_window:
        ist[i, I_NW] = 0
        ist[i, I_HEAD] = 0
    ist[i, I_ABOVE] = 0


@njit(cache=True, inline="always")
def _window_out(i, l, e, ist, cnt):
    """One window token's use of expert ``e`` at layer ``l`` of slot ``i`` leaves the window:
    its count drops by one (and the layer's count of used experts where it reaches 0). Returns
    the change of the window's n-log-n sum at that layer (``fl[i, l]``). Shared by dropping the
    oldest tokens and by moving the oldest one to the reference."""
    x = cnt[i, 0, l, e]
    cnt[i, 0, l, e] = x - 1
    if x == 1:
        ist[i, N_ISTATE + l] -= 1
    return -_dnlogn(x - 1)


@njit(cache=True)
def _drop_oldest(i, ist, cnt, fl, ring, n):
    """Remove the n oldest tokens of a full window (they are not moved to the reference)."""
    W = ring.shape[1]
    L = ring.shape[2]
    K = ring.shape[3]
    if n <= 0 or ist[i, I_NW] != W:
        return
    head = ist[i, I_HEAD]  # a full ring's oldest entry is the next write position
    for q in range(n):
        slot = (head + q) % W
        for l in range(L):
            a = 0.0
            for k in range(K):
                e = ring[i, slot, l, k]
                if e < 0:
                    continue
                a += _window_out(i, l, e, ist, cnt)
                ring[i, slot, l, k] = -1
            fl[i, l] += a
    ist[i, I_NW] = W - n


@njit(cache=True)
def new_stage_kernel(i, token, ist, cnt, fl, ring):
    """An external (cue) boundary of slot ``i`` at ``token``: its stage restarts empty
    (``ImplicitDetector.new_stage``; the packed state as ``update_kernel`` takes it)."""
    _stage_reset(i, ist, cnt, fl, False)
    ring[i] = -1
    ist[i, I_LAST] = token
    ist[i, I_ARMED] = 1
    ist[i, I_ONSET] = -1


@njit(cache=True)
def update_kernel(ist, cnt, fl, ring, seq_idx, experts, prm, ev, score_out):
    """Consume one token (experts[j] : [L, K]) for sequence seq_idx[j], in order.
    Returns the number of events written to ev[:, :n] (seq, token, excess), or -1 - j for an
    out-of-range sequence index."""
    n_seq = ist.shape[0]
    L = experts.shape[1]
    K = experts.shape[2]
    E = cnt.shape[3]
    window = int(prm[P_WINDOW])
    min_ref = int(prm[P_MIN_REF])
    high = prm[P_HIGH]
    low = prm[P_LOW]
    confirm = int(prm[P_CONFIRM])
    min_stage = int(prm[P_MIN_STAGE])
    warmup = int(prm[P_WARMUP])
    rate = prm[P_RATE]
    slack = int(prm[P_SLACK])
    detect = prm[P_DETECT] != 0.0
    zw = N_ISTATE
    zr = N_ISTATE + L
    zc = N_ISTATE + 2 * L
    n_ev = 0
    for j in range(seq_idx.shape[0]):
        i = seq_idx[j]
        if i < 0 or i >= n_seq:
            return -1 - j
        tok = ist[i, I_NTOK]
        head = ist[i, I_HEAD]
        if ist[i, I_NW] == window:
            # The oldest window token moves to the reference: w -1, r +1, c unchanged.
            for l in range(L):
                a = 0.0
                b = 0.0
                for k in range(K):
                    e = ring[i, head, l, k]
                    if e < 0:
                        continue
                    a += _window_out(i, l, e, ist, cnt)
                    y = cnt[i, 1, l, e]
                    b += _dnlogn(y)
                    cnt[i, 1, l, e] = y + 1
                    if y == 0:
                        ist[i, zr + l] += 1
                fl[i, l] += a
                fl[i, L + l] += b
            ist[i, I_NW] -= 1
            ist[i, I_NR] += 1
        for l in range(L):
            a = 0.0
            c = 0.0
            for k in range(K):
                e = experts[j, l, k]
                if e < 0 or e >= E:
                    ring[i, head, l, k] = -1
                    continue
                ring[i, head, l, k] = e
                x = cnt[i, 0, l, e]
                y = cnt[i, 1, l, e]
                if x + y == 0:
                    ist[i, zc + l] += 1
                if x == 0:
                    ist[i, zw + l] += 1
                a += _dnlogn(x)
                c += _dnlogn(x + y)
                cnt[i, 0, l, e] = x + 1
            fl[i, l] += a
            fl[i, 2 * L + l] += c
        head += 1
        if head == window:
            head = 0
        ist[i, I_HEAD] = head
        ist[i, I_NW] += 1
        score_out[j] = np.nan
        if ist[i, I_NW] == window and ist[i, I_NR] >= min_ref:
            d = _score(fl[i], ist[i], L, K)
            nb = ist[i, I_BASEN]
            if nb < warmup:
                # The null level of D (estimator bias left after the Miller-Madow correction)
                # depends on the model's routing spread; learn it from the sequence itself.
                fl[i, 3 * L] += (d - fl[i, 3 * L]) / (nb + 1)
                ist[i, I_BASEN] = nb + 1
            else:
                x = d - fl[i, 3 * L]
                score_out[j] = x
                if x < low:
                    fl[i, 3 * L] += rate * x  # follow slow drift of the null level while quiet
                    ist[i, I_ONSET] = -1
                elif ist[i, I_ONSET] < 0:
                    ist[i, I_ONSET] = tok
                if ist[i, I_ARMED] == 0:
                    if x < low:
                        ist[i, I_ARMED] = 1
                elif detect:
                    if x > high:
                        ist[i, I_ABOVE] += 1
                    else:
                        ist[i, I_ABOVE] = 0
                    if ist[i, I_ABOVE] >= confirm and tok - ist[i, I_LAST] >= min_stage:
                        ev[0, n_ev] = i
                        ev[1, n_ev] = tok
                        ev[2, n_ev] = x
                        n_ev += 1
                        ist[i, I_LAST] = tok
                        ist[i, I_ARMED] = 0
                        # The new stage is the window's tail since D started rising (plus a
                        # little slack): older window tokens belong to the old stage and
                        # would otherwise leak into the new stage's reference.
                        keep = tok - ist[i, I_ONSET] + 1 + slack
                        if ist[i, I_ONSET] < 0 or keep > window:
                            keep = window
                        _drop_oldest(i, ist, cnt, fl, ring, window - keep)
                        _stage_reset(i, ist, cnt, fl, True)
                        ist[i, I_ONSET] = -1
        ist[i, I_NTOK] = tok + 1
    return n_ev


@dataclass
class ImplicitEvents:
    seq: np.ndarray  # int64 [n]
    token: np.ndarray  # int64 [n]
    score: np.ndarray  # float64 [n]: excess x when the boundary fired

    def __len__(self) -> int:
        return len(self.seq)  # not .shape[0]: no tuple made per quiet step


def _frozen(dtype) -> np.ndarray:
    a = np.empty(0, dtype)
    a.flags.writeable = False
    return a


_NO_EVENTS = ImplicitEvents(_frozen(np.int64), _frozen(np.int64), _frozen(np.float64))


class ImplicitDetector:
    """Routing-shift detector for ``n_seq`` sequence slots of shape [L, E] with top-K routing.

    ``update(seq_idx, experts[B, L, K])`` consumes one token per entry (repeated slots are
    consumed in order). With ``detect=False`` it only tracks the stage histograms and scores.
    """

    def __init__(self, n_seq: int, n_layer: int, n_expert: int, top_k: int, config: ImplicitConfig | None = None,
                 detect: bool = True):
        if min(n_seq, n_layer, n_expert, top_k) < 1:
            raise SaemError(f"bad shape: n_seq={n_seq} n_layer={n_layer} n_expert={n_expert} top_k={top_k}")
        if n_expert > np.iinfo(np.int16).max:
            raise SaemError("at most 32767 experts")
        self.config = config or ImplicitConfig()
        self.config.validate()
        self.detect = detect
        self.n_seq, self.n_layer, self.n_expert, self.top_k = n_seq, n_layer, n_expert, top_k
        W, L = self.config.window, n_layer
        # Packed state (see update_kernel); the attributes below are views into it.
        self._ist = np.zeros((n_seq, N_ISTATE + 3 * L), np.int64)
        self._cnt = np.zeros((n_seq, 2, L, n_expert), np.int32)
        self._fl = np.zeros((n_seq, 3 * L + 1))
        self.state = self._ist[:, :N_ISTATE]
        self.nz = self._ist[:, N_ISTATE:].reshape(n_seq, 3, L)
        self.w = self._cnt[:, 0]
        self.r = self._cnt[:, 1]
        self.sw, self.sr, self.sc = self._fl[:, :L], self._fl[:, L:2 * L], self._fl[:, 2 * L:3 * L]
        self.ring = np.full((n_seq, W, L, top_k), -1, np.int16)
        self._prm = np.zeros(10)
        self._set_params(1.0)
        self._ev = np.empty((3, 64))
        self._scores = np.empty(64)
        for i in range(n_seq):
            self.reset(i)

    def _set_params(self, scale: float) -> None:
        c = self.config
        self._prm[:] = (c.window, c.min_ref, c.high * scale, c.low * scale, c.confirm, c.min_stage_tokens,
                        c.baseline_warmup, c.baseline_rate, c.onset_slack, 1.0 if self.detect else 0.0)
        self._scale = scale

    def _check_slot(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise SaemError(f"sequence slot {seq} out of range 0..{self.n_seq - 1}")

    def reset(self, seq: int, start_token: int = 0) -> None:
        """A new sequence in slot ``seq`` (the null level is learnt again)."""
        self._check_slot(seq)
        self._ist[seq, :N_ISTATE] = 0
        self._ist[seq, I_NTOK] = start_token
        self._fl[seq, 3 * self.n_layer] = 0.0
        self.new_stage(seq, start_token)

    def new_stage(self, seq: int, token: int) -> None:
        """An external (cue) boundary at ``token``: the stage restarts empty."""
        self._check_slot(seq)
        new_stage_kernel(seq, token, self._ist, self._cnt, self._fl, self.ring)

    def n_tokens(self, seq: int) -> int:
        return int(self._ist[seq, I_NTOK])

    def raw_score(self, seq: int) -> float:
        """D of slot ``seq`` now (before subtracting the null level); NaN if undefined."""
        if self._ist[seq, I_NW] == 0:
            return float("nan")
        return float(_score(self._fl[seq], self._ist[seq], self.n_layer, self.top_k))

    def null_level(self, seq: int) -> float:
        return float(self._fl[seq, 3 * self.n_layer])

    def stage_histogram(self, seq: int) -> np.ndarray:
        """int64 [L, E]: expert usage of slot ``seq``'s current stage so far."""
        return self.w[seq].astype(np.int64) + self.r[seq]

    def stage_tokens(self, seq: int) -> int:
        return int(self._ist[seq, I_NW] + self._ist[seq, I_NR])

    def update(self, seq_idx, experts: np.ndarray, scale: float = 1.0,
               scores_out: np.ndarray | None = None) -> ImplicitEvents:
        """Consume one token per entry. ``scale`` multiplies both thresholds (StageDetector
        asks for a stronger shift when cues are also on). ``scores_out[j]`` (optional, float64
        [B]) receives the excess x after entry j (NaN while not yet defined)."""
        seq_idx = step_slots(seq_idx)
        experts = routing_rows(experts, seq_idx.shape[0], (self.n_layer, self.n_expert, self.top_k), "update")
        return self.update_checked(seq_idx, experts, scale, scores_out)

    def update_checked(self, seq_idx: np.ndarray, experts: np.ndarray, scale: float = 1.0,
                       scores_out: np.ndarray | None = None) -> ImplicitEvents:
        """``update`` for slots and rows already checked (``step_slots``, ``routing_rows``): a
        caller that checked them once for several detectors spares the checks here."""
        ist, cnt, fl, ring, prm, ev, scores = self.kernel_args(scale, seq_idx.shape[0])
        n = update_kernel(ist, cnt, fl, ring, seq_idx, experts, prm, ev, scores if scores_out is None else scores_out)
        if n <= 0:
            if n == 0:
                return _NO_EVENTS
            raise SaemError(f"update: sequence index {int(seq_idx[-1 - n])} out of range 0..{self.n_seq - 1}")
        ev = self._ev[:, :n]
        return ImplicitEvents(ev[0].astype(np.int64), ev[1].astype(np.int64), ev[2].copy())

    def kernel_args(self, scale: float, B: int) -> tuple:
        """(ist, cnt, fl, ring, prm, ev, scores): the arguments of ``update_kernel`` but the
        step's slots and rows, for a step of ``B`` tokens with the thresholds times ``scale``
        (the event and score buffers grown to ``B``). For a caller that runs the kernel inside
        its own (stage.pair)."""
        if scale != self._scale:
            self._set_params(scale)
        if self._ev.shape[1] < B:
            self._ev = np.empty((3, B))
            self._scores = np.empty(B)
        return self._ist, self._cnt, self._fl, self.ring, self._prm, self._ev, self._scores


def score_trace(experts: np.ndarray, n_expert: int, config: ImplicitConfig | None = None,
                boundaries: np.ndarray | None = None, start_token: int = 0) -> np.ndarray:
    """float64 [T]: the statistic D after each token of one sequence, with the stage restarted
    at each given boundary token and no detection (NaN where D is not defined yet). Used to fit
    thresholds on within-stage routing."""
    T, L, K = experts.shape
    det = ImplicitDetector(1, L, n_expert, K, config, detect=False)
    det.reset(0, start_token)
    out = np.full(T, np.nan)
    cuts = sorted({int(b) - start_token for b in (boundaries if boundaries is not None else [])} | {0, T})
    cuts = [c for c in cuts if 0 <= c <= T]
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a > 0:
            det.new_stage(0, start_token + a)
        det.update(np.zeros(b - a, np.int64), experts[a:b], scores_out=out[a:b])
    return out


def detect_trace(experts: np.ndarray, n_expert: int, config: ImplicitConfig | None = None,
                 start_token: int = 0) -> ImplicitEvents:
    """Implicit boundaries of one whole sequence (one kernel call)."""
    T, L, K = experts.shape
    det = ImplicitDetector(1, L, n_expert, K, config)
    det.reset(0, start_token)
    return det.update(np.zeros(T, np.int64), experts)
