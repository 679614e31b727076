"""Synthetic, stage-structured routing traces (NOT recorded from a model).

Until the engine records real routing traces, calibration, the stage detector and the
policy simulator are exercised on traces generated here. Everything in a synthetic trace is
made up, but shaped after what the SAEM paper reports for Qwen3 on MATH-500:

* a sequence is a run of reasoning *stages*; stage counts are 1-49 per sequence (median 5,
  mean 8) and stage lengths 55-7129 tokens (median 271, mean 484). Both are drawn from
  log-normals whose median is the reported median and whose sigma is fitted so that the
  mean *after clipping* to the reported range is the reported mean;
* each stage has its own per-layer expert-affinity distribution: a Zipf law of exponent
  ``skew`` over a random ranking of the experts (higher skew = a few experts dominate);
* adjacent stages are coherent: the next stage's affinity is
  ``coherence * previous + (1 - coherence) * fresh``, i.e. ``coherence`` is the share of the
  next stage's affinity mass inherited from the completed stage;
* each token picks ``top_k`` distinct experts per layer from its stage's affinity
  (successive sampling without replacement, like a noisy top-k router) with gate weights
  proportional to the affinity and normalised over the chosen k (sorted descending);
* the text is filler sentences cut into byte pieces (pieces may split multi-byte UTF-8
  characters), and every stage after the first starts with a reasoning cue ("Wait, ...")
  at a line start, so the cue matcher can find the boundaries. ``stage_starts`` holds the
  index of the first token of each stage (the cue's first token).

Optional, off by default (so every other family stays byte-identical): ``drift_every`` makes a
stage's hot set drift without a cue or a recorded boundary (every ``drift_every`` tokens the
affinity keeps ``drift_keep`` of itself and takes the rest fresh), and ``token_noise`` routes
that share of the tokens uniformly over the experts (tokens no stage predicts).

``stationary=True`` gives the null model: one stage per sequence (same token budget), no
stage cues, so routing never shifts.

The API (``SyntheticConfig``, ``make_stage_traces``) is shared with the policy simulator;
new fields are only ever added with defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from saem_gguf.errors import SaemError
from saem_gguf.trace import ModelSignature, SequenceTrace, TraceSet

# Cues planted at stage boundaries by default: all of them are in the general cue set.
DEFAULT_STAGE_CUES: tuple[str, ...] = (
    "Alternatively",
    "Wait",
    "But wait",
    "Hmm",
    "Let me double-check",
    "Let me verify",
    "Another way",
    "On second thought",
    "Instead",
)


@dataclass
class SyntheticConfig:
    """Shape and statistics of a synthetic trace set. Defaults: Qwen3-30B-A3B routing shape."""

    n_layer: int = 48
    n_expert: int = 128
    top_k: int = 8
    n_sequences: int = 8
    seed: int = 0
    # Zipf exponent of each stage's per-layer affinity over a random expert ranking.
    skew: float = 1.2
    # Share of the next stage's affinity inherited from the previous stage (0 = unrelated).
    coherence: float = 0.6
    # Multiplies stage lengths (and their clip range) so tests can use short stages.
    stage_len_scale: float = 1.0
    # One stage per sequence, no boundary cues: the null model for false-alarm tests.
    stationary: bool = False
    # Stage-count and stage-length statistics (paper: Qwen3, MATH-500).
    n_stage_median: float = 5.0
    n_stage_mean: float = 8.0
    n_stage_min: int = 1
    n_stage_max: int = 49
    stage_len_median: float = 271.0
    stage_len_mean: float = 484.0
    stage_len_min: int = 55
    stage_len_max: int = 7129
    # Fixed stage count per sequence (overrides the drawn one) when > 0.
    n_stages: int = 0
    # Prompt tokens at the start of every sequence (routed like stage 0, never a boundary).
    prompt_len: int = 0
    # Text: cues written at boundaries; share of boundaries that carry one (the rest are
    # implicit: the routing shifts without any lexical cue).
    with_text: bool = True
    stage_cues: tuple[str, ...] = DEFAULT_STAGE_CUES
    cue_prob: float = 1.0
    # Cues written at sentence starts *inside* stages (no routing shift): noisy markers.
    noise_cues: tuple[str, ...] = ()
    noise_cue_rate: float = 0.0  # probability per sentence
    # Cues whose boundaries start an unrelated stage (coherence 0 at that boundary).
    reset_cues: tuple[str, ...] = ()
    # Probability per sentence of a mid-sentence lower-case cue word ("we can alternatively")
    # that must NOT be detected as a boundary.
    decoy_rate: float = 0.05
    # Recurring stage kinds: when > 0, a pool of this many affinity profiles shared by every
    # sequence; a stage's cue names its kind (the i-th stage cue opens kind i mod n_kinds, the
    # first stage and cue-less stages draw one at random) and the stage routes by
    # ``kind_share * kind + (1 - kind_share) * fresh`` (coherence is then unused).
    n_kinds: int = 0
    kind_share: float = 0.8
    # Hot sets that drift inside a stage: every ``drift_every`` tokens (0: never) the stage's
    # affinity moves to ``drift_keep * current + (1 - drift_keep) * fresh``, with no cue and no
    # recorded boundary (what a cache that follows the routing handles and a stage rule does not).
    drift_every: int = 0
    drift_keep: float = 0.8
    # Token noise: each token routes, with this probability, by a uniform affinity over the
    # experts instead of its stage's (tokens no stage predicts; they pollute recency caches).
    token_noise: float = 0.0
    with_weights: bool = True
    arch: str = "qwen3moe"
    name: str = "synthetic"


# --------------------------------------------------------------------------------------------
# Distributions fitted to the paper's statistics


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _clipped_lognormal_mean(mu: float, s: float, lo: float, hi: float) -> float:
    a, b = math.log(lo), math.log(hi)
    inner = math.exp(mu + 0.5 * s * s) * (_norm_cdf((b - mu - s * s) / s) - _norm_cdf((a - mu - s * s) / s))
    return inner + lo * _norm_cdf((a - mu) / s) + hi * (1.0 - _norm_cdf((b - mu) / s))


def fit_clipped_lognormal(median: float, mean: float, lo: float, hi: float) -> tuple[float, float]:
    """(mu, sigma) of a log-normal with the given median whose mean after clipping to
    [lo, hi] is ``mean``. Clipping does not move the median when lo <= median <= hi."""
    if not (0 < lo <= median <= hi) or mean <= median:
        raise SaemError(f"cannot fit a clipped log-normal to median={median} mean={mean} range=[{lo}, {hi}]")
    mu = math.log(median)
    s_lo, s_hi = 1e-3, 10.0
    if _clipped_lognormal_mean(mu, s_hi, lo, hi) < mean:
        raise SaemError(f"mean {mean} is not reachable within [{lo}, {hi}] with median {median}")
    for _ in range(100):  # the clipped mean grows monotonically with sigma on this range
        mid = 0.5 * (s_lo + s_hi)
        if _clipped_lognormal_mean(mu, mid, lo, hi) < mean:
            s_lo = mid
        else:
            s_hi = mid
    return mu, 0.5 * (s_lo + s_hi)


def draw_stage_counts(cfg: SyntheticConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    if cfg.n_stages > 0:
        return np.full(n, cfg.n_stages, np.int64)
    mu, s = fit_clipped_lognormal(cfg.n_stage_median, cfg.n_stage_mean, cfg.n_stage_min, cfg.n_stage_max)
    x = np.exp(rng.normal(mu, s, n))
    return np.clip(np.rint(x), cfg.n_stage_min, cfg.n_stage_max).astype(np.int64)


def draw_stage_lengths(cfg: SyntheticConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    if cfg.stage_len_min >= cfg.stage_len_max:  # fixed length (tests)
        return np.full(n, max(1, round(cfg.stage_len_min * cfg.stage_len_scale)), np.int64)
    mu, s = fit_clipped_lognormal(cfg.stage_len_median, cfg.stage_len_mean, cfg.stage_len_min, cfg.stage_len_max)
    x = np.clip(np.exp(rng.normal(mu, s, n)), cfg.stage_len_min, cfg.stage_len_max)
    return np.maximum(1, np.rint(x * cfg.stage_len_scale)).astype(np.int64)


# --------------------------------------------------------------------------------------------
# Affinities and top-k sampling


def zipf_affinity(rng: np.random.Generator, n_layer: int, n_expert: int, skew: float) -> np.ndarray:
    """float64 [L, E]: per layer, a Zipf(skew) law over a random ranking of the experts."""
    base = (np.arange(1, n_expert + 1, dtype=np.float64)) ** (-float(skew))
    base /= base.sum()
    ranks = np.argsort(rng.random((n_layer, n_expert)), axis=1)
    return base[ranks]


@njit(cache=True, inline="always")
def _next_u64(st):
    # splitmix64: a per-call generator state instead of numba's process-global RNG, so
    # results depend on the seed only.
    z = st[0] + np.uint64(0x9E3779B97F4A7C15)
    st[0] = z
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def _uniform(st):
    # Through int64: a signed conversion is one instruction, an unsigned one is not.
    return float(np.int64(_next_u64(st) >> np.uint64(11))) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def _build_alias(probs, alias_p, alias_i):
    """Walker/Vose alias tables per (stage, layer): O(1) draws instead of a binary search."""
    S, L, E = probs.shape
    small = np.empty(E, np.int64)
    large = np.empty(E, np.int64)
    q = np.empty(E, np.float64)
    for s in range(S):
        for l in range(L):
            tot = 0.0
            for e in range(E):
                tot += probs[s, l, e]
            ns = 0
            nl = 0
            for e in range(E):
                q[e] = probs[s, l, e] * E / tot
                if q[e] < 1.0:
                    small[ns] = e
                    ns += 1
                else:
                    large[nl] = e
                    nl += 1
            while ns > 0 and nl > 0:
                ns -= 1
                a = small[ns]
                g = large[nl - 1]
                alias_p[s, l, a] = q[a]
                alias_i[s, l, a] = g
                q[g] = (q[g] + q[a]) - 1.0
                if q[g] < 1.0:
                    nl -= 1
                    small[ns] = g
                    ns += 1
            for i in range(nl):
                alias_p[s, l, large[i]] = 1.0
                alias_i[s, l, large[i]] = large[i]
            for i in range(ns):  # rounding leftovers
                alias_p[s, l, small[i]] = 1.0
                alias_i[s, l, small[i]] = small[i]


@njit(cache=True, parallel=True)
def _sample_topk(alias_p, alias_i, order, probs, token_stage, k, seed, experts, weights):
    """Fill experts[T, L, k] / weights[T, L, k]: k distinct experts per token and layer.

    Successive sampling without replacement == drawing from the full distribution and
    rejecting repeats; each draw is one alias-table lookup. Once the chosen experts hold half
    of the mass, rejections get expensive and the remaining mass is scanned exactly instead.
    Each token has its own generator stream (seeded from the token index), so the result does
    not depend on how chunks of tokens are spread over threads.
    """
    T = token_stage.shape[0]
    L = probs.shape[1]
    E = probs.shape[2]
    chunk = 256
    n_chunks = (T + chunk - 1) // chunk
    for ch in prange(n_chunks):
        st = np.empty(1, np.uint64)
        chosen = np.empty(k, np.int64)
        p = np.empty(k, np.float64)
        taken = np.zeros(E, np.bool_)
        for t in range(ch * chunk, min(T, (ch + 1) * chunk)):
            st[0] = seed ^ (np.uint64(t) * np.uint64(0xD1B54A32D192ED03))
            _sample_token(alias_p, alias_i, order, probs, token_stage[t], k, st, chosen, p, taken, experts, weights, t,
                          L, E)


@njit(cache=True, inline="always")
def _sample_token(alias_p, alias_i, order, probs, s, k, st, chosen, p, taken, experts, weights, t, L, E):
    for l in range(L):
        ap = alias_p[s, l]
        ai = alias_i[s, l]
        pr = probs[s, l]
        od = order[s, l]
        total = 0.0
        for x in range(E):
            total += pr[x]
        mass = 0.0
        j = 0
        while j < k:
            if mass < 0.5 * total:
                # Rejection costs 1 / (1 - mass) draws per pick: cheap until the chosen
                # experts hold half of the mass. One 64-bit draw: the high 32 bits pick the
                # alias column (multiply-shift), the low 32 bits the coin within it.
                z = _next_u64(st)
                col = np.int64(((z >> np.uint64(32)) * np.uint64(E)) >> np.uint64(32))
                coin = float(np.int64(z & np.uint64(0xFFFFFFFF))) * (1.0 / 4294967296.0)
                e = col if coin < ap[col] else ai[col]
                if taken[e]:
                    continue
            else:
                # Exact draw from the remaining mass, scanning experts by decreasing affinity:
                # the scan usually stops after a few of the (untaken) heaviest experts.
                u = _uniform(st) * (total - mass)
                e = -1
                acc = 0.0
                for q in range(E):
                    x = od[q]
                    if taken[x] or pr[x] <= 0.0:
                        continue
                    e = x
                    acc += pr[x]
                    if acc > u:
                        break
            taken[e] = True
            chosen[j] = e
            p[j] = pr[e]
            mass += pr[e]
            j += 1
        for a in range(k):
            taken[chosen[a]] = False
        # llama.cpp returns top-k sorted by gate value, descending.
        for a in range(1, k):
            ce = chosen[a]
            cp = p[a]
            b = a - 1
            while b >= 0 and p[b] < cp:
                chosen[b + 1] = chosen[b]
                p[b + 1] = p[b]
                b -= 1
            chosen[b + 1] = ce
            p[b + 1] = cp
        norm = 0.0
        for a in range(k):
            norm += p[a]
        for a in range(k):
            experts[t, l, a] = chosen[a]
            weights[t, l, a] = p[a] / norm


def sample_routing(
    affinity: np.ndarray, token_stage: np.ndarray, top_k: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """experts int16 [T, L, k], weights float32 [T, L, k] for tokens whose stage is
    ``token_stage[t]`` and whose stage affinities are ``affinity[S, L, E]``."""
    affinity = np.ascontiguousarray(affinity, dtype=np.float64)
    S, L, E = affinity.shape
    if not 0 < top_k <= E:
        raise SaemError(f"top_k must be in 1..{E}, got {top_k}")
    if np.any((affinity > 0).sum(axis=2) < top_k):
        raise SaemError("every stage affinity needs at least top_k experts with positive mass")
    alias_p = np.empty((S, L, E), np.float64)
    alias_i = np.empty((S, L, E), np.int64)
    _build_alias(affinity, alias_p, alias_i)
    T = int(token_stage.shape[0])
    experts = np.empty((T, L, top_k), np.int16)
    weights = np.empty((T, L, top_k), np.float32)
    order = np.ascontiguousarray(np.argsort(-affinity, axis=2, kind="stable"))
    _sample_topk(alias_p, alias_i, order, affinity, token_stage.astype(np.int64), top_k, np.uint64(seed), experts,
                 weights)
    return experts, weights


# --------------------------------------------------------------------------------------------
# Text

_WORDS = (
    "the we need to compute value of x so that is equal sum term first second and then number "
    "function which gives for each case let n be consider square root integer factor prime both "
    "sides angle triangle area probability total ratio this it not can must with from into by when "
    "since divide multiply plus minus times answer remainder digit even odd positive negative"
).split()
_MATH = (" =", " +", " 2", " 3", " 12", " 1/2", " x^2", " π", " ≤", " √2", " θ", " →", " n²", " ∑", " é")
_OPENERS = ("We", "The", "Then", "Now", "Next", "First", "This", "Let", "For", "If", "Since")
_DECOYS = (" alternatively", " wait", " therefore", " instead", " hmm")


class _TextGen:
    """Cuts filler sentences and cues into byte pieces; keeps a piece -> token id vocabulary."""

    def __init__(self, rng: np.random.Generator, cfg: SyntheticConfig):
        self.rng = rng
        self.cfg = cfg
        self.vocab: dict[bytes, int] = {}
        self._sentence_left = 0
        self._buf = np.empty(0)
        self._pos = 0

    def _u(self) -> float:
        # Generator.random() costs ~1 us per call; drawing blocks keeps text generation cheap.
        if self._pos >= self._buf.shape[0]:
            self._buf = self.rng.random(8192)
            self._pos = 0
        self._pos += 1
        return float(self._buf[self._pos - 1])

    def _pick(self, seq):
        return seq[int(self._u() * len(seq))]

    def _split(self, s: str, out: list[bytes]) -> None:
        # BPE-like: a word is 1-3 pieces at random byte offsets, which may cut a multi-byte
        # character (byte-fallback tokens do that).
        b = s.encode("utf-8")
        n = len(b)
        r = self._u()
        if n <= 3 or r < 0.6:
            out.append(b)
            return
        c1 = 1 + int(self._u() * (n - 1))
        if r < 0.9 or n < 6:
            out.append(b[:c1])
            out.append(b[c1:])
            return
        c2 = 1 + int(self._u() * (n - 1))
        a, z = min(c1, c2), max(c1, c2)
        out.append(b[:a])
        if z > a:
            out.append(b[a:z])
        out.append(b[z:])

    def words(self, n_tokens: int, out: list[bytes], sentence_start: bool) -> None:
        """Append filler pieces until ``n_tokens`` more pieces were added."""
        cfg = self.cfg
        target = len(out) + n_tokens
        while len(out) < target:
            if sentence_start:
                self._sentence_left = 6 + int(self._u() * 12)
                if cfg.noise_cues and self._u() < cfg.noise_cue_rate:
                    self._split(self._pick(cfg.noise_cues) + ",", out)
                    w = " " + self._pick(_WORDS)
                else:
                    w = self._pick(_OPENERS)
                sentence_start = False
            elif self._sentence_left <= 0:
                w = "." + (" " if self._u() < 0.7 else "\n\n")
                sentence_start = True
            else:
                r = self._u()
                if r < 0.15:
                    w = self._pick(_MATH)
                elif r < 0.15 + cfg.decoy_rate / 10:
                    w = self._pick(_DECOYS)
                else:
                    w = " " + self._pick(_WORDS)
                self._sentence_left -= 1
            self._split(w, out)
        del out[target:]

    def stage(self, n_tokens: int, cue: str | None, last: bool) -> list[bytes]:
        out: list[bytes] = []
        if cue is not None:
            self._split(cue + ",", out)
            self._split(" " + self._pick(_WORDS), out)
            self._sentence_left = 4 + int(self._u() * 10)
            body = max(0, n_tokens - len(out) - (0 if last else 1))
            self.words(body, out, sentence_start=False)
        else:
            body = max(0, n_tokens - (0 if last else 1))
            self.words(body, out, sentence_start=True)
        if not last:
            # Close the stage on a paragraph break so the next stage's cue is at a line start.
            out.append(b".\n\n")
        return out

    def ids(self, pieces: list[bytes]) -> np.ndarray:
        v = self.vocab
        return np.fromiter((v.setdefault(p, len(v)) for p in pieces), np.int32, len(pieces))


# --------------------------------------------------------------------------------------------


def _check(cfg: SyntheticConfig) -> None:
    if cfg.n_layer < 1 or cfg.n_expert < 1 or not 0 < cfg.top_k <= cfg.n_expert:
        raise SaemError(f"bad routing shape: n_layer={cfg.n_layer} n_expert={cfg.n_expert} top_k={cfg.top_k}")
    if cfg.n_sequences < 1:
        raise SaemError("n_sequences must be >= 1")
    if not 0.0 <= cfg.coherence <= 1.0:
        raise SaemError(f"coherence must be in [0, 1], got {cfg.coherence}")
    if cfg.skew < 0:
        raise SaemError(f"skew must be >= 0, got {cfg.skew}")
    if cfg.stage_len_scale <= 0:
        raise SaemError("stage_len_scale must be > 0")
    if not 0.0 <= cfg.cue_prob <= 1.0 or not 0.0 <= cfg.noise_cue_rate <= 1.0:
        raise SaemError("cue_prob and noise_cue_rate must be probabilities")
    if cfg.n_kinds < 0 or not 0.0 <= cfg.kind_share <= 1.0:
        raise SaemError("n_kinds must be >= 0 and kind_share in [0, 1]")
    if cfg.drift_every < 0 or not 0.0 <= cfg.drift_keep <= 1.0:
        raise SaemError("drift_every must be >= 0 and drift_keep in [0, 1]")
    if not 0.0 <= cfg.token_noise <= 1.0:
        raise SaemError("token_noise must be a probability")
    if cfg.with_text and cfg.cue_prob > 0 and not cfg.stage_cues and not cfg.stationary:
        raise SaemError("cue_prob > 0 needs at least one stage cue")


def make_sequence(
    cfg: SyntheticConfig, rng: np.random.Generator, textgen: _TextGen | None, kinds: np.ndarray | None = None
) -> tuple[SequenceTrace, list[str | None]]:
    """One synthetic sequence (see module docstring) and the cue written at each stage start
    (None for the first stage and for implicit boundaries). ``kinds`` [n_kinds, L, E]: the
    recurring stage kinds' affinities (``cfg.n_kinds``)."""
    L, E = cfg.n_layer, cfg.n_expert
    n_st = 1 if cfg.stationary else int(draw_stage_counts(cfg, rng, 1)[0])
    lengths = draw_stage_lengths(cfg, rng, n_st)
    if cfg.stationary:
        # Same token budget as a staged sequence, in one stage.
        lengths = np.array([int(draw_stage_lengths(cfg, rng, int(draw_stage_counts(cfg, rng, 1)[0])).sum())])

    cues: list[str | None] = [None]
    for _ in range(1, n_st):
        if cfg.stage_cues and rng.random() < cfg.cue_prob:
            cues.append(cfg.stage_cues[int(rng.integers(len(cfg.stage_cues)))])
        else:
            cues.append(None)

    aff = np.empty((n_st, L, E))
    if kinds is not None:
        for s in range(n_st):
            k = cfg.stage_cues.index(cues[s]) if cues[s] in cfg.stage_cues else int(rng.integers(len(kinds)))
            aff[s] = cfg.kind_share * kinds[k % len(kinds)] + (1.0 - cfg.kind_share) * zipf_affinity(rng, L, E, cfg.skew)
    else:
        aff[0] = zipf_affinity(rng, L, E, cfg.skew)
        for s in range(1, n_st):
            c = 0.0 if cues[s] in cfg.reset_cues else cfg.coherence
            aff[s] = c * aff[s - 1] + (1.0 - c) * zipf_affinity(rng, L, E, cfg.skew)

    pieces: list[bytes] = []
    if cfg.prompt_len > 0:
        if textgen is not None:
            textgen.words(cfg.prompt_len, pieces, sentence_start=True)
            pieces[-1] = b"\n"  # generation starts on a fresh line, like after "<think>\n"
        else:
            pieces.extend([b""] * cfg.prompt_len)
    starts = []
    for s in range(n_st):
        starts.append(len(pieces))
        if textgen is not None:
            pieces.extend(textgen.stage(int(lengths[s]), cues[s], last=s == n_st - 1))
        else:
            pieces.extend([b""] * int(lengths[s]))
    T = len(pieces)
    stage_starts = np.array(starts, np.int32)
    stage_starts[0] = 0  # the prompt belongs to the first stage
    token_stage = np.zeros(T, np.int64)
    for s in range(1, n_st):
        token_stage[stage_starts[s]:] = s

    seed = int(rng.integers(0, 2**63 - 1))
    aff, token_stage = _drift_and_noise(cfg, rng, aff, token_stage, stage_starts, seed)
    experts, weights = sample_routing(aff, token_stage, cfg.top_k, seed)
    token_ids = textgen.ids(pieces) if textgen is not None else np.zeros(T, np.int32)
    trace = SequenceTrace(
        token_ids=token_ids,
        pieces=pieces,
        experts=experts,
        weights=weights if cfg.with_weights else None,
        stage_starts=stage_starts,
        prompt_len=int(cfg.prompt_len),
    )
    return trace, cues


def _drift_and_noise(cfg: SyntheticConfig, rng: np.random.Generator, aff: np.ndarray, token_stage: np.ndarray,
                     stage_starts: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The routing rows (affinities [R, L, E]) and each token's row once in-stage drift and token
    noise are applied (SyntheticConfig.drift_every, token_noise); unchanged, drawing nothing from
    ``rng``, when both are off (the other families stay byte-identical)."""
    if cfg.drift_every <= 0 and cfg.token_noise <= 0:
        return aff, token_stage
    L, E = aff.shape[1:]
    T = token_stage.shape[0]
    rows = []
    row_of = np.empty(T, np.int64)
    ends = [*stage_starts[1:].tolist(), T]
    for s in range(aff.shape[0]):
        cur = aff[s]
        for a in range(int(stage_starts[s]), ends[s], cfg.drift_every if cfg.drift_every > 0 else T):
            if a > stage_starts[s]:
                cur = cfg.drift_keep * cur + (1.0 - cfg.drift_keep) * zipf_affinity(rng, L, E, cfg.skew)
            rows.append(cur)
            row_of[a:ends[s]] = len(rows) - 1
    if cfg.token_noise > 0:
        rows.append(np.full((L, E), 1.0 / E))
        noisy = np.random.default_rng(seed ^ 0x5EED).random(T) < cfg.token_noise
        row_of[noisy] = len(rows) - 1
    return np.stack(rows), row_of


def make_stage_traces(cfg: SyntheticConfig) -> TraceSet:
    """A TraceSet of ``cfg.n_sequences`` synthetic stage-structured sequences.

    Deterministic in ``cfg`` (seed included). ``meta`` records that the set is synthetic and
    the config it came from, plus the cue written at each boundary (None = implicit).
    """
    _check(cfg)
    rng = np.random.default_rng(cfg.seed)
    textgen = _TextGen(rng, cfg) if cfg.with_text else None
    kinds = np.stack([zipf_affinity(rng, cfg.n_layer, cfg.n_expert, cfg.skew) for _ in range(cfg.n_kinds)]) \
        if cfg.n_kinds > 0 else None
    made = [make_sequence(cfg, rng, textgen, kinds) for _ in range(cfg.n_sequences)]
    seqs = [m[0] for m in made]
    sig = ModelSignature(
        arch=cfg.arch, n_layer=cfg.n_layer, n_expert=cfg.n_expert, n_expert_used=cfg.top_k, name=cfg.name
    )
    meta = {
        "synthetic": True,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "boundary_cues": [m[1] for m in made],
    }
    return TraceSet(signature=sig, sequences=seqs, source="synthetic", meta=meta)
