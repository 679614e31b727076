"""`calibrate -m MODEL (--prompts FILE | --traces T ...) -o PROFILE.json`: the model's cue set Tmodel,
thresholds, dominant-expert statistics (what static-hot and load-time placement use), the
routing of the stages each kept cue opens (what saem-cue ranks by) and a sample of the routing
itself (what the adaptive saem replays to choose its slot layout)."""

from __future__ import annotations

import argparse
import sys

from saem_gguf.cli.common import add_model_args
from saem_gguf.fileio import check_output_path
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
    p.add_argument("--min-stage-tokens", type=int, default=32,
                   help="cues whose stages are mostly shorter than this are pruned as noise, and the "
                        "runtime detector merges shorter stages (32; the embedded model's stages are "
                        "about 20 tokens: use 12)")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from saem_gguf.cli.trace_cmd import check_n_predict
    from saem_gguf.errors import SaemError

    check_output_path(args.output, "calibrate -o")
    if args.min_stage_tokens < 1:
        raise SaemError("--min-stage-tokens must be >= 1")
    if args.prompts is not None:
        check_n_predict(args.n_predict)
    prof = build_profile(_traces(args), args.cues, args.min_stage_tokens)
    prof.save(args.output)
    kept = ", ".join(c.text for c in prof.cues) or "(none: implicit detection only)"
    profiled = ", ".join(c["text"] for c in prof.stats["cue_profiles"]["cues"]["cues"]) or "(none)"
    print(f"{args.output}: Tmodel = {kept}; saem-cue profiles: {profiled}", file=sys.stderr)
    return 0


def build_profile(ts: TraceSet, cues: str | None = None, min_stage_tokens: int = 32):
    """The profile of ``ts``'s model from its traces (the command's work; bench/device calls it
    too): Tmodel and thresholds, expert counts, saem-cue's stage profiles and the routing sample
    the adaptive saem replays at load. ``cues``: the candidate cue set (default: the family's)."""
    from saem_gguf.engine import FAMILY_CUES
    from saem_gguf.errors import SaemError
    from saem_gguf.simulator import calibration_counts, calibration_sample
    from saem_gguf.stage.calibrate import CalibrationConfig, calibrate_traceset, encode_routing
    from saem_gguf.stage.cues import CueSet

    if not ts.sequences or not any(s.n_tokens for s in ts.sequences):
        raise SaemError("no traced tokens to calibrate on")
    candidates = CueSet.load(cues or FAMILY_CUES.get(ts.signature.arch, "general"))
    prof = calibrate_traceset(ts, candidates, CalibrationConfig(min_stage_tokens=min_stage_tokens))
    counts = calibration_counts(ts, ts.signature.n_layer, ts.signature.n_expert)
    prof.stats["expert_counts"] = counts.astype(int).tolist()
    prof.stats["cue_profiles"] = _cue_profiles(ts, candidates, min_stage_tokens)
    # what the adaptive saem replays itself over at load to choose its slot layout
    sample = calibration_sample(ts)
    if sample.sequences:
        prof.stats["calibration_routing"] = encode_routing(sample)
    return prof


def _cue_profiles(ts: TraceSet, candidates, min_stage_tokens: int) -> dict:
    """saem-cue's part of the profile: the routing of the stages each candidate cue opens, for
    the cues whose profile predicts those stages at least as well as the stage before them
    (cue_profiles.profile_gain, at ECR 25 %), whether or not Tmodel kept them; with their cue
    definitions, so the engine's detector can fire on them under saem-cue."""
    from saem_gguf.policies.cue_profiles import START, cue_stage_counts, detected_cues, profile_gain, to_json
    from saem_gguf.stage.coherence import capacity_of
    from saem_gguf.stage.detector import DetectorConfig, StageDetector

    sig = ts.signature
    L, E = sig.n_layer, sig.n_expert
    events = detected_cues(ts.sequences, lambda: StageDetector(
        1, candidates, DetectorConfig(min_stage_tokens=min_stage_tokens), n_layer=L, n_expert=E,
        top_k=sig.n_expert_used))
    gain = profile_gain(ts.sequences, events, E, capacity_of(E, 0.25))
    keep = [c for c, g in gain.items() if g["keep"]]
    counts = cue_stage_counts(ts.sequences, events, E)
    return {"cues": candidates.subset(keep).to_dict(),
            "counts": to_json({c: counts[c] for c in [*keep, START] if c in counts}),
            "gain": gain}


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
