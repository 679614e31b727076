"""`simulate`: replay routing traces under each placement policy x ECR x batch size."""

from __future__ import annotations

import argparse
import json
import sys

from saem_gguf.errors import SaemError
from saem_gguf.fileio import PLOT_SUFFIXES, check_output_path, write_text_atomic


def register(sub: argparse._SubParsersAction) -> None:
    from saem_gguf.budget import ECR_HELP
    from saem_gguf.cli.common import ecr_list_arg, int_list_arg
    from saem_gguf.costmodel import DEFAULT_HW, HW_PRESETS, MODEL_PRESETS
    from saem_gguf.policies import DEFAULT_POLICIES, POLICIES

    p = sub.add_parser(
        "simulate", help="replay routing traces under placement policies (hit rate, Load, tokens/s)",
        description="Replay routing traces under each policy x expert cache ratio x batch size and report "
                    "hit rate, adjusted hit rate, Load (MB/token), transfers, CPU-executed expert-tokens and "
                    "estimated tokens/s from a hardware cost model. Policies: " + ", ".join(POLICIES) + ".")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="T", help="trace file (.npz) to replay")
    src.add_argument("--synthetic", action="store_true", help="generate synthetic stage-structured traces")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policy names, or 'all' (default: %(default)s)")
    p.add_argument("--ecr", type=ecr_list_arg, default="3.125%,6.25%,12.5%,25%,50%",
                   help="comma-separated; each an " + ECR_HELP + " (default: %(default)s)")
    p.add_argument("--batch", type=int_list_arg, default=(1,), help="batch sizes, comma-separated (default: 1)")
    p.add_argument("--hw", default=DEFAULT_HW,
                   help=f"hardware: {', '.join(HW_PRESETS)}, measure[:PRESET] (CPU side measured here) "
                        "or FILE.json (default: %(default)s)")
    p.add_argument("--overlap", action="store_true",
                   help="CPU and GPU experts of a layer run concurrently (the paper's runtime; the engine's "
                        "phase-1 native layer runs them one after the other)")
    p.add_argument("--copy-barrier", action="store_true",
                   help="each decode step waits for every copy issued before it (the engine's phase-1 native "
                        "layer: one copy event per step) instead of per-slot readiness")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                   help="model shape for the cost model (default: the preset matching the trace's routing shape)")
    p.add_argument("--quant", default=None, help="quant type of the experts, e.g. Q4_K, Q8_0, BF16 (default: Q4_K)")
    p.add_argument("--calib-trace", metavar="FILE", help="calibration traces (default: hold out --calib-frac)")
    p.add_argument("--calib-frac", type=float, default=0.25,
                   help="share of --trace's sequences held out for calibration (default: %(default)s)")
    p.add_argument("--events", choices=("detector", "cued", "all", "none"), default="detector",
                   help="stage events: run the stage detector over the traces' text and routing (default), "
                        "the recorded boundaries that carry a text cue, all recorded boundaries, or none")
    p.add_argument("--cues", default="general",
                   help="cue set of the stage detector: a built-in name or a cue JSON file (default: %(default)s)")
    from saem_gguf.cli.common import ram_budget_arg, ram_policy_choices

    ram_choosable = ram_policy_choices()
    r = p.add_argument_group("RAM tier projection (docs/RAM_TIER.md)")
    r.add_argument("--ram-budget", type=ram_budget_arg, default=None, metavar="SIZE",
                   help="project a RAM tier of SIZE expert bytes (e.g. 8G) below each VRAM cache: its "
                        "hit rate, disk MB/token and tokens/s with its disk reads (--hw's ssd_read_bw, "
                        "ssd_latency_s), serialised on the critical path (default: off)")
    r.add_argument("--ram-policy", choices=ram_choosable, default=None, metavar="POLICY",
                   help="policy choosing the RAM-resident experts (default: each VRAM policy's, or saem "
                        f"when that one places all or nothing): {', '.join(ram_choosable)}")
    p.add_argument("--plot", metavar="FILE.png", help="write hit rate / tokens/s vs ECR plots")
    p.add_argument("--json", metavar="OUT", help="write all results as JSON ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    g = p.add_argument_group("synthetic traces (with --synthetic)")
    g.add_argument("--seqs", type=int, default=8, help="sequences to replay (default: %(default)s)")
    g.add_argument("--calib-seqs", type=int, default=4,
                   help="calibration sequences, generated with another seed (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--skew", type=float, default=None, help="Zipf exponent of stage affinities")
    g.add_argument("--coherence", type=float, default=None, help="affinity share kept across a boundary")
    g.add_argument("--stage-scale", type=float, default=None, help="multiplies stage lengths")
    g.add_argument("--cue-prob", type=float, default=None, help="share of boundaries that carry a text cue")
    g.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence")
    g.add_argument("--stationary", action="store_true", help="one stage per sequence, no cues (null model)")
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--experts", type=int, default=None)
    g.add_argument("--top-k", type=int, default=None)
    p.set_defaults(func=run)


def _synthetic(args):
    try:
        from saem_gguf.synthetic import SyntheticConfig, make_stage_traces
    except ImportError as e:  # pragma: no cover - module is part of the package
        raise SaemError(f"synthetic traces are not available ({e})") from None
    kw = {}
    for a, f in (("skew", "skew"), ("coherence", "coherence"), ("stage_scale", "stage_len_scale"),
                 ("cue_prob", "cue_prob"), ("prompt_len", "prompt_len"), ("layers", "n_layer"),
                 ("experts", "n_expert"), ("top_k", "top_k")):
        v = getattr(args, a)
        if v is not None:
            kw[f] = v
    if args.seqs < 1:
        raise SaemError("--seqs must be >= 1")
    base = SyntheticConfig(n_sequences=args.seqs, seed=args.seed, stationary=args.stationary, **kw)
    ts = make_stage_traces(base)
    calib = None
    if args.calib_seqs > 0:
        import dataclasses

        calib = make_stage_traces(dataclasses.replace(base, n_sequences=args.calib_seqs, seed=args.seed + 1_000_003))
    return ts, calib


def run(args: argparse.Namespace) -> int:
    from saem_gguf.policies import POLICIES
    from saem_gguf.simulator import RamProjection, SimConfig, default_cost, ram_slots, simulate, split_calibration
    from saem_gguf.trace import load_traces

    pols = tuple(POLICIES) if args.policies.strip() == "all" else tuple(
        x.strip() for x in args.policies.split(",") if x.strip())
    unknown = [x for x in pols if x not in POLICIES]
    if unknown:
        raise SaemError(f"unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    if not pols:
        raise SaemError("no policy to simulate")
    if any(e <= 0 for e in args.ecr):
        raise SaemError("--ecr values must be above 0% (simulate compares caches; 0% is cpu-moe)")
    if not args.batch or any(b < 1 for b in args.batch):
        raise SaemError("--batch values must be >= 1")
    if args.ram_policy is not None and args.ram_budget is None:
        raise SaemError("--ram-policy needs --ram-budget (the RAM tier is off without one)")
    if args.ram_budget == "auto":
        raise SaemError("simulate projects a machine from --hw, not this one: --ram-budget needs a size, "
                        "not auto")
    if not 0 <= args.calib_frac < 1:  # wrong whatever it would have split, --synthetic's traces too
        raise SaemError("--calib-frac must be in [0, 1)")
    if args.json and args.json != "-":
        check_output_path(args.json, "--json")
    if args.plot:
        check_output_path(args.plot, "--plot", suffixes=PLOT_SUFFIXES)

    if args.synthetic:
        ts, calib = _synthetic(args)
        source = "synthetic" + (" (stationary)" if args.stationary else "")
    else:
        ts = load_traces(args.trace)
        source = args.trace
        if args.calib_trace:
            calib = load_traces(args.calib_trace, expect=ts.signature)
        else:
            ts, calib = split_calibration(ts, args.calib_frac)
        if not ts.sequences:
            raise SaemError(f"{args.trace}: no sequences left to replay"
                            + ("" if args.calib_trace else f" after holding out --calib-frac {args.calib_frac}"))

    from saem_gguf.costmodel import get_hw

    hw = get_hw(args.hw).with_switches(args.overlap, args.copy_barrier)
    cost = default_cost(ts, hw, args.model, args.quant)
    # the simulator counts ECR in percent of a layer's experts
    cfg = SimConfig(policies=pols, ecrs=tuple(round(100 * e, 9) for e in args.ecr), batches=tuple(args.batch), events=args.events,
                    cues=args.cues)
    n_runs = len(pols) * len(cfg.ecrs) * len(cfg.batches)
    ram = None
    if args.ram_budget is not None:
        sig = ts.signature
        ram_slots(args.ram_budget, sig.n_layer, sig.n_expert, cost.expert_bytes)  # a budget too small: say so now
        ram = RamProjection(budget_bytes=args.ram_budget, policy=args.ram_policy)

    from tqdm import tqdm

    with tqdm(total=n_runs, file=sys.stderr, disable=args.quiet, unit="run", desc="simulate") as bar:
        res = simulate(ts, cfg, cost, calib=calib, progress=bar.update, ram=ram)
    res.info["source_name"] = source

    if not args.quiet:
        d = cost.describe()
        print(f"traces: {source}: {len(ts.sequences)} sequences, {ts.decoded_tokens} decode tokens, "
              f"{res.info['calibration_sequences']} calibration sequences")
        print(f"cost: {d['model']} on {hw.name}: expert {cost.expert_bytes / 1e6:.2f} MB, transfer "
              f"{d['transfer_us']:.0f} us, GPU {d['gpu_expert_us_1tok']:.1f} us/expert, CPU "
              f"{d['cpu_expert_us_1tok']:.1f} us/expert at 1 token; CPU beats transfer below "
              f"{d['crossover_tokens'] or '>4096'} tokens; CPU/GPU overlap {'on' if hw.cpu_gpu_overlap else 'off'}; "
              f"copies {'block the next step' if hw.copy_barrier else 'ready per slot'}")
        columns = ("hit_rate", "adj_hit_rate", "load_mb_per_token", "cpu_share", "tok_s")
        if ram is not None:
            from saem_gguf.budget import format_size

            row = res.rows[0]
            print(f"RAM tier: {format_size(ram.budget_bytes)} holds {row['ram_slots']}/{ts.signature.n_expert} "
                  f"experts per layer; disk {hw.ssd_read_bw / 1e9:.1f} GB/s, {hw.ssd_latency_s * 1e6:.0f} us per "
                  "read, reads serialised with compute (tok/s +disk)")
            columns += ("ram_hit_rate", "disk_mb_per_token", "tok_s_with_ram")
        print()
        print(res.table(columns))
    if args.json:
        text = json.dumps(res.to_json(), indent=1)
        if args.json == "-":
            print(text)
        else:
            write_text_atomic(args.json, text)
    if args.plot:
        from saem_gguf.plots import plot_results

        plot_results(res, args.plot, title=f"{source}: {cost.model} on {hw.name}")
        if not args.quiet:
            print(f"plot: {args.plot}")
    return 0
