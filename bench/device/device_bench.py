"""The device run's measurements, in order: correctness, the policy bench, the copy/decode overlap.

Called by bench/device/run.sh (on the GPU machine; or with --dry-run here, on the CPU build with
tiny models, so the script cannot fail there for a reason a CPU could have caught). Each phase
writes one file into --out and lines to stdout. Correctness comes first; a failed check fails the
run (exit 1), but the bench still runs, marked invalid: device minutes are scarce, and its figures
help find the fault.

  correctness.json  greedy tokens of cpu-moe / saem / gpu-all at two ECRs (identical?), per expert-
                    slot mode on a GPU (zero slot, and skipped ids: patch 0007); teacher-forced
                    logits (ubatches of 1, 3 and 12 tokens: mmvq, its MoE kernel, mmq) of the GPU
                    run vs the CPU backend's (a child process with no GPU visible) within a
                    tolerance; native routing counts vs the per-token routing read back
  bench.md / .json  decode tok/s (mean ± stddev over reps) and prefill tok/s per policy x ECR, on a
                    Qwen3-30B-A3B-shaped model (replayed reasoning text: real stage structure),
                    calibrated first (a profile from 4 other examples, as `calibrate` makes);
                    per repetition a first request on a fresh cache and a second, other one on
                    the cache the first left; the policies price with the profile fitted to the
                    first device run (bench/device/fit_device_run.py)
  overlap.json      per decode step: time with K async expert copies issued before it, without,
                    and the copies alone; hidden = copy time not added to the step; the host time
                    to issue them one call each and batched (the engine's two calls)

  python bench/device/device_bench.py --out DIR [--dry-run] [--layers 16] [--reps 3]
  python bench/device/device_bench.py logits --model M --tokens T.json --n-prompt N --out L.npy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from saem_gguf import native_api as na
from saem_gguf.budget import AUTO
from saem_gguf.cli.script import run_script
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.gpu_memory import gpu_memory
from saem_gguf.testmodels import STAGE_PLANT, ModelSpec, ensure_model

PROMPT = ("Question: a train leaves at 3 pm and travels 120 km at 80 km/h. When does it arrive? "
          "Let me think step by step. First, compute the time.")
CHECK_POLICIES = ("cpu-moe", "saem", "gpu-all")
BENCH_POLICIES = ("gpu-all", "cpu-moe", "n-cpu-moe", "static-hot", "lru-cpu", "lfu-cpu", "saem",
                  "saem-cue")
# the first device run's constants (bench/device/fit_device_run.py): the H200 machine's best known
FITTED_HW = Path(__file__).resolve().parent / "results" / "2026-12-04-h200" / "fitted_hw.json"
ECR_FREE_POLICIES = ("gpu-all", "cpu-moe")  # measured once: they ignore the cache size
# ubatch sizes of the teacher-forced logits: 1 (mmvq), 3 (mmvq's multi-token MoE kernel), 12 (mmq)
FORCED_UBATCHES = (1, 3, 12)
# GPU vs CPU-backend logits: |diff| <= LOGIT_RTOL * max|logit| per step. The GPU quantizes
# activations to q8_1 (mmvq) where the CPU uses q8_0, and reduces in another order; 2 % of the
# logit range bounds that on these models while any wrong expert row moves logits by O(range).
LOGIT_RTOL = 0.02


@dataclass(frozen=True)
class RunSizes:
    check_model: ModelSpec
    bench_model: ModelSpec
    check_tokens: int  # greedy tokens per correctness run
    bench_tokens: int  # decode tokens per bench replay
    reps: int
    ecrs: tuple[float, ...]
    check_ecrs: tuple[float, ...]
    overlap_steps: int
    overlap_copies: int  # async expert copies issued before each measured step
    bench_budget_s: float  # the bench stops repeating (noted) once it has used this much
    calib_examples: int  # held-out examples replayed to calibrate the bench model
    calib_tokens: int  # decode tokens of each
    n_ctx: int = 1024


def sizes(dry_run: bool, layers: int, reps: int) -> RunSizes:
    if dry_run:
        tiny = ModelSpec(arch="qwen3moe", expert_type="q4_0", n_layer=2, n_embd=64, n_ff_exp=64,
                         n_expert=8, n_expert_used=2, n_head=4, n_head_kv=2, head_dim=16,
                         planted=STAGE_PLANT, name="device-dry-run")
        return RunSizes(tiny, tiny, check_tokens=12, bench_tokens=12, reps=reps,
                        ecrs=(0.125, 0.25, 0.5), check_ecrs=(0.25, 0.5), overlap_steps=4,
                        overlap_copies=2, bench_budget_s=120, calib_examples=2, calib_tokens=24, n_ctx=512)
    check = ModelSpec(arch="qwen3moe", expert_type="q4_0", n_layer=4, n_embd=512, n_ff_exp=256,
                      n_expert=32, n_expert_used=4, n_head=8, n_head_kv=2, head_dim=64,
                      planted=STAGE_PLANT, name="device-check")
    # Qwen3-30B-A3B's expert shapes (128 experts, top-8, n_embd 2048, expert FFN 768, GQA 32/4 x 128)
    bench = ModelSpec(arch="qwen3moe", expert_type="q4_0", n_layer=layers, n_embd=2048, n_ff_exp=768,
                      n_expert=128, n_expert_used=8, n_head=32, n_head_kv=4, head_dim=128,
                      expert_pool=8, planted=STAGE_PLANT, name="qwen3-30b-a3b-shape")
    return RunSizes(check, bench, check_tokens=48, bench_tokens=96, reps=reps,
                    ecrs=(0.125, 0.25, 0.5), check_ecrs=(0.25, 0.5), overlap_steps=48,
                    overlap_copies=16, bench_budget_s=300, calib_examples=4, calib_tokens=600)


def _log(msg: str) -> None:
    print(f"[device-bench] {msg}", flush=True)


def _engine(model: Path, policy: str, ecr: float, n_ctx: int) -> Engine:
    return Engine(EngineConfig(model=model, n_ctx=n_ctx, policy=policy, ecr=ecr, progress=False))


@contextlib.contextmanager
def _zero_slot_mode(value: str | None):
    """SAEM_MOE_ZERO_SLOT for the cache inits inside (native/moe_cache.cpp reads it at init)."""
    old = os.environ.get("SAEM_MOE_ZERO_SLOT")
    if value is None:
        os.environ.pop("SAEM_MOE_ZERO_SLOT", None)
    else:
        os.environ["SAEM_MOE_ZERO_SLOT"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SAEM_MOE_ZERO_SLOT", None)
        else:
            os.environ["SAEM_MOE_ZERO_SLOT"] = old


def _slots(eng: Engine, ecr: float) -> int:
    return round(ecr * eng.info.n_expert)


def last_logits(eng: Engine) -> np.ndarray:
    llama_cpp = sys.modules["llama_cpp"]
    ptr = llama_cpp.llama_get_logits_ith(eng.llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(eng.llm.n_vocab(),)).astype(np.float32).copy()


def forced_logits(eng: Engine, tokens: list[int], n_prompt: int) -> np.ndarray:
    """Teacher-forced logits of the last token of each ubatch: the prompt (>= 32 tokens: the stock
    graph), then the rest in ubatches of FORCED_UBATCHES sizes in turn, so the device branch runs
    every CUDA MUL_MAT_ID path it takes below stock_min_batch."""
    eng.reset_sequence()
    eng.llm.reset()
    eng.llm.eval(tokens[:n_prompt])
    rows = [last_logits(eng)]
    i, k = n_prompt, 0
    while i < len(tokens):
        n = FORCED_UBATCHES[k % len(FORCED_UBATCHES)]
        eng.llm.eval(tokens[i:i + n])
        rows.append(last_logits(eng))
        i, k = i + n, k + 1
    return np.stack(rows)


def counts_match_routing(eng: Engine, n_tokens: int) -> dict:
    """Generate with the native counters reset; compare them with the per-ubatch routing read back."""
    ctx = eng.llm.ctx
    n_layers = len(eng.info.moe_layers)
    seen = np.zeros((n_layers, eng.info.n_expert), np.int64)
    engine_hook = eng.llm._saem_hook

    def hook(tokens: list[int]) -> None:
        routing = na.saem_moe_get_last_routing(ctx)
        for li in range(n_layers):
            ids = routing[:, li, :].ravel()
            seen[li] += np.bincount(ids[ids >= 0], minlength=eng.info.n_expert)
        engine_hook(tokens)

    na.saem_moe_reset_counts(ctx)
    eng.llm._saem_hook = hook
    try:
        eng.generate(PROMPT, n_tokens)
    finally:
        eng.llm._saem_hook = engine_hook
    native = np.array([na.saem_moe_get_counts(ctx, layer.index) for layer in eng.info.moe_layers])
    return {"equal": bool(np.array_equal(native, seen)), "routed_ids": int(seen.sum()),
            "native_ids": int(native.sum())}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ; None when they are identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def correctness(model: Path, rs: RunSizes, have_gpu: bool, out: Path) -> bool:
    """Writes correctness.json; True when every check passed."""
    # on a GPU: the zero-slot device branch (default) and skipped ids (SAEM_MOE_ZERO_SLOT=0, 0007)
    modes = {"zero-slot": None, "skip-ids": "0"} if have_gpu else {"cpu": None}
    eng = _engine(model, CHECK_POLICIES[0], rs.check_ecrs[0], rs.n_ctx)
    report: dict = {"model": str(model), "gpu": have_gpu, "logit_rtol": LOGIT_RTOL, "modes": {}}
    prompt = eng.llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    ok = True
    reference: list[int] | None = None
    device: dict[str, np.ndarray] = {}
    try:
        for mode, env in modes.items():
            with _zero_slot_mode(env):
                runs = {}
                for ecr in rs.check_ecrs:
                    for pol in CHECK_POLICIES:
                        eng.set_placement(pol, _slots(eng, ecr))
                        runs[f"{pol}@{ecr:g}"] = eng.generate(PROMPT, rs.check_tokens).tokens
                if reference is None:
                    reference = next(iter(runs.values()))
                diverge = {k: _first_divergence(v, reference) for k, v in runs.items()}
                eng.set_placement("saem", _slots(eng, rs.check_ecrs[0]))
                counts = counts_match_routing(eng, rs.check_tokens)
                # the mixed layers' logits in this mode (gpu-all is ALL_DEV: no skipped rows)
                device[f"saem@{rs.check_ecrs[0]:g} [{mode}]"] = forced_logits(eng, prompt + reference, len(prompt))
            ok &= all(d is None for d in diverge.values()) and counts["equal"]
            report["modes"][mode] = {"greedy_first_divergence": diverge, "counts": counts}
            _log(f"correctness [{mode}]: greedy identical {sum(d is None for d in diverge.values())}/"
                 f"{len(diverge)}, native counts == routing: {counts['equal']}")
        eng.set_placement("gpu-all", eng.info.n_expert)
        device["gpu-all"] = forced_logits(eng, prompt + reference, len(prompt))
    finally:
        eng.close()
    report["tokens"] = reference
    cpu = _cpu_backend_logits(model, prompt + reference, len(prompt), rs.n_ctx, out)
    top2 = np.sort(cpu, axis=1)[:, -2:]
    # a divergence at a step whose top-2 logits are this close is a rounding tie, not a wrong row
    report["cpu_top1_margin_min"] = float((top2[:, 1] - top2[:, 0]).min())
    report["logits_vs_cpu"] = {}
    for name, logits in device.items():
        err = np.abs(logits - cpu).max(axis=1) / np.maximum(np.abs(cpu).max(axis=1), 1e-30)
        within = bool((err <= LOGIT_RTOL).all())
        same_argmax = bool((logits.argmax(axis=1) == cpu.argmax(axis=1)).all())
        report["logits_vs_cpu"][name] = {"max_rel_err": float(err.max()), "mean_rel_err": float(err.mean()),
                                         "within_tolerance": within, "same_argmax": same_argmax,
                                         "steps": int(len(err))}
        ok &= within
        _log(f"logits {name} vs CPU backend: max rel err {err.max():.2e} (tolerance {LOGIT_RTOL}), "
             f"same argmax every step: {same_argmax}")
    report["ok"] = bool(ok)
    (out / "correctness.json").write_text(json.dumps(report, indent=1) + "\n")
    return bool(ok)


def _cpu_backend_logits(model: Path, seq: list[int], n_prompt: int, n_ctx: int, out: Path) -> np.ndarray:
    """The same sequence's logits from the CPU backend of the same libraries (no GPU visible), cpu-moe."""
    tok_file, npy = out / "_seq.json", out / "_cpu_logits.npy"
    tok_file.write_text(json.dumps(seq))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        subprocess.run([sys.executable, __file__, "logits", "--model", str(model), "--tokens", str(tok_file),
                        "--n-prompt", str(n_prompt), "--n-ctx", str(n_ctx), "--out", str(npy)],
                       check=True, env=env)
        return np.load(npy)
    finally:
        tok_file.unlink(missing_ok=True)
        npy.unlink(missing_ok=True)


def _replay_text(eng: Engine, example, n_tokens: int) -> str:
    """The first ``n_tokens`` tokens of ``example``'s completion, as text (the replayed decode)."""
    toks = eng.llm.tokenize(example.completion.encode(), add_bos=False, special=True)[:n_tokens]
    return eng.llm.detokenize(toks).decode("utf-8", errors="ignore")


def replayed_routing(model: Path, policy: str, examples, n_tokens: int, n_ctx: int):
    """The routing of ``examples`` replayed on ``model`` (each prompt and the first ``n_tokens``
    tokens of its completion) as a TraceSet, recorded by an engine under ``policy``."""
    from saem_gguf.trace import TraceSet

    eng = Engine(EngineConfig(model=model, n_ctx=n_ctx, policy=policy, progress=False, record=True))
    try:
        seqs = []
        for ex in examples:
            eng.replay(ex.prompt, _replay_text(eng, ex, n_tokens))
            seqs.append(eng.sequence_trace())
        return TraceSet(eng.signature(), seqs, source="engine", meta={"model": model.name})
    finally:
        eng.close()


def calibrate(model: Path, rs: RunSizes) -> Path:
    """A profile of the bench model, as a user makes one with ``calibrate`` before choosing a
    placement: the routing of ``rs.calib_examples`` held-out examples (others than the bench's)
    replayed on the GPU (gpu-all: routing does not depend on placement), then calibrate's own
    work (calibrate_cmd.build_profile). Without it static-hot has nothing to place and saem
    neither priors nor a routing sample to choose its layout by (the first run had none)."""
    from saem_gguf.cli.calibrate_cmd import build_profile
    from saem_gguf.defaultmodel.corpus import heldout_examples

    examples = heldout_examples(2 + rs.calib_examples, seed=7)[2:]  # 0, 1: the bench's requests
    ts = replayed_routing(model, "gpu-all", examples, rs.calib_tokens, rs.n_ctx)
    path = model.with_suffix(".profile.json")  # beside the generated model: not one of the run's files
    build_profile(ts).save(str(path))
    return path


def bench(model: Path, rs: RunSizes, out: Path, hw: str) -> None:
    """Per policy x ECR and repetition: the placement set up afresh (the native cache re-made,
    its load-time copies done, as after loading the model), then two requests timed: the first
    (``decode_tps``, a cold cache, as the first device run measured) and a second, other one
    (``decode_tps_warm``: the cache as the first request left it, as a server's second request
    finds it). Hit rate and MB/token per request."""
    from saem_gguf.defaultmodel.corpus import heldout_examples

    first, second = heldout_examples(2, seed=7)
    t = time.perf_counter()
    profile = calibrate(model, rs)
    _log(f"bench model calibrated on {rs.calib_examples} other examples in {time.perf_counter() - t:.1f} s")
    auto = Engine(EngineConfig(model=model, n_ctx=rs.n_ctx, policy="saem", vram_budget=AUTO, progress=False,
                               profile=profile, hw=hw))
    auto_notes = [n for n in auto.notes if "vram-budget" in n or "expert cache" in n]
    auto.close()
    for n in auto_notes:
        _log(n)
    eng = Engine(EngineConfig(model=model, n_ctx=rs.n_ctx, policy="cpu-moe", progress=False, profile=profile,
                              hw=hw))
    try:
        texts = [_replay_text(eng, first, rs.bench_tokens), _replay_text(eng, second, rs.bench_tokens)]
        prompts = [len(eng.prompt_tokens(x.prompt, parse_special=True)) for x in (first, second)]
        configs = [(p, None) for p in BENCH_POLICIES if p in ECR_FREE_POLICIES]
        configs += [(p, e) for e in rs.ecrs for p in BENCH_POLICIES if p not in ECR_FREE_POLICIES]
        rows = {c: {"pp": [], "tg": [], "tg_warm": [], "stats": {}, "stats_warm": {}, "layout": None}
                for c in configs}
        for pol, ecr in configs:  # warm-up: kernels, planner JIT, pages
            eng.set_placement(pol, eng.info.n_expert if ecr is None else _slots(eng, ecr))
            eng.replay(first.prompt, texts[0])
        t0, reps_done = time.perf_counter(), 0
        for rep in range(rs.reps):
            if rep >= 3 and time.perf_counter() - t0 > rs.bench_budget_s:
                break
            for pol, ecr in configs:
                eng.set_placement(pol, eng.info.n_expert if ecr is None else _slots(eng, ecr))
                r = rows[(pol, ecr)]
                res = eng.replay(first.prompt, texts[0])
                r["pp"].append(res.prompt_tokens / res.seconds_prompt)
                r["tg"].append(len(res.tokens) / res.seconds_decode)
                r["stats"] = eng.stats()
                eng.reset_stats()
                res = eng.replay(second.prompt, texts[1])
                r["tg_warm"].append(len(res.tokens) / res.seconds_decode)
                r["stats_warm"] = eng.stats()
                r["layout"] = r["stats"].get("slot_layout")
            reps_done += 1
            _log(f"bench rep {rep + 1}: {time.perf_counter() - t0:.0f} s")
        overlap(eng, rs, out)  # on the same loaded model: one load of the big file less
    finally:
        eng.close()
    results = []
    lines = [f"model: {model.name} ({rs.bench_model.n_layer} layers), calibrated on {rs.calib_examples} other "
             f"examples, cost model {Path(hw).name}; prompts {prompts[0]} and {prompts[1]} tokens, "
             f"{rs.bench_tokens} decode tokens per request, {reps_done} reps",
             "", "| policy | ECR | first request tok/s | hit | MB/token | second request tok/s | hit | MB/token "
             "| prefill tok/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def mean_sd(xs: list[float]) -> tuple[float, float]:
        return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0

    for (pol, ecr), r in rows.items():
        (tg, tg_sd), (tw, tw_sd) = mean_sd(r["tg"]), mean_sd(r["tg_warm"])
        pp = statistics.mean(r["pp"])
        s, w = r["stats"], r["stats_warm"]
        results.append({"policy": pol, "ecr": ecr, "decode_tps": r["tg"], "prefill_tps": r["pp"],
                        "decode_mean": tg, "decode_sd": tg_sd, "prefill_mean": pp,
                        **{k: s.get(k) for k in ("hit_rate", "mb_moved_per_token", "copies", "boundaries")},
                        "decode_tps_warm": r["tg_warm"], "decode_mean_warm": tw, "decode_sd_warm": tw_sd,
                        **{f"{k}_warm": w.get(k) for k in ("hit_rate", "mb_moved_per_token", "copies")},
                        "slot_layout": r["layout"]})
        lines.append(f"| {pol} | {'all' if ecr is None else f'{ecr:.1%}'} | {tg:.1f} ± {tg_sd:.1f} | "
                     f"{s.get('hit_rate', 0):.1%} | {s.get('mb_moved_per_token', 0):.2f} | {tw:.1f} ± {tw_sd:.1f} | "
                     f"{w.get('hit_rate', 0):.1%} | {w.get('mb_moved_per_token', 0):.2f} | {pp:.0f} |")
    table = "\n".join(lines)
    print(table, flush=True)
    (out / "bench.md").write_text(table + "\n")
    (out / "bench.json").write_text(json.dumps({"model": str(model), "spec": asdict(rs.bench_model),
                                                "reps": reps_done, "decode_tokens": rs.bench_tokens,
                                                "hw": str(hw), "profile": profile.name,
                                                "vram_budget_auto": auto_notes,
                                                "results": results}, indent=1) + "\n")


def overlap(eng: Engine, rs: RunSizes, out: Path) -> None:
    """Do async expert copies hide behind decode? Host-timed: each step ends in llama_decode's own
    synchronisation, and ``copies alone`` ends in saem_moe_copy_sync. n-cpu-moe: a static, mixed
    placement (whole layers resident, the rest on the CPU), so the only copies are the ones issued
    here."""
    eng.set_placement("n-cpu-moe", _slots(eng, rs.ecrs[-1]))
    ctx = eng.llm.ctx
    toks = eng.llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    eng.reset_sequence()
    eng.llm.reset()
    eng.llm.eval(toks)
    # re-copy resident experts into their own slots: real copies, unchanged residency
    work = [(layer.index, e, s) for layer in eng.info.moe_layers
            for s, e in enumerate(na.saem_moe_get_slot_owner(ctx, layer.index)) if e >= 0]
    work = work[: rs.overlap_copies]
    if not work:
        raise RuntimeError("overlap: the n-cpu-moe placement left no resident expert to copy")

    def copies() -> None:
        for il, e, s in work:
            na.saem_moe_copy_expert_async(ctx, il, e, s, True)

    def step(with_copies: bool) -> float:
        t = time.perf_counter()
        if with_copies:
            copies()
        eng.llm.eval([toks[-1]])
        return time.perf_counter() - t

    def copy_only() -> float:
        t = time.perf_counter()
        copies()
        na.saem_moe_copy_sync(ctx)
        return time.perf_counter() - t

    # the host time to issue the copies: one call each (above) against the engine's two calls, all
    # copies, then the maps of their layers (saem_moe_copy_experts_async leaves the maps alone)
    batch = np.array(work, np.int32)
    layers = np.unique(batch[:, 0])
    maps = np.array([na.saem_moe_get_slot_map(ctx, int(il)) for il in layers], np.int32)

    def issue(batched: bool) -> float:
        t = time.perf_counter()
        if batched:
            na.saem_moe_copy_experts_async(ctx, batch)
            na.saem_moe_set_slot_maps(ctx, layers, maps)
        else:
            copies()
        dt = time.perf_counter() - t
        na.saem_moe_copy_sync(ctx)
        return dt

    for _ in range(3):  # warm-up
        step(False)
        step(True)
        copy_only()
        issue(True)
    plain, with_c, alone, each, batched = [], [], [], [], []
    for _ in range(rs.overlap_steps):  # interleaved, so drift hits all alike
        plain.append(step(False))
        with_c.append(step(True))
        alone.append(copy_only())
        each.append(issue(False))
        batched.append(issue(True))
    med = statistics.median
    exposed = max(0.0, med(with_c) - med(plain))
    hidden = max(0.0, med(alone) - exposed)
    nbytes = sum(eng.info.moe_layers[0].bytes_per_expert for _ in work)
    rep = {"copies_per_step": len(work), "bytes_per_step": nbytes,
           "step_ms_median": med(plain) * 1e3, "step_with_copies_ms_median": med(with_c) * 1e3,
           "copies_alone_ms_median": med(alone) * 1e3, "exposed_ms": exposed * 1e3,
           "hidden_ms": hidden * 1e3, "hidden_fraction": hidden / med(alone) if med(alone) > 0 else None,
           "copy_GBps": nbytes / med(alone) / 1e9 if med(alone) > 0 else None,
           "issue_one_call_each_ms_median": med(each) * 1e3, "issue_batched_ms_median": med(batched) * 1e3,
           "steps": rs.overlap_steps, "timing": "host perf_counter around synchronising calls"}
    _log(f"overlap: {len(work)} copies ({nbytes / 2**20:.1f} MiB) alone {rep['copies_alone_ms_median']:.2f} ms, "
         f"step {rep['step_ms_median']:.2f} ms -> {rep['step_with_copies_ms_median']:.2f} ms with copies "
         f"(exposed {rep['exposed_ms']:.2f} ms, hidden {rep['hidden_ms']:.2f} ms); issuing them "
         f"{rep['issue_one_call_each_ms_median']:.3f} ms one call each, {rep['issue_batched_ms_median']:.3f} ms batched")
    (out / "overlap.json").write_text(json.dumps(rep, indent=1) + "\n")


def _logits_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--n-prompt", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    eng = _engine(a.model, "cpu-moe", 0.25, a.n_ctx)
    try:
        np.save(a.out, forced_logits(eng, json.loads(a.tokens.read_text()), a.n_prompt))
    finally:
        eng.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["logits"]:
        return _logits_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny models (this machine's CPU build)")
    ap.add_argument("--layers", type=int, default=16, help="layers of the bench model (16)")
    ap.add_argument("--reps", type=int, default=3, help="bench repetitions (3)")
    ap.add_argument("--hw", default=str(FITTED_HW),
                    help="the cost model the policies decide with (default: the profile fitted to the first "
                         "device run, bench/device/fit_device_run.py)")
    ap.add_argument("--models", type=Path, default=None,
                    help="where the generated models are cached (default: the test-model cache)")
    a = ap.parse_args(argv)
    rs = sizes(a.dry_run, a.layers, a.reps)
    a.out.mkdir(parents=True, exist_ok=True)
    gpus = gpu_memory()
    _log("GPUs: " + (", ".join(f"{g.name} {g.description} {g.free_bytes / 2**30:.1f}/"
                               f"{g.total_bytes / 2**30:.1f} GiB free" for g in gpus) or "none"))
    t = time.perf_counter()
    check_model = ensure_model(rs.check_model, a.models)
    _log(f"check model written in {time.perf_counter() - t:.1f} s")
    correct = correctness(check_model, rs, bool(gpus), a.out)
    if not correct:  # measured anyway (device minutes are scarce), but the run fails
        _log("CORRECTNESS FAILED: see correctness.json; the figures below are not valid results")
    t = time.perf_counter()
    bench_model = ensure_model(rs.bench_model, a.models)
    _log(f"bench model ready in {time.perf_counter() - t:.1f} s ({bench_model.stat().st_size / 2**30:.2f} GiB)")
    bench(bench_model, rs, a.out, a.hw)
    return 0 if correct else 1


if __name__ == "__main__":
    raise SystemExit(run_script(main))
