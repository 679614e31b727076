"""`bench`: every policy x ECR in one process, same prompts, repetitions interleaved.

One model load; between configurations only the native expert cache is re-initialised, so the
comparison is on the same weights, threads and build. Prints a llama-bench-like table with ratios
to the first policy (at the same ECR), and JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from saem_gguf.budget import ECR_HELP
from saem_gguf.cli.common import add_model_args, add_ram_tier_args, ecr_list_arg
from saem_gguf.cli.engine_args import open_engine
from saem_gguf.errors import SaemError
from saem_gguf.fileio import check_output_path, write_text_atomic
from saem_gguf.prompts import load_prompts


def register(sub: argparse._SubParsersAction) -> None:
    from saem_gguf.policies import POLICIES

    p = sub.add_parser("bench", help="compare placement policies x expert cache ratios",
                       description="Benchmark placement policies and ECRs on one model in one "
                                   "process (repetitions interleaved).")
    add_model_args(p)
    p.add_argument("--policies", default="cpu-moe,lru,static-hot,saem",
                   help=f"comma-separated ({', '.join(POLICIES)}); the first is the baseline")
    p.add_argument("--ecr", type=ecr_list_arg, default="12.5%,25%,50%",
                   help="comma-separated; each an " + ECR_HELP + " (default: %(default)s)")
    p.add_argument("--profile", default=None, metavar="PROFILE.json",
                   help="calibration profile (cues, thresholds, expert counts for static-hot)")
    p.add_argument("-p", "--n-prompt", type=int, default=None,
                   help="use one synthetic prompt of this many tokens instead of the prompt set")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens generated per prompt (64)")
    p.add_argument("--prompts", default=None, help="file with one prompt per line (default: built-in)")
    p.add_argument("--max-prompts", type=int, default=3, help="prompts used from the set (3)")
    p.add_argument("--replay", action="store_true",
                   help="teacher-forced decode of generated reasoning texts (stage cues included) "
                        "instead of free generation: routing follows a real stage structure even on "
                        "a random-weight model; -n is ignored")
    p.add_argument("--reps", type=int, default=2, help="repetitions (2)")
    add_ram_tier_args(p)
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write JSON here")
    p.set_defaults(func=run)


def _split(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise SaemError(f"--{what}: give at least one value")
    return items


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from saem_gguf.policies import POLICIES

    policies = _split(args.policies, "policies")
    for p in policies:
        if p not in POLICIES:
            raise SaemError(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
    ecrs = args.ecr
    if args.reps < 1 or args.n_predict < 1:
        raise SaemError("--reps and -n must be >= 1")
    if args.max_prompts < 1 or (args.n_prompt is not None and args.n_prompt < 1):
        raise SaemError("--max-prompts and -p must be >= 1")
    if args.json_out:
        check_output_path(args.json_out, "--json")
    eng = open_engine(args, policy=policies[0], ecr=ecrs[0])
    try:
        if not eng.info.is_moe:
            raise SaemError(f"{eng.info.architecture} is a dense model: nothing to compare")
        prompts = _prompts(eng, args)
        configs = [(pol, ecr) for ecr in ecrs for pol in policies]
        rows: dict[tuple[str, float], dict] = {c: {"pp": [], "tg": [], "stats": [], "texts": None}
                                                for c in configs}
        # warm-up: JIT-compiled planner kernels, caches and pages are ready before anything is timed
        for pol, ecr in configs:
            eng.set_placement(pol, round(ecr * eng.info.n_expert))
            if args.replay:
                eng.replay(prompts[0][0], prompts[0][1][:40])
            else:
                eng.generate(prompts[0], min(8, args.n_predict))
        bar = tqdm(total=args.reps * len(configs) * len(prompts), desc="bench", file=sys.stderr,
                   disable=args.quiet)
        for _rep in range(args.reps):
            for pol, ecr in configs:
                slots = round(ecr * eng.info.n_expert)
                eng.set_placement(pol, slots)
                pp_tok = pp_s = tg_tok = tg_s = 0.0
                texts = []
                for prompt in prompts:
                    res = eng.replay(*prompt) if args.replay else eng.generate(prompt, args.n_predict)
                    pp_tok += res.prompt_tokens
                    pp_s += res.seconds_prompt
                    tg_tok += len(res.tokens)
                    tg_s += res.seconds_decode
                    texts.append(res.tokens)
                    bar.update(1)
                r = rows[(pol, ecr)]
                r["pp"].append(pp_tok / pp_s if pp_s else 0.0)
                r["tg"].append(tg_tok / tg_s if tg_s else 0.0)
                r["stats"] = eng.stats()
                r["texts"] = r["texts"] or texts
        bar.close()
    finally:
        eng.close()
    table, out = _report(rows, configs, policies, args, eng)
    print(table)
    if args.json_out:
        write_text_atomic(args.json_out, json.dumps(out, indent=2))
    return 0


def _prompts(eng, args) -> list:
    if args.replay:
        from saem_gguf.defaultmodel.corpus import heldout_examples

        return [(e.prompt, e.completion) for e in heldout_examples(max(1, args.max_prompts), seed=7)]
    if args.n_prompt:
        base = "Let me think step by step. First, compute the sum. Wait, check it again. "
        toks: list[int] = []
        while len(toks) < args.n_prompt:
            toks += eng.llm.tokenize(base.encode(), add_bos=False)
        return [eng.llm.detokenize(toks[: args.n_prompt]).decode("utf-8", errors="ignore")]
    prompts = load_prompts(args.prompts)[: max(1, args.max_prompts)]
    if eng.llm.metadata.get("tokenizer.chat_template"):
        prompts = [eng.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    return prompts


def _report(rows, configs, policies, args, eng):
    base_pol = policies[0]
    lines = ["| policy | ECR | pp t/s | tg t/s | tg vs " + base_pol + " | hit rate | MB/token | "
             "boundaries | same output |",
             "|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    out = {"model": str(eng.path), "n_predict": args.n_predict, "reps": args.reps,
           "baseline": base_pol, "results": []}
    for pol, ecr in configs:
        r = rows[(pol, ecr)]
        base = rows[(base_pol, ecr)]
        pp, tg = statistics.median(r["pp"]), statistics.median(r["tg"])
        tg_base = statistics.median(base["tg"])
        s = r["stats"]
        same = r["texts"] == base["texts"]
        lines.append(f"| {pol} | {ecr:.1%} | {pp:.1f} | {tg:.2f} | {tg / tg_base if tg_base else 0:.2f}x | "
                     f"{s.get('hit_rate', 0):.1%} | {s.get('mb_moved_per_token', 0):.3f} | "
                     f"{s.get('boundaries', 0)} | {'yes' if same else 'NO'} |")
        out["results"].append({"policy": pol, "ecr": ecr, "pp_tps": r["pp"], "tg_tps": r["tg"],
                               "tg_ratio": tg / tg_base if tg_base else None, "same_output": same,
                               **{k: s.get(k) for k in ("hit_rate", "mb_moved_per_token", "boundaries",
                                                        "copies", "bytes_moved", "slots_per_layer")},
                               **{k: v for k, v in s.items() if k.startswith("ram_")}})  # the RAM tier's
    return "\n".join(lines), out
