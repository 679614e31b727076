"""bench/device/prepare.sh + run.sh --dry-run: the device script's every step, on this machine's CPU
build with tiny models, so that the 15 device minutes are never lost to a bug a CPU can show."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

EXPECTED_FILES = {"log.txt", "env.txt", "correctness.json", "bench.md", "bench.json", "overlap.json",
                  "placement_cost.json"}


def _sh(script: str, *args: str, out=None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(REPO / "bench" / "device" / script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, llama_cpp):
    b = tmp_path_factory.mktemp("device") / "bundle"
    r = _sh("prepare.sh", "--dry-run", "--bundle", str(b))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (b / "bundle.json").is_file() and (b / "py" / "llama_cpp" / "llama_cpp.py").is_file()
    assert not (b / "py" / "llama_cpp" / "lib").exists()  # the bindings travel without a library
    return b


def test_stale_bundle_stops_the_run_before_anything_is_measured(bundle, tmp_path):
    stale = tmp_path / "stale"
    subprocess.run(["cp", "-r", str(bundle), str(stale)], check=True)
    manifest = json.loads((stale / "bundle.json").read_text())
    (stale / "bundle.json").write_text(json.dumps({**manifest, "key": manifest["key"][:-4] + "0000"}))
    out = tmp_path / "out"
    r = _sh("run.sh", "--dry-run", "--bundle", str(stale), out=out, timeout=120)
    assert r.returncode == 1
    assert "error: stale device bundle" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (out / "correctness.json").exists()


def test_missing_bundle_is_one_clear_error(tmp_path):
    r = _sh("run.sh", "--dry-run", "--bundle", str(tmp_path / "none"), out=tmp_path / "out", timeout=60)
    assert r.returncode == 1 and "holds neither prebuilt libraries nor the source" in r.stdout + r.stderr


def test_dry_run_end_to_end(bundle, tmp_path):
    out = tmp_path / "out"
    r = _sh("run.sh", "--dry-run", "--bundle", str(bundle), out=out, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = {p.name for p in out.iterdir()}
    assert files == EXPECTED_FILES and len(files) <= 8  # the device tool brings back 8 files at most
    corr = json.loads((out / "correctness.json").read_text())
    assert corr["ok"] and corr["modes"]["cpu"]["counts"]["equal"]
    assert set(corr["modes"]["cpu"]["greedy_first_divergence"].values()) == {None}
    assert set(corr["logits_vs_cpu"]) == {"gpu-all", "saem@0.25 [cpu]"}
    for name, cmp in corr["logits_vs_cpu"].items():  # the CPU backend against itself: exact
        assert cmp["max_rel_err"] == 0.0 and cmp["same_argmax"], name
    bench = json.loads((out / "bench.json").read_text())
    got = {(x["policy"], x["ecr"]) for x in bench["results"]}
    for pol in ("n-cpu-moe", "static-hot", "lru-cpu", "lfu-cpu", "saem", "saem-cue"):
        assert {(pol, e) for e in (0.125, 0.25, 0.5)} <= got
    assert {("gpu-all", None), ("cpu-moe", None)} <= got
    assert bench["reps"] >= 3 and all(len(x["decode_tps"]) == bench["reps"] for x in bench["results"])
    assert any("no GPU" in n for n in bench["vram_budget_auto"])
    overlap = json.loads((out / "overlap.json").read_text())
    assert overlap["copies_per_step"] > 0 and overlap["copies_alone_ms_median"] > 0
    cost = {row["policy"]: row for row in json.loads((out / "placement_cost.json").read_text())}
    assert set(cost) == {"cpu-moe", "saem"}
    assert all(row["tokens"] > 0 and row["median_us"] > 0 and row["replay_median_us"] > 0 for row in cost.values())
    env = (out / "env.txt").read_text()
    assert json.loads((bundle / "bundle.json").read_text())["key"] in env
    # stock llama.cpp's own buffers for -ot exps=CPU (docs/NATIVE.md): three loads, each named
    layouts = [line for line in env.splitlines() if line.startswith("-ot _exps=CPU")]
    assert len(layouts) == 3 and all("model buffer size" in line for line in layouts), env
