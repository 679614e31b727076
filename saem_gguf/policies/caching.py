"""On-demand caches: LRU (Mixtral-Offloading), LFU, and a recency-frequency temporal-retention
policy (the update-only mode of the cache-aware router paper, with a fixed LRFU priority in
place of the trained Temporal Router).

Two ways to serve a miss, both modelled:

* ``load`` (``lru``, ``lfu``, ``temporal``): the expert is copied into a cache slot (evicting
  the lowest-priority resident) and the layer waits for the copy before running it on the GPU,
  as Mixtral-Offloading does. The native layer of this project cannot do this mid-graph.
* ``cpu`` (``lru-cpu``, ``lfu-cpu``, ``temporal-cpu``): the expert runs in place on the CPU and
  is copied in after the layer for the next tokens, if its priority beats the victim's. This is
  what the engine does (copy_expert async; the copy takes effect at the next decode).
"""

from __future__ import annotations

import math

from typing import ClassVar

import numpy as np
from numba import njit

from saem_gguf.kernel_books import Book, KernelBooks, entry_point, f64_1d, f64_2d, i32_1d, i32_2d, i64_2d
from saem_gguf.policies.base import Policy, PolicyContext
from saem_gguf.policies.state import (
    OP_AFTER_USE, OP_DEMAND, OP_EVICT, CacheState, ResidencyChange, StepEvents, put_op, gather, op_buffer,
    scratch_buffer, scratch_views,
)

KIND_LRU = 0
KIND_LFU = 1
KIND_LRFU = 2

# Priorities live in one float64 key per (layer, expert), comparable across experts at any step:
#   LRU: the step of the last access;  LFU: the access count;
#   LRFU: ln(v) + g * lam, where v = sum over accesses of c * exp(-lam * (g - g_access)) is the
#   decayed frequency at step g. Adding g * lam makes the key time-invariant between accesses, so
#   eviction compares keys without recomputing decays (no pow in the victim search).
NO_KEY = -1e300


@njit(cache=True)
def _touch(kind, key, l, e, c, g, lam):
    """Expert ``e`` of layer ``l`` was used by ``c`` tokens at global step ``g``: update its key
    in ``key`` float64 [L, E] for priority ``kind`` (KIND_*; ``lam``: the LRFU decay per step)."""
    if kind == KIND_LRU:
        key[l, e] = g
    elif kind == KIND_LFU:
        key[l, e] += c
    else:
        k = key[l, e]
        v = 0.0 if k <= NO_KEY else np.exp(k - g * lam)
        key[l, e] = np.log(v + c) + g * lam


@njit(cache=True)
def _victim(key, l, g, owner, n_slots, stamp, avoid_used):
    """Free slot, else the slot of the lowest-priority resident (skipping experts used at this
    step when avoid_used). -1 when there is none. key float64 [L, E]; owner int32 [L, Smax];
    n_slots int32 [L]; stamp int64 [L, E]: the last step each expert was used."""
    best = -1
    best_p = 0.0
    for s in range(n_slots[l]):
        o = owner[l, s]
        if o < 0:
            return s
        if avoid_used and stamp[l, o] == g:
            continue
        p = key[l, o]
        if best < 0 or p < best_p:
            best = s
            best_p = p
    return best


@njit(cache=True)
def resident_floor(key, l, owner, n_slots):
    """The lowest ``key`` [L, E] of layer ``l``'s residents in ``owner`` [L, Smax]; -inf while a
    slot is free (a miss then always gets in).

    Every kind's key only grows between admissions (LRU: the step of the last use; LFU: the
    count; LRFU: ln of the decayed count plus g * lam, which an access raises and time does not
    move), and a resident set changes only at an admission. So the floor taken after a layer's
    last admission still bounds every resident's key later: a miss whose key is not above it
    beats no resident, and ``admit_after_use`` would admit nothing. The ``-cpu`` caches and the
    adaptive policy's shadow caches skip the slot search then (the same decisions); after a
    decode each resident's key read is a cache miss, so that search is most of a quiet step's
    work at a full cache."""
    lo = np.inf
    for s in range(n_slots[l]):
        o = owner[l, s]
        if o < 0:
            return -np.inf
        if key[l, o] < lo:
            lo = key[l, o]
    return lo


@njit(cache=True)
def admit_after_use(key, l, g, owner, slot_of, n_slots, stamp, miss, n_miss, admitted):
    """The ``-cpu`` variants' rule after layer ``l`` of step ``g`` ran its misses on the CPU:
    take the missed experts ``miss[:n_miss]`` best first (reorders ``miss``) and move each into a
    free slot or the slot of the lowest-priority resident not used at this step, while it beats
    that resident. Updates ``owner``/``slot_of``; writes (expert, slot, evicted expert or -1) to
    ``admitted`` rows and returns how many."""
    for a in range(1, n_miss):  # insertion sort by priority, descending
        x = miss[a]
        px = key[l, x]
        b = a - 1
        while b >= 0 and key[l, miss[b]] < px:
            miss[b + 1] = miss[b]
            b -= 1
        miss[b + 1] = x
    n_in = 0
    for i in range(n_miss):
        e = miss[i]
        if n_slots[l] == 0:
            break
        slot = _victim(key, l, g, owner, n_slots, stamp, True)
        if slot < 0:
            break
        o = owner[l, slot]
        if o >= 0:
            if key[l, o] >= key[l, e]:
                break
            slot_of[l, o] = -1
        owner[l, slot] = e
        slot_of[l, e] = slot
        admitted[n_in, 0] = e
        admitted[n_in, 1] = slot
        admitted[n_in, 2] = o
        n_in += 1
    return n_in


@njit(cache=True)
def decide_caching(rows, g, slot_of, owner, n_slots, key, stamp, floor, kind, lam, miss_cpu, scratch, ops):
    """The cache's decisions for one decode step: returns how many ``ops`` rows it wrote.

    rows int16 [B, L, K]: the step's routing (-1 rows: no token); g: the global step (the clock
    of LRU keys and LRFU decay); slot_of int32 [L, E] / owner int32 [L, Smax] / n_slots int32
    [L]: the CacheState, updated in place; key float64 [L, E]: priority keys (see above), stamp
    int64 [L, E]: last global step each expert was used; floor float64 [L]: with ``miss_cpu``,
    a lower bound of each layer's resident keys (``resident_floor``; -inf: none known), updated
    at each admission; kind: KIND_*; lam: LRFU decay per step
    (0 otherwise); miss_cpu: a miss runs on the CPU and is loaded after the layer when it beats
    the victim (True; ops OP_EVICT, OP_AFTER_USE) or is loaded into the lowest-priority slot
    before the layer uses it (False; OP_EVICT, OP_DEMAND); scratch int32: ``state.scratch_buffer``;
    ops int32 [>= 2 L E, 4]: (layer, expert, slot, OP_*) rows in issue order."""
    cnt, uniq, miss, _, admitted = scratch_views(scratch)
    L = slot_of.shape[0]
    n_ops = 0
    for l in range(L):
        n = gather(rows, l, cnt, uniq)
        for i in range(n):  # priorities see every access, resident or not
            e = uniq[i]
            _touch(kind, key, l, e, cnt[e], g, lam)
            stamp[l, e] = g
        n_miss = 0
        for i in range(n):
            e = uniq[i]
            if slot_of[l, e] < 0:
                miss[n_miss] = e
                n_miss += 1
        if not miss_cpu:
            for i in range(n_miss):
                if n_slots[l] == 0:  # nowhere to load: the host runs it
                    break
                e = miss[i]
                # Prefer victims not used at this step; with fewer slots than routed experts
                # an expert already computed at this step is evicted.
                slot = _victim(key, l, g, owner, n_slots, stamp, True)
                if slot < 0:
                    slot = _victim(key, l, g, owner, n_slots, stamp, False)
                o = owner[l, slot]
                if o >= 0:
                    slot_of[l, o] = -1
                    n_ops = put_op(ops, n_ops, l, o, slot, OP_EVICT)
                owner[l, slot] = e
                slot_of[l, e] = slot
                n_ops = put_op(ops, n_ops, l, e, slot, OP_DEMAND)
        else:
            # load the missed experts for the next tokens, best first, while they beat the victim;
            # none does unless the best beats the layer's floor (resident_floor)
            top = -np.inf
            for i in range(n_miss):
                top = max(top, key[l, miss[i]])
            n_in = 0
            if n_miss > 0 and top > floor[l]:
                n_in = admit_after_use(key, l, g, owner, slot_of, n_slots, stamp, miss, n_miss, admitted)
                floor[l] = resident_floor(key, l, owner, n_slots)
            for i in range(n_in):
                e, slot, o = admitted[i, 0], admitted[i, 1], admitted[i, 2]
                if o >= 0:
                    n_ops = put_op(ops, n_ops, l, o, slot, OP_EVICT)
                n_ops = put_op(ops, n_ops, l, e, slot, OP_AFTER_USE)
        for i in range(n):
            cnt[uniq[i]] = 0
    return n_ops


def lrfu_lambda(half_life: float) -> float:
    """Decay rate per step of an LRFU key with this half-life (steps)."""
    return float(np.log(2.0) / half_life)


def initial_keys(kind: int, calib: np.ndarray, top_k: int, prior_tokens: float, slot_of: np.ndarray) -> np.ndarray:
    """Priority keys [L, E] at model load (see the key definitions above): LRU ranks the
    calibrated residents as older than any real access; LFU and LRFU start from the calibrated
    per-token frequencies worth ``prior_tokens`` tokens of evidence (LRFU: as evidence at step 0)."""
    tot = calib.sum(axis=1, keepdims=True)
    freq = np.divide(calib, tot, out=np.zeros_like(calib), where=tot > 0) * top_k  # per token
    if kind == KIND_LRU:
        key = np.full(calib.shape, -1e18)
        rank = np.argsort(np.argsort(-calib, axis=1, kind="stable"), axis=1)
        res = slot_of >= 0
        key[res] = -1.0 - rank[res]
        return key
    prior = freq * prior_tokens
    if kind == KIND_LFU:
        return prior
    return np.where(prior > 0, np.log(np.maximum(prior, 1e-300)), NO_KEY)


# The cache's books (kernel_books): ``decide_caching``'s arrays, in its order
CACHING_BOOKS = (Book("slot_of", np.int32, 2), Book("owner", np.int32, 2), Book("n_slots", np.int32, 1),
                 Book("key", np.float64, 2), Book("stamp", np.int64, 2), Book("floor", np.float64, 1),
                 Book("scratch", np.int32, 1), Book("ops", np.int32, 2))


@njit(cache=True)
def caching_entry(rows, g, kind, lam, miss_cpu, tab):
    """``decide_caching`` with its books from ``tab`` (``CACHING_BOOKS``' table)."""
    return decide_caching(rows, g, i32_2d(tab, 0), i32_2d(tab, 1), i32_1d(tab, 2), f64_2d(tab, 3), i64_2d(tab, 4),
                          f64_1d(tab, 5), kind, lam, miss_cpu, i32_1d(tab, 6), i32_2d(tab, 7))


class CachingPolicy(Policy):
    """Priority cache; subclasses pick the priority (``kind``) and the miss handling."""

    kind: ClassVar[int] = KIND_LRU
    miss_cpu: ClassVar[bool] = False
    # LRFU half-life in decode steps (temporal policy only)
    half_life: float = 16.0
    # LFU/LRFU prior: calibration frequencies worth this many tokens of evidence
    prior_tokens: float = 64.0

    def __init__(self, half_life: float | None = None, prior_tokens: float | None = None) -> None:
        super().__init__()
        if half_life is not None:
            self.half_life = float(half_life)
        if prior_tokens is not None:
            self.prior_tokens = float(prior_tokens)

    def start(self, ctx: PolicyContext) -> CacheState:
        state = super().start(ctx)
        self._lam = lrfu_lambda(self.half_life) if self.kind == KIND_LRFU else 0.0
        self._key = initial_keys(self.kind, ctx.calib, ctx.top_k, self.prior_tokens, state.slot_of)
        self._stamp = np.full((ctx.n_layer, ctx.n_expert), -1, np.int64)
        self._floor = np.full(ctx.n_layer, -np.inf)  # nothing known: the first miss searches
        self._step = 0  # global decode step: one per observe
        self._scratch = scratch_buffer(ctx.n_expert)
        self._ops = op_buffer(ctx.n_layer, ctx.n_expert)
        self._books = KernelBooks(CACHING_BOOKS, {
            "slot_of": state.slot_of, "owner": state.owner, "n_slots": state.n_slots, "key": self._key,
            "stamp": self._stamp, "floor": self._floor, "scratch": self._scratch, "ops": self._ops})
        self._tab = self._books.table
        self._bound_rows: np.ndarray | None = None  # bind_step's rows and caching_entry's entry point for them
        self._bound_entry = caching_entry
        return state

    def bind_step(self, routing_rows: np.ndarray) -> None:
        self._bound_entry = entry_point(caching_entry, routing_rows, self._step, self.kind, self._lam, self.miss_cpu,
                                        self._tab)
        self._bound_rows = routing_rows

    def observe(self, routing_rows: np.ndarray, events: StepEvents,
                link_budget: float = math.inf) -> ResidencyChange | None:
        # the entry point only for the bound rows: it would read any other array as their type
        kernel = self._bound_entry if routing_rows is self._bound_rows else caching_entry
        n = kernel(routing_rows, self._step, self.kind, self._lam, self.miss_cpu, self._tab)
        self._step += 1
        if n == 0:
            return None
        return ResidencyChange(ops=self._ops[:n], n_in_step=n, target=self.state.slot_of)


class LruPolicy(CachingPolicy):
    name = "lru"
    summary = "LRU on demand, miss waits for the load (Mixtral-Offloading)"
    kind = KIND_LRU


class LruCpuPolicy(CachingPolicy):
    name = "lru-cpu"
    summary = "LRU, miss runs on the CPU and is loaded for the next tokens (what the engine does)"
    kind = KIND_LRU
    miss_cpu = True


class LfuPolicy(CachingPolicy):
    name = "lfu"
    summary = "LFU on demand (calibration prior), miss waits for the load"
    kind = KIND_LFU


class LfuCpuPolicy(CachingPolicy):
    name = "lfu-cpu"
    summary = "LFU, miss runs on the CPU, loaded after if more frequent than the victim"
    kind = KIND_LFU
    miss_cpu = True


class TemporalPolicy(CachingPolicy):
    name = "temporal"
    summary = "recency-frequency retention (LRFU, half-life 16 steps): update-only, miss waits for the load"
    kind = KIND_LRFU


class TemporalCpuPolicy(CachingPolicy):
    name = "temporal-cpu"
    summary = "recency-frequency retention, miss runs on the CPU and is loaded after"
    kind = KIND_LRFU
    miss_cpu = True
