"""Slow, obvious references for the placement kernels (the way stumpy tests its kernels against
``tests/naive.py``): plain Python over dicts and sorted lists, no Numba, written from the
documented rules rather than from the kernels' code. test_naive.py compares them on random
inputs."""

from __future__ import annotations

import math

import numpy as np

from saem_gguf.costmodel import C_BARRIER, C_DENSE_LAYER_S, C_DMA_SLOW, C_OVERLAP, C_STEP_S, C_SYNC, t_cpu, t_gpu, t_xfer


def rank_fill(scores: np.ndarray, n_slots: np.ndarray, slot_of: np.ndarray, owner: np.ndarray):
    """(copies, evictions) as (layer, expert, slot) lists: each layer keeps its n_slots
    highest-scoring experts, ties at the cut to residents and then to lower ids; an expert
    with score <= 0 is never copied in. Evictions in slot order; copies best first (score, then
    id) into the lowest free or freed slots."""
    copies, evictions = [], []
    L, E = scores.shape
    for l in range(L):
        S = int(n_slots[l])
        if S <= 0:
            continue
        resident = {e for e in range(E) if slot_of[l, e] >= 0}
        ranked = sorted(range(E), key=lambda e: (-scores[l, e], e not in resident, e))
        want = {e for e in ranked[:S] if e in resident or scores[l, e] > 0}
        freed = []
        for s in range(S):
            e = int(owner[l, s])
            if e < 0 or e not in want:
                freed.append(s)
            if e >= 0 and e not in want:
                evictions.append((l, e, s))
        entrants = sorted((e for e in want if e not in resident), key=lambda e: (-scores[l, e], e))
        copies += [(l, e, s) for e, s in zip(entrants, freed)]
    return copies, evictions


def _layer_end(t, gpu_t, cpu_t, n_cpu, cost, link):
    """When a layer ends: GPU work, then (or alongside, with overlap) its CPU work, slowed while
    the link's DMA shares host memory bandwidth, plus one sync when any expert ran on the CPU."""
    if n_cpu == 0:
        return gpu_t

    def cpu_wall(work, start):
        f, busy = cost[C_DMA_SLOW], link - start
        if busy <= 0 or f <= 1:
            return work
        return work * f if work * f <= busy else busy + (work - busy / f)

    if cost[C_OVERLAP] > 0:
        return max(gpu_t, t + cpu_wall(cpu_t, t)) + cost[C_SYNC]
    return gpu_t + cpu_wall(cpu_t, gpu_t) + cost[C_SYNC]


def replay_fixed(routing: np.ndarray, slot_of: np.ndarray, ready_at: np.ndarray, cost: np.ndarray,
                 rule: bool, clock: list[float]) -> dict[str, float]:
    """Fixed residency, step by step: per layer, residents run on the GPU (waiting for a copy in
    flight unless, with ``rule``, the CPU is faster), then each non-resident runs on the CPU or,
    with ``rule`` when the CPU is slower, goes through the temporary slot. Returns the totals
    (accesses, hits, cpu_tokens, temp, stall) and advances ``clock`` = [now, link]."""
    out = dict(accesses=0.0, hits=0.0, cpu_tokens=0.0, temp=0.0, stall=0.0)
    S, B, L, K = routing.shape
    for s in range(S):
        active = [b for b in range(B) if routing[s, b, 0, 0] >= 0]
        if not active:
            continue
        now, link = clock
        if cost[C_BARRIER] > 0 and link > now:
            out["stall"] += link - now
            now = link
        for l in range(L):
            uses: dict[int, int] = {}  # expert -> tokens, in first-use order
            for b in active:
                for e in routing[s, b, l]:
                    uses[int(e)] = uses.get(int(e), 0) + 1
            t = now + cost[C_DENSE_LAYER_S]
            gpu_t, cpu_t, n_cpu = t, 0.0, 0
            for e, c in uses.items():
                out["accesses"] += c
                if slot_of[l, e] < 0:
                    continue
                out["hits"] += c
                r = ready_at[l, slot_of[l, e]]
                if r > gpu_t and rule and t_cpu(c, cost) <= (r - gpu_t) + t_gpu(c, cost):
                    cpu_t, n_cpu = cpu_t + t_cpu(c, cost), n_cpu + 1
                    out["cpu_tokens"] += c
                    continue
                if r > gpu_t:
                    out["stall"] += r - gpu_t
                    gpu_t = r
                gpu_t += t_gpu(c, cost)
            for e, c in uses.items():
                if slot_of[l, e] >= 0:
                    continue
                if not rule or t_cpu(c, cost) <= max(0.0, link - t) + t_xfer(cost) + t_gpu(c, cost):
                    cpu_t, n_cpu = cpu_t + t_cpu(c, cost), n_cpu + 1
                    out["cpu_tokens"] += c
                else:
                    link = max(t, link) + t_xfer(cost)
                    out["temp"] += 1
                    if link > gpu_t:
                        out["stall"] += link - gpu_t
                        gpu_t = link
                    gpu_t += t_gpu(c, cost)
            now = _layer_end(t, gpu_t, cpu_t, n_cpu, cost, link)
        clock[0], clock[1] = now + cost[C_STEP_S], link
    return out


def replay_cache_cpu(routing: np.ndarray, slots: int, resident: list[list[int]], kind: str, calib_freq: np.ndarray,
                     prior_tokens: float, half_life: float) -> tuple[float, int, list[set[int]]]:
    """The ``-cpu`` caches' residency, step by step: every access updates the expert's
    priority (lru: last step; lfu: count, from a calibrated prior; lrfu: the sum of 2^(-age /
    half_life) over its accesses, from the prior); after a layer runs, its missed experts, best
    first, replace the lowest-priority resident not used at this step while they beat it.
    ``resident[l]``: the experts in slot order at start. Returns (hits, loads, final sets)."""
    L = routing.shape[2]
    slots_of = [list(r) + [-1] * (slots - len(r)) for r in resident]
    last: dict[tuple[int, int], int] = {}
    events: dict[tuple[int, int], list[tuple[int, float]]] = {}  # (l, e) -> [(step, tokens)]
    rank = {}
    for l in range(L):
        order = sorted(range(calib_freq.shape[1]), key=lambda e: (-calib_freq[l, e], e))
        rank.update({(l, e): i for i, e in enumerate(order)})

    initial = [set(r) for r in resident]

    def priority(l, e, g):
        if kind == "lru":  # never used: the load-time residents rank as older than any use
            return last.get((l, e), -1.0 - rank[(l, e)] if e in initial[l] else -1e18)
        prior = calib_freq[l, e] * prior_tokens
        if kind == "lfu":
            v = prior
            for _, c in events.get((l, e), []):
                v += c
            return v
        v = prior * 2.0 ** (-g / half_life) + sum(c * 2.0 ** (-(g - t) / half_life) for t, c in events.get((l, e), []))
        return math.log(v) if v > 0 else -math.inf

    hits, loads = 0.0, 0
    for s in range(routing.shape[0]):
        rows = [b for b in range(routing.shape[1]) if routing[s, b, 0, 0] >= 0]
        if not rows:
            continue
        for l in range(L):
            uses: dict[int, int] = {}
            for b in rows:
                for e in routing[s, b, l]:
                    uses[int(e)] = uses.get(int(e), 0) + 1
            for e, c in uses.items():
                last[(l, e)] = s
                events.setdefault((l, e), []).append((s, c))
            misses = [e for e in uses if e not in slots_of[l]]
            hits += sum(c for e, c in uses.items() if e in slots_of[l])
            for e in sorted(misses, key=lambda x: -priority(l, x, s)):
                if slots == 0:
                    break
                if -1 in slots_of[l]:
                    slot = slots_of[l].index(-1)
                else:
                    cands = [i for i, o in enumerate(slots_of[l]) if o not in uses]
                    if not cands:
                        break
                    slot = min(cands, key=lambda i: priority(l, slots_of[l][i], s))
                    if priority(l, slots_of[l][slot], s) >= priority(l, e, s):
                        break
                slots_of[l][slot] = e
                loads += 1
    return hits, loads, [{e for e in r if e >= 0} for r in slots_of]


def adaptive_step_gain(rows: np.ndarray, before: np.ndarray, after: np.ndarray, n_slots: np.ndarray,
                       cost: np.ndarray, copy_cost: float) -> float:
    """What one adaptive-saem candidate earns on one step, in one-token hits (the score of
    ``policies/adaptive.py``): per cached layer, every expert of the step held in its set
    ``before`` [L, E] (bool) saves ``t_cpu(c) - t_gpu(c)`` for the ``c`` tokens routed to it, a
    layer whose used experts are all held also skips the CPU round trip (C_SYNC), and every expert
    in its set ``after`` the step that was not there before costs ``copy_cost``; all over what one
    token's hit saves."""
    one = t_cpu(1, cost) - t_gpu(1, cost)
    total = 0.0
    for l in range(rows.shape[1]):
        if n_slots[l] == 0:
            continue
        uses: dict[int, int] = {}
        for b in range(rows.shape[0]):
            if rows[b, 0, 0] < 0:
                continue
            for e in rows[b, l]:
                uses[int(e)] = uses.get(int(e), 0) + 1
        held = [e for e in uses if before[l, e]]
        total += sum((t_cpu(uses[e], cost) - t_gpu(uses[e], cost)) / one for e in held)
        if len(held) == len(uses):
            total += cost[C_SYNC] / one
        total -= copy_cost * int(np.count_nonzero(after[l] & ~before[l]))
    return total


def adaptive_copy_price(idle: float, cost: np.ndarray, copies_per_step: float, step_s: float, slope: float) -> float:
    """The price of one copy, in one-token hits, for an adaptive-saem candidate that makes
    ``copies_per_step`` copies a step on average, of steps of ``step_s`` seconds: ``idle`` (the
    price on an idle link) plus ``slope`` times the link's load (copies x t_xfer over the step,
    at most 1) times what a copy costs beyond ``idle`` when its whole transfer slows CPU experts
    (t_xfer x (1 - 1 / DMA slow-down), over what one token's hit saves)."""
    one = t_cpu(1, cost) - t_gpu(1, cost)
    full = t_xfer(cost) * (1.0 - 1.0 / max(cost[C_DMA_SLOW], 1.0)) / one
    load = min(copies_per_step * t_xfer(cost) / step_s, 1.0)
    return idle + slope * load * (full - idle)


def adaptive_barrier_charge(idle: float, copy_price: float, cost: np.ndarray, layer_copies: list[int],
                            placed: int, step_s: float) -> tuple[float, float]:
    """(charge, stall): what an adaptive-saem candidate's copies of one step cost it, in one-token
    hits, under the copy barrier (the next step waits for every copy queued before it), and how
    many copy times the link ran past the step. One copy at a time on a link clock counted in
    copy times from the step's start: first the ``placed`` copies of a re-rank made between steps,
    then ``layer_copies[l]`` copies issued after layer ``l`` of ``L``, at ``(l + 1) / L`` of the
    step's ``step_s`` seconds. A copy that finds the link free costs ``idle``; one that waits for
    another costs ``copy_price`` times its whole transfer's DMA slow-down of CPU experts
    (t_xfer x (1 - 1 / slow-down), over what one token's hit saves); each copy time the clock runs
    past the step costs the whole transfer (t_xfer over what a hit saves), less that slow-down
    (no CPU expert runs while the next step waits)."""
    one = t_cpu(1, cost) - t_gpu(1, cost)
    queued = copy_price * t_xfer(cost) * (1.0 - 1.0 / max(cost[C_DMA_SLOW], 1.0)) / one
    step = step_s / t_xfer(cost)
    clock, charge = 0.0, 0.0
    issues = [0.0] * placed + [(l + 1) * step / len(layer_copies) for l, n in enumerate(layer_copies) for _ in range(n)]
    for i, issued in enumerate(issues):
        if clock <= issued and i >= placed:
            charge += idle
            clock = issued + 1.0
        else:
            charge += queued
            clock += 1.0
    stall = max(clock - step, 0.0)
    return charge + stall * (t_xfer(cost) / one - queued), stall


def adaptive_clock_loss(rows: np.ndarray, held: np.ndarray, layer_copies: list[int], placed: int, backlog: float,
                        cost: np.ndarray, seen: dict | None = None, barrier: bool = False) -> tuple[float, float]:
    """(loss, backlog): what an adaptive-saem candidate's copies cost it on one step, in one-token
    hits, on its own step clock, and the seconds its link stays busy past the step's end. The
    step is priced as the simulator prices a layer: every layer, cached or not,
    starts after its dense part; the experts ``held`` [L, E] (bool) run on the GPU, the rest on
    the CPU, slowed while the link is busy (``_layer_end``); ``layer_copies[l]`` copies queue on
    the link when layer ``l`` ends. The link starts the step busy for ``backlog`` seconds (the
    last step's) plus the ``placed`` copies of a re-rank made between steps. The loss is the
    step's time less its time with no slow-down (the same work, DMA slow-down 1), over what one
    token's hit saves; the backlog is where the link frees past the step's end (its part outside
    the layers included). ``seen["gpu_bound"]`` (when given) counts the layers whose GPU part
    outlasted their CPU part slowed throughout while the link was busy: with CPU/GPU overlap the
    slow-down costs such a layer nothing.

    Under the copy barrier (``barrier``; the next decode waits for every copy queued before it)
    ``backlog`` is ignored: the step's link starts idle, the ``placed`` copies (issued after the
    last step) are a stall of their whole transfer, and so is the link's run past the step's end;
    both are in the loss, and that run is the backlog returned."""
    one = t_cpu(1, cost) - t_gpu(1, cost)
    free = cost.copy()
    free[C_DMA_SLOW] = 1.0
    ends = []
    for c in (cost, free):
        now, link = 0.0, 0.0 if barrier else backlog + placed * t_xfer(c)
        for l in range(rows.shape[1]):
            uses: dict[int, int] = {}
            for b in range(rows.shape[0]):
                if rows[b, 0, 0] >= 0:
                    for e in rows[b, l]:
                        uses[int(e)] = uses.get(int(e), 0) + 1
            t = now + c[C_DENSE_LAYER_S]
            gpu = t + sum(t_gpu(n, c) for e, n in uses.items() if held[l, e])
            cpu = [t_cpu(n, c) for e, n in uses.items() if not held[l, e]]
            if seen is not None and c is cost and cpu and c[C_OVERLAP] > 0 and link > t \
                    and gpu - t > sum(cpu) * c[C_DMA_SLOW]:
                seen["gpu_bound"] = seen.get("gpu_bound", 0) + 1
            now = _layer_end(t, gpu, sum(cpu), len(cpu), c, link)
            if layer_copies[l]:
                link = max(now, link) + layer_copies[l] * t_xfer(c)
        ends.append((now + c[C_STEP_S], link))
    (end, link), (end_free, _) = ends
    run_past = max(link - end, 0.0)
    if barrier:
        return (end - end_free + placed * t_xfer(cost) + run_past) / one, run_past
    return (end - end_free) / one, run_past


def expected_step_s(calib: np.ndarray, top_k: int, n_slots: np.ndarray, cost: np.ndarray) -> float:
    """A one-token decode step's expected time with each layer's ``n_slots`` most counted
    experts on the GPU and the rest on the CPU: per layer the dense part, each expert's chance
    of being used (its count over the layer's tokens, ``calib.sum() / top_k``) times its
    one-token GPU or CPU time, and a CPU round trip times the chance that any CPU expert is
    used; plus the step's fixed part. The long way: a loop over every expert."""
    total = float(cost[C_STEP_S])
    for l in range(calib.shape[0]):
        tokens = calib[l].sum() / top_k
        order = sorted(range(calib.shape[1]), key=lambda e: (-calib[l, e], e))
        total += float(cost[C_DENSE_LAYER_S])
        p_no_cpu = 1.0
        for rank, e in enumerate(order):
            q = min(calib[l, e] / tokens, 1.0) if tokens > 0 else min(top_k / calib.shape[1], 1.0)
            if rank < n_slots[l]:
                total += q * t_gpu(1, cost)
            else:
                total += q * t_cpu(1, cost)
                p_no_cpu *= 1.0 - q
        total += float(cost[C_SYNC]) * (1.0 - p_no_cpu)
    return total


def step_uses(rows: np.ndarray, slot_of: np.ndarray) -> tuple[int, int]:
    """(hits, uses) of one step: every (row, layer, k) of a row that has a token is a use, a hit
    when its expert holds a slot."""
    hits = uses = 0
    for row in rows.tolist():
        if row[0][0] < 0:
            continue
        for layer, experts in enumerate(row):
            for e in experts:
                uses += 1
                hits += slot_of[layer][e] >= 0
    return hits, uses


def warm_step_lines(rows: np.ndarray, n_slots: np.ndarray, c_slot: np.ndarray, c_key: np.ndarray,
                    stamp: np.ndarray) -> int:
    """What the adaptive policy's warm pass sums: for every use (row, layer, k) of a row entry
    that names an expert, in a layer with cache slots, the expert's first and last candidate
    slot and its stamp, plus one for each of its first and last candidate keys above 0."""
    C = c_key.shape[2]
    total = 0
    for row in rows.tolist():
        for layer, experts in enumerate(row):
            if n_slots[layer] == 0:
                continue
            for e in experts:
                if e < 0:
                    continue
                total += int(c_slot[layer, e, 0]) + int(c_slot[layer, e, C - 1]) + int(stamp[layer, e])
                total += int(c_key[layer, e, 0] > 0) + int(c_key[layer, e, C - 1] > 0)
    return total


def lead_line(scores: list[np.ndarray], net_sums: list[np.ndarray], horizon: int, memory: float, prior: float,
              i: int, j: int, x: float) -> tuple[float, float]:
    """(line, bound) of the next ``horizon`` steps' mean net-gain lead of adaptive-saem candidate
    ``i`` over ``j`` forecast from a score lead ``x`` (``policies/adaptive.py``,
    ``lead_forecast``), given each scored step's score vector and summed net gains as they stood
    before it (``scores[t]``, ``net_sums[t]``, the last entry the step being decided). Every
    past step ``t`` whose next ``horizon`` steps are all known is one observation: its score
    lead ``scores[t][i] - scores[t][j]`` and the mean lead of its next ``horizon`` steps' net
    gains, weighted ``(1 - 1 / memory) ** age`` (age 0 the newest). The line: a weighted
    least-squares line through them, its slope shrunk towards 1 and its intercept towards 0 as
    if ``prior`` steps had said so, the slope then kept within [0, 1], at ``x``. The bound: the
    larger of ``x`` and the observations' mean lead, that mean shrunk towards 0 alike. With no
    observation, ``x`` both. The forecast is the smaller of the two."""
    keep = 1.0 - 1.0 / memory
    obs = []
    for t in range(len(scores) - 1 - horizon, -1, -1):
        later = len(scores) - 1 - horizon - t
        gain = (net_sums[t + horizon] - net_sums[t]) / horizon
        obs.append((keep ** later, scores[t][i] - scores[t][j], gain[i] - gain[j]))
    if not obs:
        return x, x
    w = sum(o[0] for o in obs)
    mx = sum(o[0] * o[1] for o in obs) / w
    my = sum(o[0] * o[2] for o in obs) / w
    vxx = sum(o[0] * (o[1] - mx) ** 2 for o in obs) / w
    cxy = sum(o[0] * (o[1] - mx) * (o[2] - my) for o in obs) / w
    slope = cxy / vxx if vxx > 1e-12 else 1.0
    intercept = my - slope * mx
    slope = (w * slope + prior) / (w + prior)
    intercept = w * intercept / (w + prior)
    return min(max(slope, 0.0), 1.0) * x + intercept, max(x, w * my / (w + prior))
