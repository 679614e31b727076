"""Aggregate decode throughput of the continuous-batching scheduler at several -np (issue 13).

    python bench/bench_batch.py [-m MODEL] [--parallel 1,4,8] [--requests 32] [-n 64]
                                [--policy saem] [--ecr 25%] [--threads N] [--json OUT]

For each -np N: one engine loaded with N sequences, every request (the built-in reasoning
prompts, in turn, as chat messages, greedy, ``-n`` tokens each) submitted at once to a
``Scheduler`` of N slots, and the wall time from the first submission to the last final event.
Prints requests, generated tokens, aggregate tokens/s and its ratio to the first -np, the mean
batch size the decode steps ran (tokens / steps), llama_decode calls per step (one per run of
consecutive busy slots), the expert hit rate, with the load average.
By default the main thread sleeps until every request has ended and reads the events after
(the decode loop alone); ``--stream`` reads them as they come, from a second thread that wakes
for each token, as a server's would. Also checks what the scheduler promises: every greedy reply is the same at every -np (a reply
must not depend on what else is in the batch). No HTTP (bench/bench_server.py measures the server).

``--decode-rows 1,4,8`` measures instead what one decode step costs llama.cpp alone: a context of
that many sequences, each with the same chat prompt evaluated, then ``--steps`` calls of
``llama_decode`` with one token of each of B sequences (no sampling, no placement; positions wrap
before ``--max-pos``, so the attention spans stay in one range). Prints the mean and median time
per call, its ratio to the first B's, and rows per second. With ``--threads``/``--threads-batch``
unset, the engine's -t/-tb follow serve's rule (saem_gguf.serving.threads) in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.common import ecr_arg  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.engine import Engine, EngineConfig, SamplingConfig  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.prompts import load_prompts  # noqa: E402
from saem_gguf.serving.batch import BatchRequest, Scheduler  # noqa: E402
from saem_gguf.serving.threads import serve_threads, usable_cpus  # noqa: E402


def engine_config(args: argparse.Namespace, n_parallel: int, n_ctx_seq: int) -> EngineConfig:
    threads = serve_threads(usable_cpus(), args.threads, args.threads_batch)
    return EngineConfig(model=args.model, n_ctx=n_ctx_seq * n_parallel, n_parallel=n_parallel, policy=args.policy,
                        ecr=args.ecr, n_threads=threads.n_threads, n_threads_batch=threads.n_threads_batch,
                        flash_attn=args.flash_attn, progress=False)


def decode_rows(args: argparse.Namespace, rows: list[int], prompt: str) -> list[dict]:
    """Per B in ``rows``: llama_decode of one token of each of B sequences, timed alone."""
    eng = Engine(engine_config(args, max(rows), args.ctx_per_seq))
    lc, ctx = eng._llama_cpp, eng.llm.ctx
    mem = lc.llama_get_memory(ctx)
    tokens = eng.chat_prompt([{"role": "user", "content": prompt}]).tokens
    batch = lc.llama_batch_init(max(len(tokens), max(rows)), 0, 1)

    def decode(seq_rows: list[tuple[int, int, int, bool]]) -> None:
        for i, (seq, tok, pos, logits) in enumerate(seq_rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(seq_rows)
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"error: llama_decode failed on {len(seq_rows)} rows")

    out = []
    try:
        for seq in range(max(rows)):
            decode([(seq, t, j, j == len(tokens) - 1) for j, t in enumerate(tokens)])
        max_pos = min(args.max_pos, eng.n_ctx_seq)
        def back_to_the_prompt() -> int:  # every sequence's cells after its prompt freed
            for seq in range(max(rows)):
                lc.llama_memory_seq_rm(mem, seq, len(tokens), -1)
            return len(tokens)

        for b in rows:
            pos, times = back_to_the_prompt(), []
            for step in range(args.steps + args.steps // 10):  # the first tenth is a warm-up, untimed
                t0 = time.perf_counter()
                decode([(seq, tokens[step % len(tokens)], pos, True) for seq in range(b)])
                if step >= args.steps // 10:
                    times.append(time.perf_counter() - t0)
                pos += 1
                if pos >= max_pos:  # the same attention spans again
                    pos = back_to_the_prompt()
            ms = sorted(t * 1e3 for t in times)
            out.append({"rows": b, "steps": len(ms), "mean_ms": round(sum(ms) / len(ms), 4),
                        "median_ms": round(ms[len(ms) // 2], 4), "rows_per_s": round(b * len(ms) / sum(times), 1),
                        "load_avg_1m": os.getloadavg()[0]})
    finally:
        lc.llama_batch_free(batch)
        eng.close()
    return out


def run(args: argparse.Namespace, n_parallel: int, prompts: list[str]) -> tuple[dict, list[list[int]]]:
    n_ctx_seq = args.ctx_per_seq
    eng = Engine(engine_config(args, n_parallel, n_ctx_seq))
    try:
        sched = Scheduler(eng, n_parallel, queue_max=len(prompts))
        reqs = []
        for p in prompts:
            chat = sched.tokenize_chat([{"role": "user", "content": p}])
            reqs.append(BatchRequest(chat.tokens, args.n_predict, SamplingConfig(), extra_stops=chat.stop))
        sched.start()
        t0 = time.perf_counter()
        handles = [sched.submit(r) for r in reqs]
        if not args.stream:
            sched.stop(drain=True)  # joins the decode thread: this thread sleeps meanwhile
        replies = [[t for ev in h.events(timeout=600) for t in ev.token_ids] for h in handles]
        wall = time.perf_counter() - t0
        sched.stop(drain=True)
        st = sched.stats()
    finally:
        eng.close()
    tokens = sum(len(r) for r in replies)
    row = {"n_parallel": n_parallel, "requests": len(reqs), "tokens": tokens, "seconds": round(wall, 3),
           "tokens_per_s": round(tokens / wall, 1), "mean_batch": st["mean_batch"],
           "decodes_per_step": st["decodes_per_step"],
           "hit_rate": st.get("hit_rate"), "load_avg_1m": os.getloadavg()[0]}
    return row, replies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--parallel", default="1,4,8", help="comma-separated -np values")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--policy", default="saem")
    ap.add_argument("--ecr", type=ecr_arg, default=0.25)
    ap.add_argument("--threads", type=int, default=None, help="-t (default: serve's rule)")
    ap.add_argument("--threads-batch", type=int, default=None, help="-tb (default: serve's rule)")
    ap.add_argument("-fa", "--flash-attn", default="auto", choices=("on", "off", "auto"),
                    help="-fa (auto, as serve)")
    ap.add_argument("--decode-rows", default=None, metavar="B,B,...",
                    help="time llama_decode alone for steps of B one-token rows (see above) instead")
    ap.add_argument("--steps", type=int, default=3000, help="--decode-rows: timed calls per B (3000)")
    ap.add_argument("--max-pos", type=int, default=200, help="--decode-rows: positions wrap here (200)")
    ap.add_argument("--ctx-per-seq", type=int, default=512, help="context tokens per sequence")
    ap.add_argument("--stream", action="store_true",
                    help="read each event as it comes (a second busy thread, as a server has) instead of "
                         "after the last request ended")
    ap.add_argument("--json", type=output_file, default=None)
    args = ap.parse_args()
    parallel = [int(x) for x in args.parallel.split(",")]
    base = load_prompts(None)
    if args.decode_rows:
        rows = decode_rows(args, [int(x) for x in args.decode_rows.split(",")], base[0])
        print(f"{'rows':>4} {'steps':>6} {'mean ms':>8} {'median ms':>9} {'x rows ' + str(rows[0]['rows']):>9} "
              f"{'rows/s':>8} {'load':>5}")
        for r in rows:
            print(f"{r['rows']:>4} {r['steps']:>6} {r['mean_ms']:>8.3f} {r['median_ms']:>9.3f} "
                  f"{r['mean_ms'] / rows[0]['mean_ms']:>9.2f} {r['rows_per_s']:>8.0f} {r['load_avg_1m']:>5.2f}")
        if args.json:
            write_text_atomic(args.json, json.dumps(rows, indent=2) + "\n")
        return 0
    prompts = [base[i % len(base)] for i in range(args.requests)]
    rows, first = [], None
    for n in parallel:
        row, replies = run(args, n, prompts)
        if first is None:
            first = replies
        row["replies_equal_first"] = replies == first
        rows.append(row)
    t1 = rows[0]["tokens_per_s"]
    print(f"{'-np':>4} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'ratio':>6} {'batch':>6} {'decodes':>7} "
          f"{'hit rate':>8} {'same replies':>12} {'load':>5}")
    for r in rows:
        print(f"{r['n_parallel']:>4} {r['requests']:>8} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['tokens_per_s'] / t1:>6.2f} {r['mean_batch']:>6.2f} {r['decodes_per_step']:>7.2f} "
              f"{r['hit_rate'] if r['hit_rate'] is not None else '-':>8} "
              f"{str(r['replies_equal_first']):>12} {r['load_avg_1m']:>5.2f}")
    if args.json:
        write_text_atomic(args.json, json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
