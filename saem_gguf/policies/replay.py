"""Numba replay kernels shared by the policies that keep residency fixed between decisions
(static placements, SAEM, the oracle) and the timing primitives every kernel uses.

Timing model of one layer of one decode step (docs/POLICIES.md has the formulas):
the dense part runs first; then resident experts run on the GPU (waiting for a slot whose copy
is still in flight), transferred experts run after their copy lands, CPU experts run in place;
CPU and GPU work of a layer are serial unless the hardware profile says they overlap, and a
layer with CPU work pays one GPU<->CPU sync. Copies share one FIFO host-to-device link.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from saem_gguf.costmodel import C_BARRIER, C_DENSE_LAYER_S, C_DMA_SLOW, C_EXPERT_BYTES, C_OVERLAP, C_STEP_S, C_SYNC, t_cpu, t_gpu, t_xfer
from saem_gguf.policies.accounting import (
    A_ACCESS, A_BYTES, A_CPU_RUNS, A_CPU_TOKENS, A_DEMAND, A_GPU_RUNS, A_HIT, A_HIT_CPU, A_LAYER_STEPS,
    A_STALL, A_STEPS, A_TEMP, A_TOKENS, K_CPU, K_HIT, K_HIT_CPU, K_TEMP, log_put,
)

# miss modes of run_fixed
MISS_CPU = 0  # non-resident experts always run on the CPU (llama.cpp --cpu-moe style)
MISS_RULE = 1  # lower latency wins: CPU in place or transfer into the temporary slot
MISS_TRANSFER = 2  # always transfer into the temporary slot (the paper's "no CPU" ablation)

# implicit-boundary detector state (float64 array owned by the policy)
D_ON = 0
D_ALPHA = 1  # EWMA weight of the newest step's hit fraction
D_DROP = 2  # fire when EWMA < (1 - drop) * mean since the last placement
D_MIN_STEPS = 3  # steps after a placement before the detector may fire
D_STEPS = 4
D_MEAN = 5
D_EWMA = 6
N_DET = 7


def new_detector(enabled: bool, alpha: float = 0.1, drop: float = 0.2, min_steps: int = 32) -> np.ndarray:
    d = np.zeros(N_DET, np.float64)
    d[D_ON] = 1.0 if enabled else 0.0
    d[D_ALPHA] = alpha
    d[D_DROP] = drop
    d[D_MIN_STEPS] = min_steps
    return d


def reset_detector(det: np.ndarray) -> None:
    det[D_STEPS] = 0.0
    det[D_MEAN] = 0.0
    det[D_EWMA] = 0.0


@njit(cache=True)
def gather(routing, s, l, cnt, uniq):
    """Unique experts of layer l at step s into uniq[:n] with token counts in cnt[e]
    (an expert used by several tokens of the step runs once)."""
    B = routing.shape[1]
    K = routing.shape[3]
    n = 0
    for b in range(B):
        if routing[s, b, 0, 0] < 0:
            continue
        for k in range(K):
            e = routing[s, b, l, k]
            if cnt[e] == 0:
                uniq[n] = e
                n += 1
            cnt[e] += 1
    return n


@njit(cache=True)
def cpu_phase(work, start, link, cost):
    """Wall time of ``work`` seconds of CPU expert runs starting at ``start`` while the link is
    busy until ``link``: DMA shares the host DRAM bandwidth, so that part runs slower."""
    f = cost[C_DMA_SLOW]
    busy = link - start
    if busy <= 0.0 or f <= 1.0:
        return work
    if work * f <= busy:
        return work * f
    return busy + (work - busy / f)


@njit(cache=True)
def layer_end(t, gpu_t, cpu_t, n_cpu, cost, link):
    """When a layer whose experts could start at ``t`` ends: its GPU work ends at ``gpu_t``, its
    ``n_cpu`` CPU runs take ``cpu_t`` seconds (slowed while the link is busy until ``link``),
    after the GPU part or alongside it (C_OVERLAP), plus one sync when any ran on the CPU."""
    if n_cpu == 0:
        return gpu_t
    if cost[C_OVERLAP] > 0:
        return max(gpu_t, t + cpu_phase(cpu_t, t, link, cost)) + cost[C_SYNC]
    return gpu_t + cpu_phase(cpu_t, gpu_t, link, cost) + cost[C_SYNC]


@njit(cache=True)
def active_tokens(routing, s):
    """Sequences of ``routing`` [S, B, L, K] with a token at step ``s``."""
    n = 0
    for b in range(routing.shape[1]):
        if routing[s, b, 0, 0] >= 0:
            n += 1
    return n


@njit(cache=True)
def time_tables(B, cost):
    """GPU and CPU times of one expert for 0..B tokens (an expert serves at most one token per
    sequence per step), so the per-expert pricing is a table lookup."""
    tg = np.empty(B + 1, np.float64)
    tc = np.empty(B + 1, np.float64)
    for c in range(B + 1):
        tg[c] = t_gpu(c, cost)
        tc[c] = t_cpu(c, cost)
    return tg, tc


@njit(cache=True)
def step_begin(clock, cost):
    """(now, GPU link free time, stall) at the start of a decode step; with a barrier the step
    starts once every earlier copy has landed."""
    now = clock[0]
    link = clock[1]
    stall = 0.0
    if cost[C_BARRIER] > 0 and link > now:
        stall = link - now
        now = link
    return now, link, stall


@njit(cache=True)
def step_end(clock, acc, now, link, cost, ntok, L, n_acc, n_hit, n_cpu_tok, n_cpu_runs, n_gpu_runs, n_copies,
             stall):
    """Close a decode step: advance the clock and add the counters every replay kernel keeps
    (``n_copies`` experts went over the link on demand)."""
    clock[0] = now + cost[C_STEP_S]
    clock[1] = link
    acc[A_ACCESS] += n_acc
    acc[A_HIT] += n_hit
    acc[A_CPU_TOKENS] += n_cpu_tok
    acc[A_CPU_RUNS] += n_cpu_runs
    acc[A_GPU_RUNS] += n_gpu_runs
    acc[A_DEMAND] += n_copies
    acc[A_BYTES] += n_copies * cost[C_EXPERT_BYTES]
    acc[A_STALL] += stall
    acc[A_TOKENS] += ntok
    acc[A_STEPS] += 1
    acc[A_LAYER_STEPS] += ntok * L


# Per-step tallies of one replay step (float64 array ``tally``, zeroed at each step start)
T_ACCESS = 0  # routed (token, layer, k) accesses
T_HIT = 1  # of those, resident
T_CPU_TOKENS = 2
T_CPU_RUNS = 3
T_GPU_RUNS = 4
T_HIT_CPU = 5  # resident but still in flight: ran on the CPU instead of waiting
T_TEMP = 6  # transfers into the temporary slot
T_STALL = 7  # seconds the GPU waited for copies
N_TALLY = 8


@njit(cache=True)
def fixed_layer(g, l, n, uniq, cnt, slot_of, ready_at, t, link, tx, tg, tc, miss_mode, tally, log, log_n):
    """Price layer ``l`` of global step ``g`` with residency as it is: the ``n`` experts
    ``uniq[:n]`` used by ``cnt[e]`` tokens each. ``t`` is when the layer's experts may start
    (after its dense part), ``link`` when the host-to-device link is free. Residents run on the
    GPU first (their work hides the transfers below), waiting for a slot in flight unless the CPU
    is faster (MISS_RULE); a non-resident runs on the CPU or, when ``miss_mode`` says so, through
    the temporary slot. Adds to ``tally`` (T_*); returns (GPU end, CPU seconds, CPU runs, link)."""
    gpu_t = t
    cpu_t = 0.0
    n_cpu = 0
    for i in range(n):
        e = uniq[i]
        c = cnt[e]
        tally[T_ACCESS] += c
        slot = slot_of[l, e]
        if slot < 0:
            continue
        tally[T_HIT] += c
        r = ready_at[l, slot]
        if r > gpu_t:
            if miss_mode == MISS_RULE and tc[c] <= (r - gpu_t) + tg[c]:
                cpu_t += tc[c]
                n_cpu += 1
                tally[T_CPU_TOKENS] += c
                tally[T_HIT_CPU] += 1
                log_put(log, log_n, g, l, e, slot, K_HIT_CPU)
                continue
            tally[T_STALL] += r - gpu_t
            gpu_t = r
        gpu_t += tg[c]
        tally[T_GPU_RUNS] += 1
        log_put(log, log_n, g, l, e, slot, K_HIT)
    for i in range(n):
        e = uniq[i]
        c = cnt[e]
        if slot_of[l, e] >= 0:
            continue
        if miss_mode == MISS_CPU or (miss_mode == MISS_RULE and tc[c] <= max(0.0, link - t) + tx + tg[c]):
            cpu_t += tc[c]
            n_cpu += 1
            tally[T_CPU_TOKENS] += c
            log_put(log, log_n, g, l, e, -1, K_CPU)
        else:
            done = max(t, link) + tx
            link = done
            tally[T_TEMP] += 1
            if done > gpu_t:
                tally[T_STALL] += done - gpu_t
                gpu_t = done
            gpu_t += tg[c]
            tally[T_GPU_RUNS] += 1
            log_put(log, log_n, g, l, e, -1, K_TEMP)
    tally[T_CPU_RUNS] += n_cpu
    return gpu_t, cpu_t, n_cpu, link


@njit(cache=True)
def run_fixed(routing, s0, s1, step0, slot_of, ready_at, cost, miss_mode, clock, acc, det, log, log_n):
    """Replay steps [s0, s1) with residency fixed. Returns the step after the last one run:
    s1, or earlier when the implicit-boundary detector fires (the caller re-plans there).

    routing int16 [S, B, L, K] (-1 = no token); step0: global index of step 0; slot_of int32
    [L, E] and ready_at float64 [L, Smax] of the CacheState; cost: CostModel.array (C_*);
    miss_mode: MISS_*; clock float64 [now, link free at]; acc: Accounting counters (A_*);
    det: built-in detector state (D_*); log int32 [n, 5] / log_n int64 [1]: decision log."""
    S, B, L, K = routing.shape
    E = slot_of.shape[1]
    cnt = np.zeros(E, np.int32)
    uniq = np.empty(E, np.int32)
    tally = np.zeros(N_TALLY, np.float64)
    tx = t_xfer(cost)
    tg, tc = time_tables(B, cost)
    dense = cost[C_DENSE_LAYER_S]
    for s in range(s0, s1):
        ntok = active_tokens(routing, s)
        if ntok == 0:
            continue
        g = step0 + s
        now, link, stall = step_begin(clock, cost)
        tally[:] = 0.0
        for l in range(L):
            n = gather(routing, s, l, cnt, uniq)
            t = now + dense
            gpu_t, cpu_t, n_cpu, link = fixed_layer(g, l, n, uniq, cnt, slot_of, ready_at, t, link, tx, tg, tc,
                                                    miss_mode, tally, log, log_n)
            for i in range(n):
                cnt[uniq[i]] = 0
            now = layer_end(t, gpu_t, cpu_t, n_cpu, cost, link)
        step_end(clock, acc, now, link, cost, ntok, L, tally[T_ACCESS], tally[T_HIT], tally[T_CPU_TOKENS],
                 tally[T_CPU_RUNS], tally[T_GPU_RUNS], tally[T_TEMP], stall + tally[T_STALL])
        acc[A_HIT_CPU] += tally[T_HIT_CPU]
        acc[A_TEMP] += tally[T_TEMP]
        n_acc = tally[T_ACCESS]
        if det[D_ON] > 0 and n_acc > 0:
            h = tally[T_HIT] / n_acc
            det[D_STEPS] += 1
            det[D_MEAN] += (h - det[D_MEAN]) / det[D_STEPS]
            det[D_EWMA] = h if det[D_STEPS] == 1 else det[D_EWMA] + det[D_ALPHA] * (h - det[D_EWMA])
            if det[D_STEPS] >= det[D_MIN_STEPS] and det[D_EWMA] < (1.0 - det[D_DROP]) * det[D_MEAN]:
                return s + 1
    return s1
