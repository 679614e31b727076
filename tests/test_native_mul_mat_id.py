"""Runs the C-level test of the MUL_MAT_ID skip flag (native/tests/test_mul_mat_id_skip.cpp), built
and installed with the patched library (<prefix>/bin/saem-test-mul-mat-id)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from saem_gguf.llama_lib import load_llama_cpp


def test_mul_mat_id_skip_negative_ids():
    lib_dir = Path(load_llama_cpp().llama_cpp._base_path)
    exe = lib_dir.parent / "bin" / "saem-test-mul-mat-id"
    assert exe.exists(), f"{exe} missing: the build installs it (SAEM_BUILD_TESTS=ON)"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{lib_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " 0 failures" in r.stdout and "FAIL" not in r.stdout
