"""Flags shared by the commands that load a model (llama.cpp-style names) and their validation."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from saem_gguf.budget import AUTO, parse_ecr, parse_size
from saem_gguf.numa import NUMA_MODES

if TYPE_CHECKING:
    from saem_gguf.engine import SamplingConfig


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _ecr(text: str) -> float:
    from saem_gguf.errors import SaemError

    try:
        return parse_ecr(text)
    except SaemError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    from saem_gguf.errors import SaemError

    try:
        return parse_size(text)
    except SaemError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _vram_budget(text: str) -> int | str:
    return AUTO if text.strip().lower() == AUTO else _size(text)


def add_model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    g = p.add_argument_group("model (llama.cpp flags)")
    g.add_argument("-m", "--model", type=Path, required=model_required, default=None,
                   help="GGUF model" + ("" if model_required else " (default: the embedded model)"))
    g.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, help="context size (4096)")
    g.add_argument("-t", "--threads", type=_positive_int, default=None,
                   help="CPU threads for non-resident experts (default: all cores of the node)")
    g.add_argument("-ngl", "--n-gpu-layers", type=int, default=99,
                   help="layers whose non-expert weights go to the GPU (99 = all; CPU builds ignore it)")
    g.add_argument("--numa", choices=NUMA_MODES, default="off",
                   help="NUMA: isolate = pin expert threads and weights to the GPU-local node")
    g.add_argument("--verbose", action="store_true", help="llama.cpp's log and placement details")
    g.add_argument("--quiet", action="store_true", help="no progress bars or notes")


def add_placement_args(p: argparse.ArgumentParser, multi: bool = False) -> None:
    from saem_gguf.policies import POLICIES

    g = p.add_argument_group("expert placement")
    if multi:
        g.add_argument("--policies", default="cpu-moe,lru,saem",
                       help=f"comma-separated policies ({', '.join(POLICIES)})")
        g.add_argument("--ecr", default="0.125,0.25,0.5",
                       help="comma-separated expert cache ratios (fractions or NN%%)")
    else:
        g.add_argument("--policy", choices=sorted(POLICIES), default="saem", metavar="POLICY",
                       help=f"placement policy (default saem): {', '.join(POLICIES)}")
        x = g.add_mutually_exclusive_group()
        x.add_argument("--ecr", type=_ecr, default=None, metavar="R",
                       help="expert cache ratio: slots per layer / n_expert (default 0.25)")
        x.add_argument("--vram-budget", type=_vram_budget, default=None, metavar="SIZE",
                       help="device memory for the model, e.g. 8G, or auto (free GPU memory at start "
                            "minus a margin; the default when a GPU is present): sizes the expert cache")
    g.add_argument("--profile", type=Path, default=None, metavar="PROFILE.json",
                   help="calibration profile (cue set, thresholds) from `calibrate`")


def _finite_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def _unit_float(text: str) -> float:
    v = _finite_float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return v


def _int_at_least(minimum: int, meaning: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{meaning}, got {v}")
        return v

    return parse


def _seed(text: str) -> int | None:
    """llama.cpp's -s: an unsigned 32-bit seed; -1 (= 4294967295) asks for a random one (None)."""
    from saem_gguf.engine import SEED_RANDOM

    v = _int_at_least(-1, " (-1 = a random seed)")(text)
    if v in (-1, SEED_RANDOM):
        return None
    if v > SEED_RANDOM:
        raise argparse.ArgumentTypeError(f"must be at most {SEED_RANDOM - 1}, or -1 for a random seed; got {v}")
    return v


def add_sampling_args(p: argparse.ArgumentParser, n_predict: int = 256) -> None:
    """llama.cpp's sampling flags (common/arg.cpp names and meanings), sampled by llama-cpp-python's
    chain; the one different default is --temp 0 (greedy)."""
    g = p.add_argument_group("sampling (llama.cpp flags; the default --temp 0 is greedy, unlike "
                             "llama.cpp's 0.8)")
    g.add_argument("-n", "--predict", "--n-predict", dest="n_predict", default=n_predict, metavar="N",
                   type=_int_at_least(-1, " (-1 = until the context is full)"),
                   help=f"tokens to generate ({n_predict}; -1 = until end of generation or a "
                                     "full context; capped at the room the context has left)")
    g.add_argument("--temp", "--temperature", dest="temp", type=_finite_float, default=0.0, metavar="N",
                   help="temperature (default 0 = greedy; llama.cpp's default is 0.8; <= 0 is greedy)")
    g.add_argument("--top-k", type=int, default=40, metavar="N", help="top-k sampling (40, 0 = disabled)")
    g.add_argument("--top-p", type=_unit_float, default=0.95, metavar="N",
                   help="top-p sampling (0.95, 1.0 = disabled)")
    g.add_argument("--min-p", type=_unit_float, default=0.05, metavar="N",
                   help="min-p sampling (0.05, 0.0 = disabled)")
    g.add_argument("--typical", "--typical-p", dest="typical", type=_unit_float, default=1.0, metavar="N",
                   help="locally typical sampling, parameter p (1.0 = disabled)")
    g.add_argument("--repeat-last-n", type=_int_at_least(0), default=64, metavar="N",
                   help="last n tokens to consider for penalize (64, 0 = disabled)")
    g.add_argument("--repeat-penalty", type=_finite_float, default=1.0, metavar="N",
                   help="penalize repeat sequence of tokens (1.0 = disabled)")
    g.add_argument("--presence-penalty", type=_finite_float, default=0.0, metavar="N",
                   help="repeat alpha presence penalty (0.0 = disabled)")
    g.add_argument("--frequency-penalty", type=_finite_float, default=0.0, metavar="N",
                   help="repeat alpha frequency penalty (0.0 = disabled)")
    g.add_argument("-s", "--seed", type=_seed, default=None, metavar="SEED",
                   help="RNG seed: any value is a fixed seed, 0 too (default -1: a random one, shown by "
                        "--verbose and --json)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ignore end-of-generation tokens and continue generating")
    g.add_argument("-r", "--reverse-prompt", dest="reverse_prompt", action="append", default=[],
                   metavar="PROMPT", help="stop generating at PROMPT (the text ends before it); repeatable")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat")
    g.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None, metavar="PROMPT",
                   help="system prompt (with the model's chat template)")
    g.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="chat template for a GGUF without one (or to replace it): a Jinja file, or the "
                        "name of a llama-cpp-python chat format (chatml, llama-2, llama-3, gemma, ...); "
                        "without both, llama-cpp-python's fallback llama-2 is used")


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    from saem_gguf.engine import SamplingConfig

    return SamplingConfig(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          typical_p=args.typical, repeat_penalty=args.repeat_penalty,
                          repeat_last_n=args.repeat_last_n, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, ignore_eos=args.ignore_eos,
                          stop=tuple(args.reverse_prompt))
