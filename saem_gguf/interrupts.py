"""Signals held back while C code runs that only a callback can stop.

Python runs a signal's handler at the next bytecode of the main thread. While llama.cpp loads a
model, the only bytecode is in the callbacks it makes (progress, log), and the handler then runs
on entering one: its exception cannot pass through llama.cpp, Python swallows it ("Exception
ignored on calling ctypes callback function"), and ctypes hands llama.cpp an unset return value
(the progress callback's "go on or cancel"), so the load went on or stopped at random and the
signal was lost or turned into "Failed to load model". Inside ``deferred_signals`` a signal is
only recorded; the progress callback reads the record and cancels the load; on the way out the
signal is raised again, to the handler it would have met, in ordinary code.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Iterator

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class DeferredSignals:
    """What came while deferred: ``signum``, the first signal (None: none)."""

    signum: int | None = None


@contextlib.contextmanager
def deferred_signals() -> Iterator[DeferredSignals]:
    """While inside (main thread only), SIGINT, SIGTERM and SIGHUP are recorded, not handled; a
    signal the process ignores stays ignored. On the way out the previous handlers come back and
    the first recorded signal is raised to them (KeyboardInterrupt for Ctrl-C, the CLI's
    Terminated, or the default action: the process ends)."""
    seen = DeferredSignals()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def record(signum: int, _frame) -> None:
        if seen.signum is None:
            seen.signum = signum

    previous = {}
    for s in DEFERRED_SIGNALS:
        handler = signal.getsignal(s)
        if handler is signal.SIG_IGN or handler is None:  # ignored, or not installed from Python
            continue
        previous[s] = signal.signal(s, record)
    try:
        yield seen
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if seen.signum is not None:
            # runs the handler now (raise_signal checks for signals before it returns)
            signal.raise_signal(seen.signum)
