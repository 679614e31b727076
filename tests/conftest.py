"""Shared fixtures: the patched llama.cpp (must be built: `bash setup.sh`) and generated models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from saem_gguf.testmodels import ModelSpec, ensure_model

REPO = Path(__file__).resolve().parents[1]

# One spec per (architecture, expert quant type) that the foundation guarantees loads.
ARCH_QUANTS = [(a, q) for a in ("qwen3moe", "qwen2moe", "llama") for q in ("f16", "q8_0", "q4_0")]


def spec_for(arch: str, quant: str, **kw) -> ModelSpec:
    if quant == "q4_k":
        kw.setdefault("n_embd", 256)
        kw.setdefault("n_ff_exp", 256)
        kw.setdefault("head_dim", 64)
    return ModelSpec(arch=arch, expert_type=quant, **kw)


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python bound to the patched library (the build must exist; setup.sh makes it)."""
    from saem_gguf.llama_lib import load_llama_cpp

    return load_llama_cpp()


@pytest.fixture(scope="session")
def model_path():
    """model_path(spec) -> Path of the generated GGUF (cached outside the tree)."""
    return ensure_model


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "saem_gguf", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
