"""Serving throughput and latency: C concurrent clients x M requests each against one `serve`
process on localhost, at each -np, repeated (issue 13, item 6).

    python bench/bench_server.py [-m MODEL] [--np 1,4,8] [--repeat 3] [--clients 8] [--requests 25]
                                 [--max-tokens 32] [--ctx-per-seq 1024] [--json OUT] [-- SERVE FLAGS]

Every request is a streamed chat completion at temperature 0 with ``ignore_eos`` and
``max_tokens``, so each generates exactly that many tokens and the -np values do the same work;
the questions vary by request. Per -np: aggregate generated tokens/s (all completion tokens over
the wall time from the first request sent to the last answer read), time to first token (the
first content chunk) and whole-request latency at p50 and p99, and failed requests (any error or
a short answer). Each -np gets its own server with ``-c`` = ctx-per-seq x np, so every sequence
has the same context, and every server runs with the same flags (serve's own thread rule unless
-t/-tb are passed after --).

The -np values are interleaved within each repetition (1, 4, 8, 1, 4, 8, ...), so a drift in the
machine's load hits all of them alike; the table gives the mean +/- the standard deviation over the
repetitions, the ratio to the first -np taken within each repetition, and the range of the 1-minute
load average seen before and after the runs. Run it on a quiet machine (under the project's
heavy-job lock on a shared one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import httpx2 as httpx  # noqa: E402

from saem_gguf.cli.arg_types import bounded_int, output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from serve_helpers import ServerProcess  # noqa: E402


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float  # time to the first content chunk
    latency_s: float
    completion_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class RunResult:
    n_parallel: int
    requests: int
    failed: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    load_before: float
    load_after: float
    first_error: str | None


def one_request(client: httpx.Client, question: str, max_tokens: int) -> RequestResult:
    """One streamed chat completion. The events are read as the wire has them (a JSON parse only
    until the first content and for the usage): the client's own cost stays small beside the
    server's on a machine the two share."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    done = False
    body = {"model": "bench", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return RequestResult(0.0, time.perf_counter() - t0, 0, f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                elif '"error"' in data[:12]:
                    return RequestResult(0.0, time.perf_counter() - t0, 0, data[:200])
                elif ttft is None and '"content":"' in data and '"content":""' not in data:
                    ttft = time.perf_counter() - t0
                elif '"usage"' in data:
                    tokens = json.loads(data)["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed request is counted, whatever failed
        return RequestResult(0.0, time.perf_counter() - t0, 0, f"{type(e).__name__}: {e}")
    if not done:
        return RequestResult(0.0, time.perf_counter() - t0, tokens, "the stream ended without [DONE]")
    latency = time.perf_counter() - t0
    if tokens != max_tokens:
        return RequestResult(ttft or latency, latency, tokens, f"{tokens} of {max_tokens} tokens")
    return RequestResult(ttft if ttft is not None else latency, latency, tokens)


def run_one(n_parallel: int, args: argparse.Namespace) -> RunResult:
    serve_args = ["-np", str(n_parallel), "-c", str(args.ctx_per_seq * n_parallel),
                  "--queue", str(args.clients * args.requests), *args.serve_args]
    if args.model:
        serve_args = ["-m", args.model, *serve_args]
    server = ServerProcess(serve_args).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=600,
                              limits=httpx.Limits(max_connections=args.clients + 1))
        one_request(client, "Warm up.", 4)  # first-use costs (threads, caches) stay out of the figures
        load_before = os.getloadavg()[0]
        questions = [f"Question {i}: what is {i * 7 % 97} + {i * 13 % 89}?" for i in range(args.clients * args.requests)]
        results: list[RequestResult] = []
        lock = threading.Lock()

        def client_loop(c: int) -> None:
            for r in range(args.requests):
                res = one_request(client, questions[c * args.requests + r], args.max_tokens)
                with lock:
                    results.append(res)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client_loop, range(args.clients)))
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()[0]
    finally:
        rc = server.stop(signal.SIGTERM)
    if rc != 0:
        raise SystemExit(f"error: the server (-np {n_parallel}) exited with {rc}: {server.stderr()[-2000:]}")
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    ttft = np.array([r.ttft_s for r in ok]) if ok else np.zeros(1)
    lat = np.array([r.latency_s for r in ok]) if ok else np.zeros(1)
    tokens = sum(r.completion_tokens for r in results)
    return RunResult(n_parallel, len(results), len(failed), round(wall, 3), tokens, round(tokens / wall, 2),
                     round(float(np.percentile(ttft, 50)), 4), round(float(np.percentile(ttft, 99)), 4),
                     round(float(np.percentile(lat, 50)), 4), round(float(np.percentile(lat, 99)), 4),
                     load_before, load_after, failed[0].error if failed else None)


@dataclass(frozen=True)
class Summary:
    """One -np over the repetitions: means and standard deviations (ddof 1; 0 with one repetition)."""

    n_parallel: int
    repetitions: int
    requests: int  # over every repetition
    failed: int
    tokens_per_s: tuple[float, float]  # (mean, sd)
    ratio: tuple[float, float]  # tokens/s over the first -np's of the same repetition
    ttft_p50_s: tuple[float, float]
    ttft_p99_s: tuple[float, float]
    latency_p50_s: tuple[float, float]
    latency_p99_s: tuple[float, float]
    load_min: float
    load_max: float


def _mean_sd(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, float)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def summarize(reps: list[list[RunResult]]) -> list[Summary]:
    """``reps[r][i]``: repetition r's run of the i-th -np (the first -np is the ratios' base)."""
    out = []
    for i, first in enumerate(reps[0]):
        runs = [rep[i] for rep in reps]
        loads = [x for r in runs for x in (r.load_before, r.load_after)]
        out.append(Summary(
            first.n_parallel, len(runs), sum(r.requests for r in runs), sum(r.failed for r in runs),
            _mean_sd([r.tokens_per_s for r in runs]),
            _mean_sd([r.tokens_per_s / rep[0].tokens_per_s for r, rep in zip(runs, reps)]),
            _mean_sd([r.ttft_p50_s for r in runs]), _mean_sd([r.ttft_p99_s for r in runs]),
            _mean_sd([r.latency_p50_s for r in runs]), _mean_sd([r.latency_p99_s for r in runs]),
            min(loads), max(loads)))
    return out


def table(summaries: list[Summary]) -> str:
    base = summaries[0].n_parallel
    head = (f"{'-np':>4} {'reps':>4} {'requests':>8} {'failed':>6} {'tok/s':>16} {'x -np ' + str(base):>15} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'lat p50':>8} {'lat p99':>8} {'load':>10}")
    rows = [head, "-" * len(head)]
    for s in summaries:
        rows.append(f"{s.n_parallel:>4} {s.repetitions:>4} {s.requests:>8} {s.failed:>6} "
                    f"{s.tokens_per_s[0]:>7.0f} +/- {s.tokens_per_s[1]:<4.0f} "
                    f"{s.ratio[0]:>6.2f} +/- {s.ratio[1]:<4.2f} "
                    f"{s.ttft_p50_s[0] * 1e3:>7.0f}ms {s.ttft_p99_s[0] * 1e3:>7.0f}ms "
                    f"{s.latency_p50_s[0]:>7.2f}s {s.latency_p99_s[0]:>7.2f}s "
                    f"{s.load_min:>4.2f}-{s.load_max:<4.2f}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Flags after -- go to every `serve` (e.g. -- --policy lru --ecr 25%%).")
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded model)")
    p.add_argument("--np", dest="n_parallel", default="1,4,8",
                   help="comma-separated -np values; the first is the ratios' base (1,4,8)")
    p.add_argument("--repeat", type=bounded_int(1, 1000), default=3,
                   help="repetitions, the -np values interleaved within each (3)")
    p.add_argument("--clients", type=bounded_int(1, 256), default=8, help="concurrent clients (8)")
    p.add_argument("--requests", type=bounded_int(1, 100_000), default=25, help="requests per client (25)")
    p.add_argument("--max-tokens", type=bounded_int(1, 100_000), default=32, help="tokens per answer (32)")
    p.add_argument("--ctx-per-seq", type=bounded_int(64, 1 << 20), default=1024,
                   help="context of each sequence; serve gets -c this x np (1024)")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT", help="write the rows as JSON")
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.serve_args = serve_args
    try:
        nps = [int(x) for x in args.n_parallel.split(",") if x.strip()]
    except ValueError:
        p.error(f"--np: expected comma-separated integers, got {args.n_parallel!r}")
    if not nps or any(n < 1 for n in nps):
        p.error(f"--np: every value must be >= 1, got {args.n_parallel!r}")
    reps: list[list[RunResult]] = []
    for rep in range(args.repeat):
        runs = []
        for n in nps:
            print(f"repetition {rep + 1}/{args.repeat}, -np {n}: {args.clients} clients x {args.requests} "
                  f"requests x {args.max_tokens} tokens ...", file=sys.stderr, flush=True)
            runs.append(run_one(n, args))
            print(f"  {runs[-1].tokens_per_s:.0f} tok/s, {runs[-1].failed} failed, load "
                  f"{runs[-1].load_before:.2f}-{runs[-1].load_after:.2f}", file=sys.stderr, flush=True)
        reps.append(runs)
    summaries = summarize(reps)
    print(table(summaries))
    for rep, runs in enumerate(reps):
        for r in runs:
            if r.first_error:
                print(f"repetition {rep + 1}, -np {r.n_parallel}: first failure: {r.first_error}")
    if args.json:
        write_text_atomic(args.json, json.dumps({"config": {k: v for k, v in vars(args).items()},
                                                 "summary": [asdict(s) for s in summaries],
                                                 "runs": [[asdict(r) for r in runs] for runs in reps]}, indent=2, default=str))
    return 1 if any(s.failed for s in summaries) else 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
