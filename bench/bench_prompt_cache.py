"""What the prompt cache saves: conversations of T turns sent to `serve` (-np 1) as llama-server's
/completion requests, each prompt the previous one of its conversation plus its answer and a new
question (what a chat client sends), N conversations taking turns (a chat between a client's side
requests, two chat windows on one server). Three ways, on the same prompts:

* ``off``: ``cache_prompt`` false, every prompt evaluated whole;
* ``slot``: the cells a slot keeps of its last request (a server with ``--cache-ram 0``);
* ``ram``: those and llama-server's host-memory cache (the default server).

    python bench/bench_prompt_cache.py [-m MODEL] [--turns 6] [--conversations 1] [--repeat 3]
                                       [--max-tokens 48] [--json OUT] [-- SERVE FLAGS]

Per request after each conversation's first: the prompt tokens evaluated (``timings.prompt_n``)
and the prompt's evaluation time (``timings.prompt_ms``, the server's own clock), summed; the
ratios off / slot and off / ram are taken within each repetition (the three runs back to back,
their order rotating), then the mean +/- standard deviation over repetitions. Each run's prompts
start with their own run number, so no run reuses another's cells. Greedy with ``ignore_eos``,
so every run generates the same answers. The 1-minute load average before and after is printed:
run it on a quiet machine.
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

from saem_gguf.cli.arg_types import bounded_int, output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from serve_helpers import ServerProcess  # noqa: E402

SYSTEM = ("You are a careful assistant. Work through each question step by step, check the "
          "arithmetic twice, and give the final answer on its own line.\n")
QUESTIONS = ["What is 47 + 38?", "And 125 - 67?", "Multiply 12 by 14.", "What is 81 divided by 9?",
             "Add 3.5 and 4.25.", "What is 2 to the power 10?", "Is 91 a prime number?", "What is 15 % of 80?"]


def conversations(url: str, turns: int, n_conv: int, max_tokens: int, cache: bool, run: int) -> list[dict]:
    """The timings of every request after each conversation's first, the conversations taking
    turns."""
    prompts = [f"Session {run}.{c}.\n{SYSTEM}" for c in range(n_conv)]
    out = []
    with httpx.Client(timeout=600) as client:
        for t in range(turns):
            for c in range(n_conv):
                prompts[c] += f"User: {QUESTIONS[(t + c) % len(QUESTIONS)]}\nAssistant:"
                r = client.post(url + "/completion", json={"prompt": prompts[c], "n_predict": max_tokens,
                                                           "temperature": 0, "ignore_eos": True, "cache_prompt": cache})
                r.raise_for_status()
                body = r.json()
                if t > 0:
                    out.append({k: body["timings"][k] for k in ("cache_n", "prompt_n", "prompt_ms")})
                prompts[c] += body["content"] + "\n"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded model)")
    p.add_argument("--turns", type=bounded_int(2, 64), default=6, help="turns of each conversation (6)")
    p.add_argument("--conversations", type=bounded_int(1, 16), default=1,
                   help="conversations taking turns on the one slot (1)")
    p.add_argument("--repeat", type=bounded_int(1, 100), default=3, help="repetitions (3)")
    p.add_argument("--max-tokens", type=bounded_int(1, 4096), default=48, help="tokens per answer (48)")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT", help="write every request's timings as JSON")
    p.add_argument("serve_flags", nargs="*", help="flags for serve, after --")
    a = p.parse_args()
    flags = ["-np", "1", "-c", "8192", "--no-warmup", *(["-m", a.model] if a.model else []), *a.serve_flags]
    load = [os.getloadavg()[0]]
    servers = {"ram": ServerProcess(flags).start(), "slot": ServerProcess([*flags, "--cache-ram", "0"]).start()}
    ways = ("off", "slot", "ram")
    runs: list[dict] = []
    try:
        for server in servers.values():  # warm up (kernels, graphs)
            conversations(server.url, 2, 1, a.max_tokens, True, -1)
        for rep in range(a.repeat):
            for way in ways[rep % 3:] + ways[:rep % 3]:
                url = servers["ram" if way == "off" else way].url
                runs.append({"rep": rep, "way": way, "requests": conversations(
                    url, a.turns, a.conversations, a.max_tokens, way != "off", len(runs))})
    finally:
        for server in servers.values():
            server.stop()
    load.append(os.getloadavg()[0])

    def total(rep: int, way: str, key: str) -> float:
        return float(sum(r[key] for r in next(x for x in runs if x["rep"] == rep and x["way"] == way)["requests"]))

    ms = {w: np.array([total(r, w, "prompt_ms") for r in range(a.repeat)]) for w in ways}
    print(f"{a.conversations} conversation(s) of {a.turns} turns, taking turns on one slot; prompt tokens "
          f"evaluated after each first turn: " + ", ".join(f"{w} {total(0, w, 'prompt_n'):.0f}" for w in ways))
    print("prompt time: " + ", ".join(f"{w} {ms[w].mean():.1f} +- {ms[w].std():.1f} ms" for w in ways))
    for w in ("slot", "ram"):
        ratio = ms["off"] / ms[w]
        print(f"off / {w}: {ratio.mean():.2f} +- {ratio.std():.2f} ({a.repeat} repetitions)")
    print(f"load average (1 min) before and after: {load[0]:.2f}, {load[1]:.2f}")
    if a.json:
        write_text_atomic(a.json, json.dumps({"runs": runs, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
