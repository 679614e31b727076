"""Expert slots in host memory (a build without GPU offload) are bounded by the memory available
after loading: the default cache shrinks to fit, a size the user gave that does not fit is one
error line. Before, the slots were allocated and zeroed whatever the memory, and under a cgroup
limit where `--ecr 0` ran the default run was killed (rc 137, no word)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import saem_gguf.engine as engine_mod
from conftest import REPO, spec_for
from saem_gguf.engine import HOST_SLOT_MARGIN_BYTES, HOST_SLOT_MARGIN_FRACTION, Engine, EngineConfig
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import read_model_info
from saem_gguf.resources import cgroup_memory_room
from saem_gguf.testmodels import ensure_model

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum."


@pytest.fixture(scope="module")
def small(llama_cpp):
    return ensure_model(spec_for("qwen3moe", "q8_0", n_expert=16, n_expert_used=4, n_layer=3, seed=5))


def _available_for(path: Path, slots: float) -> int:
    """The available bytes under which ``slots`` slots per layer (all on the CPU) fit after the margin."""
    per_slot = read_model_info(path).bytes_per_expert_all_layers
    return int((HOST_SLOT_MARGIN_BYTES + slots * per_slot) / (1 - HOST_SLOT_MARGIN_FRACTION)) + 1


def _run(path: Path, **kw) -> tuple[list[int], np.ndarray, list[str]]:
    notes: list[str] = []
    eng = Engine(EngineConfig(model=path, n_ctx=256, n_threads=2, progress=False, **kw), log=notes.append)
    try:
        n_slots = eng.placement.state.n_slots.copy() if eng.placement else np.zeros(0, np.int32)
        return eng.generate(PROMPT, 12).tokens, n_slots, notes
    finally:
        eng.close()


def test_the_default_cache_shrinks_to_the_memory_available_and_answers_the_same(small, monkeypatch):
    roomy, slots_roomy, _ = _run(small)
    assert slots_roomy.sum() == 3 * 4  # the default ECR, 25 % of 16, in each of 3 layers
    monkeypatch.setattr(engine_mod, "available_memory", lambda: _available_for(small, 2.5))
    tight, slots_tight, notes = _run(small)
    assert slots_tight.sum() == 3 * 2
    assert any("4 slots per layer need" in n and "using 2/16" in n for n in notes), notes
    assert tight == roomy  # placement never changes results


@pytest.mark.parametrize("kw,flag", [(dict(ecr=0.5), "--ecr 50%"), (dict(n_cpu_moe=1, policy="n-cpu-moe"), "-ncmoe 1")])
def test_a_cache_size_the_user_gave_that_does_not_fit_is_one_error(small, monkeypatch, kw, flag):
    monkeypatch.setattr(engine_mod, "available_memory", lambda: _available_for(small, 1.5))
    with pytest.raises(SaemError) as e:
        _run(small, **kw)
    msg = str(e.value)
    assert msg.startswith(f"{flag}: the expert cache needs") and msg.endswith(f"lower {flag.split()[0]}"), msg
    assert "\n" not in msg


def test_without_a_known_bound_the_cache_is_as_asked(small, monkeypatch):
    monkeypatch.setattr(engine_mod, "available_memory", lambda: None)
    _, n_slots, _ = _run(small, ecr=0.5)
    assert n_slots.sum() == 3 * 8  # 50 % of 16 in each of 3 layers (the layout may move them between layers)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_room_is_the_limit_less_anonymous_memory(tmp_path, version):
    proc = tmp_path / "cgroup"
    if version == "v2":
        proc.write_text("0::/user.slice/job\n")
        base = tmp_path / "user.slice" / "job"
        base.mkdir(parents=True)
        (base / "memory.max").write_text("1073741824\n")
        (base / "memory.stat").write_text("anon 104857600\nfile 524288000\n")
    else:
        proc.write_text("12:cpu,cpuacct:/job\n9:memory:/job\n")
        base = tmp_path / "memory" / "job"
        base.mkdir(parents=True)
        (base / "memory.limit_in_bytes").write_text("1073741824\n")
        (base / "memory.stat").write_text("cache 524288000\nrss 104857600\ntotal_rss 104857600\n")
    # page cache (a mapped model) is reclaimable: only the anonymous memory counts
    assert cgroup_memory_room(tmp_path, proc) == (1 << 30) - 100 * (1 << 20)
    (base / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(
        "max\n" if version == "v2" else "9223372036854771712\n")
    assert cgroup_memory_room(tmp_path, proc) is None  # no limit


def test_cgroup_files_it_cannot_read_give_no_bound_not_a_crash(tmp_path):
    """/proc/self/cgroup or the memory files in a shape this reader does not know (a container
    runtime's own, a truncated read) leave the bound unknown; before, a line without two colons
    raised ValueError out of every engine load."""
    proc = tmp_path / "cgroup"
    base = tmp_path / "memory" / "job"
    base.mkdir(parents=True)
    proc.write_text("garbage line\n9:memory:/job\n")
    (base / "memory.limit_in_bytes").write_text("lots\n")
    (base / "memory.stat").write_text("total_rss 12\n")
    assert cgroup_memory_room(tmp_path, proc) is None
    (base / "memory.limit_in_bytes").write_text("1073741824\n")
    (base / "memory.stat").write_text("total_rss twelve\n")
    assert cgroup_memory_room(tmp_path, proc) is None
    (base / "memory.stat").write_text("total_rss 12\n")
    assert cgroup_memory_room(tmp_path, proc) == (1 << 30) - 12  # the garbage line is skipped


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not os.access(CGROUP_V1, os.W_OK), reason="needs root and cgroup v1 memory")
def test_under_a_cgroup_limit_the_default_runs_where_it_was_killed(tmp_path):
    """A 612 MiB-expert model under a 250 MiB memory cgroup: `--ecr 0` runs (the mapped file's
    pages are dropped as needed); the default's 153 MiB of slots do not fit, so it runs with fewer
    (it was killed: rc 137); `--ecr 25%` is one error line."""
    model = tmp_path / "big.gguf"
    subprocess.run([sys.executable, "-m", "saem_gguf", "gen-model", "--expert-type", "q8_0", "--layers", "4",
                    "--embd", "1024", "--ff", "768", "--experts", "64", "--top-k", "4", "--expert-pool", "4",
                    "-o", str(model)], check=True, capture_output=True, cwd=REPO, timeout=300)
    group = CGROUP_V1 / f"saem-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(250 << 20))

        def run(*extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "saem_gguf", "generate", "-m", str(model), "-p", "hello",
                                   "-n", "4", *extra], capture_output=True, text=True, cwd=REPO, timeout=300,
                                  preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))

        base = run("--ecr", "0")
        assert base.returncode == 0, base.stderr  # the premise: the model itself runs in the limit
        default = run()
        assert default.returncode == 0, default.stderr
        assert "slots per layer need" in default.stderr and "using " in default.stderr, default.stderr
        given = run("--ecr", "25%")
        assert given.returncode == 1 and "Traceback" not in given.stderr
        errors = [line for line in given.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: --ecr 25%: the expert cache needs"), given.stderr
    finally:
        group.rmdir()


@pytest.mark.parametrize("fits", [True, False])
def test_with_a_gpu_experts_stay_mapped_where_pinned_memory_would_not_hold_them(small, monkeypatch, llama_cpp, fits):
    """The engine as it decides on a GPU build (offload supported, a pinned host buffer type
    offered; faked here, on the CPU build, where both buffers are the CPU's): the experts go to
    pinned memory, read without mmap, where they fit; else they stay mapped from the file."""
    from saem_gguf import native_api as na
    from saem_gguf.engine import PINNED_MARGIN_BYTES, PINNED_MARGIN_FRACTION, pin_experts

    real = na.saem_expert_host_buft
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(na, "saem_expert_host_buft", lambda want_pinned: (real(want_pinned)[0], bool(want_pinned)))
    asked: list[bool] = []  # what the loader's expert override was asked for
    keep = na.keep_experts_on_host
    monkeypatch.setattr(na, "keep_experts_on_host",
                        lambda params, pinned=True: asked.append(pinned) or keep(params, pinned=pinned))
    expert_bytes = read_model_info(small).expert_bytes
    avail = int((PINNED_MARGIN_BYTES + expert_bytes * (1.5 if fits else 0.5)) / (1 - PINNED_MARGIN_FRACTION))
    assert pin_experts(expert_bytes, avail) is fits
    monkeypatch.setattr(engine_mod, "available_memory", lambda: avail)
    notes: list[str] = []
    eng = Engine(EngineConfig(model=small, n_ctx=256, n_threads=2, progress=False), log=notes.append)
    try:
        mapped, _ = na.saem_ram_experts_mapped(eng.llm.ctx)
    finally:
        eng.close()
    assert mapped is not fits and asked == [fits]
    assert any("pinned host memory, so the model is read without mmap" in n for n in notes) is fits, notes
    assert any("they stay mapped from the file" in n for n in notes) is not fits, notes


def test_pinned_experts_need_the_margin_beside_them():
    from saem_gguf.engine import PINNED_MARGIN_BYTES, pin_experts

    assert pin_experts(10 << 30, None)  # nothing known: as before
    assert pin_experts(1 << 30, 32 << 30)
    assert not pin_experts(17 << 30, 16 << 30)  # a Qwen3-30B-A3B Q4 on a 16 GiB machine
    assert not pin_experts(1 << 30, (1 << 30) + PINNED_MARGIN_BYTES)  # the margin's 10 % is missing
