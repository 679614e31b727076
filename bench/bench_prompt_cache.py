"""What the prompt cache saves: a conversation of T turns sent to one `serve` process (-np 1) as
llama-server's /completion requests, each prompt the previous one plus its answer and a new
question (what a chat client sends), once with ``cache_prompt`` on (the default) and once off.

    python bench/bench_prompt_cache.py [-m MODEL] [--turns 6] [--repeat 3] [--max-tokens 48]
                                       [--json OUT] [-- SERVE FLAGS]

Per turn after the first: the prompt tokens evaluated (``timings.prompt_n``), the ones the cache
served (``cache_n``) and the prompt's evaluation time (``timings.prompt_ms``), the server's own
clock; over the turns, the total prompt time with the cache on and off, their ratio taken within
each repetition (the two runs of a repetition back to back, on vs off alternating first), and
the mean +/- standard deviation over repetitions. Greedy with ``ignore_eos``, so both runs
generate the same answers and send the same prompts. The 1-minute load average before and after
is printed: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import httpx2 as httpx  # noqa: E402

from saem_gguf.cli.arg_types import bounded_int  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from serve_helpers import ServerProcess  # noqa: E402

SYSTEM = ("You are a careful assistant. Work through each question step by step, check the "
          "arithmetic twice, and give the final answer on its own line.\n")
QUESTIONS = ["What is 47 + 38?", "And 125 - 67?", "Multiply 12 by 14.", "What is 81 divided by 9?",
             "Add 3.5 and 4.25.", "What is 2 to the power 10?", "Is 91 a prime number?", "What is 15 % of 80?"]


def conversation(url: str, turns: int, max_tokens: int, cache: bool) -> list[dict]:
    """The timings of each turn's request (the prompt growing by the answer and a question)."""
    prompt, out = SYSTEM, []
    with httpx.Client(timeout=600) as client:
        for t in range(turns):
            prompt += f"User: {QUESTIONS[t % len(QUESTIONS)]}\nAssistant:"
            r = client.post(url + "/completion", json={"prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                                                       "ignore_eos": True, "cache_prompt": cache})
            r.raise_for_status()
            body = r.json()
            out.append({k: body["timings"][k] for k in ("cache_n", "prompt_n", "prompt_ms")})
            prompt += body["content"] + "\n"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded model)")
    p.add_argument("--turns", type=bounded_int(2, 64), default=6, help="turns of the conversation (6)")
    p.add_argument("--repeat", type=bounded_int(1, 100), default=3, help="repetitions (3)")
    p.add_argument("--max-tokens", type=bounded_int(1, 4096), default=48, help="tokens per answer (48)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every turn's timings as JSON")
    p.add_argument("serve_flags", nargs="*", help="flags for serve, after --")
    a = p.parse_args()
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        p.error(f"--json {a.json}: no such folder")
    flags = ["-np", "1", "-c", "8192", "--no-warmup", *(["-m", a.model] if a.model else []), *a.serve_flags]
    load = [os.getloadavg()[0]]
    server = ServerProcess(flags).start()
    runs: list[dict] = []
    try:
        conversation(server.url, 2, a.max_tokens, True)  # warm up (kernels, graphs)
        for rep in range(a.repeat):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for cache in order:
                runs.append({"rep": rep, "cache": cache,
                             "turns": conversation(server.url, a.turns, a.max_tokens, cache)})
    finally:
        server.stop()
    load.append(os.getloadavg()[0])

    def total(rep: int, cache: bool, key: str) -> float:
        run = next(r for r in runs if r["rep"] == rep and r["cache"] == cache)
        return float(sum(t[key] for t in run["turns"][1:]))  # turns after the first

    on = np.array([total(r, True, "prompt_ms") for r in range(a.repeat)])
    off = np.array([total(r, False, "prompt_ms") for r in range(a.repeat)])
    ratio = off / on
    evaluated = [total(0, c, "prompt_n") for c in (True, False)]
    print(f"turns 2-{a.turns}: prompt tokens evaluated {evaluated[0]:.0f} with the cache, {evaluated[1]:.0f} "
          f"without ({total(0, True, 'cache_n'):.0f} served by the cache)")
    print(f"prompt time, turns 2-{a.turns}: cache on {on.mean():.1f} +- {on.std():.1f} ms, off {off.mean():.1f} "
          f"+- {off.std():.1f} ms; off / on {ratio.mean():.2f} +- {ratio.std():.2f} ({a.repeat} repetitions)")
    print(f"load average (1 min) before and after: {load[0]:.2f}, {load[1]:.2f}")
    if a.json:
        write_text_atomic(a.json, json.dumps({"runs": runs, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
