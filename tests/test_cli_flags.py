"""llama.cpp's load-time flags, the one --ecr unit and --hw: each flag parsed like a user types it,
loaded into llama.cpp, and its effect read back from llama.cpp (bindings, /proc, or its own log)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from conftest import run_cli, spec_for
from saem_gguf.cli.engine_args import engine_config
from saem_gguf.cli.main import build_parser
from saem_gguf.engine import Engine
from saem_gguf.errors import SaemError
from saem_gguf.llama_lib import load_llama_cpp
from saem_gguf.testmodels import ensure_model

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum."


@pytest.fixture(scope="module")
def model(llama_cpp) -> str:
    return str(ensure_model(spec_for("qwen3moe", "q8_0", n_expert=8, n_expert_used=2, n_layer=3, seed=5)))


@pytest.fixture(scope="module")
def model_hd32(llama_cpp) -> str:
    """Head size 32: quantized KV cache types (blocks of 32) fit it."""
    return str(ensure_model(spec_for("qwen3moe", "q8_0", n_head=2, n_head_kv=1, head_dim=32, seed=6)))


def open_with(*argv: str, **over) -> Engine:
    """An Engine from `generate` flags, parsed by the real CLI parser."""
    args = build_parser().parse_args(["generate", "-p", "x", "--quiet", "--hw", "rtx4090-ddr5", *argv])
    return Engine(engine_config(args, **over))


def one_line_usage_error(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    return r.stderr


# --- threads ----------------------------------------------------------------------------------

def test_threads_and_batch_threads_reach_the_context(model, llama_cpp):
    every = len(os.sched_getaffinity(0))  # llama.cpp reads -t / -tb of 0 or less as every CPU
    for argv, expected in ((["-t", "1", "-tb", "2"], (1, 2)), (["-t", "1"], (1, 1)),  # -tb defaults to -t
                           (["-t", "-1"], (every, every)), (["-t", "1", "-tb", "0"], (1, every))):
        eng = open_with("-m", model, *argv)
        try:
            assert (llama_cpp.llama_n_threads(eng.llm.ctx), llama_cpp.llama_n_threads_batch(eng.llm.ctx)) == expected
        finally:
            eng.close()


# --- context size ----------------------------------------------------------------------------------

def test_ctx_size_zero_is_the_models_context_length(model, llama_cpp):
    """llama.cpp's -c 0 (llama.vim's documented command line has --ctx-size 0): the context the
    GGUF was trained for, said in a note; the generated test models say 4096."""
    eng = open_with("-m", model, "-c", "0")
    try:
        assert eng.cfg.n_ctx == 4096 == llama_cpp.llama_n_ctx(eng.llm.ctx)
        assert any(n.startswith("-c 0: the model's context length, 4096") for n in eng.notes), eng.notes
    finally:
        eng.close()
    assert "must be >= 0, got -1" in one_line_usage_error(run_cli("generate", "-m", model, "-c", "-1", "-p", "x"))


def test_ctx_size_default_is_never_more_than_the_model_was_trained_for(model, llama_cpp):
    """No -c: 4096, or the model's own context length where that is shorter (llama.cpp's default
    is the model's own; the embedded model's is 2048); -c N is N."""
    short = str(ensure_model(spec_for("qwen3moe", "q8_0", n_expert=8, n_expert_used=2, n_layer=3, seed=5,
                                      n_ctx_train=1024)))
    for path, argv, expected in ((model, (), 4096), (short, (), 1024), (short, ("-c", "0"), 1024),
                                 (short, ("-c", "1536"), 1536)):
        eng = open_with("-m", path, *argv)
        try:
            assert eng.cfg.n_ctx == expected == llama_cpp.llama_n_ctx(eng.llm.ctx), (path, argv)
        finally:
            eng.close()


# --- batch sizes, KV cache types, flash attention -----------------------------------------------

def test_batch_sizes_reach_the_context(model, llama_cpp):
    eng = open_with("-m", model, "-b", "64", "-ub", "16", record=True)
    try:
        assert llama_cpp.llama_n_batch(eng.llm.ctx) == 64
        assert llama_cpp.llama_n_ubatch(eng.llm.ctx) == 16
        # a prompt of several ubatches: the routing of every one is read, not only the last's
        res = eng.generate(" ".join(["seven"] * 40), 2)
        assert res.prompt_tokens > 16
        trace = eng.sequence_trace()
        assert trace.experts.shape[0] == len(trace.token_ids) >= res.prompt_tokens  # a row per token
        assert (trace.experts[:, 0, :] >= 0).all()  # first MoE layer: every token routed
    finally:
        eng.close()
    eng = open_with("-m", model)  # llama.cpp's defaults
    try:
        assert llama_cpp.llama_n_batch(eng.llm.ctx) == 2048
        assert llama_cpp.llama_n_ubatch(eng.llm.ctx) == 512
    finally:
        eng.close()


def test_batch_size_does_not_change_the_output(model):
    outs = []
    for argv in (["-b", "8", "-ub", "8"], ["-b", "2048", "-ub", "512"]):
        eng = open_with("-m", model, "--policy", "saem", "--ecr", "25%", *argv)
        try:
            outs.append(eng.generate(PROMPT, 12).tokens)
        finally:
            eng.close()
    assert outs[0] == outs[1]


def _state_bytes(model: str, *argv: str) -> int:
    eng = open_with("-m", model, "-c", "256", *argv)
    try:
        eng.generate(PROMPT, 4)
        return eng._llama_cpp.llama_state_get_size(eng.llm.ctx)
    finally:
        eng.close()


def test_kv_cache_types_change_the_cache_memory(model_hd32):
    f16 = _state_bytes(model_hd32)
    q8 = _state_bytes(model_hd32, "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")
    f32 = _state_bytes(model_hd32, "-ctk", "f32", "-ctv", "f32")
    k_only = _state_bytes(model_hd32, "-ctk", "q8_0")
    assert q8 < k_only < f16 < f32


def test_kv_cache_type_that_does_not_fit_the_head_size_is_one_line(model):
    r = run_cli("generate", "-m", model, "-p", "x", "-n", "1", "-ctk", "q8_0", "--hw", "rtx4090-ddr5")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: -ctk q8_0")
    assert "Traceback" not in r.stderr
    one_line_usage_error(run_cli("generate", "-p", "x", "-ctk", "q9_9"))


@pytest.mark.parametrize("value,logged", [("on", "enabled"), ("off", "disabled"), ("auto", "auto"),
                                          ("0", "disabled")])
def test_flash_attention_setting_reaches_llama_cpp(model, value, logged):
    r = run_cli("generate", "-m", model, "-p", "x", "-n", "1", "-fa", value, "--verbose",
                "--hw", "rtx4090-ddr5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"flash_attn            = {logged}" in r.stderr


def test_flash_attention_bad_value_is_a_usage_error():
    assert "expected on, off or auto" in one_line_usage_error(run_cli("generate", "-p", "x", "-fa", "yes"))


# --- mmap, mlock --------------------------------------------------------------------------------

def _maps_and_locked(model: str, *argv: str) -> tuple[bool, int]:
    eng = open_with("-m", model, *argv)
    try:
        mapped = model in Path("/proc/self/maps").read_text()
        locked = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmLck:"))
        return mapped, locked
    finally:
        eng.close()


def test_no_mmap_and_mlock_reach_the_loader(model):
    mapped, locked = _maps_and_locked(model, "--no-mmap")
    assert not mapped and locked == 0
    mapped, locked = _maps_and_locked(model)
    assert mapped and locked == 0
    mapped, locked = _maps_and_locked(model, "--mlock")
    assert mapped and locked > 0


# --- extra buffer types: -nr -------------------------------------------------------------------

def test_no_repack_reaches_the_loader(model):
    """llama.cpp's -nr: no extra buffer type (repacked layout, AMX) for any weight, where without
    it the weights other than the experts get one as in stock. Read from llama.cpp's own log: Q4_0
    matrices (repacked on AVX2, AMX where the CPU has it), or F16 ones where the AMX tiles fault
    (the engine then keeps Q4_0 out of AMX itself; F16 runs there without tiles)."""
    from saem_gguf import native_api as na

    if na.saem_cpu_amx_tiles_fault():
        path = model
    else:
        path = str(ensure_model(spec_for("qwen3moe", "q8_0", matrix_type="q4_0", seed=5)))

    def extra_buffers(*argv: str) -> list[str]:
        r = run_cli("generate", "-m", path, "-p", "x", "-n", "1", "--verbose", "--hw", "rtx4090-ddr5", *argv)
        assert r.returncode == 0, r.stderr[-2000:]
        return [line for line in r.stderr.splitlines()
                if "model buffer size" in line and ("AMX" in line or "REPACK" in line)]

    stock_like = extra_buffers()
    if not stock_like:
        pytest.skip("this CPU has no extra buffer type for these weights")
    assert extra_buffers("-nr") == [] and extra_buffers("--no-repack") == []


# --- offload: -ngl, -cmoe, -ncmoe ---------------------------------------------------------------

def test_ngl_values(model, llama_cpp):
    for value, expect in (("auto", -1), ("all", -1), ("0", 0), ("12", 12)):
        args = build_parser().parse_args(["generate", "-p", "x", "-ngl", value])
        assert args.n_gpu_layers == expect
    assert "auto or all" in one_line_usage_error(run_cli("generate", "-p", "x", "-ngl", "most"))
    if not llama_cpp.llama_supports_gpu_offload():
        eng = open_with("-m", model, "-ngl", "4")
        try:
            assert any("-ngl is ignored" in n for n in eng.notes)
        finally:
            eng.close()


def _slots(eng: Engine) -> list[int]:
    from saem_gguf import native_api as na

    return [na.saem_moe_get_layer_info(eng.llm.ctx, il).n_slots
            for il in range(na.saem_moe_n_layers(eng.llm.ctx))]


def test_cpu_moe_and_n_cpu_moe_are_the_static_baselines(model):
    outs = {}
    for name, argv in (("cmoe", ["-cmoe"]), ("ncmoe", ["-ncmoe", "1"]), ("ncmoe0", ["-ncmoe", "0"]),
                       ("ncmoe9", ["--n-cpu-moe", "9"]), ("saem", ["--ecr", "25%"])):
        eng = open_with("-m", model, *argv)
        try:
            outs[name] = (eng.policy_name, _slots(eng), eng.generate(PROMPT, 12).tokens)
        finally:
            eng.close()
    assert outs["cmoe"][:2] == ("cpu-moe", [0, 0, 0])
    # llama.cpp's "first N layers": blk.0 keeps its experts on the CPU, the later layers hold all 8
    assert outs["ncmoe"][:2] == ("n-cpu-moe", [0, 8, 8])
    assert outs["ncmoe0"][1] == [8, 8, 8] and outs["ncmoe9"][1] == [0, 0, 0]
    # placement never changes what is computed
    assert len({tuple(o[2]) for o in outs.values()}) == 1


def test_offload_flag_conflicts_are_usage_errors():
    one_line_usage_error(run_cli("generate", "-p", "x", "-cmoe", "--policy", "saem"))
    one_line_usage_error(run_cli("generate", "-p", "x", "-ncmoe", "2", "--ecr", "25%"))
    one_line_usage_error(run_cli("generate", "-p", "x", "-ncmoe", "-1"))


# --- -ot ----------------------------------------------------------------------------------------

def test_override_tensor_reaches_the_loader(model):
    r = run_cli("generate", "-m", model, "-p", "x", "-n", "1", "--verbose", "--hw", "rtx4090-ddr5",
                "-ot", r"blk\.1\.attn_q\.weight=CPU", "-ot", r"blk\.2\.attn_k\.weight=CPU")
    assert r.returncode == 0, r.stderr[-2000:]
    overridden = [line for line in r.stderr.splitlines() if "buffer type overridden" in line]
    names = {line.split()[1] for line in overridden}
    assert {"blk.1.attn_q.weight", "blk.2.attn_k.weight"} <= names
    assert "blk.0.attn_q.weight" not in names
    experts = {f"blk.{i}.ffn_{m}_exps.weight" for i in range(3) for m in ("gate", "up", "down")}
    if load_llama_cpp().llama_supports_gpu_offload():
        # expert management's own override comes first and still decides every expert tensor
        assert experts <= names
    else:
        # a CPU-only build loads the experts as stock does: no override of them at all
        assert not experts & names


def test_override_tensor_errors(model):
    r = run_cli("generate", "-m", model, "-p", "x", "-n", "1", "-ot", "attn=NOPE0", "--hw", "rtx4090-ddr5")
    assert r.returncode == 1 and "unknown buffer type 'NOPE0'" in r.stderr and "CPU" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    one_line_usage_error(run_cli("generate", "-p", "x", "-ot", "no-equals-sign"))
    one_line_usage_error(run_cli("generate", "-p", "x", "-ot", "(unclosed=CPU"))


def test_override_tensor_meeting_expert_management(model):
    # into a device buffer: contradicts expert management, refused before loading
    r = run_cli("generate", "-m", model, "-p", "x", "-ot", "exps=CUDA0", "--hw", "rtx4090-ddr5")
    assert r.returncode == 1 and "expert management" in r.stderr and "Traceback" not in r.stderr
    # into host memory: agrees with it, said once
    eng = open_with("-m", model, "-ot", r"ffn_.*_exps=CPU")
    try:
        assert any("already stay in host memory" in n for n in eng.notes)
        assert eng.placement is not None
    finally:
        eng.close()


# --- NUMA ---------------------------------------------------------------------------------------

def test_numa_takes_llama_cpp_strategies(model):
    from saem_gguf import numa

    for value, ggml in (("distribute", 1), ("isolate", 2), ("numactl", 3)):
        p = numa.plan(value)
        assert p.llama_strategy == ggml and p.node is None  # llama.cpp's meaning: no pinning of ours
    assert numa.plan(None).llama_strategy == 0
    one_line_usage_error(run_cli("generate", "-p", "x", "--numa", "off"))
    two_nodes = numa.Topology({0: [0, 1], 1: [2, 3]}, gpu_nodes=[1])
    pinned = numa.plan(None, pin_gpu_node=True, topo=two_nodes)
    assert pinned.node == 1 and pinned.cpus == [2, 3]


# --- one --ecr unit -----------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("25%", 0.25), ("0.25", 0.25), ("12.5%", 0.125), ("1", 1.0),
                                        ("0", 0.0), ("100%", 1.0)])
def test_ecr_units(text, value):
    from saem_gguf.budget import parse_ecr

    assert parse_ecr(text) == pytest.approx(value)


def test_bare_percentage_is_refused_with_a_hint():
    from saem_gguf.budget import parse_ecr

    with pytest.raises(SaemError, match="write 25%"):
        parse_ecr("25")
    with pytest.raises(SaemError, match="out of range"):
        parse_ecr("150%")
    msg = one_line_usage_error(run_cli("generate", "-p", "x", "--ecr", "25"))
    assert "25%" in msg


ECR_COMMANDS = ("generate", "chat", "bench", "simulate", "inspect")


@pytest.mark.parametrize("command", ECR_COMMANDS)
def test_every_help_states_the_ecr_unit(command):
    r = run_cli(command, "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "(25%)" in text and "(0.25)" in text, text


def test_ecr_25_percent_through_every_command(model, tmp_path):
    hw = ("--hw", "rtx4090-ddr5")
    r = run_cli("generate", "-m", model, "-p", PROMPT, "-n", "4", "--ecr", "25%", "--json", *hw)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["experts"]["ecr"] == 0.25
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, "-m", "saem_gguf", "chat", "-m", model, "--ecr", "25%", "-n", "4", *hw],
                       input="hello\n/stats\n", capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "ECR 25.0%" in r.stdout, r.stderr
    out = tmp_path / "bench.json"
    r = run_cli("bench", "-m", model, "--policies", "cpu-moe,saem", "--ecr", "25%", "-n", "2", "--reps", "1",
                "--max-prompts", "1", "--json", str(out), "--quiet", *hw)
    assert r.returncode == 0, r.stderr
    assert {row["ecr"] for row in json.loads(out.read_text())["results"]} == {0.25}
    r = run_cli("simulate", "--synthetic", "--seqs", "1", "--calib-seqs", "1", "--stage-scale", "0.2",
                "--ecr", "25%", "--policies", "lru", "--json", "-", "--quiet", "--model", "qwen3-30b-a3b")
    assert r.returncode == 0, r.stderr
    assert {row["ecr"] for row in json.loads(r.stdout)["rows"]} == {25.0}  # the simulator counts in %
    r = run_cli("inspect", model, "--ecr", "25%", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["cache_plan"]["ecr"] == 0.25


# --- --hw ---------------------------------------------------------------------------------------

def test_hw_measure_is_fast_cached_and_reused(tmp_path, monkeypatch):
    from saem_gguf import hw_measure
    from saem_gguf.costmodel import get_hw

    monkeypatch.setenv("SAEM_GGUF_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    hw, path, measured = hw_measure.measured_profile("rtx4090-ddr5")
    first = time.perf_counter() - t0
    assert measured and path.is_file() and path.parent == tmp_path / "hw"
    assert first < 2.0, f"the first measurement took {first:.2f} s"
    assert hw.cpu_mem_bw > 1e8 and hw.cpu_flops_per_core > 1e6 and hw.cpu_cores >= 1
    assert "not measured" in hw.notes  # the GPU/link fallback is said in the profile
    assert "disk under the cache measured" in hw.notes and hw.ssd_read_bw > 1e6 and hw.ssd_latency_s > 0
    again, path2, measured2 = hw_measure.measured_profile("rtx4090-ddr5")
    assert not measured2 and path2 == path and again == hw
    assert get_hw("measure") == hw
    # another machine (or preset) is another cache entry
    other = dict(hw_measure.machine_identity(), cpu="another CPU")
    assert hw_measure.cache_path("rtx4090-ddr5", other) != path
    assert hw_measure.cache_path("h200-server") != path
    # the cached profile is a valid --hw FILE.json
    assert get_hw(str(path)) == hw


@pytest.mark.parametrize("content,needle", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"name": "x"}', "missing"),
])
def test_hw_file_errors_are_one_line(model, tmp_path, content, needle):
    p = tmp_path / "hw.json"
    p.write_text(content)
    r = run_cli("generate", "-m", model, "-p", "x", "-n", "1", "--hw", str(p))
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_hw_file_field_checks(tmp_path):
    import dataclasses

    from saem_gguf.costmodel import HW_PRESETS
    from saem_gguf.hw_measure import load_profile

    good = dataclasses.asdict(HW_PRESETS["rtx3060-ddr4"])
    for field, bad, needle in (("h2d_bw", 0, "must be > 0"), ("cpu_cores", 2.5, "whole number"),
                               ("cpu_mem_bw", "fast", "must be a number"), ("copy_barrier", 1, "true or false"),
                               ("turbo", 1, "unknown field")):
        p = tmp_path / f"{field}.json"
        p.write_text(json.dumps({**good, field: bad}))
        with pytest.raises(SaemError, match=needle):
            load_profile(p)
    with pytest.raises(SaemError, match="no such file"):
        load_profile(tmp_path / "absent.json")


def test_engine_prices_with_the_given_hardware(model, tmp_path):
    import dataclasses

    from saem_gguf.costmodel import HW_PRESETS

    p = tmp_path / "slow-link.json"
    p.write_text(json.dumps(dataclasses.asdict(HW_PRESETS["rtx3060-ddr4"].replace(name="slow", h2d_bw=1e6))))
    args = build_parser().parse_args(["generate", "-m", model, "-p", "x", "--quiet", "--hw", str(p)])
    eng = Engine(engine_config(args))
    try:
        assert eng.placement.policy.ctx.cost.hw.h2d_bw == 1e6
    finally:
        eng.close()
    r = run_cli("generate", "-m", model, "-p", "x", "--hw", "abacus")
    assert r.returncode == 1 and "unknown hardware" in r.stderr


def test_chat_replies_run_to_their_end_of_turn_by_default():
    # llama-cli's -n default is -1; with 512 the embedded model's longest replies lost their answer line
    from saem_gguf.cli.main import build_parser

    assert build_parser().parse_args(["chat"]).n_predict == -1
    assert build_parser().parse_args(["chat", "-n", "64"]).n_predict == 64


def test_inspect_ctx_size_zero_plans_for_the_models_context(model):
    r = run_cli("inspect", model, "-c", "0", "--ecr", "25%", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cache_plan"]["n_ctx"] == 4096


def test_escapes_in_the_prompt_and_stop_strings_as_llama_cpp_reads_them(model, tmp_path):
    """-e/--escape, on by default as in llama.cpp: the prompt (-p, and -f's text too) and -r have
    their escape sequences processed (cli.common.process_escapes, llama.cpp's
    string_process_escapes; compared with stock llama-server in test_serve_reference); --no-escape
    keeps them as typed."""
    def run(*argv: str) -> dict:
        r = run_cli("generate", "-m", model, "-n", "8", "--json", "--quiet", *argv)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    typed = "Q: 12 + 7?\\nA:\\t\\x41"  # as a shell passes -p 'Q: 12 + 7?\nA:\t\x41'
    meant = run("-p", "Q: 12 + 7?\nA:\tA")["prompt_tokens"]
    assert run("-p", typed)["prompt_tokens"] == meant
    assert run("-p", typed, "--escape")["prompt_tokens"] == meant
    literal = run("-p", typed, "--no-escape")
    assert literal["prompt_tokens"] != meant
    assert literal["prompt_tokens"] == run("-p", typed, "-e", "--no-escape")["prompt_tokens"]  # the last one holds
    f = tmp_path / "prompt.txt"
    f.write_text(typed + "\n")
    assert run("-f", str(f))["prompt_tokens"] == meant
    # -r: a stop string typed as \n is the newline
    free = run("-p", "Wait, let me verify", "-n", "40")
    assert "\n" in free["text"], free["text"]
    stopped = run("-p", "Wait, let me verify", "-n", "40", "-r", "\\n")
    assert stopped["text"] == free["text"][:free["text"].index("\n")] and stopped["finish_reason"] == "stop"
    r = run_cli("generate", "-m", model, "-p", "\\xff", "-n", "1", "--quiet")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        "error: -p/--prompt is not UTF-8 once its escape sequences are processed (byte 0xff at 0); --no-escape keeps "
        "them as typed")


def test_system_prompt_file_as_llama_cpp_reads_it(model, tmp_path):
    """-sysf FNAME (llama.cpp's): the file's text less one trailing newline is the system prompt;
    the later of -sys and -sysf holds; an unreadable file is one usage line."""
    f = tmp_path / "system.txt"
    f.write_text("You answer in one word.\n")

    def prompt(*argv: str) -> list[int]:
        r = run_cli("generate", "-m", model, "--chat", "-p", "Hi", "-n", "1", "--json", "--quiet", *argv)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["prompt_tokens"]

    given = prompt("-sys", "You answer in one word.")
    assert prompt("-sysf", str(f)) == given != prompt()
    assert prompt("-sys", "Other.", "-sysf", str(f)) == given
    r = run_cli("generate", "-m", model, "--chat", "-p", "Hi", "-sysf", str(tmp_path / "none.txt"))
    assert r.returncode == 2 and "-sysf/--system-prompt-file: cannot read" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_verbose_prompt_lists_the_prompt_tokens_as_llama_cpp(model):
    """--verbose-prompt (llama.cpp's): the prompt, its token count and each token as
    ``id -> 'piece'`` on stderr, the ids those generation used."""
    import re

    r = run_cli("generate", "-m", model, "-p", PROMPT, "-n", "2", "--json", "--quiet", "--verbose-prompt")
    assert r.returncode == 0, r.stderr
    used = json.loads(r.stdout)["prompt_tokens"]
    assert f"prompt: '{PROMPT}'" in r.stderr and f"number of tokens in prompt = {len(used)}" in r.stderr
    listed = [int(m) for m in re.findall(r"^ *(\d+) -> '", r.stderr, re.M)]
    assert listed == used


def test_log_disable_and_threads_http_as_llama_cpp_takes_them(model):
    """--log-disable (every model command, llama.cpp's): nothing on stderr, even with -v before
    or after it; serve's --threads-http N (llama-server's) is taken and checked."""
    for argv in (["--log-disable", "-v"], ["-v", "--log-disable"]):
        r = run_cli("generate", "-m", model, "-p", PROMPT, "-n", "2", *argv)
        assert r.returncode == 0 and r.stderr == "" and r.stdout.strip(), (argv, r.stderr)
    r = run_cli("serve", "-m", "/nonexistent/m.gguf", "--port", "0", "--threads-http", "4")
    assert r.returncode == 1 and "no such file" in r.stderr.strip().splitlines()[-1]  # parsed, then the model
    r = run_cli("serve", "--port", "0", "--threads-http", "x")
    assert r.returncode == 2 and "--threads-http" in r.stderr and "Traceback" not in r.stderr
