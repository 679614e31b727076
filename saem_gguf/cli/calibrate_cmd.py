"""`calibrate -m MODEL (--prompts FILE | --traces T ...) -o PROFILE.json`: the model's cue set Tmodel,
thresholds, and dominant-expert statistics (what static-hot and load-time placement use)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from saem_gguf.cli.common import add_model_args
from saem_gguf.trace import TraceSet, check_signature, load_traces


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="build a model's stage profile from traces or prompts",
                       description="Prune candidate cues on frequency, segmentation noise and "
                                   "adjacent-stage coherence (TCseq) over routing traces; write the "
                                   "profile the engine loads with --profile.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=None, help="record traces from these prompts first")
    src.add_argument("--traces", nargs="+", default=None, help="trace files (from `trace`)")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens per prompt (256)")
    p.add_argument("--cues", default=None,
                   help="candidate cue set: built-in name or JSON file (default: general + family)")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from saem_gguf.engine import FAMILY_CUES
    from saem_gguf.stage.calibrate import calibrate_traceset
    from saem_gguf.stage.cues import CueSet

    ts = _traces(args)
    arch = ts.signature.arch
    candidates = CueSet.load(args.cues or FAMILY_CUES.get(arch, "general"))
    prof = calibrate_traceset(ts, candidates)
    counts = np.zeros((ts.signature.n_layer, ts.signature.n_expert))
    for s in ts.sequences:
        for l in range(counts.shape[0]):
            counts[l] += np.bincount(s.experts[:, l, :].ravel(), minlength=counts.shape[1])
    prof.stats["expert_counts"] = counts.astype(int).tolist()
    prof.save(args.output)
    kept = ", ".join(c.text for c in prof.cues) or "(none: implicit detection only)"
    print(f"{args.output}: Tmodel = {kept}", file=sys.stderr)
    return 0


def _traces(args) -> TraceSet:
    if args.traces:
        sets = [load_traces(t) for t in args.traces]
        for t, ts in zip(args.traces[1:], sets[1:]):
            check_signature(ts, sets[0].signature, where=t)
        return TraceSet(sets[0].signature, [s for ts in sets for s in ts.sequences], source="engine")
    from saem_gguf.cli.engine_args import open_engine
    from saem_gguf.cli.trace_cmd import record_traces
    from saem_gguf.prompts import load_prompts

    eng = open_engine(args, record=True, policy="cpu-moe", ecr=0.0)
    try:
        return record_traces(eng, load_prompts(args.prompts), args.n_predict, False, args.quiet)
    finally:
        eng.close()
