"""The held-out split of the default model's arithmetic, shared by the corpus and the evaluation.

A fixed tenth of the (operation, a, b) triples is held out: no training reply ever computes one of
them (in any step of any turn), and the evaluation asks about them. One-digit facts (both operands
below 10) are never held out, because column arithmetic needs every one of them.
"""

from __future__ import annotations

import zlib

OPERATIONS = ("add", "sub", "mul")


def is_heldout(op: str, a: int, b: int) -> bool:
    """True for the tenth of ``a op b`` computations that training never sees."""
    if op not in OPERATIONS:
        raise ValueError(f"unknown operation {op!r}")
    if a < 10 and b < 10:
        return False
    return zlib.crc32(f"{op}:{a}:{b}".encode()) % 10 == 0
