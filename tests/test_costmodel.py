"""Cost model: bytes per expert from ggml block sizes, the roofline times, the CPU-vs-transfer
rule, presets and the measure path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from saem_gguf.costmodel import (
    HW_PRESETS, MODEL_PRESETS, CostModel, expert_bytes, find_model_shape, get_hw,
    t_cpu, t_gpu, t_xfer, tensor_bytes,
)
from saem_gguf.errors import SaemError


def test_expert_bytes_by_quant_type():
    # Q4_K: 256-element blocks of 144 bytes. gate/up rows have n_embd elements, down rows n_ff.
    assert tensor_bytes(2048, 768, "Q4_K") == 768 * (2048 // 256) * 144
    assert expert_bytes(2048, 768, "Q4_K") == 2 * 768 * 8 * 144 + 2048 * 3 * 144 == 2_654_208
    assert expert_bytes(2048, 768, "F16") == 3 * 2048 * 768 * 2
    assert expert_bytes(2048, 768, "BF16") == 3 * 2048 * 768 * 2
    assert expert_bytes(2048, 768, "Q8_0") == 3 * 2048 * 768 // 32 * 34
    # mixed types (Q4_K_M stores some down projections in Q6_K: 210 bytes per 256)
    assert expert_bytes(2048, 768, "Q4_K", "Q6_K") == 2 * 768 * 8 * 144 + 2048 * 3 * 210
    assert MODEL_PRESETS["qwen3-30b-a3b"].expert_bytes() == 2_654_208


def test_bad_quant_inputs():
    with pytest.raises(SaemError, match="unknown quant type"):
        expert_bytes(2048, 768, "Q4_Z")
    with pytest.raises(SaemError, match="not a multiple"):
        expert_bytes(2048, 100, "Q4_K")  # down rows of 100 elements cannot hold 256-blocks


def _cost(hw="rtx4090-ddr5"):
    return CostModel.from_shape(MODEL_PRESETS["qwen3-30b-a3b"], HW_PRESETS[hw])


def test_roofline_times_match_formulas():
    c = _cost()
    hw = c.hw
    b = c.expert_bytes
    f = c.expert_flops
    for n in (1, 4, 64, 512):
        assert c.gpu_time(n) == pytest.approx(hw.gpu_launch_s + max(b / hw.gpu_mem_bw, n * f / hw.gpu_flops))
        assert c.cpu_time(n) == pytest.approx(hw.cpu_expert_overhead_s + max(b / hw.cpu_mem_bw, n * f / hw.cpu_flops))
    assert c.transfer_time() == pytest.approx(hw.h2d_latency_s + b / hw.h2d_bw)
    assert t_gpu(3, c.array) == pytest.approx(c.gpu_time(3))
    assert t_cpu(3, c.array) == pytest.approx(c.cpu_time(3))
    assert t_xfer(c.array) == pytest.approx(c.transfer_time())


def cpu_wins(n_tokens: int, link_wait: float, cost) -> bool:
    """The paper's rule as the replay kernels apply it: a non-resident expert runs on the CPU
    when that is no slower than waiting for the link, copying it and running it on the GPU."""
    return t_cpu(n_tokens, cost) <= link_wait + t_xfer(cost) + t_gpu(n_tokens, cost)


@pytest.mark.parametrize("hw", sorted(HW_PRESETS))
def test_cpu_wins_at_few_tokens(hw):
    c = _cost(hw)
    assert cpu_wins(1, 0.0, c.array)  # the paper: CPU execution wins when few tokens use the expert
    n = c.crossover_tokens()
    assert n > 1
    assert not cpu_wins(n, 0.0, c.array) and cpu_wins(n - 1, 0.0, c.array)
    # a busy link only helps the CPU
    assert cpu_wins(n, 1.0, c.array)


def test_presets_and_hw_specs(tmp_path):
    assert get_hw("h200-server").gpu_mem_bw > get_hw("rtx3060-ddr4").gpu_mem_bw
    with pytest.raises(SaemError, match="unknown hardware"):
        get_hw("abacus")
    p = tmp_path / "hw.json"
    import dataclasses

    p.write_text(json.dumps(dataclasses.asdict(HW_PRESETS["rtx3060-ddr4"].replace(name="mine", h2d_bw=5e9))))
    hw = get_hw(str(p))
    assert hw.name == "mine" and hw.h2d_bw == 5e9
    p.write_text("{}")
    with pytest.raises(SaemError, match="not a hardware profile"):
        get_hw(str(p))
    assert find_model_shape(48, 128, 8).name == "qwen3-30b-a3b"
    assert find_model_shape(3, 5, 2) is None


def test_cost_model_rejects_nonsense():
    with pytest.raises(SaemError):
        CostModel.from_expert_bytes(0, HW_PRESETS["rtx4090-ddr5"])
    with pytest.raises(SaemError, match="h2d_bw"):
        CostModel.from_expert_bytes(1000, HW_PRESETS["rtx4090-ddr5"].replace(h2d_bw=0))


def test_measure_fills_cpu_side():
    from saem_gguf.hw_measure import measure_cpu

    base = HW_PRESETS["rtx4090-ddr5"]
    hw = measure_cpu(base, quick=True)
    assert hw.cpu_mem_bw > 1e8 and hw.cpu_cores >= 1 and hw.cpu_flops_per_core > 1e6
    assert hw.gpu_mem_bw == base.gpu_mem_bw and hw.h2d_bw == base.h2d_bw  # GPU side untouched
    assert hw.name.startswith("measured+")
    assert np.isfinite(CostModel.from_shape(MODEL_PRESETS["qwen3-30b-a3b"], hw).cpu_time(1))


def test_ram_tier_cost_prices_a_copy_as_a_disk_read(tmp_path):
    """The RAM tier's cost model: a hit runs from RAM, a copy and a miss read the expert from the
    preset's disk; a profile written before the SSD fields existed still loads (their defaults),
    and a zero disk bandwidth is refused like the other bandwidths."""
    import dataclasses

    from saem_gguf.policies.adaptive import copy_cost_in_hits

    hw = HW_PRESETS["rtx3060-ddr4"]
    vram = CostModel.from_expert_bytes(2_654_208, hw)
    ram = vram.ram_tier()
    assert ram.expert_bytes == vram.expert_bytes
    assert ram.transfer_time() == pytest.approx(hw.ssd_latency_s + 2_654_208 / hw.ssd_read_bw)
    assert ram.gpu_time(1) == pytest.approx(hw.cpu_expert_overhead_s + 2_654_208 / hw.cpu_mem_bw)
    assert ram.cpu_time(1) == pytest.approx(hw.cpu_expert_overhead_s + hw.ssd_latency_s + 2_654_208 / hw.ssd_read_bw)
    assert ram.transfer_time() > 4 * vram.transfer_time()  # the disk, not PCIe
    # a read-ahead costs about the miss it would save (they share the disk), never nothing
    assert 0.5 < copy_cost_in_hits(ram.array) < 1.5
    for name, preset in HW_PRESETS.items():
        assert preset.ssd_read_bw < preset.h2d_bw and preset.ssd_latency_s > preset.h2d_latency_s, name
    old = {k: v for k, v in dataclasses.asdict(hw).items() if not k.startswith("ssd_")}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    assert get_hw(str(p)).ssd_read_bw > 0
    p.write_text(json.dumps({**old, "ssd_read_bw": 0}))
    with pytest.raises(SaemError, match="ssd_read_bw must be > 0"):
        get_hw(str(p))
    with pytest.raises(SaemError, match="ssd_read_bw"):
        CostModel.from_expert_bytes(1000, hw.replace(ssd_read_bw=0))


def test_measure_disk_read_reads_a_dropped_scratch_file(tmp_path):
    """The disk probe reads its scratch file back after dropping it from the page cache (a real
    read, so slower than RAM and with a positive per-read latency) and leaves nothing behind."""
    from saem_gguf.hw_measure import measure_disk_read, measure_memory_bandwidth

    bw, latency = measure_disk_read(tmp_path, n_bytes=8 << 20, read_size=1 << 20, n_latency=8)
    assert 1e6 < bw < measure_memory_bandwidth(32 << 20) * 4
    assert 0 < latency < 1.0
    assert list(tmp_path.iterdir()) == []


def test_flops_per_core_is_single_threaded_best_of_short_runs_and_sanity_checked():
    """The per-core rate comes from one core (a child process whose BLAS has one thread), as the
    best of short runs; an implausible rate is measured again, and one that stays implausible is
    reported as such (the profile is then not cached)."""
    from saem_gguf.hw_measure import (
        PLAUSIBLE_GEMM_FLOPS_PER_CORE, QUANT_SHARE_OF_GEMM, gemm_rate_plausible, measure_flops_per_core,
        single_core_gemm_seconds,
    )

    real = measure_flops_per_core(repeats=5)
    assert real.plausible and real.attempts >= 1
    assert real.flops_per_core == pytest.approx(QUANT_SHARE_OF_GEMM * real.gemm_flops)
    assert 0 < single_core_gemm_seconds(64, 3) < 1.0
    lo, hi = PLAUSIBLE_GEMM_FLOPS_PER_CORE
    n = 256
    seconds_for = lambda rate: 2.0 * n**3 / rate  # noqa: E731
    # a first run preempted throughout (1000x too slow), then a real one: measured twice
    runs = iter([seconds_for(lo / 1000), seconds_for(40e9)])
    m = measure_flops_per_core(n=n, probe=lambda n_, r: next(runs))
    assert (m.plausible, m.attempts) == (True, 2) and m.gemm_flops == pytest.approx(40e9)
    # implausible every time: three tries, the nearest to the plausible range kept, flagged
    runs = iter([seconds_for(lo / 100), seconds_for(lo / 3), seconds_for(hi * 50)])
    m = measure_flops_per_core(n=n, probe=lambda n_, r: next(runs))
    assert (m.plausible, m.attempts) == (False, 3) and m.gemm_flops == pytest.approx(lo / 3)
    assert not gemm_rate_plausible(m.gemm_flops) and gemm_rate_plausible(lo) and gemm_rate_plausible(hi)


def test_an_implausible_measurement_is_not_cached(tmp_path, monkeypatch, capsys):
    from saem_gguf import hw_measure

    monkeypatch.setenv("SAEM_GGUF_CACHE", str(tmp_path))
    monkeypatch.setattr(hw_measure, "single_core_gemm_seconds", lambda n, r: 2.0 * n**3 / 1e6)  # 1 MFLOP/s
    hw, path, measured = hw_measure.measured_profile("rtx4090-ddr5")
    assert measured and not path.exists()
    assert "IMPLAUSIBLE" in hw.notes
    assert "warning: --hw measure" in capsys.readouterr().err


def test_cost_switches_turn_on_and_keep_what_the_profile_has():
    """simulate's and bench_policies' --overlap / --copy-barrier (HardwareProfile.with_switches)."""
    hw = HW_PRESETS["rtx4090-ddr5"]
    assert hw.with_switches() == hw and not hw.cpu_gpu_overlap and not hw.copy_barrier
    on = hw.with_switches(overlap=True, copy_barrier=True)
    assert on.cpu_gpu_overlap and on.copy_barrier and on.replace(cpu_gpu_overlap=False, copy_barrier=False) == hw
    assert on.with_switches() == on  # a flag left off does not turn a profile's switch off
