"""argparse value types shared by the commands' own flags (usage errors, exit code 2)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from saem_gguf.errors import SaemError
from saem_gguf.fileio import check_output_path


def bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v

    return parse


def finite_float(text: str) -> float:
    """An argparse type: a finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def output_file(text: str) -> Path:
    """An argparse type: a path where a file can be written (``fileio.check_output_path``),
    checked as the flag is parsed, so that a run of minutes does not end on a path it cannot
    write (a benchmark's --json)."""
    try:
        return check_output_path(text, "file")
    except SaemError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
