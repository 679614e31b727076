"""The GGUF fuzzer (tests/gguf_fuzz.py): seeded mutants of real generated models through inspect
(in-process) and a real llama.cpp load (worker subprocesses). No crash, traceback or hang."""

from __future__ import annotations

import pytest

from gguf_fuzz import FAILURES, mutate, mutation_slots, run_fuzz
from saem_gguf.testmodels import ModelSpec, ensure_model


def _assert_clean(report) -> None:
    print(report.summary())  # the figures by outcome (pytest -s shows them)
    assert report.failures() == 0, "\n".join(report.findings[:20])
    for counts in (report.inspect, report.load):
        assert not set(counts) - {"ok", "rejected", "load_error", *FAILURES}


def test_mutations_are_seeded_and_cover_every_part():
    import random

    path = ensure_model(ModelSpec(arch="qwen3moe", expert_type="q4_0"))
    slots = mutation_slots(path)
    kinds = {s.kind for s in slots}
    assert kinds >= {"header", "kv_value", "kv_type", "length", "n_dims", "dim", "tensor_type",
                     "offset", "data"}
    data = path.read_bytes()
    a = [mutate(data, slots, random.Random(5)) for _ in range(3)]
    b = [mutate(data, slots, random.Random(5)) for _ in range(3)]
    assert a == b and all(m != data for m, _ in a)


def test_fuzz_fast(tmp_path):
    _assert_clean(run_fuzz(n_inspect=200, n_load=24, seed=11, workdir=tmp_path))


@pytest.mark.slow
def test_fuzz_long(tmp_path):
    """>= 2,000 llama.cpp loads (and 5,000 inspects)."""
    report = run_fuzz(n_inspect=5000, n_load=2000, seed=2026, workdir=tmp_path)
    assert sum(report.load.values()) >= 2000
    _assert_clean(report)
