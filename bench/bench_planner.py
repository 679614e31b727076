"""Benchmarks: SAEM planner cost per stage boundary at 48 layers x 128 experts (target <= 1 ms),
and simulator throughput in token-layer steps per second.

    python bench/bench_planner.py [--json OUT] [--quick]

Prints the figures; asserts nothing (timings depend on the machine and its load).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.costmodel import HW_PRESETS, MODEL_PRESETS, CostModel  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.policies.ranking import plan_from_scores, rank_fill_kernel  # noqa: E402
from saem_gguf.accounting import Accounting  # noqa: E402
from saem_gguf.policies.base import PolicyContext, budget_slots  # noqa: E402
from saem_gguf.policies.state import CacheState  # noqa: E402
from saem_gguf.policies.saem import SaemPolicy  # noqa: E402

L, E = 48, 128


def _median_us(fn, n: int) -> tuple[float, float]:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts = np.array(ts) * 1e6
    return float(np.median(ts)), float(np.percentile(ts, 90))


def bench_planner(reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    cost = CostModel.from_shape(MODEL_PRESETS["qwen3-30b-a3b"], HW_PRESETS["rtx4090-ddr5"])
    out = []
    for ecr in (3.125, 6.25, 12.5, 25.0, 50.0):
        S = budget_slots(ecr, E)
        state = CacheState.empty(E, np.full(L, S, np.int32))
        # stage profiles of skewed routing, each boundary replacing about half of the residents
        profiles = [rng.zipf(1.3, size=(L, E)).astype(np.float64) for _ in range(8)]
        state.place(plan_from_scores(state, profiles[0]))
        copies = np.empty((L * S, 3), np.int32)
        evicts = np.empty((L * S, 3), np.int32)
        i = [0]

        def kernel_only():
            i[0] += 1
            rank_fill_kernel(profiles[i[0] % 8], state.n_slots, state.slot_of, state.owner, copies, evicts)

        def plan():
            i[0] += 1
            plan_from_scores(state, profiles[i[0] % 8])

        # A whole boundary as the simulator/engine does it: rank, plan, evict, issue copies.
        ctx = PolicyContext(n_layer=L, n_expert=E, top_k=8, n_slots=np.full(L, S, np.int32), cost=cost,
                            calib_counts=profiles[0])
        pol = SaemPolicy()
        st2 = pol.start(ctx)
        acct = Accounting()

        def boundary():
            i[0] += 1
            p = plan_from_scores(st2, profiles[i[0] % 8])
            pol.apply(p, st2, acct, 0)

        kernel_only()
        plan()
        boundary()
        k_med, k_p90 = _median_us(kernel_only, reps)
        p_med, p_p90 = _median_us(plan, reps)
        b_med, b_p90 = _median_us(boundary, reps)
        n_copies = plan_from_scores(state, profiles[3]).n_copies
        out.append({"ecr": ecr, "slots": S, "rank_fill_us_median": k_med, "rank_fill_us_p90": k_p90,
                    "plan_us_median": p_med, "plan_us_p90": p_p90, "boundary_us_median": b_med,
                    "boundary_us_p90": b_p90, "copies_per_boundary": n_copies})
    return out


def bench_simulator(quick: bool) -> list[dict]:
    from saem_gguf.simulator import SimConfig, default_cost, simulate
    from saem_gguf.synthetic import SyntheticConfig, make_stage_traces

    ts = make_stage_traces(SyntheticConfig(n_sequences=2 if quick else 8, seed=1,
                                           stage_len_scale=0.25 if quick else 1.0))
    cost = default_cost(ts)
    pols = ("cpu-moe", "static-hot", "lru", "lru-cpu", "lfu", "temporal", "saem", "saem-implicit", "oracle")
    # warm-up (compilation) on a tiny slice, not timed
    small = type(ts)(signature=ts.signature, sequences=ts.sequences[:1], source=ts.source,
                     meta={"boundary_cues": ts.meta["boundary_cues"][:1]})
    simulate(small, SimConfig(policies=pols, ecrs=(12.5,), batches=(1,)), cost)
    out = []
    for B in (1, 8):
        res = simulate(ts, SimConfig(policies=pols, ecrs=(12.5,), batches=(B,)), cost)
        for r in res.rows:
            out.append({"policy": r["policy"], "batch": B, "ecr": 12.5, "layer_steps": r["layer_steps"],
                        "wall_s": r["wall_s"], "layer_steps_per_s": r["layer_steps"] / r["wall_s"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=output_file, metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, shorter traces")
    args = ap.parse_args()
    reps = 50 if args.quick else 300
    planner = bench_planner(reps)
    print(f"SAEM planner per stage boundary, {L} layers x {E} experts (median / p90 over {reps}; target <= 1000 us)")
    print(f"{'ECR %':>7} {'slots':>5} {'copies':>6} {'rank_fill us':>16} {'plan us':>16} {'boundary us':>16}")
    for r in planner:
        print(f"{r['ecr']:>7g} {r['slots']:>5} {r['copies_per_boundary']:>6} "
              f"{r['rank_fill_us_median']:>8.0f} / {r['rank_fill_us_p90']:<5.0f} "
              f"{r['plan_us_median']:>8.0f} / {r['plan_us_p90']:<5.0f} "
              f"{r['boundary_us_median']:>8.0f} / {r['boundary_us_p90']:<5.0f}")
    sim = bench_simulator(args.quick)
    print()
    print("simulator throughput (synthetic Qwen3-30B-A3B shape, ECR 12.5 %): token-layer steps per second")
    print(f"{'policy':<14} {'batch 1':>12} {'batch 8':>12}")
    for p in dict.fromkeys(r["policy"] for r in sim):
        cells = [next(r for r in sim if r["policy"] == p and r["batch"] == B)["layer_steps_per_s"] for B in (1, 8)]
        print(f"{p:<14} {cells[0] / 1e6:>10.2f} M {cells[1] / 1e6:>10.2f} M")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n(load average {load:.1f} on {os.cpu_count()} CPUs while measuring)")
    if args.json:
        write_text_atomic(args.json, json.dumps({"planner": planner, "simulator": sim, "loadavg": load,
                                                 "cpus": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
