"""Entry point: builds the argparse tree from the subcommand modules and maps errors and signals
to exit codes.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func=run`` with ``run(args) -> int``. A module listed here that is not present yet is skipped,
so parallel work can add commands without touching this file.

Exit codes: 0 done; 1 bad input (one ``error: ...`` line on stderr); 2 usage (argparse);
130 Ctrl-C (SIGINT); 128 + signal for SIGTERM (143) and SIGHUP (129), after the same cleanup as
Ctrl-C (temporary output files removed, the model closed). ``SAEM_DEBUG=1`` re-raises unexpected
exceptions with their traceback instead of the one-line ``internal error``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys

from saem_gguf import __version__
from saem_gguf.cli.llama_env import annotate_help, environment_arguments, underscores_read_as_dashes
from saem_gguf.cli.llama_flags import refuse_llama_flags
from saem_gguf.cli.signals import interrupts_raise
from saem_gguf.errors import SaemError, Terminated, UsageError

# Order is the order shown by --help.
COMMANDS = (
    "chat",
    "generate",
    "serve",
    "bench",
    "inspect",
    "gen_model",
    "trace",
    "calibrate",
    "simulate",
    "build",
)


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line (``error: ...``, exit 2) like every other error; --help has the usage.
    Subcommand parsers are made with the same class."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # a command's parser (the top one has the subcommands): llama.cpp's --flag_name spelling is
        # read, a llama.cpp flag it does not take is refused by name before argparse reads it as
        # something else (llama_flags.py), and llama.cpp's LLAMA_ARG_* variables are read before
        # the command line, as llama.cpp reads them (llama_env.py)
        if args is not None and self._subparsers is None:
            args = underscores_read_as_dashes(self, list(args))
            refuse_llama_flags(self, args)
            args = environment_arguments(self, args) + args
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
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
    for command in sub.choices.values():
        annotate_help(command)
    parser.commands = sub.choices  # name -> the command's parser (main names it in an error)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        # the command modules' imports take a second or more (numpy, numba, gguf)
        parser = build_parser()
        args, extras = parser.parse_known_args(argv)
        if extras:
            # argparse would name the top parser ("python -m saem_gguf: unrecognized arguments");
            # the command's parser names the command whose --help lists what it takes
            parser.commands.get(getattr(args, "command", None), parser).error(
                f"unrecognized arguments: {' '.join(extras)}")
    except KeyboardInterrupt:
        return _interrupted()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "log_disable", False):  # wherever it stands, as llama.cpp pauses its log
        args.quiet, args.verbose = True, False
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    try:
        with interrupts_raise():
            return int(args.func(args) or 0)
    except UsageError as e:
        _fail(str(e))
        return 2
    except SaemError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return _interrupted()
    except Terminated as e:
        print(f"terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, and keep the interpreter's final flush of
        # stdout from raising a second BrokenPipeError at exit
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}")
    except MemoryError:
        return _fail("out of memory (lower -c, or use a smaller model)")
    except Exception as e:  # noqa: BLE001 - a bug must still end in one line, not a traceback
        if os.environ.get("SAEM_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        return _fail(f"internal error ({type(e).__name__}{': ' + first if first else ''}); "
                     "SAEM_DEBUG=1 shows the traceback")


def _interrupted() -> int:
    print("interrupted", file=sys.stderr)
    return 130


MESSAGE_MAX_CHARS = 2000


def _fail(message: str) -> int:
    """One line, whatever the message holds (text from a corrupt file may hold line breaks)."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    if len(line) > MESSAGE_MAX_CHARS:
        line = line[:MESSAGE_MAX_CHARS] + "..."
    print(f"error: {line}", file=sys.stderr)
    return 1
