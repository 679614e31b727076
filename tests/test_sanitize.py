"""The sanitizer run (bench/sanitize.sh): the patched library and native/ built with ASan+UBSan
into their own cache key, the native and engine tests run against it; no report. A full llama.cpp
build the first time (tens of minutes on 2 cores), hence slow."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO


def _toolchain_has_sanitizers() -> bool:
    if not (shutil.which("gcc") and shutil.which("cmake")):
        return False
    lib = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return Path(lib).is_absolute() and Path(lib).exists()


@pytest.mark.slow
@pytest.mark.skipif(not _toolchain_has_sanitizers(), reason="gcc with libasan and cmake are needed")
def test_sanitizers_report_nothing():
    r = subprocess.run(["bash", str(REPO / "bench" / "sanitize.sh")], capture_output=True, text=True,
                       timeout=4 * 3600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "sanitizer report files: 0" in r.stdout, r.stdout[-4000:]
