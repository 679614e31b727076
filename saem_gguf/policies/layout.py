"""Slot layout: how a slot budget is split over the layers, decided at load from the cost model
and the calibrated routing.

Why: a layer with every expert resident runs no expert on the CPU, so it also skips the
GPU->CPU->GPU round trip (``C_SYNC``) and the per-expert CPU overheads; a layer holding part of
its experts pays the round trip at nearly every step. Where those fixed costs dominate (small
experts, few layers), llama.cpp's ``--n-cpu-moe`` (whole layers resident, the rest on the CPU)
beats any per-layer cache of the same bytes; where expert weights dominate, a cache in every
layer wins. Which one holds is a question of the cost model and the routing, so the layout is
chosen by pricing them, not by the workload's name.

Candidate layouts: ``r`` layers fully resident (those a full residency saves most in), the
remaining slots spread evenly over the other layers, for every ``r`` the budget allows (``r = 0``
is the uniform layout, the largest ``r`` is n-cpu-moe's bytes plus the remainder cached).
Each is priced as the expected time of one decode step's expert work with the calibrated hot
experts resident (a static estimate; a cache does better on drifting routing, which only makes
the cached layers' estimate pessimistic). The cheapest layout is kept; ties keep fewer
resident layers (the uniform layout, whose cache can follow the routing).

Where calibration routing is known (``PolicyContext.replay_calibration``) the adaptive saem
does not use this estimate to pick the count of whole layers: it replays itself over that
routing at each count of ``whole_layer_grid`` and keeps the fastest, at a batch above 1 the
fewest within ``layout_margin`` of it (adaptive.py; the replay cross-fitted and as wide as the
batch: simulator.CalibrationReplay), which measured closer to the best layout
(docs/POLICIES.md, "Is the chosen layout the best one?").
This module still prices which layers go whole and how the rest is spread.

Because the estimate is pessimistic for the uniform layout's cache, a layout with resident
layers must beat it by ``MIN_GAIN`` of the step's expert time. Measured with ``saem``
on bench_policies' twelve families (docs/POLICIES.md): layouts estimated to save under 0.1 %
were 0.02-0.5 % slower than the uniform one; every estimate of 0.6 % or more was faster (by
0.16-10.5 %).
"""

from __future__ import annotations

from math import comb

import numpy as np

from saem_gguf.costmodel import C_OVERLAP, C_SYNC, t_cpu, t_gpu

# the share of the uniform layout's estimated step time a layout with resident layers must save
MIN_GAIN = 0.005
# layouts priced by replaying the policy over its calibration routing (whole_layer_grid)
GRID_POINTS = 7


def expert_use_probability(calib: np.ndarray, top_k: int) -> np.ndarray:
    """float64 [L, E]: the probability that one token routes to each expert, from token-level
    calibration counts (each token adds ``top_k`` counts per layer); uniform ``top_k / E`` for a
    layer without counts."""
    L, E = calib.shape
    tokens = calib.sum(axis=1, keepdims=True) / max(top_k, 1)
    uniform = np.full((L, E), min(1.0, top_k / max(E, 1)))
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(tokens > 0, calib / np.where(tokens > 0, tokens, 1.0), uniform)
    return np.clip(q, 0.0, 1.0)


def layer_time_table(q: np.ndarray, batch: int, cost: np.ndarray) -> np.ndarray:
    """float64 [L, E + 1]: expected expert time of each layer in one step of ``batch`` tokens
    with its ``s`` most used experts resident (column ``s``): GPU runs of the resident, CPU runs
    of the rest and, when any of the rest is used, one CPU round trip (as costmodel.layer_end)."""
    L, E = q.shape
    order = np.argsort(-q, axis=1, kind="stable")
    qs = np.take_along_axis(q, order, axis=1)
    c = np.arange(1, batch + 1)
    ways = np.array([comb(batch, int(n)) for n in c], np.float64)
    p_tokens = ways * qs[..., None] ** c * (1.0 - qs[..., None]) ** (batch - c)  # [L, E, B]: P(c tokens use it)
    gpu = p_tokens @ np.array([t_gpu(int(n), cost) for n in c])  # [L, E]
    cpu = p_tokens @ np.array([t_cpu(int(n), cost) for n in c])
    zeros = np.zeros((L, 1))
    gpu_resident = np.concatenate([zeros, np.cumsum(gpu, axis=1)], axis=1)  # first s on the GPU
    cpu_rest = np.concatenate([np.cumsum(cpu[:, ::-1], axis=1)[:, ::-1], zeros], axis=1)  # the rest on the CPU
    log_unused = batch * np.log1p(-np.minimum(qs, 1.0 - 1e-12))
    p_none = np.exp(np.concatenate([np.cumsum(log_unused[:, ::-1], axis=1)[:, ::-1], zeros], axis=1))
    experts = np.maximum(gpu_resident, cpu_rest) if cost[C_OVERLAP] > 0 else gpu_resident + cpu_rest
    return experts + cost[C_SYNC] * (1.0 - p_none)


def spread(total: int, layers: np.ndarray, n_expert: int, table: np.ndarray) -> np.ndarray:
    """int32 [len(layers)]: ``total`` slots spread evenly over ``layers``, the remainder to the
    layers where one more slot saves most (at most ``n_expert`` each)."""
    n = layers.size
    if n == 0:
        return np.zeros(0, np.int32)
    base = min(total // n, n_expert)
    out = np.full(n, base, np.int32)
    extra = min(total - base * n, n) if base < n_expert else 0
    if extra > 0:
        saving = table[layers, base] - table[layers, base + 1]
        out[np.argsort(-saving, kind="stable")[:extra]] += 1
    return out


def max_whole_layers(budget: np.ndarray, n_expert: int) -> int:
    """How many layers the slot ``budget`` [L] could make fully resident (its bytes, as whole
    layers of ``n_expert`` slots): the largest candidate of choose_layout and of whole_layer_grid."""
    budget = np.asarray(budget)
    return min(budget.size, int(budget.sum()) // max(int(n_expert), 1))


def whole_layer_grid(whole_max: int, points: int = GRID_POINTS) -> list[int]:
    """``points`` counts of whole resident layers spread evenly over 0..whole_max (fewer when
    they coincide): the layouts the adaptive saem replays on its calibration routing, and
    bench/bench_layout.py on the replayed traces."""
    if points < 2 or whole_max <= 0:
        return [0]
    return sorted({round(k * whole_max / (points - 1)) for k in range(points)})


def choose_layout(calib: np.ndarray, top_k: int, budget: np.ndarray, batch: int, cost: np.ndarray,
                  min_gain: float = MIN_GAIN, resident: int | None = None) -> tuple[np.ndarray, float, float]:
    """(slots per layer, its expected step time, the uniform layout's) for the slot ``budget``
    [L] (the same total bytes), see the module docstring; a layout with resident layers is
    kept only when it saves ``min_gain`` of the uniform layout's time. ``resident``: the
    candidate with that many resident layers (at most what the budget holds) instead of the
    cheapest: the count the adaptive saem replayed fastest, or one of bench_layout.py's grid."""
    L, E = calib.shape
    total = int(np.asarray(budget).sum())
    table = layer_time_table(expert_use_probability(calib, top_k), max(int(batch), 1), cost)
    rows = np.arange(L)
    uniform = np.zeros(L, np.int32)
    uniform[:] = spread(total, rows, E, table)
    best, best_t = uniform, float(table[rows, uniform].sum())
    uniform_t = best_t
    base = np.minimum(uniform, E)
    gain = table[rows, base] - table[:, E]  # what full residency saves in each layer
    by_gain = np.argsort(-gain, kind="stable")
    for r in range(1, max_whole_layers(budget, E) + 1):
        full = by_gain[:r]
        rest = np.setdiff1d(rows, full)
        slots = np.full(L, E, np.int32)
        slots[rest] = spread(total - r * E, rest, E, table)
        t = float(table[rows, slots].sum())
        if resident is not None:
            if r <= resident:
                best, best_t = slots, t
        elif t < best_t and t < uniform_t * (1.0 - min_gain):
            best, best_t = slots, t
    return best, best_t, uniform_t
