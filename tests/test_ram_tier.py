"""The RAM tier on real generated GGUFs and the real patched llama.cpp: the native byte ranges are
the file's bytes, prefetch / release / residency act on the page cache, the non-expert weights
lock (or say why not), and greedy output is bit-identical with the tier on or off, at several
budgets, under every policy the tier is benchmarked with."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import REPO, spec_for
from native_helpers import stock_load_repacks
from saem_gguf import native_api as na
from saem_gguf.budget import AUTO
from saem_gguf.costmodel import CostModel, get_hw
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import read_model_info
from saem_gguf.ram_tier import RamBudget, RamTier, parse_ram_budget, plan_ram_budget, ram_policy_for
from saem_gguf.testmodels import STAGE_PLANT, ensure_model

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum. Alternatively, count up from 12. So the answer"
TIER_POLICIES = ["lru-cpu", "lfu-cpu", "static-hot", "saem"]
N_EXPERT = 16


@pytest.fixture(scope="module")
def private_model(tmp_path_factory, llama_cpp):
    """A private, written-back copy of a stage-routed model: no other process maps its pages, and
    none is dirty, so MADV_PAGEOUT can really drop them (a shared or dirty page stays)."""
    src = ensure_model(spec_for("qwen3moe", "q8_0", n_expert=N_EXPERT, n_expert_used=4, n_layer=3, seed=5,
                                planted=STAGE_PLANT))
    dst = tmp_path_factory.mktemp("ramtier") / "model.gguf"
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return dst


def _engine(path, **kw) -> Engine:
    kw.setdefault("policy", "cpu-moe")
    kw.setdefault("ecr", 0.0)
    return Engine(EngineConfig(model=path, n_ctx=256, n_threads=2, progress=False, hw="rtx3060-ddr4", **kw))


def _greedy(eng: Engine, n: int = 24) -> tuple[list[int], bytes]:
    """Greedy tokens and the raw bytes of the last decode's logits (bit-exactness, not closeness)."""
    res = eng.generate(PROMPT, n)
    ptr = eng._llama_cpp.llama_get_logits_ith(eng.llm.ctx, -1)
    return res.tokens, bytes(np.ctypeslib.as_array(ptr, shape=(eng.llm.n_vocab(),)))


@pytest.fixture(scope="module")
def engine(private_model):
    eng = _engine(private_model)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine):
    engine.placement.tiers.clear()
    return _greedy(engine)


def _moe_layers(eng: Engine) -> list[int]:
    return eng.placement.moe_layers


# --- native: ranges, residency, prefetch, release, lock -----------------------------------------
def test_expert_ranges_are_the_experts_bytes_in_the_file(engine, private_model):
    """Each (layer, expert) range holds exactly that expert's slice of gate, up and down as the
    GGUF stores it (tensor data offset + expert * stride)."""
    reader = GGUFReader(private_model)
    tensors = {t.name: t for t in reader.tensors}
    assert na.saem_ram_experts_mapped(engine.llm) == (True, "")
    for il in _moe_layers(engine):
        for e in (0, 7, N_EXPERT - 1):
            ranges = na.saem_ram_expert_ranges(engine.llm, il, e)
            info = na.saem_moe_get_layer_info(engine.llm, il)
            assert [n for _, n in ranges] == list(info.mat_nbytes)
            for (addr, n), mat in zip(ranges, ("up", "gate", "down")):
                t = tensors[f"blk.{il}.ffn_{mat}_exps.weight"]
                stride = t.n_bytes // N_EXPERT
                assert n == stride
                with open(private_model, "rb") as f:
                    f.seek(t.data_offset + e * stride)
                    want = f.read(n)
                assert ctypes.string_at(addr, n) == want, (il, e, mat)


def test_ranges_and_prefetch_refuse_bad_arguments(engine):
    il = _moe_layers(engine)[0]
    with pytest.raises(na.NativeArgumentError, match="expert 16 out of range"):
        na.saem_ram_expert_ranges(engine.llm, il, N_EXPERT)
    with pytest.raises(na.NativeArgumentError, match="out of range"):
        na.saem_ram_prefetch(engine.llm, il, [-1])
    with pytest.raises(na.NativeArgumentError, match="prefetch method"):
        na.saem_ram_prefetch(engine.llm, il, [0], 7)
    with pytest.raises(na.NativeArgumentError, match="release advice"):
        na.saem_ram_release(engine.llm, il, [0], 9)
    with pytest.raises(na.NativeArgumentError, match="layer"):
        na.saem_ram_expert_residency(engine.llm, 999, 0)


def _inside_pages(eng: Engine, il: int, e: int) -> int:
    ps = os.sysconf("SC_PAGESIZE")
    return sum(max(0, (a + n) // ps - (a + ps - 1) // ps) for a, n in na.saem_ram_expert_ranges(eng.llm, il, e))


def test_release_drops_pages_and_prefetch_reads_them_back(engine):
    """MADV_PAGEOUT (when the kernel has it) drops every page wholly inside the expert; both
    prefetch methods bring them all back."""
    il, e = _moe_layers(engine)[1], 3
    for method in (na.SAEM_RAM_PREFETCH_THREAD, na.SAEM_RAM_PREFETCH_MADVISE):
        advice = na.saem_ram_release(engine.llm, il, [e])
        resident, total = na.saem_ram_expert_residency(engine.llm, il, e)
        if advice == na.SAEM_RAM_RELEASE_PAGEOUT:
            assert resident <= total - _inside_pages(engine, il, e), (resident, total)
        na.saem_ram_prefetch(engine.llm, il, [e], method)
        na.saem_ram_prefetch_wait(engine.llm)
        deadline = time.monotonic() + 5.0  # MADV_WILLNEED reads asynchronously
        while na.saem_ram_expert_residency(engine.llm, il, e)[0] < total and time.monotonic() < deadline:
            time.sleep(0.01)
        assert na.saem_ram_expert_residency(engine.llm, il, e) == (total, total), method


def test_evicted_experts_are_paged_out_and_passing_ones_only_marked_cold(engine):
    """An expert the policy evicts is released (MADV_PAGEOUT drops its pages); one a step used
    without the policy keeping it is only marked cold (MADV_COLD): its pages stay while memory has
    room, so the next miss on it is not a disk read."""
    info = read_model_info(engine.path)
    per = info.bytes_per_expert_all_layers
    cost = CostModel.from_expert_bytes(info.moe_layers[0].bytes_per_expert, get_hw("rtx3060-ddr4")).ram_tier()
    calib = np.tile(np.arange(N_EXPERT, dtype=np.float64), (len(info.moe_layers), 1))  # 12..15 hottest
    tier = RamTier(engine.llm, _moe_layers(engine), "static-hot", RamBudget(4 * per, 4, N_EXPERT, per), cost,
                   calib_counts=calib)
    l, il = 1, _moe_layers(engine)[1]
    want = tier.state.slot_of >= 0
    assert want[l, 12:].all() and not want[l, :12].any()
    passing = 0
    na.saem_ram_prefetch(engine.llm, il, [passing])  # the step's in-graph read-ahead read it
    total = na.saem_ram_expert_residency(engine.llm, il, passing)[1]
    deadline = time.monotonic() + 5.0
    while na.saem_ram_expert_residency(engine.llm, il, passing)[0] < total and time.monotonic() < deadline:
        time.sleep(0.01)
    used = np.zeros_like(want)
    used[l, passing] = True
    smaller = want.copy()
    smaller[l, 15] = False  # the policy evicts expert 15
    tier._realise(smaller, used=used)
    assert tier.stats.released == 2
    if tier.passing_advice == na.SAEM_RAM_RELEASE_COLD:
        assert na.saem_ram_expert_residency(engine.llm, il, passing) == (total, total)
    if tier.release_advice == na.SAEM_RAM_RELEASE_PAGEOUT:
        resident, total15 = na.saem_ram_expert_residency(engine.llm, il, 15)
        assert resident <= total15 - _inside_pages(engine, il, 15), (resident, total15)


def test_non_expert_weights_lock(engine):
    locked = na.saem_ram_lock_non_expert(engine.llm)
    info = read_model_info(engine.path)
    # every non-expert weight, rounded out to pages (the GGUF header and padding are not weights)
    assert info.non_expert_bytes * 0.9 <= locked <= info.non_expert_bytes + 64 * os.sysconf("SC_PAGESIZE") * 64
    na.saem_ram_unlock_non_expert(engine.llm)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("capsh") or not shutil.which("prlimit"),
                    reason="needs root, capsh and prlimit to drop CAP_IPC_LOCK and set RLIMIT_MEMLOCK 0")
def test_mlock_refusal_is_one_note_naming_the_limit(private_model):
    """Without CAP_IPC_LOCK and with RLIMIT_MEMLOCK 0 the lock is refused: the tier says so in
    one note naming the limit and runs on (the weights may then page); output is unchanged."""
    code = ("import sys; from saem_gguf.engine import Engine, EngineConfig\n"
            f"e = Engine(EngineConfig(model={str(private_model)!r}, n_ctx=256, n_threads=2, progress=False, "
            "hw='rtx3060-ddr4', policy='cpu-moe', ecr=0.0, ram_budget=1 << 20, ram_policy='lru-cpu'), log=print)\n"
            "print('tokens', e.generate('hello', 4).tokens)\n")
    r = subprocess.run(["prlimit", "--memlock=0:0", "capsh", "--drop=cap_ipc_lock", "--", "-c",
                        f"{sys.executable} -c \"$0\"", code], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stdout.splitlines() if "not locked" in line]
    assert len(notes) == 1 and "RLIMIT_MEMLOCK is 0 bytes" in notes[0], r.stdout
    assert "tokens [" in r.stdout


def test_the_tier_keeps_experts_mapped_where_llama_cpp_would_repack_them():
    """The tier pages experts from the file's mapping, which a repacked copy is not: with it the
    experts stay as the file has them (as with -nr), where without it a CPU-only build keeps
    llama.cpp's repacked layout (Q4_0 on AVX2)."""
    path = ensure_model(spec_for("qwen3moe", "q4_0", n_expert=N_EXPERT, n_expert_used=4, n_layer=3, seed=5))
    if not stock_load_repacks(path):
        pytest.skip("llama.cpp does not repack Q4_0 experts on this CPU (no AVX2)")
    for ram_budget, repacked in ((None, True), (AUTO, False)):
        eng = _engine(path, ram_budget=ram_budget)
        try:
            infos = [na.saem_moe_get_layer_info(eng.llm, il) for il in _moe_layers(eng)]
            assert all(all(i.repacked) == repacked and any(i.repacked) == repacked for i in infos)
            assert na.saem_ram_experts_mapped(eng.llm)[0] == (not repacked)
            assert len(eng.generate(PROMPT, 4).tokens) == 4
        finally:
            eng.close()


# --- the tier: placement never changes results ---------------------------------------------------
@pytest.mark.parametrize("route_prefetch", [True, False], ids=["route-prefetch", "no-route-prefetch"])
@pytest.mark.parametrize("policy", TIER_POLICIES)
@pytest.mark.parametrize("slots", [1, N_EXPERT // 4, N_EXPERT // 2, N_EXPERT])
def test_greedy_output_is_bit_identical_with_the_tier(engine, reference, policy, slots, route_prefetch):
    """Tokens and the last logits equal the run without the tier, while the tier really pages:
    it released experts (dropping their pages) and the next steps read them back from the file;
    with the routed-expert prefetch the graph runs the host branch through the prefetch op."""
    info = read_model_info(engine.path)
    budget = RamBudget(slots * info.bytes_per_expert_all_layers, slots, N_EXPERT, info.bytes_per_expert_all_layers)
    cost = CostModel.from_expert_bytes(info.moe_layers[0].bytes_per_expert, get_hw("rtx3060-ddr4"))
    calib = 1.0 + np.arange(len(info.moe_layers) * N_EXPERT, dtype=np.float64).reshape(len(info.moe_layers), N_EXPERT)
    tier = RamTier(engine.llm, _moe_layers(engine), policy, budget, cost, calib_counts=calib)
    engine.placement.tiers[:] = [tier]
    na.saem_ram_set_route_prefetch(engine.llm, route_prefetch)
    advised = na.saem_ram_route_prefetched(engine.llm)
    try:
        got = _greedy(engine)
    finally:
        engine.placement.tiers.clear()
        na.saem_ram_set_route_prefetch(engine.llm, False)
    assert got == reference
    # each decode step advises its 4 routed experts in each of the 3 layers (plus the prompt's)
    advised = na.saem_ram_route_prefetched(engine.llm) - advised
    assert advised >= 4 * 3 * (len(got[0]) - 1) if route_prefetch else advised == 0, advised
    assert tier.stats.accesses == 4 * len(info.moe_layers) * (len(got[0]) - 1)
    if slots < N_EXPERT:
        assert tier.stats.released > 0, tier.stats
    elif policy == "static-hot":  # every expert has evidence, so every one is placed at load
        assert tier.stats.hits == tier.stats.accesses and tier.stats.released == 0, tier.stats


def test_engine_flags_start_the_tier_and_keep_the_output(private_model, reference):
    eng = _engine(private_model, ram_budget=AUTO, ram_policy="saem")
    try:
        assert eng.ram_tier is not None
        assert any(n.startswith("RAM tier: ") and "experts per layer resident" in n for n in eng.notes)
        assert _greedy(eng) == reference
        assert "ram_hit_rate" in eng.stats()
    finally:
        eng.close()


def test_without_mmap_the_tier_says_once_it_is_off(private_model, reference):
    eng = _engine(private_model, ram_budget=AUTO, use_mmap=False)
    try:
        assert eng.ram_tier is None
        off = [n for n in eng.notes if n.startswith("RAM tier is off")]
        assert len(off) == 1 and "not memory-mapped" in off[0] and "'CPU'" in off[0], eng.notes
        assert _greedy(eng) == reference
    finally:
        eng.close()


# --- the budget ---------------------------------------------------------------------------------
def test_budget_sizes_and_auto(private_model):
    info = read_model_info(private_model)
    per = info.bytes_per_expert_all_layers
    assert plan_ram_budget(info, 5 * per + 1, 256).slots == 5
    assert plan_ram_budget(info, 10**15, 256).slots == N_EXPERT
    auto = plan_ram_budget(info, AUTO, 256, available=lambda: 4 << 30)
    assert auto.slots == N_EXPERT and auto.note.startswith("auto: 4.00 GiB available")
    with pytest.raises(SaemError, match="holds no expert"):
        plan_ram_budget(info, per - 1, 256)
    with pytest.raises(SaemError, match="no room for one expert"):
        plan_ram_budget(info, AUTO, 256, available=lambda: 256 << 20)
    assert parse_ram_budget("Auto") == AUTO and parse_ram_budget("1.5G") == 3 << 29
    with pytest.raises(SaemError, match="above zero"):
        parse_ram_budget("0")


def test_ram_policy_defaults():
    assert ram_policy_for("lru-cpu", None) == "lru-cpu"
    assert ram_policy_for("cpu-moe", None) == "saem"
    assert ram_policy_for("saem", "static-hot") == "static-hot"
    with pytest.raises(SaemError, match="places nothing"):
        ram_policy_for("saem", "gpu-all")


def test_python_api_takes_a_ram_budget(private_model, reference):
    from saem_gguf import Llama

    llm = Llama(str(private_model), expert_policy="cpu-moe", ecr=0.0, ram_budget="1M", ram_policy="lfu-cpu",
                n_ctx=256, n_threads=2, verbose=False, hw="rtx3060-ddr4")
    try:
        stats = llm.expert_stats()
        assert llm._saem_engine.ram_tier is not None and llm._saem_engine.ram_tier.policy_name == "lfu-cpu"
        assert _greedy(llm._saem_engine) == reference
        assert "ram_hit_rate" in llm.expert_stats() and stats["policy"] == "cpu-moe"
    finally:
        llm.close()


def test_cli_flags_reach_the_tier_in_generate_and_bench(private_model):
    """--ram-budget / --ram-policy / --ram-prefetch through the commands; bench keeps the tier
    across its policy switches (one note at load, the tier's hit rate in every row's stats)."""
    from conftest import run_cli

    r = run_cli("generate", "-m", str(private_model), "-p", "hi", "-n", "4", "--ecr", "0", "--hw", "rtx3060-ddr4",
                "--ram-budget", "1M", "--ram-policy", "lru-cpu", "--ram-prefetch", "thread")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("[saem] RAM tier: ") and "resident" in line]
    assert len(notes) == 1 and "policy lru-cpu, prefetch thread + routed experts" in notes[0], r.stderr
    out = private_model.parent / "bench.json"
    r = run_cli("bench", "-m", str(private_model), "-n", "2", "--reps", "1", "--max-prompts", "1",
                "--policies", "cpu-moe,saem", "--ecr", "0", "--hw", "rtx3060-ddr4", "--ram-budget", "1M",
                "--no-ram-route-prefetch", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    assert sum("RAM tier: " in line and "resident" in line for line in r.stderr.splitlines()) == 1, r.stderr
    import json

    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 2 and all(row["ram_accesses"] > 0 for row in rows), rows


def test_tier_under_a_vram_cache_keeps_the_output(private_model, reference):
    """Both tiers: experts in (CPU-device) slots come from the slots, the host branch's routed
    experts are read ahead; greedy output unchanged."""
    eng = _engine(private_model, policy="lru", ecr=0.5, ram_budget=AUTO, ram_policy="lru-cpu")
    try:
        assert eng.ram_tier is not None and eng.placement.state.n_slots.max() == N_EXPERT // 2
        assert _greedy(eng) == reference
        stats = eng.stats()
        assert stats["copies"] > 0 and stats["ram_route_prefetched"] > 0, stats
    finally:
        eng.close()


def test_native_api_mirrors_every_header_function():
    """native_api.py is the 1:1 mirror of saem_native.h: every SAEM_API function has a signature
    entry and a Python function of the same name, and the ABI and status codes agree."""
    import re

    header = (REPO / "native" / "saem_native.h").read_text()
    functions = re.findall(r"SAEM_API\s+[\w\s\*]+?\b(saem_\w+)\s*\(", header)
    assert len(functions) >= 30, functions
    for name in functions:
        assert name in na._SIGNATURES, name
        assert callable(getattr(na, name, None)), name
    assert set(na._SIGNATURES) == set(functions)
    assert f"SAEM_NATIVE_ABI_VERSION {na.ABI_VERSION}" in header
    for code, value in re.findall(r"#define (SAEM_(?:E_\w+|OK|RAM_\w+|COUNT_\w+|SINK_\w+))\s+(-?\d+)", header):
        assert getattr(na, code) == int(value), code
