"""Replay a device run's bench in the simulator and fit the cost model's hardware constants to it.

    .venv/bin/python bench/device/fit_device_run.py [--run DIR] [--record] [--out PROFILE.json]

Why: the first device run (bench/device/results/2026-12-04-h200) put llama.cpp's static
``n-cpu-moe`` ahead of every per-expert policy, where the simulated tables put ``saem`` at 1.0-1.5x
it. The simulator replays the same policies over the same routing, so it can say which of its
assumptions the device broke: every policy is deterministic on a given routing, so the hit rates
and MB moved per token must come out as measured (they check that the trace is the device's),
and the tokens/s then depend only on the hardware constants, fitted here in three steps:

1. the GPU side (``gpu_layer_overhead_s``) from ``gpu-all`` (every expert resident);
2. a CPU layer's expert time (``sync_s`` + top-k x ``t_cpu(1)``) from ``cpu-moe`` and the three
   ``n-cpu-moe`` rows (no copy, no cache: only whole layers on one side or the other), by least
   squares over their count of CPU layers;
3. the link (``h2d_bw``), whether the next step waits for every copy (``copy_barrier``: what the
   native layer does, native/moe_cache.cpp ``wait_copies_on_compute``) and how that CPU time
   splits into the round trip and the per-expert part, by a grid over the rows of the policies
   that copy (``lru-cpu``, ``lfu-cpu``, ``saem-cue``; see DYNAMIC), least squares of log
   tokens/s.

Prints every row (device, simulated with the preset the run's engine priced with, simulated with
the fit) and writes the fitted profile (a HardwareProfile JSON: ``--hw FILE.json`` everywhere).

The routing: the run's bench replays one held-out example (47 prompt tokens, 96 decoded) on a
generated 16-layer model; ``--record`` writes that model here (5.7 GiB, deterministic: the same
file as on the device) and records the replay's routing on the CPU build into
``DIR/trace.npz``, which is kept with the run so the fit needs no model. The CPU's routing equals
the GPU's up to float rounding at near ties (the device run's correctness check compares tokens,
not routing), which the hit-rate check above would show.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.costmodel import GB, HW_PRESETS, CostModel, HardwareProfile  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.simulator import SimConfig, simulate  # noqa: E402
from saem_gguf.trace import TraceSet, load_traces, save_traces  # noqa: E402

DEFAULT_RUN = Path(__file__).resolve().parent / "results" / "2026-12-04-h200"
# the rows the link is fitted on: the caches, whose decisions depend on the routing alone (their
# hits and copies here are the device's exactly), and saem-cue, whose code is the run's and whose
# hits and copies come within 1.1 % and 1.7 % of the device's (its link budget reads the cost
# model); its partly cached layers are what tells the round trip from the per-expert time. Not
# saem: its code has changed since the run.
DYNAMIC = ("lru-cpu", "lfu-cpu", "saem-cue")
STATIC = ("gpu-all", "cpu-moe", "n-cpu-moe")
# the grid of step 3
H2D_GB_S = (10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 25.0, 32.0, 45.5)
SYNC_S = (5e-6, 10e-6, 20e-6, 40e-6, 80e-6, 160e-6)
CPU_EXPERT_OVERHEAD_S = 4e-6  # the preset's; the per-expert time's fixed part, not separable here


def record(run: Path) -> Path:
    """The device bench's replay on this machine's build, its routing saved as ``run/trace.npz``."""
    from device_bench import replayed_routing, sizes

    from saem_gguf.defaultmodel.corpus import heldout_examples
    from saem_gguf.testmodels import ensure_model

    spec = json.loads((run / "bench.json").read_text())
    rs = sizes(False, int(spec["spec"]["n_layer"]), 1)
    model = ensure_model(rs.bench_model)
    examples = heldout_examples(1, seed=7)  # device_bench.bench's first request
    ts = replayed_routing(model, "cpu-moe", examples, rs.bench_tokens, rs.n_ctx)
    out = run / "trace.npz"
    save_traces(dataclasses.replace(ts, meta={**ts.meta, "run": run.name}), str(out))
    return out


def device_rows(run: Path) -> dict[tuple[str, float | None], dict]:
    return {(r["policy"], r["ecr"]): r for r in json.loads((run / "bench.json").read_text())["results"]}


# the stage detector's cue set: the engine's on a qwen3moe model without a profile (FAMILY_CUES)
CUES = "qwen3"


def long_traces(run: Path) -> TraceSet:
    """Held-out examples 1-7 of seed 7 replayed on the bench model: RUN/trace_long.npz, else the
    first run's (the same generated model and examples; the signature is checked)."""
    from saem_gguf.trace import check_signature

    path = run / "trace_long.npz"
    ts = load_traces(str(path if path.exists() else DEFAULT_RUN / "trace_long.npz"))
    check_signature(ts, load_traces(str(run / "trace.npz")).signature, where=str(path))
    return ts


def bench_calibration(long: TraceSet, calib_examples: int = 4, calib_tokens: int = 600) -> TraceSet:
    """The routing device_bench.calibrate profiles the bench model on: held-out examples 2.. of
    seed 7 (``calib_examples`` of them, ``calib_tokens`` decoded each), cut from ``long``
    (long_traces: examples 1-7)."""
    from saem_gguf.simulator import _cut

    return TraceSet(long.signature, [_cut(s, s.prompt_len + calib_tokens)
                                     for s in long.sequences[1:1 + calib_examples]], source="engine")


def run_calibration(run: Path) -> TraceSet | None:
    """The calibration a run's bench had: none for the first run's bench (its bench.json names no
    profile), else the bench's own (bench_calibration)."""
    return bench_calibration(long_traces(run)) if json.loads((run / "bench.json").read_text()).get("profile") else None


def simulate_run(ts: TraceSet, hw: HardwareProfile, policies: tuple[str, ...], ecrs: list[float],
                 calib: TraceSet | None = None) -> dict:
    """(policy, ECR as a fraction, None for the ECR-free ones) -> the simulator's row."""
    cost = CostModel.from_expert_bytes(ts.signature.expert_bytes, hw)
    cfg = SimConfig(policies=policies, ecrs=tuple(100.0 * e for e in ecrs), batches=(1,), cues=CUES)
    res = simulate(ts, cfg, cost, calib=calib)
    return {(r["policy"], None if r["policy"] in ("gpu-all", "cpu-moe") else r["ecr"] / 100.0): r for r in res.rows}


def log_error(sim: dict, dev: dict, policies: tuple[str, ...]) -> float:
    """Root mean square of log(simulated / measured tokens/s) over the rows of ``policies``."""
    errs = [math.log(sim[k]["tok_s"] / r["decode_mean"]) for k, r in dev.items() if k[0] in policies and k in sim]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def fit(ts: TraceSet, dev: dict, base: HardwareProfile, ecrs: list[float],
        calib: TraceSet | None = None) -> tuple[HardwareProfile, dict]:
    L = ts.signature.n_layer
    K = ts.signature.n_expert_used
    expert_bytes = ts.signature.expert_bytes
    # 1. the GPU side: every layer's dense part and resident experts, from gpu-all
    probe = simulate_run(ts, base.replace(gpu_layer_overhead_s=0.0), ("gpu-all",), ecrs, calib)[("gpu-all", None)]
    per_layer = (1.0 / dev[("gpu-all", None)]["decode_mean"] - 1.0 / probe["tok_s"]) / L
    gpu_overhead = max(0.0, per_layer)
    # 2. a CPU layer's expert time, from the whole-layer placements
    xs, ys = [], []
    for (pol, ecr), r in dev.items():
        if pol == "cpu-moe" or pol == "n-cpu-moe":
            n_cpu = L if pol == "cpu-moe" else L - round(L * ecr)
            xs.append(n_cpu)
            ys.append(1.0 / r["decode_mean"])
    slope, _ = np.polyfit(np.array(xs, float), np.array(ys), 1)
    cpu_layer_s = float(slope)
    # 3. the link, the barrier and the round trip's share, on the dynamic rows
    trials = []
    for barrier in (False, True):
        for sync in SYNC_S:
            per_expert = (cpu_layer_s - sync) / K - CPU_EXPERT_OVERHEAD_S
            if per_expert <= 0:
                continue
            for h2d in H2D_GB_S:
                hw = base.replace(gpu_layer_overhead_s=gpu_overhead, sync_s=sync,
                                  cpu_expert_overhead_s=CPU_EXPERT_OVERHEAD_S, cpu_mem_bw=expert_bytes / per_expert,
                                  h2d_bw=h2d * GB, copy_barrier=barrier, dma_slows_cpu=True)
                sim = simulate_run(ts, hw, STATIC + DYNAMIC, ecrs, calib)
                trials.append((log_error(sim, dev, DYNAMIC), log_error(sim, dev, STATIC + DYNAMIC), hw, sim))
    trials.sort(key=lambda t: t[0])
    best_dyn, best_all, hw, sim = trials[0]
    summary = {"gpu_layer_overhead_us": gpu_overhead * 1e6, "cpu_layer_us": cpu_layer_s * 1e6,
               "sync_us": hw.sync_s * 1e6, "cpu_expert_us": (cpu_layer_s - hw.sync_s) / K * 1e6,
               "h2d_gb_s": hw.h2d_bw / GB, "copy_barrier": hw.copy_barrier,
               "rms_log_error_dynamic": best_dyn, "rms_log_error_all": best_all,
               "runner_up": [{"h2d_gb_s": t[2].h2d_bw / GB, "copy_barrier": t[2].copy_barrier,
                              "sync_us": t[2].sync_s * 1e6, "rms_log_error_dynamic": t[0]} for t in trials[1:4]],
               "barrier_off_best": next(({"h2d_gb_s": t[2].h2d_bw / GB, "sync_us": t[2].sync_s * 1e6,
                                          "rms_log_error_dynamic": t[0]} for t in trials if not t[2].copy_barrier),
                                        None)}
    return hw, {"summary": summary, "sim": sim}


def predict_bench(run: Path, hw: HardwareProfile, ecrs: list[float], decode_tokens: int = 96,
                  calib_examples: int = 4, calib_tokens: int = 600) -> list[dict]:
    """What the simulator expects of device_bench.bench as it is now, on ``hw``: the bench model
    calibrated on held-out examples 2.. (``calib_examples`` of them, ``calib_tokens`` decoded
    each), then per policy x ECR the first request (example 0, a cold cache) and a second (example
    1, the cache as the first left it), ``decode_tokens`` each. From RUN/trace.npz (example 0) and
    long_traces (examples 1-7)."""
    from saem_gguf.simulator import _cut

    from device_bench import BENCH_POLICIES

    first = load_traces(str(run / "trace.npz"))
    long = long_traces(run)
    sig = first.signature
    one = first.sequences[0]
    two = _cut(long.sequences[0], long.sequences[0].prompt_len + decode_tokens)
    calib = bench_calibration(long, calib_examples, calib_tokens)
    runs = {name: simulate_run(TraceSet(sig, seqs, source="engine"), hw, BENCH_POLICIES, ecrs, calib)
            for name, seqs in (("first", [one]), ("both", [one, two]))}
    rows = []
    for key, r1 in runs["first"].items():
        r2 = runs["both"][key]
        t2 = r2["time_s"] - r1["time_s"]
        n2 = r2["tokens"] - r1["tokens"]
        rows.append({"policy": key[0], "ecr": key[1],
                     "first_tok_s": r1["tok_s"], "first_hit": r1["hit_rate"],
                     "second_tok_s": n2 / t2 if t2 > 0 else 0.0,
                     "second_hit": (r2["hit_rate"] * r2["accesses"] - r1["hit_rate"] * r1["accesses"])
                     / max(r2["accesses"] - r1["accesses"], 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=DEFAULT_RUN, help="a device run's output folder (bench.json)")
    ap.add_argument("--record", action="store_true", help="(re)record RUN/trace.npz on this machine first")
    ap.add_argument("--base", default="h200-server", help="the preset the fit starts from (h200-server)")
    ap.add_argument("--engine-hw", default="rtx4090-ddr5",
                    help="the preset the run's engine priced with, for the 'as run' column (rtx4090-ddr5: "
                         "--hw measure takes the GPU side from it)")
    ap.add_argument("--cores", type=int, default=16, help="the device's CPU cores (16: the lent H200 machine)")
    ap.add_argument("--out", type=output_file, default=None, help="fitted profile JSON (default RUN/fitted_hw.json)")
    a = ap.parse_args(argv)
    trace = a.run / "trace.npz"
    if a.record or not trace.exists():
        trace = record(a.run)
    ts = load_traces(str(trace))
    dev = device_rows(a.run)
    ecrs = sorted({e for (_, e) in dev if e is not None})
    base = HW_PRESETS[a.base].replace(name=f"{a.run.name}-fit", notes="")
    base = base.replace(cpu_cores=a.cores)
    calib = run_calibration(a.run)
    hw, found = fit(ts, dev, base, ecrs, calib)
    hw = hw.replace(notes=f"fitted to {a.run.name}'s bench by bench/device/fit_device_run.py: "
                          f"rms log error {found['summary']['rms_log_error_all']:.3f} over its rows")
    shown = STATIC + DYNAMIC + ("static-hot", "saem", "saem-cue")
    as_run = simulate_run(ts, HW_PRESETS[a.engine_hw].replace(cpu_cores=base.cpu_cores), shown, ecrs, calib)
    fitted = simulate_run(ts, hw, shown, ecrs, calib)
    print(f"{a.run.name}: {trace.name}, {ts.decoded_tokens} decoded tokens "
          f"(fitted on {', '.join(STATIC + DYNAMIC)}; saem simulated with this code, which is not the code "
          "nor the cost model its device rows ran with)")
    print("| policy | ECR | device tok/s | hit dev / sim | MB/token dev / sim | sim as run | sim fitted | fitted / device |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, r in dev.items():
        f, s0 = fitted[k], as_run[k]
        ecr = "all" if k[1] is None else f"{k[1]:.1%}"
        print(f"| {k[0]} | {ecr} | {r['decode_mean']:.1f} | {r['hit_rate']:.3f} / {f['hit_rate']:.3f} | "
              f"{r['mb_moved_per_token']:.2f} / {f['load_mb_per_token']:.2f} | {s0['tok_s']:.1f} | {f['tok_s']:.1f} | "
              f"{f['tok_s'] / r['decode_mean']:.3f} |")
    summ = found["summary"]
    print("fit: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in summ.items() if not isinstance(v, (list, dict))))
    print(f"best without the barrier: {summ['barrier_off_best']}")
    if (a.run / "trace_long.npz").exists() or (DEFAULT_RUN / "trace_long.npz").exists():
        print("\nthe bench as device_bench.py runs it now (calibrated; a first and a second request), "
              "simulated on the fitted profile:")
        print("| policy | ECR | first request tok/s | hit | second request tok/s | hit |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in predict_bench(a.run, hw, ecrs):
            ecr = "all" if r["ecr"] is None else f"{r['ecr']:.1%}"
            print(f"| {r['policy']} | {ecr} | {r['first_tok_s']:.1f} | {r['first_hit']:.3f} | "
                  f"{r['second_tok_s']:.1f} | {r['second_hit']:.3f} |")
    out = a.out or a.run / "fitted_hw.json"
    write_text_atomic(out, json.dumps(dataclasses.asdict(hw), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
