"""Per-token placement cost in the live engine (issue 12, item 5: <= 100 us median per token for
every policy at 48 layers x 128 experts x top-8).

    python bench/bench_placement_cost.py [--layers 48] [--experts 128] [--top-k 8] [--ecr 25%]
                                         [-n 200] [--reps 3] [--policies a,b,...] [--parts] [--json OUT]

One process, one generated model of that routing shape (tiny matrices, so llama.cpp's decode is
cheap and the placement's share is visible). For each policy the engine decodes ``-n`` tokens
and ``Placement.on_token`` (read the routing from the native sink, count hits, feed the stage detector(s), run
the policy's one-step entry point, sync the native slot maps and issue copies) is timed around
each call, in wall time and in the calling thread's CPU time (on a loaded machine the wall time
also counts waiting for a core). ``--reps`` repetitions run every policy in turn, so a change of
the machine's load touches all policies alike; per policy the tokens of all repetitions give the
median and p90, and the per-repetition medians show the spread; the load average is printed
with each. The first tokens of each run, which compile nothing but warm caches, are excluded
(``--skip``). Asserts nothing: timings depend on the machine and its load.

Each run is then replayed on a fresh placement of the same policy: the prompt's placement from
its recorded prefill routing, then the recorded tokens' routing and text through one routing
read and ``Placement.on_step`` each, back to back, with no decode between them (``replayed
median``; the same decisions, tests/test_bench_placement_cost.py). The two medians differ only
in what the decode between two tokens leaves behind; the replayed one is the placement's own
work. A third replay waits a token's median time, idle, before each token (``after an idle
token``): it tells the decode's memory traffic from the time passing (on the 2-core development
machine, a virtual machine, idling alone costs as much as a decode: docs/POLICIES_HISTORY.md, per-token
cost). Each policy's median is also given as a share of the whole token (llama.cpp's decode,
sampling, detokenizing and the placement, from one on_token call to the next, in the same run).
``--parts`` adds one more live run per policy and repetition, with clock reads at the joints of
``on_token`` (``part_times``): the median per token of the stage detector, the link meter, the
policy's ``observe``, the native copies and the rest, to tell which part a change should go after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.common import ecr_arg  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.engine import Engine, EngineConfig  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.policies.base import budget_slots  # noqa: E402
from saem_gguf.testmodels import ensure_model  # noqa: E402
from saem_gguf.testmodels.spec import ModelSpec  # noqa: E402

# every policy the engine runs (the wait-for-load caches run as their -cpu variants)
ENGINE_POLICIES = ("cpu-moe", "n-cpu-moe", "static-hot", "lru-cpu", "lfu-cpu", "temporal-cpu", "saem", "saem:uniform",
                   "saem-stage", "saem-strict", "saem-implicit", "saem-cue", "saem-nocpu", "gpu-all")


def timed_tokens(eng: Engine, prompt: str, n: int,
                 periods: list[float] | None = None) -> tuple[list[float], list[float], list[tuple]]:
    """Decode ``n`` tokens; the wall time and this thread's CPU time of each Placement.on_token
    call, in microseconds (on a shared machine the wall time also counts waiting for a core),
    and what ``replayed_tokens`` replays: each prefill ubatch ("prompt", n_tokens, routing) and
    each token ("token", routing, piece), in order. ``periods`` (optional) receives the wall
    time from each on_token call's start to the next one's, the whole token (llama.cpp's
    decode, sampling, detokenizing and the placement) in microseconds: the baseline the
    placement's share is measured against in the same run."""
    pl = eng.placement
    inner = pl.on_token
    inner_prompt = pl.on_prompt
    wall: list[float] = []
    cpu: list[float] = []
    seen: list[tuple] = []

    def on_prompt(n_tokens: int):
        inner_prompt(n_tokens)
        seen.append(("prompt", n_tokens, pl.last_routing()))

    last = [0.0]

    def on_token(piece: bytes):
        # the thread's CPU clock is a system call, about 5 us each after a decode (a per-token
        # A/B, docs/POLICIES.md): it is read outside the wall window, and nothing but the call
        # is inside it
        c = time.thread_time()
        t = time.perf_counter()
        out = inner(piece)
        t_end = time.perf_counter()
        c_end = time.thread_time()
        wall.append((t_end - t) * 1e6)
        cpu.append((c_end - c) * 1e6)
        if periods is not None and last[0]:
            periods.append((t - last[0]) * 1e6)
        last[0] = t
        seen.append(("token", pl.last_routing(), piece))  # after the timed call: the same ubatch's routing
        return out

    pl.on_token, pl.on_prompt = on_token, on_prompt
    try:
        eng.generate(prompt, n_predict=n)
    finally:
        del pl.on_token, pl.on_prompt
    return wall, cpu, seen


def replayed_tokens(eng: Engine, seen: list[tuple], idle_us: float = 0.0) -> list[float]:
    """The same tokens' placement on a fresh placement of the same policy, with no decode
    between them: one routing read and ``Placement.on_step`` with the recorded routing, wall
    microseconds each (native copies and slot maps are real; the prompt's placement is replayed
    first, untimed). Back to back (``idle_us`` 0) the gap to ``timed_tokens`` is what running
    between two decodes costs the same work, not the policy's own work. ``idle_us`` > 0 waits
    that long before each token, spinning on the clock (touching no memory): where that alone
    brings the cost back to the live one, it is the passing time, not the decode's memory
    traffic, that leaves the caches cold (a virtual machine sharing its cores does that)."""
    pl = eng.placement
    seq0 = np.zeros(1, np.int64)
    wall: list[float] = []
    for what, a, b in seen:
        if what == "prompt":
            pl.on_prompt(a, b)
            continue
        if idle_us > 0:
            until = time.perf_counter() + idle_us * 1e-6
            while time.perf_counter() < until:
                pass
        t = time.perf_counter()
        pl.last_routing()
        pl.on_step(a, [b], seq0)
        wall.append((time.perf_counter() - t) * 1e6)
    return wall


PROMPT = "Wait, let me verify: what is 2 + 3?"

# the joints of Placement.on_token that part_times clocks: (part, object attribute, method names)
PARTS = (("detector", "pair", ("feed_checked", "feed")), ("detector", "detector", ("feed_checked", "feed")),
         ("link meter", "link", ("budget", "decided")), ("policy", "policy", ("observe",)),
         ("copies", None, ("_put_in_force",)))
PART_NAMES = ("detector", "link meter", "policy", "copies", "rest")


def part_times(eng: Engine, prompt: str, n: int) -> dict[str, list[float]]:
    """Where each decoded token's placement time goes: one more live run of ``n`` tokens with
    clock reads at the joints of ``Placement.on_token`` (the stage detector or detector pair, the
    link meter, the policy's ``observe``, the native copies and slot maps; "rest" is what the
    call took besides, the routing read and its own Python), in microseconds per token. Its
    clock reads cost time of their own, so its totals are not the wall figures above; the
    shares tell which part a change should go after."""
    pl = eng.placement
    now = time.perf_counter
    acc = dict.fromkeys(PART_NAMES, 0.0)
    wrapped: list[tuple[object, str]] = []
    # the parts being clocked now: a detector's feed calls its own feed_checked, counted once
    running: set[str] = set()

    def clocked(obj, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def call(*args, **kw):
            if part in running:
                return inner(*args, **kw)
            running.add(part)
            t = now()
            try:
                return inner(*args, **kw)
            finally:
                acc[part] += (now() - t) * 1e6
                running.discard(part)
        setattr(obj, name, call)
        wrapped.append((obj, name))

    for part, attr, names in PARTS:
        obj = pl if attr is None else getattr(pl, attr)
        if obj is None or (attr == "detector" and pl.pair is not None):  # the pair runs in its place
            continue
        for name in names:
            clocked(obj, name, part)
    out: dict[str, list[float]] = {k: [] for k in PART_NAMES}
    inner_token = pl.on_token

    def on_token(piece: bytes):
        for k in acc:
            acc[k] = 0.0
        t = now()
        r = inner_token(piece)
        total = (now() - t) * 1e6
        acc["rest"] = total - sum(acc[k] for k in PART_NAMES if k != "rest")
        for k in PART_NAMES:
            out[k].append(acc[k])
        return r

    pl.on_token = on_token
    try:
        eng.generate(prompt, n_predict=n)
    finally:
        for obj, name in [(pl, "on_token")] + wrapped:
            delattr(obj, name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--ecr", type=ecr_arg, default=0.25, help="cache ratio: 25%% or 0.25 (the CLI's one unit)")
    p.add_argument("-n", type=int, default=200, help="decoded tokens per policy")
    p.add_argument("--skip", type=int, default=20, help="first tokens of each run not counted")
    p.add_argument("--reps", type=int, default=3, help="runs of every policy, in turn")
    p.add_argument("--policies", default=",".join(ENGINE_POLICIES),
                   help="comma-separated; saem:uniform is the default saem with the uniform slot layout "
                        "(the budget's slots in every layer, what a model whose experts dominate gets)")
    p.add_argument("--parts", action="store_true",
                   help="also one more live run per policy and repetition with clock reads at the joints of "
                        "the placement (detector, link meter, policy, copies, rest): medians per token")
    p.add_argument("--json", type=output_file, default=None)
    a = p.parse_args(argv)
    path = ensure_model(ModelSpec(n_layer=a.layers, n_expert=a.experts, n_expert_used=a.top_k, expert_pool=8))
    eng = Engine(EngineConfig(model=path, n_ctx=a.n + 64, n_threads=1, ecr=a.ecr, progress=False),
                 log=lambda m: None)
    slots = budget_slots(100.0 * a.ecr, a.experts)  # the default saem may split it unevenly
    policies = a.policies.split(",")
    runs: dict[str, list[dict]] = {pol: [] for pol in policies}
    try:
        print(f"placement per decoded token, {a.layers} layers x {a.experts} experts x top-{a.top_k}, "
              f"{slots} slots per layer, {a.reps} repetitions x {a.n} tokens, load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        for rep in range(a.reps):
            for pol in policies:
                name, _, layout = pol.partition(":")
                args = {"layout": layout} if layout else None
                eng.set_placement(name, int(slots), args)
                periods: list[float] = []
                wall, cpu, seen = timed_tokens(eng, PROMPT, a.n, periods)
                eng.set_placement(name, int(slots), args)
                replay = replayed_tokens(eng, seen)
                eng.set_placement(name, int(slots), args)
                idle = replayed_tokens(eng, seen, statistics.median(periods))
                run = {"wall": wall[a.skip:], "cpu": cpu[a.skip:], "replay": replay[a.skip:], "idle": idle[a.skip:],
                       "period": periods[a.skip:], "loadavg": os.getloadavg()[0]}
                if a.parts:
                    eng.set_placement(name, int(slots), args)
                    run["parts"] = {k: v[a.skip:] for k, v in part_times(eng, PROMPT, a.n).items()}
                runs[pol].append(run)
            print(f"  repetition {rep + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        eng.close()
    rows = []
    for pol, rr in runs.items():
        wall = sorted(x for r in rr for x in r["wall"])
        cpu = sorted(x for r in rr for x in r["cpu"])
        replay = [x for r in rr for x in r["replay"]]
        period = [x for r in rr for x in r["period"]]
        idle = [x for r in rr for x in r["idle"]]
        rep_medians = [statistics.median(r["wall"]) for r in rr]
        loads = [r["loadavg"] for r in rr]
        row = {"policy": pol, "tokens": len(wall), "median_us": round(statistics.median(wall), 1),
               "p90_us": round(wall[int(0.9 * (len(wall) - 1))], 1),
               "cpu_median_us": round(statistics.median(cpu), 1),
               "cpu_p90_us": round(cpu[int(0.9 * (len(cpu) - 1))], 1),
               "replay_median_us": round(statistics.median(replay), 1),
               "idle_replay_median_us": round(statistics.median(idle), 1),
               "token_median_us": round(statistics.median(period), 1),
               "share_of_token": round(statistics.median(wall) / statistics.median(period), 4),
               "rep_median_us": [round(m, 1) for m in rep_medians],
               "loadavg": [round(x, 2) for x in loads]}
        rows.append(row)
        print(f"  {pol:<14} wall median {row['median_us']:>7.1f} us  p90 {row['p90_us']:>7.1f} us  "
              f"CPU median {row['cpu_median_us']:>7.1f} us  p90 {row['cpu_p90_us']:>7.1f} us  "
              f"replayed median {row['replay_median_us']:>6.1f} us, after an idle token "
              f"{row['idle_replay_median_us']:>6.1f} us  "
              f"{100 * row['share_of_token']:.1f} % of the token ({row['token_median_us']:.0f} us)  "
              f"per-run medians {min(rep_medians):.1f}-{max(rep_medians):.1f} us  "
              f"(load {min(loads):.2f}-{max(loads):.2f})", flush=True)
        if a.parts:
            row["parts_median_us"] = {k: round(statistics.median(x for r in rr for x in r["parts"][k]), 1)
                                      for k in PART_NAMES}
            print("  " + " " * 14 + " parts (medians per token, with clock reads): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in row["parts_median_us"].items()) + " us", flush=True)
    if a.json:
        write_text_atomic(a.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
