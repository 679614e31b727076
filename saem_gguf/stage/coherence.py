"""Stage histograms and adjacent-stage coherence (TCseq).

TCseq (docs/STAGES.md has the full definition): for adjacent stages s -> s+1 and MoE layer l,
fill a per-layer cache of C = ceil(capacity_ratio * n_expert) experts with the C experts the
*completed* stage s used most in layer l, and measure the share of stage s+1's expert
activations in layer l that this cache serves:

    TC_l(s -> s+1) = sum_{e in Top_C(h_{s,l})} h_{s+1,l}[e] / sum_e h_{s+1,l}[e]

TCseq_l averages TC_l over all transitions weighted by the next stage's token count, which
makes it exactly the hit rate of SAEM's stage-aware refill policy (without capacity misses
inside a stage) on layer l; the overall TCseq is the mean over layers. Higher = the completed
stage predicts the next better. ``baseline = C / n_expert`` is what a random cache would get.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError


@njit(cache=True)
def _hist_kernel(experts, start, stop, n_expert, out):
    L = experts.shape[1]
    K = experts.shape[2]
    for t in range(start, stop):
        for l in range(L):
            for k in range(K):
                e = experts[t, l, k]
                if 0 <= e < n_expert:  # negative ids: padding / unrouted slots
                    out[l, e] += 1


def stage_histogram(experts: np.ndarray, n_expert: int, start: int = 0, stop: int | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """int64 [L, E]: how often each expert was routed to in each layer over tokens
    [start, stop). Adds into ``out`` when given (aggregating a batch of sequences)."""
    experts = _check_experts(experts)
    T, L, _ = experts.shape
    stop = T if stop is None else stop
    if not 0 <= start <= stop <= T:
        raise SaemError(f"token range [{start}, {stop}) is outside a trace of {T} tokens")
    if out is None:
        out = np.zeros((L, n_expert), np.int64)
    elif out.shape != (L, n_expert):
        raise SaemError(f"histogram shape {out.shape} does not match ({L}, {n_expert})")
    _hist_kernel(experts, start, stop, n_expert, out)
    return out


def stage_histograms(experts: np.ndarray, bounds: np.ndarray, n_expert: int) -> np.ndarray:
    """int64 [S, L, E] for the stages [bounds[s], bounds[s+1]) (bounds sorted, S+1 entries)."""
    experts = _check_experts(experts)
    bounds = np.asarray(bounds, np.int64)
    S = bounds.shape[0] - 1
    out = np.zeros((max(S, 0), experts.shape[1], n_expert), np.int64)
    for s in range(S):
        _hist_kernel(experts, int(bounds[s]), int(bounds[s + 1]), n_expert, out[s])
    return out


def _check_experts(experts: np.ndarray) -> np.ndarray:
    if not isinstance(experts, np.ndarray) or experts.ndim != 3:
        raise SaemError(f"experts must be an array [T, L, K], got {getattr(experts, 'shape', type(experts))}")
    if not np.issubdtype(experts.dtype, np.integer):
        raise SaemError(f"experts must hold integer expert ids, got {experts.dtype}")
    return experts


def capacity_of(n_expert: int, capacity_ratio: float) -> int:
    if not 0 < capacity_ratio <= 1:
        raise SaemError(f"capacity_ratio must be in (0, 1], got {capacity_ratio}")
    return max(1, min(n_expert, math.ceil(capacity_ratio * n_expert - 1e-9)))


@njit(cache=True)
def _top_kernel(hist, capacity, out):
    """Per row: insertion into a sorted list of ``capacity`` entries, scanning ids upwards, so
    ties keep the lower id. O(E * small) per row instead of a full sort."""
    R, E = hist.shape
    vals = np.empty(capacity, hist.dtype)
    for r in range(R):
        n = 0
        for e in range(E):
            v = hist[r, e]
            if n == capacity:
                if v <= vals[n - 1]:
                    continue
                n -= 1  # the smallest entry drops out
            p = n
            while p > 0 and vals[p - 1] < v:
                vals[p] = vals[p - 1]
                out[r, p] = out[r, p - 1]
                p -= 1
            vals[p] = v
            out[r, p] = e
            n += 1


def top_experts(hist: np.ndarray, capacity: int) -> np.ndarray:
    """int64 [..., C]: per layer, the C most used experts, most used first (ties: lower id)."""
    hist = np.asarray(hist)
    E = hist.shape[-1]
    capacity = max(0, min(int(capacity), E))
    flat = np.ascontiguousarray(hist.reshape(-1, E))
    out = np.empty((flat.shape[0], capacity), np.int64)
    if capacity:
        _top_kernel(flat, capacity, out)
    return out.reshape(*hist.shape[:-1], capacity)


@njit(cache=True)
def _sum_kernel(hists, out):
    B, L, E = hists.shape
    for l in range(L):
        for e in range(E):
            out[l, e] = 0
        for b in range(B):
            for e in range(E):
                out[l, e] += hists[b, l, e]


@njit(cache=True)
def _tc_kernel(prev, nxt, capacity, out):
    """out[l] = share of nxt[l] served by prev[l]'s top-`capacity` experts."""
    L, E = prev.shape
    sel = np.zeros(E, np.bool_)
    for l in range(L):
        tot = 0
        for e in range(E):
            tot += nxt[l, e]
            sel[e] = False
        if tot == 0:
            out[l] = np.nan
            continue
        # Partial selection (C passes of argmax) is cheaper than a sort for C << E and keeps
        # the lower-id tie rule of top_experts().
        for _ in range(capacity):
            best = -1
            bv = -1
            for e in range(E):
                if not sel[e] and prev[l, e] > bv:
                    bv = prev[l, e]
                    best = e
            sel[best] = True
        hit = 0
        for e in range(E):
            if sel[e]:
                hit += nxt[l, e]
        out[l] = hit / tot


def transition_coherence(prev_hist: np.ndarray, next_hist: np.ndarray, capacity: int) -> np.ndarray:
    """float64 [L]: TC_l(prev -> next) (NaN for a layer where next has no activations)."""
    prev_hist = np.ascontiguousarray(prev_hist, np.int64)
    next_hist = np.ascontiguousarray(next_hist, np.int64)
    if prev_hist.shape != next_hist.shape or prev_hist.ndim != 2:
        raise SaemError(f"histogram shapes differ: {prev_hist.shape} vs {next_hist.shape}")
    out = np.empty(prev_hist.shape[0], np.float64)
    _tc_kernel(prev_hist, next_hist, min(capacity, prev_hist.shape[1]), out)
    return out


@dataclass
class TCSeq:
    per_layer: np.ndarray  # float64 [L]
    overall: float
    n_transitions: int
    capacity: int
    baseline: float  # capacity / n_expert: a random cache's hit rate
    per_transition: np.ndarray  # float64 [n_transitions]: layer mean of each transition
    weights: np.ndarray  # float64 [n_transitions]: tokens of each transition's next stage

    def to_dict(self) -> dict:
        return {
            "overall": _f(self.overall),
            "per_layer": [_f(x) for x in self.per_layer.tolist()],
            "n_transitions": int(self.n_transitions),
            "capacity": int(self.capacity),
            "baseline": float(self.baseline),
        }


def _f(x: float) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 6)


def tcseq(segments: Sequence[tuple[np.ndarray, np.ndarray]], n_expert: int, capacity_ratio: float = 0.25,
          weighting: str = "tokens") -> TCSeq:
    """TCseq over sequences given as (experts [T, L, K], stage bounds [S+1]) pairs.

    ``weighting="tokens"`` weights each transition by its next stage's length (the hit-rate
    reading); ``"transitions"`` weights every transition equally.
    """
    if weighting not in ("tokens", "transitions"):
        raise SaemError("weighting must be 'tokens' or 'transitions'")
    cap = capacity_of(n_expert, capacity_ratio)
    rows, wts = [], []
    L = None
    for experts, bounds in segments:
        hists = stage_histograms(experts, bounds, n_expert)
        L = experts.shape[1]
        lens = np.diff(np.asarray(bounds, np.int64))
        for s in range(1, hists.shape[0]):
            if lens[s] <= 0 or lens[s - 1] <= 0:
                continue
            rows.append(transition_coherence(hists[s - 1], hists[s], cap))
            wts.append(float(lens[s]) if weighting == "tokens" else 1.0)
    return _summarise(rows, wts, L or 0, cap, n_expert)


def _summarise(rows: list[np.ndarray], wts: list[float], L: int, cap: int, n_expert: int) -> TCSeq:
    if not rows:
        return TCSeq(np.full(L, np.nan), float("nan"), 0, cap, cap / n_expert, np.empty(0), np.empty(0))
    m = np.vstack(rows)
    w = np.asarray(wts, np.float64)
    valid = np.isfinite(m)
    mw = np.where(valid, m, 0.0) * w[:, None]
    den = (valid * w[:, None]).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = mw.sum(axis=0) / den
    overall = float(np.nanmean(per_layer)) if np.isfinite(per_layer).any() else float("nan")
    return TCSeq(per_layer, overall, len(rows), cap, cap / n_expert, np.nanmean(m, axis=1), w)


def aggregate_stage(hists: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """Sum per-sequence stage histograms [L, E] (or [B, L, E]) over the batch: SAEM's
    per-layer, per-expert usage of the completed stage across batch queries."""
    a = np.asarray(hists)
    if a.ndim == 2:
        return a.astype(np.int64, copy=True)
    if a.ndim != 3:
        raise SaemError(f"expected [L, E] or [B, L, E] histograms, got shape {a.shape}")
    if a.dtype != np.int64 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, np.int64)
    out = np.empty(a.shape[1:], np.int64)
    _sum_kernel(a, out)
    return out


def stage_frequencies(hist: np.ndarray) -> np.ndarray:
    """float64 [L, E]: per-layer usage frequencies (each layer sums to 1, or 0 if unused)."""
    h = np.asarray(hist, np.float64)
    tot = h.sum(axis=-1, keepdims=True)
    return np.divide(h, tot, out=np.zeros_like(h), where=tot > 0)
