"""The simulator's pricing of placement decisions: what each decode step costs given the
residency in force and the decisions a policy made (policies.state.ResidencyChange).

Timing model of one layer of one decode step (docs/POLICIES.md has the formulas):
the dense part runs first; then resident experts run on the GPU (waiting for a slot whose copy
is still in flight, or, under SAEM's rule, running on the CPU when that is faster), demand
loads are copied in while the layer waits, CPU experts run in place, transferred experts run
after their copy lands; CPU and GPU work of a layer are serial unless the hardware profile says
they overlap, and a layer with CPU work pays one GPU<->CPU sync. Loads after use are issued
when their layer ends; a placement's copies when the step ends. Copies share one FIFO
host-to-device link and a slot is usable when its copy has landed (``ready_at``).

The policies never see any of this: they decide from routing and events only, and the engine
puts the same decisions in force natively.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from saem_gguf.accounting import (
    A_ACCESS, A_ASYNC, A_BYTES, A_CPU_RUNS, A_CPU_TOKENS, A_DEMAND, A_EVICT, A_GPU_RUNS, A_HIT, A_HIT_CPU,
    A_LAYER_STEPS, A_PROACTIVE, A_STALL, A_STEPS, A_TEMP, A_TOKENS, K_CPU, K_HIT, K_HIT_CPU, K_TEMP, log_put,
)
from saem_gguf.costmodel import (  # layer_end: a layer's time, shared with the policies' step clock
    C_BARRIER, C_DENSE_LAYER_S, C_EXPERT_BYTES, C_STEP_S, layer_end, t_cpu, t_gpu, t_xfer,
)
from saem_gguf.policies.base import MISS_CPU, MISS_RULE
from saem_gguf.policies.state import OP_AFTER_USE, OP_DEMAND, OP_EVICT, OP_PREFETCH, active_rows, gather


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
def price_layer(g, l, n, uniq, cnt, slot_of, owner, ready_at, t, link, tx, tg, tc, miss_mode, ops, p, q, tally,
                log, log_n):
    """Price layer ``l`` of global step ``g``: the ``n`` experts ``uniq[:n]`` used by ``cnt[e]``
    tokens each, under the residency ``slot_of`` / ``owner`` the step started with, and the
    demand loads among the decisions ``ops[p:q]`` (this layer's). ``t`` is when the layer's
    experts may start (after its dense part), ``link`` when the host-to-device link is free.

    Residents run on the GPU first (their work hides the transfers below), waiting for a slot
    in flight unless the CPU is faster (MISS_RULE). Then the demand loads, in decision order:
    each copy starts when the link is free (and, when it evicts an expert this step used, once
    the GPU has run it), and the layer waits for it. A non-resident expert not loaded runs on
    the CPU or, when ``miss_mode`` says so, through the temporary slot. Applies the demand
    loads and their evictions to the maps; adds to ``tally`` (T_*); returns (GPU end, CPU
    seconds, CPU runs, link)."""
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
    n_loaded = 0
    wait_gpu = False
    for j in range(p, q):
        e, slot, kind = ops[j, 1], ops[j, 2], ops[j, 3]
        if kind == OP_EVICT:
            wait_gpu = cnt[e] > 0  # its run at this step must finish before the slot is overwritten
            continue
        if kind != OP_DEMAND:
            continue
        start = max(t, link)
        if wait_gpu:
            start = max(start, gpu_t)
        wait_gpu = False
        done = start + tx
        link = done
        ready_at[l, slot] = done
        if done > gpu_t:
            tally[T_STALL] += done - gpu_t
            gpu_t = done
        gpu_t += tg[cnt[e]]
        tally[T_GPU_RUNS] += 1
        n_loaded += 1
    if n_loaded > 0:
        apply_ops(ops, p, q, slot_of, owner, g, log, log_n)
        return gpu_t, cpu_t, n_cpu, link
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
def has_demand(ops, p, q):
    """Whether decisions ``ops[p:q]`` load an expert before its use (OP_DEMAND)."""
    for j in range(p, q):
        if ops[j, 3] == OP_DEMAND:
            return True
    return False


@njit(cache=True)
def apply_ops(ops, p, q, slot_of, owner, g, log, log_n):
    """Put decisions ``ops[p:q]`` (evictions and copies) in the maps and the log, at step ``g``."""
    for j in range(p, q):
        e, slot, kind = ops[j, 1], ops[j, 2], ops[j, 3]
        lj = ops[j, 0]
        if kind == OP_EVICT:
            if slot_of[lj, e] != slot or owner[lj, slot] != e:
                raise ValueError("eviction of an expert that is not in that slot")
            slot_of[lj, e] = -1
            owner[lj, slot] = -1
        else:
            if owner[lj, slot] != -1 or slot_of[lj, e] != -1:
                raise ValueError("copy into an occupied slot, or of a resident expert")
            slot_of[lj, e] = slot
            owner[lj, slot] = e
        log_put(log, log_n, g, lj, e, slot, kind)


@njit(cache=True)
def price_steps(routing, s0, s1, step0, slot_of, owner, ready_at, ops, n_in_step, miss_mode, cost, clock, acc,
                log, log_n):
    """Price decode steps [s0, s1) of ``routing`` int16 [S, B, L, K] (-1 rows: no token;
    ``step0``: the global index of step 0): the residency ``slot_of`` int32 [L, E] / ``owner``
    int32 [L, Smax] stayed fixed through them but for the decisions ``ops`` int32 [n, 4] made on
    observing step s1 - 1: its first ``n_in_step`` rows during that step (a demand load before
    its layer's use, the rest when its layer ends), the others at its end (a placement). The
    maps and ``ready_at`` float64 [L, Smax] (when each slot's last copy lands) are updated;
    miss_mode: MISS_* (how a miss is served); cost: CostModel.array (C_*); clock float64 [now,
    link free at]; acc: counters (accounting.A_*); log int32 [n, 5] / log_n int64 [1]: the
    decision log (accounting.log_put)."""
    S, B, L, K = routing.shape
    E = slot_of.shape[1]
    cnt = np.zeros(E, np.int32)
    uniq = np.empty(E, np.int32)
    tally = np.zeros(N_TALLY, np.float64)
    tx = t_xfer(cost)
    tg, tc = time_tables(B, cost)
    dense = cost[C_DENSE_LAYER_S]
    for s in range(s0, s1):
        rows = routing[s]
        ntok = active_rows(rows)
        if ntok == 0:
            continue
        g = step0 + s
        now, link, stall = step_begin(clock, cost)
        tally[:] = 0.0
        n_load = 0.0
        n_async = 0.0
        n_pro = 0.0
        n_evict = 0.0
        decided = s == s1 - 1
        p = 0
        for l in range(L):
            n = gather(rows, l, cnt, uniq)
            q = p
            while decided and q < n_in_step and ops[q, 0] == l:
                q += 1
            t = now + dense
            gpu_t, cpu_t, n_cpu, link = price_layer(g, l, n, uniq, cnt, slot_of, owner, ready_at, t, link, tx, tg,
                                                    tc, miss_mode, ops, p, q, tally, log, log_n)
            now = layer_end(t, gpu_t, cpu_t, n_cpu, cost, link)
            for j in range(p, q):
                kind = ops[j, 3]
                if kind == OP_EVICT:
                    n_evict += 1
                elif kind == OP_DEMAND:
                    n_load += 1
                else:  # issued when the layer ends, for the next tokens
                    done = max(now, link) + tx
                    link = done
                    ready_at[l, ops[j, 2]] = done
                    if kind == OP_AFTER_USE:
                        n_load += 1
                        n_async += 1
                    else:
                        n_pro += 1
            if q > p and not has_demand(ops, p, q):  # (price_layer applied a demand layer's)
                apply_ops(ops, p, q, slot_of, owner, g, log, log_n)
            for i in range(n):
                cnt[uniq[i]] = 0
            p = q
        step_end(clock, acc, now, link, cost, ntok, L, tally[T_ACCESS], tally[T_HIT], tally[T_CPU_TOKENS],
                 tally[T_CPU_RUNS], tally[T_GPU_RUNS], n_load + tally[T_TEMP], stall + tally[T_STALL])
        acc[A_HIT_CPU] += tally[T_HIT_CPU]
        acc[A_TEMP] += tally[T_TEMP]
        acc[A_ASYNC] += n_async
        acc[A_PROACTIVE] += n_pro
        acc[A_BYTES] += n_pro * cost[C_EXPERT_BYTES]
        acc[A_EVICT] += n_evict
    if n_in_step < ops.shape[0]:
        price_placement(ops, n_in_step, step0 + s1, slot_of, owner, ready_at, cost, clock, acc, log, log_n)


@njit(cache=True)
def price_placement(ops, p, g, slot_of, owner, ready_at, cost, clock, acc, log, log_n):
    """A placement before step ``g``: the evictions and copies ``ops[p:]``, the copies queued in
    order on the host-to-device link (FIFO behind whatever is already queued) from the current
    time; each slot becomes usable when its copy lands. Counted as prefetches (A_PROACTIVE)."""
    tx = t_xfer(cost)
    now = clock[0]
    for j in range(p, ops.shape[0]):
        l, e, slot, kind = ops[j, 0], ops[j, 1], ops[j, 2], ops[j, 3]
        apply_ops(ops, j, j + 1, slot_of, owner, g, log, log_n)
        if kind == OP_EVICT:
            acc[A_EVICT] += 1
            continue
        start = max(now, clock[1])
        clock[1] = start + tx
        ready_at[l, slot] = clock[1]
        acc[A_BYTES] += cost[C_EXPERT_BYTES]
        if kind == OP_PREFETCH:
            acc[A_PROACTIVE] += 1
        else:
            acc[A_DEMAND] += 1
