"""A `serve` process on a free localhost port for the end-to-end tests and the server bench: started
with its flags, its URL read from the line it prints when it listens, stopped by a signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
URL_LINE = re.compile(r"\[saem\] serving .* at (http://\S+) ")


@dataclass
class ServerProcess:
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    proc: subprocess.Popen | None = None
    url: str = ""
    stderr_lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "saem_gguf", "serve", "--port", "0", *self.args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO, env={**os.environ, "NO_COLOR": "1", **self.env})
        listening = threading.Event()

        def read() -> None:  # keeps the pipe drained for the process's whole life
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                m = URL_LINE.search(line)
                if m and not self.url:
                    self.url = m.group(1)
                    listening.set()
            listening.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not listening.wait(timeout) or not self.url:
            self.kill()
            raise RuntimeError(f"serve did not start: {''.join(self.stderr_lines)}")
        return self

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit status."""
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
