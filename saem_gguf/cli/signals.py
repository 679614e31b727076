"""Signals as exceptions in the main thread, and never lost.

SIGTERM and SIGHUP raise ``Terminated`` (Python's default would end the process without running
any ``finally``); SIGINT raises Python's own ``KeyboardInterrupt``. Either way the exception
unwinds through the command's cleanup (temporary files removed, the model closed).

Python runs a signal's handler at the next bytecode of the main thread, wherever that is. When
it is inside a function that C called back (llama-cpp-python's log callback, llvmlite's object
cache notification while Numba compiles) or a ``__del__``, the exception cannot reach the C
caller: Python prints it as "Exception ignored" and goes on, and the command would run to its
end as if no signal had come. ``interrupts_raise`` catches those through ``sys.unraisablehook``
and sends the signal again a moment later, when the main thread is back in ordinary code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

from saem_gguf.errors import Terminated

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# long enough for the callback that swallowed the exception to return to its C caller; a second
# swallow (the C side calls back again) sends it once more, so any value converges
REDELIVERY_DELAY_S = 0.005


def _lost_signal(exc: BaseException | None) -> int | None:
    """The signal whose exception ``exc`` is, or None."""
    if isinstance(exc, Terminated):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    return None


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """While inside (main thread only): SIGTERM and SIGHUP raise Terminated, and a signal's
    exception that a C callback or ``__del__`` swallowed is raised again in ordinary code. The
    previous handlers and unraisable hook come back after; a re-sent signal still pending then is
    raised on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, _frame) -> None:
        raise Terminated(signum)

    pending: list[threading.Timer] = []
    previous_hook = sys.unraisablehook

    def redeliver_lost(unraisable) -> None:
        signum = _lost_signal(unraisable.exc_value)
        if signum is None:
            previous_hook(unraisable)
            return
        # raising here would be swallowed too (the hook runs inside the callback): a thread sends
        # the signal again once the callback has returned
        timer = threading.Timer(REDELIVERY_DELAY_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        pending.append(timer)
        timer.start()

    previous = {s: signal.signal(s, raise_terminated) for s in TERMINATING_SIGNALS}
    sys.unraisablehook = redeliver_lost
    try:
        yield
    finally:
        try:
            # a re-sent signal still in flight: wait for it here, inside the handlers, so that it
            # is raised (the caller maps it to its exit code), not left to the previous handler;
            # its handler runs at the first bytecode after the kill, in join at the latest
            for timer in pending:
                timer.join()
        finally:
            sys.unraisablehook = previous_hook
            for s, handler in previous.items():
                signal.signal(s, handler)
