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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from saem_gguf.cli.common import ecr_arg  # noqa: E402
from saem_gguf.engine import Engine, EngineConfig, SamplingConfig  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.prompts import load_prompts  # noqa: E402
from saem_gguf.serving.batch import BatchRequest, Scheduler  # noqa: E402


def run(args: argparse.Namespace, n_parallel: int, prompts: list[str]) -> tuple[dict, list[list[int]]]:
    n_ctx_seq = args.ctx_per_seq
    eng = Engine(EngineConfig(model=args.model, n_ctx=n_ctx_seq * n_parallel, n_parallel=n_parallel,
                              policy=args.policy, ecr=args.ecr, n_threads=args.threads, progress=False))
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
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx-per-seq", type=int, default=512, help="context tokens per sequence")
    ap.add_argument("--stream", action="store_true",
                    help="read each event as it comes (a second busy thread, as a server has) instead of "
                         "after the last request ended")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parallel = [int(x) for x in args.parallel.split(",")]
    base = load_prompts(None)
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
    sys.exit(main())
