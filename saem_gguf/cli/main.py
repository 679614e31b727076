"""Entry point: builds the argparse tree from the subcommand modules and maps errors to exit codes.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func=run`` with ``run(args) -> int``. A module listed here that is not present yet is skipped,
so parallel work can add commands without touching this file.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from saem_gguf import __version__
from saem_gguf.errors import SaemError, UsageError

# Order is the order shown by --help.
COMMANDS = (
    "chat",
    "generate",
    "bench",
    "inspect",
    "gen_model",
    "trace",
    "calibrate",
    "simulate",
    "build",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m saem_gguf",
        description=(
            "Stage-aware expert management for Mixture-of-Experts GGUF models: "
            "per-expert GPU residency that follows the reasoning, on a patched llama.cpp."
        ),
    )
    parser.add_argument("--version", action="version", version=f"saem_gguf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"saem_gguf.cli.{name}_cmd")
        except ModuleNotFoundError as e:
            if e.name == f"saem_gguf.cli.{name}_cmd":
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SaemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
