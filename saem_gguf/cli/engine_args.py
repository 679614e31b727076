"""Turn parsed CLI flags into an EngineConfig and an Engine (with progress notes on stderr)."""

from __future__ import annotations

import argparse
import sys

from saem_gguf.engine import Engine, EngineConfig


def engine_config(args: argparse.Namespace, **over) -> EngineConfig:
    kw = dict(model=args.model, n_ctx=args.ctx_size, n_threads=args.threads,
              n_gpu_layers=args.n_gpu_layers, numa=args.numa, policy=getattr(args, "policy", "saem"),
              ecr=getattr(args, "ecr", None), vram_budget=getattr(args, "vram_budget", None),
              profile=getattr(args, "profile", None), seed=getattr(args, "seed", None),
              chat_template=getattr(args, "chat_template", None), verbose=args.verbose,
              progress=not getattr(args, "quiet", False))
    kw.update(over)
    return EngineConfig(**kw)


def open_engine(args: argparse.Namespace, **over) -> Engine:
    quiet = getattr(args, "quiet", False)
    verbose = getattr(args, "verbose", False)

    def log(msg: str) -> None:
        # NUMA notes are details; everything else (cache size, policy, "management off") is shown
        if not quiet and (verbose or not msg.startswith("NUMA")):
            print(f"[saem] {msg}", file=sys.stderr)

    return Engine(engine_config(args, **over), log=log)
