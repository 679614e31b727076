"""Cost of reading one decoded token's routing back from llama.cpp, the engine's per-token hot
call: every MoE layer at once (``saem_moe_get_last_routing``) against one call per layer
(``saem_moe_get_last_ids``, the engine's read before ABI 3).

    python bench/bench_routing_read.py [--layers 48] [--experts 128] [--top-k 8] [--n 2000]

One process, one generated model (Qwen3-30B-A3B's layer count and routing shape, tiny matrices),
the two reads interleaved in rounds on the same decoded token; prints the median per-call time
of each and their ratio. Asserts nothing (timings depend on the machine and its load).
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

from saem_gguf import native_api as na  # noqa: E402
from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.engine import Engine, EngineConfig  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.testmodels import ensure_model  # noqa: E402
from saem_gguf.testmodels.spec import ModelSpec  # noqa: E402


def per_call_us(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--n", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=output_file, default=None)
    a = p.parse_args(argv)
    path = ensure_model(ModelSpec(n_layer=a.layers, n_expert=a.experts, n_expert_used=a.top_k, expert_pool=8))
    eng = Engine(EngineConfig(model=path, n_ctx=256, n_threads=1, ecr=0.25, progress=False), log=lambda m: None)
    eng.generate("What is 2 + 3?", n_predict=4)  # the last ubatch is now one decoded token
    ctx, layers = eng.llm.ctx, eng.placement.moe_layers
    one = na.saem_moe_get_last_routing(ctx, a.layers * a.top_k)
    per = np.array([na.saem_moe_get_last_ids(ctx, il) for il in layers], np.int16).transpose(1, 0, 2)
    if not np.array_equal(one, per):
        raise SystemExit("the two reads disagree")
    cap = one.size
    all_us, per_us = [], []
    for _ in range(a.rounds):
        all_us.append(per_call_us(lambda: na.saem_moe_get_last_routing(ctx, cap), a.n))
        per_us.append(per_call_us(lambda: [na.saem_moe_get_last_ids(ctx, il) for il in layers], max(1, a.n // 20)))
    res = {"layers": len(layers), "top_k": a.top_k, "all_layers_us": round(statistics.median(all_us), 2),
           "per_layer_us": round(statistics.median(per_us), 2)}
    res["ratio"] = round(res["per_layer_us"] / res["all_layers_us"], 1)
    print(f"routing read of one token, {len(layers)} MoE layers x top-{a.top_k}: "
          f"all layers {res['all_layers_us']:.1f} us, per layer {res['per_layer_us']:.1f} us "
          f"({res['ratio']:.1f}x)")
    if a.json:
        write_text_atomic(a.json, json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
