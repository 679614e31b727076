"""Does the default ``saem`` lead? Simulated tokens/s of ``saem`` against every implementable
policy, ``n-cpu-moe`` and the oracle, per trace family x ECR x batch (issue 12, item 4).

    python bench/bench_policies.py [--trace default60.npz] [--families a,b,...] [--jobs 2] [--json OUT]
    python bench/bench_policies.py --search 24 [--seed 0] [--jobs 2] [--json OUT]
    python bench/bench_policies.py ... --reuse OLD.json [--saem '{"copy_price": 0.75}']
    python bench/bench_policies.py --shape mixtral-8x7b ...   # the families on another model's shape
    python bench/bench_policies.py --hw rtx3060-ddr4 [--overlap] [--copy-barrier] ...   # another cost model
    python bench/bench_policies.py --calib-seqs 8 ...   # a larger calibration sample

``--reuse``: re-simulate ``saem`` alone (with ``--saem``'s keyword arguments, a JSON object) and
compare it with the other policies' tokens/s stored in OLD.json, a ``--json`` output of the same
workloads (a change to ``saem`` leaves the others' runs as they were, and they are most of the
time); the rows of OLD.json's other workloads are ignored, a workload missing from it is an error,
and so are rows priced on another cost model (``--hw``, ``--overlap``, ``--copy-barrier``),
routed with another ``--shape`` or calibrated on another ``--calib-seqs`` (each row records
all three; older files, which do not, are taken as they are).

Families (synthetic ones are generated like ``simulate --synthetic``: 8 sequences replayed, 4
calibration sequences from another seed, ``--calib-seqs`` to say how many):

* ``synthetic``: the paper-shaped default (``simulate --synthetic``);
* ``stationary``: ``--synthetic --stationary`` (one stage per sequence, no cues);
* ``kinds``: recurring stage kinds named by their cue (SyntheticConfig.n_kinds = 4): the
  completed stage predicts the next one badly, the cue well;
* ``drift-nocue``: short stages (x0.2) whose hot set drifts (coherence 0.8), no cue at all;
* ``shift-nocue``: paper-length stages that shift hard (coherence 0.2) without cues;
* ``kinds-drift-noise``: 4 recurring kinds, the hot set drifting every 48 tokens inside a stage
  (keeping 70 %), 15 % of tokens routed uniformly;
* ``short-kinds-noise``: 6 recurring kinds in short stages (x0.25), 30 % of them cued, 30 %
  token noise;
* ``cued-drift``: cued stages whose hot set drifts every 24 tokens (keeping 85 %), flatter
  routing (skew 1.0);
* ``fastdrift-nocue``: cue-less stages whose hot set moves every 4 tokens (keeping 60 %);
* ``fastdrift-skewed``: cued stages, skewed routing (1.5) whose hot set moves every 8 tokens
  (keeping 50 %);
* ``short-nocue``: very short cue-less stages (x0.05) sharing little (coherence 0.5);
* ``drawn-S-i`` (``--search N``, in place of the named families): N generator settings drawn
  at random with seed S (``drawn_families``: skew, coherence, stage lengths, cue share, kinds,
  in-stage drift, token noise), each its own family: workloads nobody chose, as the traces
  that will check the figures are;
* ``model``: ``--trace`` (e.g. the embedded model's 60 held-out questions recorded with
  ``trace``, as bench_default_model.py does), the last 25 % calibrating, the stage detector on
  ``--cues`` (qwen3: the set the engine's detector uses on a qwen3moe model).

"Best other" is the best tokens/s among the implementable policies: every policy but
``gpu-all``, ``oracle`` and the wait-for-load caches (``simulator.NOT_IMPLEMENTABLE``).
The last lines sum the cells up as item 4 asks: how many ``saem`` leads, how many it trails and
by how much, and the geometric means of saem / best other, saem / n-cpu-moe and saem / oracle.
Simulation is CPU-heavy: run it under the project's lock on a shared machine; ``--jobs`` runs
families in parallel processes (at most one per free core).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import multiprocessing
import random
import signal
import sys

# this folder too: a --jobs worker process imports this script by name (task_pool)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..")]

import numpy as np  # noqa: E402

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.common import ecr_list_arg, int_list_arg  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.costmodel import MODEL_PRESETS, HardwareProfile, get_hw  # noqa: E402
from saem_gguf.errors import SaemError  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.policies import POLICIES, make_policy  # noqa: E402
from saem_gguf.simulator import NOT_IMPLEMENTABLE, SimConfig, default_cost, simulate, split_calibration  # noqa: E402
from saem_gguf.synthetic import SyntheticConfig, make_stage_traces  # noqa: E402
from saem_gguf.trace import load_traces  # noqa: E402

OTHERS = tuple(p for p in POLICIES if p != "saem" and p not in NOT_IMPLEMENTABLE)
# a synthetic family's calibration sequences, as simulate --synthetic's --calib-seqs default
CALIB_SEQUENCES = 4
SYNTHETIC = {
    "synthetic": SyntheticConfig(),
    "stationary": SyntheticConfig(stationary=True),
    "kinds": SyntheticConfig(n_kinds=4),
    "drift-nocue": SyntheticConfig(cue_prob=0.0, stage_len_scale=0.2, coherence=0.8),
    "shift-nocue": SyntheticConfig(cue_prob=0.0, coherence=0.2),
    # the three together, as the issue names a generator we have not seen: recurring kinds, hot
    # sets that drift inside a stage, token noise
    "kinds-drift-noise": SyntheticConfig(n_kinds=4, drift_every=48, drift_keep=0.7, token_noise=0.15),
    # short stages of recurring kinds, few of them cued, heavy noise: no rule has much to hold on to
    "short-kinds-noise": SyntheticConfig(n_kinds=6, cue_prob=0.3, stage_len_scale=0.25, token_noise=0.3),
    # long stages whose hot set drifts fast, cues at every boundary
    "cued-drift": SyntheticConfig(coherence=0.7, drift_every=24, drift_keep=0.85, skew=1.0),
    # three more written to break the default (2026-12-02): where temporal-cpu's rule is best
    # from the first token, any lag in following it shows. A hot set that moves every 4 tokens
    # (keeping 60 %) in cue-less stages
    "fastdrift-nocue": SyntheticConfig(cue_prob=0.0, drift_every=4, drift_keep=0.6, coherence=0.9),
    # cued stages, skewed routing whose hot set moves every 8 tokens keeping half
    "fastdrift-skewed": SyntheticConfig(drift_every=8, drift_keep=0.5, skew=1.5),
    # very short cue-less stages (x0.05) that share little (coherence 0.5): recency is all there is
    "short-nocue": SyntheticConfig(cue_prob=0.0, stage_len_scale=0.05, coherence=0.5),
}


def drawn_families(n: int, seed: int) -> dict[str, SyntheticConfig]:
    """``n`` generator settings drawn at random (``--search``), each with its own trace seed. The
    ranges span the named families and beyond: flat to very skewed routing, unrelated to nearly
    identical successive stages, stages 0.05x to 2x the paper's length, no cue / some / all,
    recurring kinds or none, a hot set moving every 4 to 48 tokens or never, token noise."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        p = dict(skew=round(rng.uniform(0.8, 1.8), 2), coherence=round(rng.uniform(0.0, 0.95), 2),
                 stage_len_scale=rng.choice([0.05, 0.1, 0.25, 0.5, 1.0, 2.0]), cue_prob=rng.choice([0.0, 0.3, 1.0]),
                 n_kinds=rng.choice([0, 0, 3, 6]), drift_every=rng.choice([0, 0, 4, 8, 16, 48]),
                 drift_keep=round(rng.uniform(0.4, 0.9), 2), token_noise=rng.choice([0.0, 0.0, 0.1, 0.3]))
        out[f"drawn-{seed}-{i}"] = SyntheticConfig(seed=1000 + 10_000 * seed + i, **p)  # n <= 10,000
    return out


def family_traces(name: str, trace: str | None, seed: int, drawn: dict[str, SyntheticConfig] | None = None,
                  shape: str | None = None, calib_sequences: int = CALIB_SEQUENCES):
    """(replayed traces, calibration traces) of family ``name``: 8 sequences and
    ``calib_sequences`` of another seed for a synthetic family (a drawn one has its own seed),
    routed with the layers, experts and top-k of model preset ``shape`` (default Qwen3-30B-A3B's
    48 x 128, top-8); the model trace split 3:1."""
    if name == "model":
        if not trace:
            raise SystemExit("the model family needs --trace")
        return split_calibration(load_traces(trace), 0.25)
    if drawn and name in drawn:
        base = dataclasses.replace(drawn[name], n_sequences=8)
    else:
        base = dataclasses.replace(SYNTHETIC[name], n_sequences=8, seed=seed)
    if shape is not None:
        m = MODEL_PRESETS[shape]
        base = dataclasses.replace(base, n_layer=m.n_layer, n_expert=m.n_expert, top_k=m.n_expert_used)
    calib = dataclasses.replace(base, n_sequences=calib_sequences, seed=base.seed + 1_000_003)
    return make_stage_traces(base), make_stage_traces(calib)


@dataclasses.dataclass
class Workload:
    """One family's traces as the command line names them (``family_traces``); a --jobs worker
    is sent this and rebuilds the traces itself."""
    family: str
    trace: str | None  # recorded traces of the model family
    seed: int  # of the synthetic families (of the draw with --search)
    cues: str  # cue set of the model family's stage detector
    drawn: dict[str, SyntheticConfig]  # --search's settings by family name (empty without)
    shape: str | None  # the model preset whose layers, experts and top-k route the synthetic families
    calib_sequences: int = CALIB_SEQUENCES  # a synthetic family's calibration sequences

    @classmethod
    def of(cls, a: argparse.Namespace, family: str, drawn: dict[str, SyntheticConfig]) -> "Workload":
        return cls(family, a.trace, a.seed, a.cues, drawn, a.shape, a.calib_seqs)

    def traces(self):
        """(replayed traces, calibration traces)."""
        return family_traces(self.family, self.trace, self.seed, self.drawn, self.shape, self.calib_sequences)

    def sim_config(self, policies: tuple[str, ...], ecrs: tuple[float, ...], batches: tuple[int, ...]) -> SimConfig:
        """``simulate``'s configuration for this family (the model family's detector on its cue set)."""
        cfg = SimConfig(policies=policies, ecrs=ecrs, batches=batches)
        return dataclasses.replace(cfg, cues=self.cues) if self.family == "model" else cfg


def _changed_fields(cfg: SyntheticConfig) -> dict:
    """The settings of a drawn family that differ from the generator's defaults (``drift_keep``
    only where the hot set drifts: without ``drift_every`` it has no effect)."""
    default = SyntheticConfig()
    inert = ("seed", "n_sequences") + (("drift_keep",) if not cfg.drift_every else ())
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in inert and getattr(cfg, f.name) != getattr(default, f.name)}


def add_workload_args(p: argparse.ArgumentParser, ecr: str) -> None:
    """The options that say which workloads a bench replays (this script's and bench_layout.py's)."""
    p.add_argument("--families", default=",".join([*SYNTHETIC, "model"]))
    p.add_argument("--trace", help="recorded traces for the model family")
    p.add_argument("--ecr", type=ecr_list_arg, default=ecr,
                   help="comma-separated expert cache ratios: 25%% or 0.25 (the CLI's one unit)")
    p.add_argument("--batch", type=int_list_arg, default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--cues", default="qwen3", help="cue set of the model family's stage detector (qwen3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic families (of the draw with --search)")
    p.add_argument("--search", type=int, default=0, metavar="N",
                   help="N randomly drawn generator settings instead of --families")
    p.add_argument("--shape", choices=sorted(MODEL_PRESETS), default=None,
                   help="route the synthetic families with this model's layers, experts and top-k, and price "
                        "them with its expert size (default: qwen3-30b-a3b, 48 x 128, top-8)")
    p.add_argument("--calib-seqs", type=int, default=CALIB_SEQUENCES, metavar="N",
                   help=f"calibration sequences of a synthetic family (default {CALIB_SEQUENCES}, as simulate "
                        "--synthetic; the model family's calibration is its trace's last 25 %%)")
    p.add_argument("--json", type=output_file, help="write every row here")


def selected_families(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[list[str], dict[str, SyntheticConfig]]:
    """(family names, the drawn settings among them) of add_workload_args' options. ``model`` is
    skipped without ``--trace``. What would fail later, after minutes of simulation or in a worker
    (an unknown name, a batch size below 1, a negative --search, nothing to run, a --trace that is
    no trace file) is argparse's one-line error now, as --json's type makes an unwritable path."""
    if not a.batch or min(a.batch) < 1:
        p.error("--batch values must be >= 1")
    if a.search < 0:
        p.error(f"--search must be 0 (the named families) or more, not {a.search}")
    if a.calib_seqs < 1:
        p.error(f"--calib-seqs must be at least 1, not {a.calib_seqs}")
    drawn = drawn_families(a.search, a.seed) if a.search > 0 else {}
    fams = list(drawn) if drawn else [f for f in a.families.split(",") if f and (f != "model" or a.trace)]
    unknown = [f for f in fams if f not in SYNTHETIC and f != "model" and f not in drawn]
    if unknown:
        p.error(f"unknown families: {', '.join(unknown)} (known: {', '.join([*SYNTHETIC, 'model'])})")
    if not fams:
        p.error("no family to run (the model family needs --trace)")
    if "model" in fams:
        try:
            load_traces(a.trace)
        except SaemError as e:
            p.error(str(e))
    return fams, drawn


@dataclasses.dataclass
class FamilyTask:
    """One family's simulations (every ECR x batch), a --jobs worker's unit of work."""
    workload: Workload
    ecrs: tuple[float, ...]  # percent, as SimConfig counts
    batches: tuple[int, ...]
    saem_kwargs: dict  # --saem
    stored: dict[tuple[float, int], dict[str, float]] | None  # --reuse: the others' tok/s per (ECR %, batch)
    hw: HardwareProfile  # --hw with --overlap / --copy-barrier: what prices the runs


def measure(task: FamilyTask) -> list[dict]:
    """The rows of one family (every ECR x batch): saem's tokens/s and its ratios to the others
    (``task.stored``: the others' tokens/s from a --reuse file; saem alone is run then)."""
    fam, batches, stored = task.workload.family, task.batches, task.stored
    ts, calib = task.workload.traces()
    names = ("saem",) if stored else ("saem", *OTHERS, "oracle")
    cfg = task.workload.sim_config(names, task.ecrs, batches)
    res = simulate(ts, cfg, default_cost(ts, task.hw), calib=calib, policy_kwargs={"saem": task.saem_kwargs})
    drawn = task.workload.drawn
    hw = dataclasses.asdict(task.hw)  # each row records what priced it (--reuse checks it)
    rows = []
    for B in batches:
        for e in task.ecrs:
            runs = {r["policy"]: r for r in res.select(batch=B, ecr=e)}
            tok = {**stored[(e, B)], "saem": runs["saem"]["tok_s"]} if stored else \
                {name: r["tok_s"] for name, r in runs.items()}
            best = max(OTHERS, key=tok.__getitem__)
            row = {"family": fam, "ecr": e, "batch": B, "saem": tok["saem"], "best_other": best,
                   "best_other_tok_s": tok[best], "vs_best": tok["saem"] / tok[best],
                   "vs_n_cpu_moe": tok["saem"] / tok["n-cpu-moe"], "vs_oracle": tok["saem"] / tok["oracle"],
                   "tok_s": tok, "saem_whole_layers": runs["saem"]["whole_layers"],
                   "hw": hw, "shape": task.workload.shape, "calib_sequences": task.workload.calib_sequences}
            if fam in drawn:
                row["config"] = _changed_fields(drawn[fam])
            rows.append(row)
    return rows


_SAME = object()  # _recorded_other's answer where every row agrees (None is a shape: the default)


def _recorded_other(rows: list[dict], key: str, want):
    """The first value of ``key`` a row records other than ``want``, else _SAME (a row that does
    not record it, written before rows did, is taken as it is)."""
    return next((r[key] for r in rows if key in r and r[key] != want), _SAME)


def stored_runs(p: argparse.ArgumentParser, path: str, fams: list[str], ecrs: tuple[float, ...],
                batches: list[int], hw: HardwareProfile, shape: str | None,
                calib_sequences: int = CALIB_SEQUENCES) -> dict[str, dict[tuple[float, int], dict[str, float]]]:
    """{family: {(ECR %, batch): {policy: tok/s}}} of a --json output, for --reuse; every
    family x ECR x batch asked for must be there, priced on the same cost model (``hw``, with
    its overlap and barrier), routed with the same model shape and calibrated on as many
    sequences, where the file says (files written before it said are taken as they are);
    argparse's one-line error otherwise."""
    mine = dataclasses.asdict(hw)  # as each row records it
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        runs = {(r["family"], float(r["ecr"]), int(r["batch"])): dict(r["tok_s"]) for r in rows}
        other_hw, other_shape, other_calib = (_recorded_other(rows, key, want) for key, want in
                                              (("hw", mine), ("shape", shape), ("calib_sequences", calib_sequences)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        p.error(f"--reuse {path}: not a bench_policies --json output ({e})")
    if other_hw is not _SAME:
        p.error(f"--reuse {path} was priced on another cost model ({_hw_label(other_hw)}), not "
                f"{_hw_label(mine)}: give the same --hw / --overlap / --copy-barrier")
    if other_shape is not _SAME:
        p.error(f"--reuse {path} was routed with --shape {other_shape or 'qwen3-30b-a3b (the default)'}, "
                f"not {shape or 'the default'}")
    if other_calib is not _SAME:
        p.error(f"--reuse {path} was calibrated on {other_calib} sequences a family (--calib-seqs), "
                f"not {calib_sequences}")
    out: dict[str, dict[tuple[float, int], dict[str, float]]] = {}
    for fam in fams:
        for e in ecrs:
            for B in batches:
                if (fam, e, B) not in runs:
                    p.error(f"--reuse {path} has no run of {fam} at ECR {e:g} %, batch {B}")
                out.setdefault(fam, {})[(e, B)] = runs[(fam, e, B)]
    return out


def _hw_label(hw: dict) -> str:
    """A cost model's name and switches, as an error names it."""
    flags = [f for f, on in (("overlap", hw.get("cpu_gpu_overlap")), ("copy barrier", hw.get("copy_barrier"))) if on]
    return f"{hw.get('name', '?')}{' with ' + ' and '.join(flags) if flags else ''}"


def summary(rows: list[dict]) -> dict:
    """Item 4's figures over ``rows``: cells where saem is at least the best other (to 1e-9,
    float noise), below it, below 0.999; the worst cell; geometric means of saem / best other,
    saem / n-cpu-moe (and its least) and saem / oracle."""
    vs = np.array([r["vs_best"] for r in rows])
    n_cpu = np.array([r["vs_n_cpu_moe"] for r in rows])
    worst = min(rows, key=lambda r: r["vs_best"])

    def gmean(a: np.ndarray) -> float:
        return float(np.exp(np.log(a).mean()))

    return {"cells": len(rows), "at_least_best": int((vs >= 1 - 1e-9).sum()), "below_1": int((vs < 1 - 1e-9).sum()),
            "below_0999": int((vs < 0.999).sum()), "worst": float(vs.min()),
            "worst_cell": f"{worst['family']} {worst['ecr']:g} % batch {worst['batch']} ({worst['best_other']})",
            "geomean_vs_best": gmean(vs), "geomean_vs_n_cpu_moe": gmean(n_cpu), "min_vs_n_cpu_moe": float(n_cpu.min()),
            "geomean_vs_oracle": gmean(np.array([r["vs_oracle"] for r in rows]))}


def add_cost_args(p: argparse.ArgumentParser) -> None:
    """The cost model's options, as ``simulate`` has them: ``--hw``, ``--overlap``, ``--copy-barrier``."""
    p.add_argument("--hw", default="rtx4090-ddr5", help="the cost model's hardware: a preset or a profile JSON "
                   "(e.g. bench/device/results/2026-12-04-h200/fitted_hw.json; default rtx4090-ddr5)")
    p.add_argument("--overlap", action="store_true", help="CPU and GPU experts of a layer run concurrently, "
                   "as simulate --overlap")
    p.add_argument("--copy-barrier", action="store_true", help="each decode step waits for every copy issued "
                   "before it, as simulate --copy-barrier")


def cost_profile(p: argparse.ArgumentParser, a: argparse.Namespace) -> HardwareProfile:
    """The hardware profile ``add_cost_args``' options name; a bad ``--hw`` is one usage line."""
    try:
        hw = get_hw(a.hw)
    except SaemError as e:
        p.error(str(e))
    return hw.with_switches(a.overlap, a.copy_barrier)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p, "6.25%,12.5%,25%,50%")
    p.add_argument("--jobs", type=int, default=1, help="parallel processes (at most one per free core)")
    p.add_argument("--reuse", metavar="OLD.json", help="re-simulate saem alone against the other policies' "
                   "tokens/s stored in this --json output of the same workloads")
    p.add_argument("--saem", default="{}", metavar="JSON", help="keyword arguments of the saem policy, a JSON "
                   "object (e.g. '{\"copy_price\": 0.75}')")
    add_cost_args(p)
    a = p.parse_args(argv)
    hw = cost_profile(p, a)
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    try:
        saem_kwargs = json.loads(a.saem)
    except ValueError as e:
        p.error(f"--saem: not JSON ({e})")
    if not isinstance(saem_kwargs, dict):
        p.error("--saem must be a JSON object")
    try:  # a wrong keyword is one line here, not a traceback in a worker
        make_policy("saem", **saem_kwargs)
    except (TypeError, ValueError) as e:
        p.error(f"--saem: {e}")
    fams, drawn = selected_families(p, a)
    ecrs = tuple(100.0 * e for e in a.ecr)  # SimConfig counts in percent
    stored = stored_runs(p, a.reuse, fams, ecrs, a.batch, hw, a.shape, a.calib_seqs) if a.reuse else {}
    tasks = [FamilyTask(Workload.of(a, f, drawn), ecrs, tuple(a.batch), saem_kwargs, stored.get(f), hw)
             for f in fams]
    print(f"{'family':<12} {'ECR %':>6} {'batch':>5} {'saem tok/s':>10} {'best other':>22} "
          f"{'saem/best':>9} {'saem/n-cpu-moe':>14} {'saem/oracle':>11}")
    out = []
    with task_pool(a.jobs) as pool:
        for fam, rows in zip(fams, pool.imap(measure, tasks)):
            if fam in drawn:
                print(f"{fam}: {_changed_fields(drawn[fam])}", flush=True)
            for row in rows:
                out.append(row)
                best = f"{row['best_other']} {row['best_other_tok_s']:.1f}"
                print(f"{fam:<12} {row['ecr']:>6g} {row['batch']:>5} {row['saem']:>10.1f} {best:>22} "
                      f"{row['vs_best']:>8.3f}x {row['vs_n_cpu_moe']:>13.2f}x {row['vs_oracle']:>10.3f}x",
                      flush=True)
    if out:
        s = summary(out)
        print(f"saem at least the best other in {s['at_least_best']} of {s['cells']} cells; below it in "
              f"{s['below_1']} ({s['below_0999']} by more than 0.1 %); worst {s['worst']:.5f}x "
              f"({s['worst_cell']})")
        print(f"geometric means: saem/best other {s['geomean_vs_best']:.5f}, saem/n-cpu-moe "
              f"{s['geomean_vs_n_cpu_moe']:.4f} (least {s['min_vs_n_cpu_moe']:.4f}), saem/oracle "
              f"{s['geomean_vs_oracle']:.4f}")
    if a.json:
        write_text_atomic(a.json, json.dumps(out, indent=1))
    return 0


class _Serial:
    """Pool's imap in this process (--jobs 1: no worker, tracebacks where they happen)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    @staticmethod
    def imap(fn, tasks):
        return map(fn, tasks)


def task_pool(jobs: int):
    """``jobs`` worker processes (a Pool), or, for 1, imap in this process. The workers are
    spawned, not forked: a fork of a process whose Numba or BLAS threads hold a lock can hang
    (it did, in a pytest process). They start with Ctrl-C ignored (an ignored signal stays so
    through exec, and Python then installs no handler for it): the terminal sends it to every
    process of the group, and the parent alone answers (``run_script``), its pool terminating
    the workers, where each worker printed a traceback of its own."""
    if jobs == 1:
        return _Serial()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return multiprocessing.get_context("spawn").Pool(jobs)
    finally:
        if previous is not None:  # None: a handler C installed, which Python cannot put back
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
