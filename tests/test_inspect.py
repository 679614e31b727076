"""`inspect` reports exactly what the generator wrote."""

from __future__ import annotations

import json

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from conftest import run_cli, spec_for
from saem_gguf.budget import parse_ecr, parse_size, plan_from_budget, plan_from_ecr
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import read_model_info
from saem_gguf.testmodels import ensure_model

QT = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0,
      "q4_0": GGMLQuantizationType.Q4_0, "q4_k": GGMLQuantizationType.Q4_K}


def expert_bytes(n_rows: int, row: int, quant: str) -> int:
    block, size = GGML_QUANT_SIZES[QT[quant]]
    return n_rows * (row // block) * size


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "q4_0"), ("qwen2moe", "q8_0"), ("llama", "f16"),
                                        ("qwen3moe", "q4_k")])
def test_inspect_matches_generator(arch, quant):
    spec = spec_for(arch, quant, n_layer=3, n_expert=16, n_expert_used=4, seed=3)
    info = read_model_info(ensure_model(spec))
    assert info.architecture == arch
    assert info.n_layer == spec.n_layer
    assert info.n_expert == spec.n_expert and info.n_expert_used == spec.n_expert_used
    assert info.n_ff_exp == spec.n_ff_exp
    assert info.n_embd == spec.n_embd and info.n_head_kv == spec.n_head_kv
    assert info.n_expert_shared == (1 if arch == "qwen2moe" else 0)
    assert info.expert_types == [QT[quant].name]
    assert info.matrix_types == ["F16", "F32"]  # attention etc. in F16; the router's F32
    assert [l.index for l in info.moe_layers] == list(range(spec.n_layer))
    # gate + up: n_ff rows of n_embd; down: n_embd rows of n_ff
    per = 2 * expert_bytes(spec.n_ff_exp, spec.n_embd, quant) + expert_bytes(spec.n_embd, spec.n_ff_exp, quant)
    assert all(l.bytes_per_expert == per for l in info.moe_layers)
    assert info.expert_bytes == per * spec.n_expert * spec.n_layer
    assert info.bytes_per_expert_all_layers == per * spec.n_layer
    assert info.non_expert_bytes > 0
    assert info.expert_bytes + info.non_expert_bytes < info.file_bytes


def test_inspect_cli_json_and_ecr_budget_roundtrip():
    spec = spec_for("qwen3moe", "q4_0", n_expert=32, n_expert_used=4)
    path = str(ensure_model(spec))
    r = run_cli("inspect", path, "--json", "--ecr", "25%", "--overhead", "1M")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["n_expert"] == 32 and d["is_moe"] is True
    plan = d["cache_plan"]
    assert plan["slots_per_layer"] == 8 and plan["ecr"] == 0.25
    # the budget that --ecr says it needs buys exactly those slots back
    r2 = run_cli("inspect", path, "--json", "--vram-budget", str(plan["vram_bytes"]), "--overhead", "1M")
    assert json.loads(r2.stdout)["cache_plan"]["slots_per_layer"] == 8
    r3 = run_cli("inspect", path)
    assert r3.returncode == 0 and "32 routed, top-4" in r3.stdout


def test_budget_edges():
    info = read_model_info(ensure_model(spec_for("qwen3moe", "q8_0")))
    with pytest.raises(SaemError, match="below"):
        plan_from_budget(info, 1000, overhead=0)
    big = plan_from_budget(info, parse_size("1G"), overhead=0)
    assert big.slots_per_layer == info.n_expert and "every expert fits" in big.note
    assert plan_from_ecr(info, 0.0, overhead=0).slots_per_layer == 0
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("2GB") == 2 * 10**9
    assert parse_ecr("12.5%") == 0.125
    for bad in ("2", "-0.1", "abc", "nan"):
        with pytest.raises(SaemError):
            parse_ecr(bad)
    with pytest.raises(SaemError):
        parse_size("12 parsecs")


def test_dense_model_reported_as_dense():
    info = read_model_info(ensure_model(spec_for("llama", "f16", dense=True)))
    assert not info.is_moe and info.n_expert == 0
    r = run_cli("inspect", info.path)
    assert r.returncode == 0 and "dense model" in r.stdout
    r = run_cli("inspect", info.path, "--ecr", "0.5")
    assert r.returncode == 1 and "dense" in r.stderr


def test_inspect_names_the_types_of_the_other_matrices():
    """The matrix types decide llama.cpp's extra buffer types (repacked, AMX) for the non-expert
    weights; the token embedding, only read by rows, is not among them."""
    path = ensure_model(spec_for("qwen3moe", "q8_0", matrix_type="q4_0", seed=3))
    assert read_model_info(path).matrix_types == ["F32", "Q4_0"]
    r = run_cli("inspect", str(path))
    assert r.returncode == 0, r.stderr
    assert "(matrices F32, Q4_0)" in r.stdout
