"""The exit of a script outside the CLI (``bench/``): a signal ends it in one line, as it ends
a CLI command (``cli.main.run_command``), not in Python's traceback."""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from saem_gguf.cli.signals import interrupts_raise
from saem_gguf.errors import Terminated


def run_script(main: Callable[[], int | None]) -> int:
    """``main()``'s exit code; for Ctrl-C one line and 130, for SIGTERM / SIGHUP one line and
    128 + the signal, after ``main``'s own cleanup has run (``interrupts_raise``). The scripts
    write each file whole (``fileio.write_text_atomic``), so none is left half-written."""
    name = os.path.basename(sys.argv[0])
    try:
        with interrupts_raise():
            return int(main() or 0)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"{name}: terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
