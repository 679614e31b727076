"""Bad input: one line on stderr, exit code 1, never a traceback or a crash."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import run_cli, spec_for
from saem_gguf.testmodels import ensure_model


def assert_clean_error(r, *needles: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _write_custom(path: Path, arch: str, kv: dict, tensors: dict) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kv.items():
        w.add_uint32(k, v)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_file(tmp_path):
    assert_clean_error(run_cli("inspect", str(tmp_path / "nope.gguf")), "no such file")


def test_directory(tmp_path):
    assert_clean_error(run_cli("inspect", str(tmp_path)), "directory")


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    assert_clean_error(run_cli("inspect", str(p)), "not a GGUF")
    p.write_bytes(b"")
    assert_clean_error(run_cli("inspect", str(p)), "not a GGUF")


@pytest.mark.parametrize("frac", [0.0005, 0.01, 0.3, 0.999])
def test_truncated(tmp_path, frac):
    data = ensure_model(spec_for("qwen3moe", "q4_0")).read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: max(6, int(len(data) * frac))])
    assert_clean_error(run_cli("inspect", str(p)), "truncated")


def test_absurd_metadata(tmp_path):
    t = {"blk.0.ffn_up_exps.weight": np.zeros((4, 8, 32), np.float32)}
    base = {"qwen3moe.block_count": 1, "qwen3moe.embedding_length": 32}
    p = _write_custom(tmp_path / "a.gguf", "qwen3moe",
                      {**base, "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 9}, t)
    assert_clean_error(run_cli("inspect", str(p)), "expert_used_count")
    p = _write_custom(tmp_path / "b.gguf", "qwen3moe",
                      {**base, "qwen3moe.expert_count": 4_000_000_000, "qwen3moe.expert_used_count": 2}, t)
    assert_clean_error(run_cli("inspect", str(p)), "out of range")
    p = _write_custom(tmp_path / "c.gguf", "qwen3moe",
                      {"qwen3moe.block_count": 2_000_000_000, "qwen3moe.embedding_length": 32}, t)
    assert_clean_error(run_cli("inspect", str(p)), "block_count")
    p = _write_custom(tmp_path / "d.gguf", "qwen3moe",
                      {**base, "qwen3moe.expert_count": 6, "qwen3moe.expert_used_count": 2}, t)
    assert_clean_error(run_cli("inspect", str(p)), "does not hold expert_count")


def test_bad_flag_values(tmp_path):
    path = str(ensure_model(spec_for("qwen3moe", "q4_0")))
    r = run_cli("inspect", path, "--ecr", "2")  # a flag's value: a usage error, one line
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "out of range" in r.stderr, r.stderr
    assert_clean_error(run_cli("inspect", path, "--vram-budget", "lots"), "invalid size")
    r = run_cli("inspect", path, "-c", "many")
    assert r.returncode == 2 and "invalid int value" in r.stderr and "Traceback" not in r.stderr
