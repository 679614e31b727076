"""The default model's training script (PyTorch, a development-only dependency): a smoke run of
the whole pipeline is reproducible byte for byte and writes a GGUF that llama.cpp loads.
Skipped where torch is not installed (CI installs only what inference needs)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest


def _train_tiny(tmp_path, name: str):
    out = tmp_path / f"{name}.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "saem_gguf.defaultmodel.train", "--tiny", "--work-dir", str(tmp_path / name),
         "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, proc.stdout


@pytest.mark.slow
def test_tiny_training_is_reproducible_and_loads(tmp_path, llama_cpp):
    pytest.importorskip("torch")
    a, log_a = _train_tiny(tmp_path, "a")
    b, _ = _train_tiny(tmp_path, "b")
    assert "trained" in log_a and "wrote" in log_a
    assert hashlib.sha256(a.read_bytes()).hexdigest() == hashlib.sha256(b.read_bytes()).hexdigest()
    llm = llama_cpp.Llama(model_path=str(a), n_ctx=256, verbose=False)
    toks = llm.tokenize(b"<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n", add_bos=False, special=True)
    llm.eval(toks)
    assert llm.n_tokens == len(toks)
