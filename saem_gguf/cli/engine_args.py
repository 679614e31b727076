"""Turn parsed CLI flags into an EngineConfig and an Engine (with progress notes on stderr)."""

from __future__ import annotations

import argparse
import sys

from saem_gguf.cli.common import chat_template_kwargs, placement_policy, rope_config
from saem_gguf.engine import Engine, EngineConfig


def engine_config(args: argparse.Namespace, **over) -> EngineConfig:
    """The EngineConfig of a model command's flags (common.add_model_args / add_placement_args);
    ``over`` replaces fields the command decides itself (bench's policy, trace's recording)."""
    has_placement = hasattr(args, "cpu_moe")
    kw = dict(model=args.model, n_ctx=args.ctx_size, n_threads=args.threads,
              n_threads_batch=args.threads_batch,
              n_gpu_layers=args.n_gpu_layers, n_batch=args.n_batch, n_ubatch=args.n_ubatch,
              flash_attn=args.flash_attn, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
              use_mmap=args.use_mmap, use_mlock=args.mlock, offload_kqv=args.offload_kqv, rope=rope_config(args),
              use_extra_bufts=args.use_extra_bufts, tensor_overrides=tuple(args.tensor_overrides),
              kv_overrides=tuple(args.kv_overrides),
              numa=args.numa, pin_gpu_node=args.pin_gpu_node, hw=args.hw,
              policy=placement_policy(args) if has_placement else "saem",
              n_cpu_moe=args.n_cpu_moe if has_placement else None,
              ecr=getattr(args, "ecr", None), vram_budget=getattr(args, "vram_budget", None),
              profile=getattr(args, "profile", None), seed=getattr(args, "seed", None),
              chat_template=getattr(args, "chat_template", None), chat_template_kwargs=chat_template_kwargs(args),
              verbose=args.verbose,
              ram_budget=getattr(args, "ram_budget", None), ram_policy=getattr(args, "ram_policy", None),
              ram_prefetch=getattr(args, "ram_prefetch", "madvise"),
              ram_route_prefetch=getattr(args, "ram_route_prefetch", True),
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
