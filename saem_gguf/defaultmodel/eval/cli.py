"""``python -m saem_gguf.defaultmodel.evaluate``: run the held-out evaluation, print its table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from saem_gguf.errors import SaemError


def parser() -> argparse.ArgumentParser:
    from saem_gguf.defaultmodel.eval.harness import EvalConfig

    d = EvalConfig(model=Path())
    p = argparse.ArgumentParser(prog="python -m saem_gguf.defaultmodel.evaluate",
                                description="Evaluate a default-model GGUF on held-out problems, "
                                            "conversations and out-of-domain turns (docs/DEFAULT_MODEL.md).")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded model)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"evaluation sets' seed ({d.seed})")
    p.add_argument("--per-kind", type=int, default=d.per_kind,
                   help=f"single-turn problems of each kind ({d.per_kind})")
    p.add_argument("--conversations", type=int, default=d.n_conversations,
                   help=f"three-turn conversations ({d.n_conversations})")
    p.add_argument("--ood", type=int, default=d.n_out_of_domain,
                   help=f"single out-of-domain turns ({d.n_out_of_domain})")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size (default: the model's training context, at most 4096)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per reply ({d.max_tokens})")
    p.add_argument("--capacity", type=float, default=d.capacity_ratio, help="TCseq's cache ratio (0.25)")
    p.add_argument("--perm", type=int, default=d.n_perm,
                   help=f"permutations per TCseq baseline ({d.n_perm}; 0: no TCseq)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--failures", type=int, default=20, help="wrong or malformed turns kept in the JSON (20)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return _run(a)
    except SaemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(a: argparse.Namespace) -> int:
    from saem_gguf.defaultmodel.eval.harness import EvalConfig, evaluate, n_turns
    from saem_gguf.defaultmodel.eval.report import table
    from saem_gguf.default_model import default_model_path
    from saem_gguf.fileio import check_output_path

    for name in ("per_kind", "conversations", "ood", "perm", "failures"):
        if getattr(a, name) < 0:
            raise SaemError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if (a.ctx_size is not None and a.ctx_size < 64) or a.max_tokens < 1:
        raise SaemError("-c must be >= 64 and --max-tokens >= 1")
    if not 0 < a.capacity <= 1:
        raise SaemError(f"--capacity must be in (0, 1], got {a.capacity}")
    if a.json is not None:
        check_output_path(str(a.json), "--json")
    model = a.model or default_model_path()
    if not model.is_file():
        raise SaemError(f"{model}: no such model file")
    cfg = EvalConfig(model=model, seed=a.seed, per_kind=a.per_kind, n_conversations=a.conversations,
                     n_out_of_domain=a.ood, n_ctx=a.ctx_size, max_tokens=a.max_tokens,
                     capacity_ratio=a.capacity, n_perm=a.perm, n_threads=a.threads)
    from tqdm import tqdm

    with tqdm(total=n_turns(cfg), desc="evaluate", unit="turn", file=sys.stderr) as bar:
        res = evaluate(cfg, progress=bar.update, n_failures=a.failures)
    print(table(res))
    print("stages:", json.dumps(res["stages"]))
    if "tcseq" in res:
        t = res["tcseq"]
        print(f"TCseq {t['real']['overall']} (capacity {t['capacity_ratio']}); rows {t['rows']['mean']} "
              f"± {t['rows']['std']} (z {t['rows']['z']}); pooled {t['pooled']['mean']} ± {t['pooled']['std']} "
              f"(z {t['pooled']['z']})")
    print(f"generation {res['generation_seconds']} s, {res['reply_tokens_mean']} tokens per in-domain reply")
    if a.json is not None:
        from saem_gguf.fileio import write_text_atomic

        write_text_atomic(a.json, json.dumps(res, indent=2))
    return 0
