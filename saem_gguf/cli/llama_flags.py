"""llama.cpp's own command-line flags (every spelling in the vendored ``common/arg.cpp``), so that
one this project does not take is refused by name, in one line, before argparse reads it.

Why: argparse reads an unknown llama.cpp flag as something else. ``-cb`` (llama.cpp's
``--cont-batching``) becomes ``-c b`` ("invalid int value: 'b'"), ``-sp`` becomes ``-s p``, ``-md
DRAFT.gguf`` becomes ``-m d`` and an unrecognised ``DRAFT.gguf``. A llama.cpp user pasting a command
line gets, instead, "``-md`` is a llama.cpp flag that ``serve`` does not take". The list is
packaged (``data/llama_cpp_flags.txt``; ``python -m saem_gguf.cli.llama_flags`` writes it from the
sdist), and a test checks it against the sdist's ``arg.cpp``.
"""

from __future__ import annotations

import argparse
import re
import tarfile
from functools import lru_cache
from importlib import resources
from pathlib import Path

# common_arg({"-x", "--xx"}, ...) and common_arg({"--xx"}, {"--no-xx"}, ...): the flag lists
_COMMON_ARG = re.compile(r'common_arg\(\s*\{([^{}]*)\}(?:\s*,\s*\{([^{}]*)\})?')
_STRING = re.compile(r'"([^"\\]*)"')


def flags_in_arg_cpp(source: str) -> list[str]:
    """Every flag spelling declared in an ``arg.cpp`` text, sorted."""
    found: set[str] = set()
    for m in _COMMON_ARG.finditer(source):
        for group in m.groups():
            if group:
                found.update(s for s in _STRING.findall(group) if s.startswith("-"))
    return sorted(found)


def sdist_arg_cpp(sdist: Path) -> str:
    """``common/arg.cpp`` of the vendored llama.cpp in a llama-cpp-python sdist."""
    from saem_gguf.build.source import VENDOR_PREFIX

    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(VENDOR_PREFIX + "common/arg.cpp")
        assert member is not None
        return member.read().decode("utf-8")


@lru_cache(maxsize=1)
def llama_cpp_flags() -> frozenset[str]:
    text = resources.files("saem_gguf.data").joinpath("llama_cpp_flags.txt").read_text(encoding="utf-8")
    return frozenset(line for line in text.splitlines() if line)


def refuse_llama_flags(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """A usage error (``parser.error``) for the first of ``args`` that is a llama.cpp flag
    ``parser`` does not take; the arguments after ``--`` are not flags."""
    ours = parser._option_string_actions
    for arg in args:
        if arg == "--":
            return
        flag = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if flag in llama_cpp_flags() and flag not in ours:
            command = parser.prog.rsplit(" ", 1)[-1]
            parser.error(f"{flag} is a llama.cpp flag that {command} does not take")


if __name__ == "__main__":  # regenerate the packaged list from the sdist
    from saem_gguf.build.source import fetch_sdist

    out = Path(__file__).resolve().parent.parent / "data" / "llama_cpp_flags.txt"
    out.write_text("\n".join(flags_in_arg_cpp(sdist_arg_cpp(fetch_sdist(quiet=True)))) + "\n", encoding="utf-8")
    print(out)
