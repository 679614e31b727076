"""`serve`'s CPU thread rule: how many llama.cpp threads decode one token, and how many a ubatch of
several (llama.cpp's ``-t`` and ``-tb``; llama.cpp picks ``-tb`` for any ubatch of more than one
token, so a batch step of several sequences gets it, a step of one sequence gets ``-t``).

Rule (when neither flag is given): ``-t`` = every usable CPU but one, ``-tb`` = every usable CPU.
A server runs Python beside llama.cpp (the decode loop's sampling and placement between decodes,
the event loop writing each token to its client), and the CPU build's OpenMP workers spin after
each decode: on a one-token decode a second llama.cpp thread saves little and takes the core those
threads need, while a ubatch of several tokens has the work to share. Measured on a 2-core machine
with the embedded model (docs/ARCHITECTURE.md "Serving threads"). The rule is the same at every
``-np``, so ``-np 1`` is not handicapped: its one-token decodes get ``-t`` as a batch's one-row
steps do. Given flags win; ``-t`` alone also sets ``-tb`` (llama.cpp's default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeThreads:
    n_threads: int  # -t: a one-token ubatch
    n_threads_batch: int  # -tb: a ubatch of several tokens


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def serve_threads(n_cpus: int, threads: int | None, threads_batch: int | None) -> ServeThreads:
    """The rule above for a machine of ``n_cpus`` usable CPUs and the flags given (None: not given)."""
    if threads is not None:
        return ServeThreads(threads, threads_batch if threads_batch is not None else threads)
    return ServeThreads(max(1, n_cpus - 1), threads_batch if threads_batch is not None else max(1, n_cpus))
