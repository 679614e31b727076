"""llama.cpp's environment variables (``LLAMA_ARG_CTX_SIZE=8192``, ``LLAMA_ARG_NO_MMAP=1``, ...) and
its ``--ctx_size`` spelling, read by the commands that stand for its programs: ``generate``
(llama-completion), ``chat`` (llama-cli) and ``serve`` (llama-server).

Why: a llama-server deployment is often configured by its environment (the llama.cpp Docker
images document it that way), and llama.cpp reads a command line's ``--name_with_underscores`` as
``--name-with-underscores``. This project takes the same configuration the same way.

What llama.cpp does (``common_params_parse_ex`` in ``common/arg.cpp``), and so what is done here:
every option of the program's example that has an ``.set_env(NAME)`` is applied from ``NAME``
first, then the command line is read, so a flag on the command line wins (for a flag that
accumulates, like ``-r``, both count). An option with a negative form (``--mmap``/``--no-mmap``)
reads ``LLAMA_ARG_NO_MMAP`` (set at all: the negative form) before ``LLAMA_ARG_MMAP`` (a truthy
value: on|enabled|true|1; a falsey one: off|disabled|false|0; anything else is an error). A flag
without a value is applied where its variable is truthy and ignored otherwise. A flag given on
the command line that a variable also sets gets llama.cpp's warning line.

Where this differs, on purpose: a variable for an option llama.cpp's program would apply but the
command does not take is refused in one line (exit 2), as the flag itself is on the command line
(``llama_flags.py``), rather than left to change nothing unseen; and a value is checked by the
flag's own parser (``LLAMA_ARG_CTX_SIZE=12abc`` is an error, not llama.cpp's ``stoi`` 12).
The options, their variables and examples are packaged (``data/llama_cpp_env.tsv``; ``python -m
saem_gguf.cli.llama_env`` writes it from the sdist), and a test checks it against the sdist's
``arg.cpp``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from saem_gguf.cli.llama_flags import llama_cpp_flags, sdist_arg_cpp

# which llama.cpp program (its LLAMA_EXAMPLE_*, without the prefix) each command stands for
EXAMPLE_OF_COMMAND = {"generate": "COMPLETION", "chat": "CLI", "serve": "SERVER"}

# variables other tools read too, for what this project never does: left alone rather than refused
# (HF_TOKEN is llama.cpp's -hft, a token for downloads from Hugging Face; nothing is downloaded here)
NOT_READ = frozenset({"HF_TOKEN"})

_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")


@dataclass(frozen=True)
class EnvOption:
    """One llama.cpp option that an environment variable sets."""

    env: str
    flags: tuple[str, ...]  # its spellings, as in arg.cpp
    negative: tuple[str, ...]  # the --no-... spellings of a two-way option; () for the others
    examples: frozenset[str]  # LLAMA_EXAMPLE_* without the prefix; COMMON: every program's
    excludes: frozenset[str]
    kind: str  # its handler's: "void" (a flag), "bool" (two-way), "int", "string", "pair" (two values)

    def applies_to(self, example: str) -> bool:
        return (example in self.examples or "COMMON" in self.examples) and example not in self.excludes

    @property
    def negative_env(self) -> str:
        """llama.cpp's LLAMA_ARG_NO_* twin of a two-way option's variable."""
        return self.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_")

    def value(self, environ: Mapping[str, str]) -> str | None:
        """The variable's text as llama.cpp reads it (``get_value_from_env``): the LLAMA_ARG_NO_*
        twin, set at all, reads as "0"."""
        if self.negative and self.negative_env in environ:
            return "0"
        return environ.get(self.env)

    def is_set(self, environ: Mapping[str, str]) -> bool:
        return self.value(environ) is not None

    def to_row(self) -> str:
        return "\t".join([self.env, " ".join(self.flags), " ".join(self.negative), " ".join(sorted(self.examples)),
                          " ".join(sorted(self.excludes)), self.kind])

    @classmethod
    def from_row(cls, row: str) -> EnvOption:
        env, flags, negative, examples, excludes, kind = row.split("\t")
        return cls(env, tuple(flags.split()), tuple(negative.split()), frozenset(examples.split()),
                   frozenset(excludes.split()), kind)


# ---- reading arg.cpp ------------------------------------------------------------------------------

_OPTION_START = re.compile(r"add_opt\(common_arg\(")
_FLAG_LISTS = re.compile(r'(?:\s*//[^\n]*)*\s*\{([^{}]*)\}(?:\s*,\s*\{([^{}]*)\})?')  # after any comment lines
_STRING = re.compile(r'"([^"\\]*)"')
_ENV = re.compile(r'\.set_env\("([A-Za-z0-9_]+)"\)')
_EXAMPLES = re.compile(r"\.set_(examples|excludes)\((\{[^{}]*\}|\w+)\)")
_EXAMPLE_LIST = re.compile(r"static std::initializer_list<enum llama_example>\s+(\w+)\s*=\s*(\{[^{}]*\})")
_EXAMPLE_NAME = re.compile(r"LLAMA_EXAMPLE_(\w+)")
# the handler lambda's parameters after `common_params &`: what the option reads
_HANDLER = re.compile(r"\[[^\]]*\]\s*\(\s*common_params\s*&\s*\w*\s*(?:,\s*([^)]*))?\)")
_COMMENT = re.compile(r"/\*.*?\*/")


def _handler_kind(chunk: str) -> str:
    params = _HANDLER.search(_COMMENT.sub("", chunk)).group(1)
    if params is None:
        return "void"
    if params.count(",") == 1:
        return "pair"
    return {"int": "int", "bool": "bool"}.get(params.split()[0], "string")


def env_options_in_arg_cpp(source: str) -> list[EnvOption]:
    """Every option of an ``arg.cpp`` text that an environment variable sets, in arg.cpp's order
    (llama.cpp applies them in that order). An option declared once per example (``-np``) is
    listed once per declaration."""
    named_lists = dict(_EXAMPLE_LIST.findall(source))
    starts = [m.end() for m in _OPTION_START.finditer(source)]
    options = []
    for start, end in zip(starts, starts[1:] + [len(source)]):
        chunk = source[start:end]
        env = _ENV.search(chunk)
        if env is None or ".set_preset_only()" in chunk:
            continue
        flags, negative = _FLAG_LISTS.match(chunk).groups()
        sets: dict[str, frozenset[str]] = {"examples": frozenset({"COMMON"}), "excludes": frozenset()}
        for which, listed in _EXAMPLES.findall(chunk):
            sets[which] = frozenset(_EXAMPLE_NAME.findall(named_lists.get(listed, listed)))
        options.append(EnvOption(env.group(1), tuple(_STRING.findall(flags)), tuple(_STRING.findall(negative or "")),
                                 sets["examples"], sets["excludes"], _handler_kind(chunk)))
    return options


@lru_cache(maxsize=1)
def llama_cpp_env_options() -> tuple[EnvOption, ...]:
    text = resources.files("saem_gguf.data").joinpath("llama_cpp_env.tsv").read_text(encoding="utf-8")
    return tuple(EnvOption.from_row(row) for row in text.splitlines() if row)


def options_for(example: str) -> list[EnvOption]:
    """The options whose variables ``example``'s program reads, one per variable: an option arg.cpp
    declares once for one program and once for the rest (``-np`` in an ``if (ex == ...)``) is
    that program's declaration there."""
    chosen: dict[str, EnvOption] = {}
    for option in llama_cpp_env_options():
        if option.applies_to(example):
            earlier = chosen.get(option.env)
            if earlier is None or (example in option.examples and example not in earlier.examples):
                chosen[option.env] = option
    return list(chosen.values())


# ---- applying it to a command's parser ------------------------------------------------------------

def command_example(parser: argparse.ArgumentParser) -> str | None:
    """The llama.cpp example a command's parser stands for, or None (a command of this project's
    own: no environment is read)."""
    return EXAMPLE_OF_COMMAND.get(parser.prog.rsplit(" ", 1)[-1])


def underscores_read_as_dashes(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with a ``--flag_name`` this parser or llama.cpp knows as ``--flag-name`` spelled so,
    as llama.cpp reads every ``--`` argument (on every command: it costs nothing where no llama.cpp
    habit is at stake); values and what follows ``--`` are left as they are."""
    known = parser._option_string_actions
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        if arg.startswith("--") and "_" in name and name not in known:
            dashed = name.replace("_", "-")
            if dashed in known or dashed in llama_cpp_flags():
                arg = dashed + eq + value
        out.append(arg)
    return out


def environment_arguments(parser: argparse.ArgumentParser, args: list[str],
                          environ: Mapping[str, str] | None = None) -> list[str]:
    """The command-line arguments llama.cpp's environment variables stand for, for this command's
    parser, to be read before ``args`` (so that ``args`` win). A variable llama.cpp would apply
    that the command cannot take, or a value its flag refuses, is a usage error naming the
    variable (but for ``NOT_READ``'s). For each flag in ``args`` that a variable also sets, llama.cpp's
    warning line."""
    example = command_example(parser)
    if example is None:
        return []
    environ = os.environ if environ is None else environ
    given = set(args[:args.index("--")] if "--" in args else args)
    given |= {a.split("=", 1)[0] for a in given if a.startswith("--")}
    out: list[str] = []
    for option in options_for(example):
        value = option.value(environ)
        if value is None or option.env in NOT_READ:
            continue
        flags = _arguments_for(parser, option, value)
        if not flags:
            continue
        for flag in (*option.flags, *option.negative):
            if flag in given:
                print(f"warn: {option.env} environment variable is set, but will be overwritten by command line "
                      f"argument {flag}", file=sys.stderr)
                break
        out += flags
    return out


def _arguments_for(parser: argparse.ArgumentParser, option: EnvOption, value: str) -> list[str]:
    """What the variable of ``option`` holding ``value`` stands for on this parser's command line,
    as llama.cpp's handler of that kind reads it."""
    name = f"{option.env}={value}"
    spellings = option.flags
    if option.kind == "bool":  # the value picks the form
        if value in _FALSEY:
            spellings = option.negative
        elif value not in _TRUTHY:
            parser.error(f"environment variable {name}: invalid boolean value (on|enabled|true|1 or "
                         f"off|disabled|false|0)")
    elif option.kind == "void" and value not in _TRUTHY:
        return []  # a flag and a variable that is not truthy: nothing applied, as there
    ours = parser._option_string_actions
    flag = next((f for f in reversed(spellings) if f in ours), None)
    if flag is None:
        command = parser.prog.rsplit(" ", 1)[-1]
        parser.error(f"environment variable {name} sets llama.cpp's {spellings[-1]}, which {command} does not "
                     f"take (unset it)")
    action = ours[flag]
    if action.nargs == 0:
        return [flag]
    try:
        parser._get_values(action, [value])  # the flag's own check, so that the error names the variable
    except argparse.ArgumentError as e:
        parser.error(f"environment variable {name}: {e.message}")
    # --flag=value: a value that begins with "-" (LLAMA_ARG_N_PREDICT=-1) stays a value
    return [f"{flag}={value}"] if flag.startswith("--") else [flag, value]


def annotate_help(parser: argparse.ArgumentParser) -> None:
    """Each flag's help ends with its variable, as llama.cpp's ``--help`` shows ``(env: ...)``."""
    example = command_example(parser)
    if example is None:
        return
    for option in options_for(example):
        action = next((parser._option_string_actions[f] for f in (*option.flags, *option.negative)
                       if f in parser._option_string_actions), None)
        if action is None or action.help in (None, argparse.SUPPRESS) or "(env: " in action.help:
            continue
        names = option.env + (f", {option.negative_env}" if option.negative else "")
        action.help += f" (env: {names})"


if __name__ == "__main__":  # regenerate the packaged table from the sdist
    from saem_gguf.build.source import fetch_sdist

    out = Path(__file__).resolve().parent.parent / "data" / "llama_cpp_env.tsv"
    rows = [o.to_row() for o in env_options_in_arg_cpp(sdist_arg_cpp(fetch_sdist(quiet=True)))]
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    print(out)
