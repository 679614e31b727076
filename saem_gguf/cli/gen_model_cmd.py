"""`gen-model`: write a small real MoE GGUF (random weights, planted routing) for tests and demos."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saem_gguf.budget import format_size
from saem_gguf.errors import SaemError
from saem_gguf.fileio import check_output_path
from saem_gguf.model_check import LLAMA_MAX_EXPERTS, LLAMA_MAX_LAYERS
from saem_gguf.testmodels import ARCHS, EXPERT_TYPES, STAGE_PLANT, ModelSpec, ensure_model, write_model

# the generators whose test models need as many KV heads as heads (testmodels/archs: deepseek2's
# attention after kv_b is MHA; olmoe's)
MHA_ARCHS = ("deepseek2", "olmoe")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gen-model", help="generate a small MoE GGUF test model",
                       description="Write a small, real MoE GGUF that llama.cpp loads: random weights "
                                   "from a seed, a real byte-level BPE vocabulary, ChatML template, and "
                                   "planted routing (each token's group picks its experts).")
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen3moe")
    p.add_argument("--expert-type", choices=EXPERT_TYPES, default="q4_0")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64, help="n_embd (256-multiple for q4_k)")
    p.add_argument("--ff", type=int, default=64, help="expert FFN size (256-multiple for q4_k)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2, help="experts used per token")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None,
                   help=f"KV heads (default: as many as --heads for {' and '.join(MHA_ARCHS)}, whose test models "
                        "need it; else 2)")
    p.add_argument("--dense", action="store_true", help="a dense model (no experts)")
    p.add_argument("--stage-routing", action="store_true",
                   help="plant reasoning-stage vocabulary (compute / check / another way / conclude) "
                        "on separate expert groups, so routing shifts at stage boundaries")
    p.add_argument("--expert-pool", type=int, default=0,
                   help="experts are copies of N distinct random ones (fast big models; 0 = all distinct)")
    p.add_argument("--head-dim", type=int, default=None, help="attention head size (embd / heads)")
    p.add_argument("--fim", action="store_true",
                   help="with Qwen-Coder's fill-in-the-middle tokens (<|fim_prefix|>, ...): a model serve's and "
                        "llama-server's /infill answer, to try an editor plugin against")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="output .gguf (default: the model cache, printed)")
    p.set_defaults(func=run)


# the generators whose dense model llama.cpp loads: the MoE architectures' loaders require experts
DENSE_ARCHS = ("llama",)
MAX_DIM = 1 << 16  # embd, ff and head sizes: far above any test model, far below int overflow


def run(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    if args.output is not None:
        check_output_path(args.output, "gen-model -o")
    try:
        path = write_model(spec, args.output) if args.output else ensure_model(spec)
    except ValueError as e:  # an architecture's own constraint (e.g. olmoe: kv heads == heads)
        raise SaemError(str(e)) from None
    print(f"wrote {spec.arch} model, {format_size(path.stat().st_size)}", file=sys.stderr)
    print(path)
    return 0


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The spec the flags describe, refused with one line if llama.cpp could not load (or would
    abort on) the model it makes."""
    _in_range("--layers", args.layers, 1, LLAMA_MAX_LAYERS)
    _in_range("--embd", args.embd, 1, MAX_DIM)
    _in_range("--ff", args.ff, 1, MAX_DIM)
    _in_range("--heads", args.heads, 1, MAX_DIM)
    if args.kv_heads is None:
        args.kv_heads = args.heads if args.arch in MHA_ARCHS else min(2, args.heads)
    _in_range("--kv-heads", args.kv_heads, 1, args.heads)
    if args.heads % args.kv_heads:
        raise SaemError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} "
                        "(each KV head serves a whole group of query heads)")
    if args.head_dim is not None:
        _in_range("--head-dim", args.head_dim, 2, MAX_DIM)
        if args.head_dim % 2:
            raise SaemError(f"--head-dim {args.head_dim} must be even (RoPE rotates pairs)")
        head_dim = args.head_dim
    else:
        if args.embd % args.heads or (args.embd // args.heads) % 2:
            raise SaemError(f"--embd {args.embd} / --heads {args.heads} is not an even head size: "
                            "give --head-dim")
        head_dim = args.embd // args.heads
    if args.dense:
        if args.arch not in DENSE_ARCHS:
            raise SaemError(f"--dense needs --arch {' or '.join(DENSE_ARCHS)} (llama.cpp's "
                            f"{args.arch} loader requires experts)")
    else:
        _in_range("--experts", args.experts, 1, LLAMA_MAX_EXPERTS)
        _in_range("--top-k", args.top_k, 1, args.experts)
        _in_range("--expert-pool", args.expert_pool, 0, args.experts)
    try:
        return ModelSpec(arch=args.arch, expert_type=args.expert_type, n_layer=args.layers,
                         n_embd=args.embd, n_ff_exp=args.ff, n_expert=args.experts,
                         n_expert_used=args.top_k, n_head=args.heads, n_head_kv=args.kv_heads,
                         head_dim=head_dim, dense=args.dense, seed=args.seed,
                         expert_pool=args.expert_pool, fim=args.fim,
                         planted=STAGE_PLANT if args.stage_routing else ())
    except ValueError as e:
        raise SaemError(str(e)) from None


def _in_range(flag: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise SaemError(f"{flag} {value} is out of range [{lo}, {hi}]")
