"""serve's thread rule (saem_gguf.serving.threads) and the -t / -tb split it sets in llama.cpp."""

from __future__ import annotations

import pytest

from conftest import spec_for
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.errors import SaemError
from saem_gguf.serving.threads import ServeThreads, serve_threads
from saem_gguf.testmodels import ensure_model


@pytest.mark.parametrize("n_cpus,threads,threads_batch,expected", [
    (2, None, None, (1, 1)),  # this machine: one core for llama.cpp, one for the server's Python
    (16, None, None, (15, 15)),
    (1, None, None, (1, 1)),  # never zero threads
    (2, 3, None, (3, 3)),  # -t alone sets -tb too, as llama.cpp does
    (2, None, 2, (1, 2)),  # -tb alone: -t still follows the rule
    (8, 2, 6, (2, 6)),  # both given: both win
])
def test_thread_rule(n_cpus, threads, threads_batch, expected):
    assert serve_threads(n_cpus, threads, threads_batch) == ServeThreads(*expected)


def test_a_batch_thread_count_below_one_is_refused(llama_cpp):
    path = ensure_model(spec_for("qwen3moe", "q4_0", n_expert=16, n_expert_used=4, n_layer=3, seed=2))
    with pytest.raises(SaemError, match="-tb 0: must be >= 1"):
        Engine(EngineConfig(model=path, n_ctx=256, n_threads_batch=0, progress=False))
