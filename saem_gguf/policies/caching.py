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

from typing import ClassVar

import numpy as np
from numba import njit

from saem_gguf.costmodel import C_DENSE_LAYER_S, t_xfer
from saem_gguf.policies.accounting import A_ASYNC, A_EVICT, K_ASYNC, K_CPU, K_DEMAND, K_EVICT, K_HIT, Accounting, log_put
from saem_gguf.policies.base import Policy, PolicyContext
from saem_gguf.policies.state import CacheState, RoutingBlock
from saem_gguf.policies.replay import active_tokens, gather, layer_end, step_begin, step_end, time_tables

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
def run_caching(routing, s0, s1, step0, slot_of, owner, n_slots, ready_at, key, stamp, kind, lam,
                miss_cpu, cost, clock, acc, log, log_n):
    """Replay steps [s0, s1) under a priority cache.

    routing int16 [S, B, L, K] (-1 = no token); step0: global index of step 0 (the clock of
    LRU keys and LRFU decay); slot_of int32 [L, E], owner int32 [L, Smax], n_slots int32 [L],
    ready_at float64 [L, Smax]: the CacheState, updated in place; key float64 [L, E]: priority
    keys (see above), stamp int64 [L, E]: last global step each expert was used; kind: KIND_*;
    lam: LRFU decay per step (0 otherwise); miss_cpu: a miss runs on the CPU and is loaded after
    the layer (True) or is loaded first while the layer waits (False); cost: CostModel.array
    (C_*); clock float64 [now, link free at]; acc: counters (accounting.A_*); log int32 [n, 5] /
    log_n int64 [1]: the decision log (accounting.log_put)."""
    S, B, L, K = routing.shape
    E = slot_of.shape[1]
    cnt = np.zeros(E, np.int32)
    uniq = np.empty(E, np.int32)
    miss = np.empty(E, np.int32)
    admitted = np.empty((E, 3), np.int32)
    tx = t_xfer(cost)
    tg, tc = time_tables(B, cost)
    dense = cost[C_DENSE_LAYER_S]
    for s in range(s0, s1):
        ntok = active_tokens(routing, s)
        if ntok == 0:
            continue
        g = step0 + s
        now, link, stall = step_begin(clock, cost)
        n_acc = 0.0
        n_hit = 0.0
        n_cpu_tok = 0.0
        n_cpu_runs = 0.0
        n_gpu_runs = 0.0
        n_load = 0.0
        n_async = 0.0
        n_evict = 0.0
        for l in range(L):
            n = gather(routing, s, l, cnt, uniq)
            t = now + dense
            for i in range(n):  # priorities see every access, resident or not
                e = uniq[i]
                _touch(kind, key, l, e, cnt[e], g, lam)
                stamp[l, e] = g
            gpu_t = t
            cpu_t = 0.0
            n_cpu = 0
            n_miss = 0
            for i in range(n):
                e = uniq[i]
                c = cnt[e]
                n_acc += c
                slot = slot_of[l, e]
                if slot < 0:
                    miss[n_miss] = e
                    n_miss += 1
                    continue
                n_hit += c
                r = ready_at[l, slot]
                if r > gpu_t:
                    stall += r - gpu_t
                    gpu_t = r
                gpu_t += tg[c]
                n_gpu_runs += 1
                log_put(log, log_n, g, l, e, slot, K_HIT)
            if not miss_cpu:
                for i in range(n_miss):
                    e = miss[i]
                    c = cnt[e]
                    if n_slots[l] == 0:  # nowhere to load: the host runs it
                        cpu_t += tc[c]
                        n_cpu += 1
                        n_cpu_tok += c
                        log_put(log, log_n, g, l, e, -1, K_CPU)
                        continue
                    # Prefer victims not used at this step; with fewer slots than routed experts
                    # an expert already computed at this step is evicted.
                    slot = _victim(key, l, g, owner, n_slots, stamp, True)
                    if slot < 0:
                        slot = _victim(key, l, g, owner, n_slots, stamp, False)
                    o = owner[l, slot]
                    start = max(t, link)
                    if o >= 0:
                        if stamp[l, o] == g:
                            start = max(start, gpu_t)  # its run at this step must finish first
                        slot_of[l, o] = -1
                        n_evict += 1
                        log_put(log, log_n, g, l, o, slot, K_EVICT)
                    owner[l, slot] = e
                    slot_of[l, e] = slot
                    done = start + tx
                    link = done
                    ready_at[l, slot] = done
                    n_load += 1
                    if done > gpu_t:
                        stall += done - gpu_t
                        gpu_t = done
                    gpu_t += tg[c]
                    n_gpu_runs += 1
                    log_put(log, log_n, g, l, e, slot, K_DEMAND)
                now = layer_end(t, gpu_t, cpu_t, n_cpu, cost, link)
            else:
                for i in range(n_miss):
                    e = miss[i]
                    c = cnt[e]
                    cpu_t += tc[c]
                    n_cpu += 1
                    n_cpu_tok += c
                    log_put(log, log_n, g, l, e, -1, K_CPU)
                now = layer_end(t, gpu_t, cpu_t, n_cpu, cost, link)
                # load the missed experts for the next tokens, best first, while they beat the victim
                n_in = admit_after_use(key, l, g, owner, slot_of, n_slots, stamp, miss, n_miss, admitted)
                for i in range(n_in):
                    e, slot, o = admitted[i, 0], admitted[i, 1], admitted[i, 2]
                    if o >= 0:
                        n_evict += 1
                        log_put(log, log_n, g, l, o, slot, K_EVICT)
                    done = max(now, link) + tx
                    link = done
                    ready_at[l, slot] = done
                    n_load += 1
                    n_async += 1
                    log_put(log, log_n, g, l, e, slot, K_ASYNC)
            n_cpu_runs += n_cpu
            for i in range(n):
                cnt[uniq[i]] = 0
        step_end(clock, acc, now, link, cost, ntok, L, n_acc, n_hit, n_cpu_tok, n_cpu_runs, n_gpu_runs, n_load,
                 stall)
        acc[A_ASYNC] += n_async
        acc[A_EVICT] += n_evict


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
        return state

    def run_steps(self, block: RoutingBlock, s0: int, s1: int, state: CacheState, acct: Accounting) -> None:
        run_caching(block.routing, s0, s1, block.step0, state.slot_of, state.owner, state.n_slots, state.ready_at,
                    self._key, self._stamp, self.kind, self._lam, self.miss_cpu,
                    self.ctx.cost.array, acct.clock, acct.counters, acct.log, acct.log_n)


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
