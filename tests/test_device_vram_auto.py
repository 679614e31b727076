"""--vram-budget auto: sizing from free GPU memory (budget.plan_auto / slots_fitting), the device
query through ggml's registry (gpu_memory), and the CPU-only behaviour (no GPU: the ECR default)."""

from __future__ import annotations

import pytest

from conftest import run_cli, spec_for
from saem_gguf.budget import (
    AUTO, auto_margin, plan_auto, plan_from_budget, slots_fitting,
)
from saem_gguf.engine import DEFAULT_ECR, Engine, EngineConfig
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import read_model_info
from saem_gguf.testmodels import ensure_model

GiB = 1 << 30


@pytest.fixture(scope="module")
def path(llama_cpp):
    return ensure_model(spec_for("qwen3moe", "q4_0", n_expert=16, n_expert_used=4, n_layer=3, seed=2))


def test_plan_auto_is_the_budget_plan_of_free_memory_minus_the_margin(path):
    info = read_model_info(path)
    per_slot = info.bytes_per_expert_all_layers
    total = 24 * GiB
    p = plan_from_budget(info, total, 512)
    fixed = p.non_expert_bytes + p.kv_bytes + p.compute_bytes
    for slots in (0, 3, 9):
        free = auto_margin(total) + fixed + slots * per_slot + per_slot // 2
        plan = plan_auto(info, free, total, 512)
        assert plan.slots_per_layer == slots
        assert plan.vram_bytes <= free - auto_margin(total)
    assert plan_auto(info, 80 * GiB, 141 * GiB, 512).slots_per_layer == info.n_expert  # all fit
    with pytest.raises(SaemError, match="--vram-budget auto: .* free on the GPU"):
        plan_auto(info, auto_margin(total), total, 512)  # nothing left for the weights


def test_slots_fitting_after_load(path):
    info = read_model_info(path)
    per_slot, total = info.bytes_per_expert_all_layers, 80 * GiB
    m = auto_margin(total)
    assert m == GiB + int(0.02 * total)
    assert slots_fitting(info, m - 1, total) == 0
    assert slots_fitting(info, m + 5 * per_slot + 1, total) == 5
    assert slots_fitting(info, m + 10**6 * per_slot, total) == info.n_expert


def test_no_gpu_on_the_cpu_build(path):
    from saem_gguf.gpu_memory import gpu_memory

    assert gpu_memory() == []  # the CPU build registers no GPU device
    eng = Engine(EngineConfig(model=path, n_ctx=256, policy="saem", vram_budget=AUTO, n_threads=2,
                              progress=False))
    try:
        assert any("--vram-budget auto: no GPU" in n for n in eng.notes), eng.notes
        assert eng.cache_plan.slots_per_layer == round(DEFAULT_ECR * eng.info.n_expert)
        assert eng.stats()["slots_per_layer"] == round(DEFAULT_ECR * eng.info.n_expert)
    finally:
        eng.close()


def test_cli_auto_and_bad_values(path):
    r = run_cli("generate", "-m", str(path), "-p", "Hello", "-n", "2", "--vram-budget", "AUTO")
    assert r.returncode == 0, r.stderr
    assert "--vram-budget auto: no GPU" in r.stderr
    r = run_cli("generate", "-m", str(path), "-p", "Hello", "--vram-budget", "lots")
    assert r.returncode == 2 and "invalid size" in r.stderr and "Traceback" not in r.stderr
