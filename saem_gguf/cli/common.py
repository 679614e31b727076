"""Flags shared by the commands that load a model (llama.cpp-style names) and their validation."""

from __future__ import annotations

import argparse
from pathlib import Path

from saem_gguf.budget import parse_ecr, parse_size
from saem_gguf.numa import NUMA_MODES


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
    g.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
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
        x.add_argument("--vram-budget", type=_size, default=None, metavar="SIZE",
                       help="device memory for the model, e.g. 8G: sizes the expert cache")
    g.add_argument("--profile", type=Path, default=None, metavar="PROFILE.json",
                   help="calibration profile (cue set, thresholds) from `calibrate`")


def add_sampling_args(p: argparse.ArgumentParser, n_predict: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", type=int, default=n_predict,
                   help=f"tokens to generate ({n_predict}; -1 = until end of text)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy, the default)")
