#!/usr/bin/env python3
"""Decode speed of the expert cache vs stock llama.cpp, and expert copy throughput.

    python bench/bench_native.py                 # default model, 5 interleaved repetitions
    python bench/bench_native.py --reps 9 --tokens 128 --threads 1
    python bench/bench_native.py --no-repack     # every mode without extra buffer types (-nr)

One run, one generated model (saem_gguf.testmodels; bigger than the test models), five modes:

  stock    the unpatched llama.cpp build (`python -m saem_gguf build --variant stock`)
  nocache  the patched build, no cache API call at all
  allhost  patched, cache initialised (n_expert/2 slots per layer), every expert on the host
  mixed    patched, half of each layer's experts copied into slots and mapped (resident)
  copy     patched, expert copy throughput host -> slot (sync, and async + sync)

Two libllama builds cannot live in one process (llama-cpp-python binds one library at import), so
every measurement is a fresh worker subprocess (this script with --worker) bound to one build.
Repetitions are interleaved: each repetition runs every mode once, in a rotated order, so slow
drift and other load on the machine hit all modes alike. Each worker loads the model (read into
memory - no mmap, so no page faults while timing -, CPU; with llama.cpp's extra buffer types, as
stock loads it by default: Q4_0 / Q4_K experts repacked on AVX2 CPUs, which the cache then keeps
repacked in its CPU slots; `--no-repack` turns them off in every mode), decodes a prompt and a few warm-up tokens, then times N single-token llama_decode
calls on a fixed token sequence (identical for every mode, so routing - and work - is identical).
Reported, for four speed measures - wall-clock tokens/s; tokens per CPU-second of the worker (robust
to other load sharing the cores; with one decode thread there is no spin-waiting to inflate it);
1 / median and 1 / 10th-percentile per-token latency (each llama_decode timed on its own; the low
percentile is the least disturbed by other processes) - the median per mode, and the median over
repetitions of the per-repetition ratio mode / stock (paired). No assertion: the figures are printed (and written as JSON
with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("stock", "nocache", "allhost", "mixed")


# ------------------------------------------------------------------------------------------------
# worker (one subprocess = one library, one mode)


def _output_file(text: str) -> Path:
    """--json's type: saem_gguf imported here, not at the top, as a --worker binds its library
    before importing it (and gets no --json)."""
    sys.path.insert(0, str(REPO))
    from saem_gguf.cli.arg_types import output_file

    return output_file(text)


def _worker(args: argparse.Namespace) -> int:
    os.environ["SAEM_GGUF_LIB_DIR"] = args.lib
    sys.path.insert(0, str(REPO))
    import ctypes

    import numpy as np

    from saem_gguf.llama_lib import load_llama_cpp

    lc = load_llama_cpp()
    cb = lc.llama_log_callback(lambda level, text, user: None)
    lc.llama_log_set(cb, ctypes.c_void_p(0))

    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    # the same for every mode: stock's default (extra buffer types) unless --no-repack
    mp.use_extra_bufts = not args.no_repack
    mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE: read into memory, no mmap page faults while timing
    model = lc.llama_model_load_from_file(args.model.encode(), mp)
    assert model, "model load failed"
    cp = lc.llama_context_default_params()
    n_tok = args.prompt + args.warmup + args.tokens
    cp.n_ctx = n_tok + 16
    cp.n_batch = cp.n_ubatch = max(args.prompt, 1)
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, cp)
    assert ctx, "context creation failed"
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    rng = np.random.default_rng(1234)
    seq = [int(t) for t in rng.integers(100, n_vocab - 1, size=n_tok)]

    out: dict = {"mode": args.worker}
    if args.worker != "stock":
        from saem_gguf import native_api as na

        infos = [na.saem_moe_get_layer_info(ctx, il) for il in range(na.saem_moe_n_layers(ctx))]
        out["native"] = na.saem_native_version()
        out["repacked"] = any(any(i.repacked) for i in infos)  # the experts are in CPU_REPACK
        if args.worker in ("allhost", "mixed"):
            na.saem_moe_cache_init(ctx, [i.n_expert // 2 for i in infos])
        if args.worker == "mixed":
            for i in infos:
                for s, e in enumerate(range(0, i.n_expert, 2)):  # every other expert: half resident
                    na.saem_moe_copy_expert(ctx, i.il, e, s, update_map=True)
            out["resident"] = sum(na.saem_moe_get_layer_info(ctx, i.il).n_resident for i in infos)
        if args.worker == "copy":
            return _copy_worker(args, lc, ctx, na, infos, out)

    batch = lc.llama_batch_init(max(args.prompt, 1), 0, 1)

    def decode(tokens: list[int], pos0: int) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        rc = lc.llama_decode(ctx, batch)
        assert rc == 0, f"llama_decode: {rc}"

    decode(seq[:args.prompt], 0)
    pos = args.prompt
    for t in seq[pos:pos + args.warmup]:
        decode([t], pos)
        pos += 1
    lc.llama_synchronize(ctx)
    t0, c0 = time.perf_counter(), time.process_time()
    lat = []
    for t in seq[pos:pos + args.tokens]:
        t1 = time.perf_counter()
        decode([t], pos)
        lc.llama_synchronize(ctx)
        lat.append(time.perf_counter() - t1)
        pos += 1
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    # the logits of the last token, to check that every mode computed the same thing
    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    out.update(tok_s=args.tokens / dt, seconds=dt, cpu_tok_s=args.tokens / dc, cpu_seconds=dc,
               p10_tok_s=1.0 / float(np.percentile(lat, 10)), med_tok_s=1.0 / float(np.median(lat)),
               argmax=int(np.argmax(logits)),
               logit_sum=float(np.float64(logits.astype(np.float64).sum())))
    print(json.dumps(out))
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return 0


def _copy_worker(args, lc, ctx, na, infos, out) -> int:
    moe = [i for i in infos if i.n_expert > 0]
    na.saem_moe_cache_init(ctx, [i.n_expert for i in infos])
    # warm the host pages (mmap) and the slots once
    for i in moe:
        for e in range(i.n_expert):
            na.saem_moe_copy_expert(ctx, i.il, e, e, update_map=False)
    for kind in ("sync", "async"):
        nbytes, t0 = 0, time.perf_counter()
        for _ in range(args.copy_rounds):
            for i in moe:
                for e in range(i.n_expert):
                    s = (e + 1) % i.n_expert
                    if kind == "sync":
                        na.saem_moe_copy_expert(ctx, i.il, e, s, update_map=False)
                    else:
                        na.saem_moe_copy_expert_async(ctx, i.il, e, s, update_map=False)
                    nbytes += i.expert_nbytes
        if kind == "async":
            na.saem_moe_copy_sync(ctx)
        dt = time.perf_counter() - t0
        out[f"copy_{kind}_gb_s"] = nbytes / dt / 1e9
        out[f"copy_{kind}_bytes"] = nbytes
    out["expert_nbytes"] = moe[0].expert_nbytes
    out["device"] = moe[0].device
    print(json.dumps(out))
    return 0


# ------------------------------------------------------------------------------------------------
# driver


def _libs(args: argparse.Namespace) -> tuple[str, str]:
    sys.path.insert(0, str(REPO))
    from saem_gguf.build import BuildConfig, build, find_build

    def get(variant: str, override: str | None) -> str:
        if override:
            return override
        cfg = BuildConfig(variant=variant)
        lib = find_build(cfg) or (build(cfg) if args.build else None)
        if lib is None:
            raise SystemExit(f"no {variant} build: run `python -m saem_gguf build"
                             f"{' --variant stock' if variant == 'stock' else ''}` or pass --build")
        return str(lib)

    return get("stock", args.stock_lib), get("saem", args.saem_lib)


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    sys.path.insert(0, str(REPO))
    from saem_gguf.testmodels import ModelSpec, ensure_model

    spec = ModelSpec(arch=args.arch, expert_type=args.quant, n_layer=args.n_layer, n_embd=args.n_embd,
                     n_head=8, n_head_kv=4, head_dim=args.n_embd // 8, n_ff_exp=args.n_ff_exp,
                     n_expert=args.n_expert, n_expert_used=args.n_expert_used, seed=3, name="bench")
    return str(ensure_model(spec))


def _run(mode: str, lib: str, model: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--lib", lib, "--model", model,
           "--tokens", str(args.tokens), "--warmup", str(args.warmup), "--prompt", str(args.prompt),
           "--threads", str(args.threads), "--copy-rounds", str(args.copy_rounds)] + \
        (["--no-repack"] if args.no_repack else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"worker {mode} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    ap.add_argument("--tokens", type=int, default=96, help="timed decode tokens per worker")
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="decode threads (default 1: with other load on the machine, spinning "
                         "worker threads make wall times erratic)")
    ap.add_argument("--copy-rounds", type=int, default=3)
    ap.add_argument("--no-repack", action="store_true",
                    help="llama.cpp's -nr in every mode: no extra buffer types (no repacked experts)")
    ap.add_argument("--model", help="a GGUF (default: a generated MoE model, see --arch etc.)")
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-ff-exp", type=int, default=768)
    ap.add_argument("--n-expert", type=int, default=16)
    ap.add_argument("--n-expert-used", type=int, default=2)
    ap.add_argument("--stock-lib", help="directory of the stock libllama.so (default: cached build)")
    ap.add_argument("--saem-lib", help="directory of the patched libllama.so (default: cached build)")
    ap.add_argument("--build", action="store_true", help="build missing variants")
    ap.add_argument("--json", type=_output_file, help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)

    stock_lib, saem_lib = _libs(args)
    model = _model(args)
    print(f"model: {model} ({os.path.getsize(model) / 1e6:.0f} MB)")
    print(f"stock: {stock_lib}\nsaem:  {saem_lib}")
    print(f"{args.reps} reps x {len(MODES)} modes, {args.tokens} timed tokens each, {args.threads} threads, "
          f"{'no extra buffer types (-nr)' if args.no_repack else 'extra buffer types on (stock default)'}")
    res: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
        for m in order:
            res[m].append(_run(m, stock_lib if m == "stock" else saem_lib, model, args))
        print(f"rep {rep + 1}: " + "  ".join(f"{m} {res[m][-1]['tok_s']:.2f} ({res[m][-1]['cpu_tok_s']:.2f} cpu)"
                                          for m in MODES), flush=True)
    copy = _run("copy", saem_lib, model, args)

    same = {(r["argmax"], round(r["logit_sum"], 3)) for m in MODES for r in res[m]}
    summary = {"model": model, "reps": args.reps, "tokens": args.tokens, "threads": args.threads,
               "no_repack": args.no_repack,
               "same_output_all_modes": len(same) == 1, "modes": {}, "copy": copy}
    for key, title in (("tok_s", "wall-clock tokens/s (timed tokens / wall time)"),
                       ("cpu_tok_s", "tokens per CPU-second (process time)"),
                       ("med_tok_s", "1 / median per-token latency"),
                       ("p10_tok_s", "1 / 10th-percentile per-token latency (least disturbed tokens)")):
        print(f"\n{title}")
        print(f"{'mode':8s} {'median':>9s} {'min':>8s} {'max':>8s} {'x stock (med)':>14s} {'x stock (paired)':>17s}")
        stock_med = statistics.median(r[key] for r in res["stock"])
        for m in MODES:
            v = [r[key] for r in res[m]]
            paired = statistics.median(r[key] / s[key] for r, s in zip(res[m], res["stock"]))
            med = statistics.median(v)
            summary["modes"].setdefault(m, {})[key] = {"values": v, "median": med, "ratio_median": med / stock_med,
                                                      "ratio_paired": paired}
            print(f"{m:8s} {med:9.2f} {min(v):8.2f} {max(v):8.2f} {med / stock_med:14.3f} {paired:17.3f}")
    print(f"\nsame last-token logits in every mode and repetition: {summary['same_output_all_modes']}")
    summary["experts_repacked"] = res["nocache"][0]["repacked"]
    print(f"experts in llama.cpp's repacked layout (CPU_REPACK): {summary['experts_repacked']}")
    if "resident" in res["mixed"][0]:
        print(f"mixed: {res['mixed'][0]['resident']} experts resident in total (half of each layer)")
    print(f"expert copy host -> slot ({copy['device']}, {copy['expert_nbytes'] / 1e6:.2f} MB per expert): "
          f"sync {copy['copy_sync_gb_s']:.2f} GB/s, async+sync {copy['copy_async_gb_s']:.2f} GB/s")
    if args.json:
        from saem_gguf.fileio import write_text_atomic

        write_text_atomic(args.json, json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    if "--worker" not in sys.argv:  # a worker binds its own library before saem_gguf is imported
        sys.path.insert(0, str(REPO))
        from saem_gguf.cli.script import run_script

        raise SystemExit(run_script(main))
    raise SystemExit(main())
