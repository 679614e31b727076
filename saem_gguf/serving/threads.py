"""`serve`'s CPU thread rule: how many llama.cpp threads decode one token (``-t``) and how many a
ubatch of several (``-tb``: a prompt, a batch step of several sequences; llama.cpp picks ``-tb``
for any ubatch of more than one token).

Rule (when neither flag is given): both are every usable CPU but one. A server runs Python beside
llama.cpp (the decode loop's sampling and placement between decodes, the event loop writing each
token to its client), and the CPU build's OpenMP workers spin at the end of each decode and stall
the decode when one is preempted. Measured on a 2-core machine with the embedded model
(docs/ARCHITECTURE.md "Serving threads"): one thread for both served 3992 +/- 225 tok/s at -np 1
and 5037 +/- 361 at -np 4 while another job took a core, where a second thread for batches
collapsed to 331 +/- 225 and 1799 +/- 2734; alone, a second thread speeds a 4-row decode by 1.5x
but not a served -np 4. The rule is the same at every ``-np``, so ``-np 1`` is not handicapped.
Given flags win; ``-t`` alone also sets ``-tb`` (llama.cpp's default).
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
    spare_one = max(1, n_cpus - 1)
    return ServeThreads(spare_one, threads_batch if threads_batch is not None else spare_one)
