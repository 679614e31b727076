"""Does ``saem`` choose the best slot layout? Simulated tokens/s of the default ``saem`` (its
layout chosen at load by ``layout.choose_layout``) against the same policy held to each of a
grid of layouts, from uniform (no whole layer resident) to as many whole layers as the budget
holds (``layout="resident-N"``), per family x ECR x batch (issue 12, item 4).

    python bench/bench_layout.py [--families a,b,...] [--trace default60.npz] [--json OUT]
    python bench/bench_layout.py --search 24 [--seed 0] [--jobs 2] [--json OUT]
    python bench/bench_layout.py --hw rtx3060-ddr4 [--overlap] [--copy-barrier] ...   # another cost model

The families are bench_policies.py's (the named ones, ``model`` with ``--trace``, or ``--search
N`` drawn settings). ``chosen/best`` is the chosen layout's tokens/s over the best of the grid
and the chosen one: 1.0 where the estimate found the best layout measured, below 1 by what a
better estimate would gain. ``uniform/best`` is the same for the uniform layout, the scale of
what the choice is worth. Every layout runs the whole policy on the whole replay, so a cell
costs (points + 1) ``saem`` simulations; ``--jobs`` runs (family, ECR) tasks in parallel
processes (one per free core: simulation is CPU-heavy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

import numpy as np  # noqa: E402

from bench_policies import (  # noqa: E402
    Workload, add_cost_args, add_workload_args, cost_profile, selected_families, task_pool,
)
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.costmodel import HardwareProfile  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.policies.base import budget_slots  # noqa: E402
from saem_gguf.policies.layout import GRID_POINTS, max_whole_layers, whole_layer_grid  # noqa: E402
from saem_gguf.simulator import default_cost, simulate  # noqa: E402


@dataclasses.dataclass
class LayoutTask:
    """One family at one ECR (every batch), a --jobs worker's unit of work."""
    workload: Workload
    ecr: float  # percent, as SimConfig counts
    batches: tuple[int, ...]
    points: int  # layouts in the grid
    hw: HardwareProfile  # --hw with --overlap / --copy-barrier: what prices the runs


def measure(task: LayoutTask) -> list[dict]:
    """The rows of one family at one ECR (every batch): the chosen layout and each of the grid."""
    fam, ecr, batches = task.workload.family, task.ecr, task.batches
    ts, calib = task.workload.traces()
    cost = default_cost(ts, task.hw)
    L, E = int(ts.signature.n_layer), int(ts.signature.n_expert)
    cfg = task.workload.sim_config(("saem",), (ecr,), batches)
    budget = np.full(L, budget_slots(ecr, E), np.int32)
    layouts = {"auto": None, **{f"resident-{n}": n for n in whole_layer_grid(max_whole_layers(budget, E), task.points)}}
    tok, whole = {}, {}
    for layout in layouts:
        res = simulate(ts, cfg, cost, calib=calib, policy_kwargs={"saem": {"layout": layout}})
        for B in batches:
            row = res.select(batch=B, ecr=ecr)[0]
            tok[layout, B], whole[layout, B] = row["tok_s"], row["whole_layers"]
    hw = dataclasses.asdict(task.hw)  # each row records what priced it, and the workload's shape and sample
    rows = []
    for B in batches:
        best = max((lay for lay in layouts if lay != "auto"), key=lambda lay: tok[lay, B])
        top = max(tok[best, B], tok["auto", B])
        rows.append({"family": fam, "ecr": ecr, "batch": B, "chosen_whole": whole["auto", B],
                     "chosen_tok_s": tok["auto", B], "best_grid": best, "best_grid_tok_s": tok[best, B],
                     "chosen_vs_best": tok["auto", B] / top, "uniform_vs_best": tok["resident-0", B] / top,
                     "tok_s": {lay: tok[lay, B] for lay in layouts},
                     "hw": hw, "shape": task.workload.shape, "calib_sequences": task.workload.calib_sequences})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, "25%,50%")
    p.add_argument("--points", type=int, default=GRID_POINTS, help="layouts in the grid, uniform to all whole layers")
    p.add_argument("--jobs", type=int, default=1, help="parallel processes (at most one per free core)")
    add_cost_args(p)
    a = p.parse_args(argv)
    hw = cost_profile(p, a)
    if a.points < 1 or a.jobs < 1:
        p.error("--points and --jobs must be at least 1")
    fams, drawn = selected_families(p, a)
    tasks = [LayoutTask(Workload.of(a, f, drawn), 100.0 * e, tuple(a.batch), a.points, hw) for f in fams for e in a.ecr]
    print(f"{'family':<18} {'ECR %':>6} {'batch':>5} {'chosen':>6} {'tok/s':>7} {'best of grid':>18} "
          f"{'chosen/best':>11} {'uniform/best':>12}")
    out = []
    with task_pool(a.jobs) as pool:
        for rows in pool.imap(measure, tasks):
            for r in rows:
                out.append(r)
                best = f"{r['best_grid']} {r['best_grid_tok_s']:.2f}"
                print(f"{r['family']:<18} {r['ecr']:>6g} {r['batch']:>5} {r['chosen_whole']:>6} "
                      f"{r['chosen_tok_s']:>7.2f} {best:>18} {r['chosen_vs_best']:>10.4f}x "
                      f"{r['uniform_vs_best']:>11.4f}x", flush=True)
    ratios = np.array([r["chosen_vs_best"] for r in out])
    if ratios.size:
        print(f"chosen/best over {ratios.size} cells: geometric mean {np.exp(np.log(ratios).mean()):.5f}, "
              f"worst {ratios.min():.4f}, {int((ratios < 0.995).sum())} below 0.995")
    if a.json:
        write_text_atomic(a.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
