"""`trace -m MODEL --prompts FILE -o TRACE`: record routing traces (the simulator's format)."""

from __future__ import annotations

import argparse
import sys

from saem_gguf.cli.common import add_model_args
from saem_gguf.cli.engine_args import open_engine
from saem_gguf.errors import SaemError
from saem_gguf.fileio import check_output_path
from saem_gguf.prompts import load_prompts
from saem_gguf.trace import TraceSet, save_traces


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record routing traces of generations (for simulate/calibrate)",
                       description="Generate greedily for each prompt and record, per token, its text "
                                   "piece and every MoE layer's top-k experts, with detected stage "
                                   "boundaries, into one trace file (simulate/calibrate read it).")
    add_model_args(p)
    p.add_argument("--prompts", default=None, help="one prompt per line (default: built-in set)")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens per prompt (256)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    p.set_defaults(func=run)


def check_n_predict(n_predict: int) -> None:
    if n_predict < 1:
        raise SaemError(f"-n {n_predict}: a trace needs at least 1 generated token per prompt")


def record_traces(eng, prompts: list[str], n_predict: int, raw: bool, quiet: bool) -> TraceSet:
    from tqdm import tqdm

    seqs = []
    for prompt in tqdm(prompts, desc="trace", file=sys.stderr, disable=quiet):
        text = prompt if raw or not eng.llm.metadata.get("tokenizer.chat_template") else \
            eng.chat_prompt([{"role": "user", "content": prompt}])
        eng.generate(text, n_predict)
        seqs.append(eng.sequence_trace())
    return TraceSet(eng.signature(), seqs, source="engine",
                    meta={"model": str(eng.path), "n_predict": n_predict})


def run(args: argparse.Namespace) -> int:
    check_output_path(args.output, "trace -o")
    check_n_predict(args.n_predict)
    prompts = load_prompts(args.prompts)
    eng = open_engine(args, record=True, policy="cpu-moe", ecr=0.0)
    try:
        if eng.placement is None:
            raise SaemError(f"{eng.path}: no MoE routing to trace (dense or unsupported model)")
        ts = record_traces(eng, prompts, args.n_predict, args.raw, args.quiet)
    finally:
        eng.close()
    save_traces(ts, args.output)
    n = sum(s.n_tokens for s in ts.sequences)
    stages = sum(len(s.stage_starts) for s in ts.sequences)
    print(f"{args.output}: {len(ts.sequences)} sequences, {n} tokens, {stages} stages", file=sys.stderr)
    return 0
