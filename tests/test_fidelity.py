"""Fidelity: the same prompt tokens and the same text as llama-cpp-python on the STOCK llama.cpp.

The reference runs in a subprocess (one libllama per process): stock llama-cpp-python bound to the
unpatched build of the same llama.cpp (``python -m saem_gguf build --variant stock``; setup.sh makes
it), calling ``create_completion`` / ``create_chat_completion`` (tests/fidelity_reference.py). Our
side runs here on the patched build with expert management on: the engine's raw generation, a
chat prompt (``generate --chat``), a multi-turn ``ChatSession`` and the public ``saem_gguf.Llama``.
Models: every architecture the test-model generator writes, with and without
``tokenizer.ggml.add_bos_token``, with ChatML and with a Gemma-like template that writes
``{{ bos_token }}`` and ends turns with an EOT that is not EOS; every placement policy on some of
them. A compact matrix runs by default, the full one under ``-m slow``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from native_helpers import spec, stock_load_repacks
from fidelity_helpers import N_CTX, engine, model_for, reference, result_row, run_reference, same, stock_env, stock_lib  # noqa: F401,E501
from saem_gguf import native_api as na
from saem_gguf.chat import ChatSession
from saem_gguf.engine import Engine, EngineConfig, SamplingConfig
from saem_gguf.policies import POLICIES
from saem_gguf.testmodels import ensure_model

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum."
SYSTEM = "You check every step."
TURNS = ["What is 2 + 3?", "And that times 4?", "Check it again, please."]
N_COMPLETION, N_CHAT = 12, 8

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe", "deepseek2", "gpt-oss", "glm4moe")
TEMPLATES = (("chatml", False), ("chatml", True), ("gemma", True))  # (chat template, add_bos_token)
LIVE_POLICIES = tuple(p for p in POLICIES if p != "oracle")


# the default (fast) matrix: both template kinds, BOS on and off, four policies
FAST = {("qwen3moe", "chatml", False): "saem", ("qwen3moe", "gemma", True): "lru",
        ("llama", "chatml", True): "saem-cue", ("gpt-oss", "gemma", True): "cpu-moe"}


def _matrix() -> list:
    """Every (architecture, template/BOS variant); the other policies go round the slow rows, so
    every policy runs on some architecture."""
    others = [p for p in LIVE_POLICIES if p not in FAST.values()]
    rows, j = [], 0
    for arch in ARCHS:
        for template, add_bos in TEMPLATES:
            key = (arch, template, add_bos)
            if key in FAST:
                rows.append(pytest.param(*key, FAST[key], id=f"{arch}-{template}-{add_bos}-{FAST[key]}"))
            else:
                policy = others[j % len(others)]
                j += 1
                rows.append(pytest.param(*key, policy, id=f"{arch}-{template}-{add_bos}-{policy}",
                                         marks=pytest.mark.slow))
    assert {r.values[3] for r in rows} == set(LIVE_POLICIES)
    return rows


MATRIX = _matrix()


CASES = [{"kind": "completion", "prompt": PROMPT, "max_tokens": N_COMPLETION},
         {"kind": "chat", "system": SYSTEM, "turns": TURNS[:1], "max_tokens": N_COMPLETION},
         {"kind": "chat", "system": SYSTEM, "turns": TURNS, "max_tokens": N_CHAT}]


def _engine_side(eng: Engine) -> list[list[dict]]:
    raw = [result_row(eng.generate(PROMPT, N_COMPLETION))]
    prompt = eng.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}])
    res = eng.generate(prompt, N_COMPLETION)
    one = [{"prompt_tokens": prompt.tokens, "text": res.text, "finish_reason": res.finish_reason}]
    session = ChatSession(eng, system=SYSTEM, n_predict=N_CHAT, out=io.StringIO())
    multi = []
    for user in TURNS:
        reply = session.answer(user)
        multi.append({"prompt_tokens": session.last_prompt.tokens, "text": reply,
                      "finish_reason": session.last_finish_reason})
    return [raw, one, multi]


def _api_side(model, policy: str) -> list[list[dict]]:
    from saem_gguf import Llama

    class Recording(Llama):
        def generate(self, tokens, *args, **kwargs):
            self.prompts.append([int(t) for t in tokens])
            return super().generate(tokens, *args, **kwargs)

    def fresh():
        llm = Recording(str(model), n_ctx=N_CTX, n_threads=2, expert_policy=policy, ecr="25%",
                        verbose=False)
        llm.prompts = []
        assert llm.expert_stats()["policy"] == policy
        return llm

    out = []
    llm = fresh()
    c = llm.create_completion(PROMPT, max_tokens=N_COMPLETION, temperature=0.0)["choices"][0]
    out.append([{"prompt_tokens": llm.prompts[-1], "text": c["text"], "finish_reason": c["finish_reason"]}])
    llm.close()
    for turns, n in ((TURNS[:1], N_COMPLETION), (TURNS, N_CHAT)):
        llm = fresh()
        messages = [{"role": "system", "content": SYSTEM}]
        calls = []
        for user in turns:
            messages.append({"role": "user", "content": user})
            c = llm.create_chat_completion(messages, max_tokens=n, temperature=0.0)["choices"][0]
            calls.append({"prompt_tokens": llm.prompts[-1], "text": c["message"]["content"],
                          "finish_reason": c["finish_reason"]})
            messages.append({"role": "assistant", "content": c["message"]["content"]})
        out.append(calls)
        llm.close()
    return out


@pytest.mark.parametrize("arch,template,add_bos,policy", MATRIX)
def test_same_tokens_and_text_as_stock_llama_cpp_python(llama_cpp, stock_lib, arch, template, add_bos,
                                                         policy):
    model = model_for(arch, template, add_bos)
    ref = reference(stock_lib, model, CASES)
    bos_first = ref[0][0]["prompt_tokens"][0]
    eng = engine(model, policy)
    try:
        if add_bos:  # the GGUF asks for BOS, and the stock side put it first
            assert bos_first == eng.llm.token_bos()
        ours = _engine_side(eng)
    finally:
        eng.close()
    api = _api_side(model, policy)
    for name, side in (("engine", ours), ("Llama API", api)):
        for case, (got, want) in enumerate(zip(side, ref)):
            assert len(got) == len(want)
            for turn, (g, w) in enumerate(zip(got, want)):
                same(g, w, f"{name}, case {case}, turn {turn}")


def test_gemma_like_bos_template_has_one_bos(llama_cpp, stock_lib):
    """The template writes {{ bos_token }} and the GGUF says add_bos_token: one BOS, as
    create_chat_completion (Jinja formatter: added_special) makes it."""
    model = model_for("qwen3moe", "gemma", True)
    eng = engine(model, "saem")
    try:
        p = eng.chat_prompt([{"role": "user", "content": TURNS[0]}])
        assert p.text.startswith("<bos><start_of_turn>user\n")
        assert p.tokens.count(eng.llm.token_bos()) == 1 and p.tokens[0] == eng.llm.token_bos()
    finally:
        eng.close()


def test_cli_generate_and_chat_match_stock(stock_lib):
    """The commands themselves (not only the engine): generate --json raw and --chat, and a scripted
    multi-turn chat, on the Gemma-like model."""
    model = model_for("qwen3moe", "gemma", True)
    ref = reference(stock_lib, model, CASES)
    base = [sys.executable, "-m", "saem_gguf"]
    common = ["-m", str(model), "-c", str(N_CTX), "-t", "2", "--quiet"]
    raw = subprocess.run(base + ["generate", *common, "-p", PROMPT, "-n", str(N_COMPLETION), "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert raw.returncode == 0, raw.stderr
    d = json.loads(raw.stdout)
    same({"prompt_tokens": d["prompt_tokens"], "text": d["text"], "finish_reason": d["finish_reason"]},
          ref[0][0], "generate")
    chat1 = subprocess.run(base + ["generate", *common, "--chat", "-sys", SYSTEM, "-p", TURNS[0], "-n",
                                   str(N_COMPLETION), "--json"], capture_output=True, text=True, timeout=300,
                           cwd=REPO)
    assert chat1.returncode == 0, chat1.stderr
    d = json.loads(chat1.stdout)
    same({"prompt_tokens": d["prompt_tokens"], "text": d["text"], "finish_reason": d["finish_reason"]},
          ref[1][0], "generate --chat")
    chat = subprocess.run(base + ["chat", *common, "-sys", SYSTEM, "-n", str(N_CHAT)],
                          input="".join(t + "\n" for t in TURNS), capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert chat.returncode == 0, chat.stderr
    # the terminal shows undecodable bytes as U+FFFD; llama-cpp-python's text drops them
    assert chat.stdout.replace("\ufffd", "") == "".join(c["text"] + "\n" for c in ref[2])


def test_seeded_sampling_matches_stock(llama_cpp, stock_lib):
    """temperature > 0 with a fixed seed: llama-cpp-python's sampler, the same draws."""
    model = model_for("qwen2moe", "chatml", True)
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "seed": s}
             for s in (0, 1234)]
    ref = reference(stock_lib, model, cases)
    assert ref[0][0]["text"] != ref[1][0]["text"]  # the seed matters (else this proves nothing)
    eng = engine(model, "lru")
    try:
        for s, want in zip((0, 1234), ref):
            same(result_row(eng.generate(PROMPT, 24, SamplingConfig(temp=0.9, seed=s))), want[0],
                 f"seed {s}")
    finally:
        eng.close()
    from saem_gguf import Llama

    llm = Llama(str(model), n_ctx=N_CTX, n_threads=2, verbose=False)
    try:
        for s, want in zip((0, 1234), ref):
            c = llm.create_completion(PROMPT, max_tokens=24, temperature=0.9, seed=s)["choices"][0]
            assert c["text"] == want[0]["text"], f"API, seed {s}"
    finally:
        llm.close()


# llama.cpp takes any top_p, min_p and typical_p: at or past one end a sampler does nothing, past the
# other it keeps one token (llama-server clamps top_p and min_p into [0, 1]; serve does too)
PAST_THEIR_ENDS = [{"top_p": 1.5}, {"min_p": 2.0}, {"typical_p": -0.5}, {"top_p": -0.5, "min_p": -1.0},
                   {"typical_p": 1.5, "top_k": -3}]


def test_sampling_values_past_their_ends_draw_as_stock(llama_cpp, stock_lib):
    model = model_for("qwen2moe", "chatml", True)
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "seed": 5,
              "sampling": s} for s in PAST_THEIR_ENDS]
    ref = reference(stock_lib, model, cases)
    assert len({r[0]["text"] for r in ref}) >= 3  # the values matter (else this proves nothing)
    eng = engine(model, "lru")
    try:
        for s, want in zip(PAST_THEIR_ENDS, ref):
            same(result_row(eng.generate(PROMPT, 24, SamplingConfig(temp=0.9, seed=5, **s))), want[0], str(s))
    finally:
        eng.close()


@pytest.mark.parametrize("overrides", [{"qwen2moe.expert_used_count": 1}, {"tokenizer.ggml.add_bos_token": False},
                                       {"qwen2moe.expert_used_count": 1, "tokenizer.ggml.add_bos_token": False}])
def test_kv_overrides_answer_as_stock_with_them(llama_cpp, stock_lib, overrides):
    """--override-kv: llama.cpp loads the model with the metadata changed (fewer experts per token,
    no BOS), as stock llama-cpp-python's Llama(kv_overrides=...); the placement routes as many."""
    model = model_for("qwen2moe", "chatml", True)
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": 16, "model": {"kv_overrides": overrides}},
             {"kind": "completion", "prompt": PROMPT, "max_tokens": 16}]
    ref = reference(stock_lib, model, cases)
    assert ref[0][0] != ref[1][0]  # the override changes the answer (else this proves nothing)
    eng = engine(model, "lru", kv_overrides=tuple(overrides.items()))
    try:
        if "qwen2moe.expert_used_count" in overrides:
            assert eng.placement.top_k == eng.info.n_expert_used == overrides["qwen2moe.expert_used_count"]
        same(result_row(eng.generate(PROMPT, 16)), ref[0][0], str(overrides))
    finally:
        eng.close()


def test_rope_scaling_flags_answer_as_stock_with_them(llama_cpp, stock_lib):
    """--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx N (a context stretched past training, as
    for Qwen3 at 128k): llama.cpp builds the context with them, as stock llama-cpp-python's
    Llama(rope_scaling_type=..., rope_freq_scale=..., yarn_orig_ctx=...); -nkvo keeps the KV cache
    in host memory (a CPU build has it there anyway: the setting is checked on the context)."""
    from saem_gguf.engine import RopeConfig

    from saem_gguf.default_model import default_model_path

    model = default_model_path()  # trained: the random test models answer alike under any scaling
    stretched = {"rope_scaling_type": 2, "rope_freq_scale": 0.25, "yarn_orig_ctx": 64}
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": 16, "model": stretched},
             {"kind": "completion", "prompt": PROMPT, "max_tokens": 16}]
    ref = reference(stock_lib, model, cases)
    assert ref[0][0] != ref[1][0]  # the scaling changes the answer (else this proves nothing)
    eng = engine(model, "lru", rope=RopeConfig("yarn", None, 0.25, 64), offload_kqv=False)
    try:
        assert eng.llm.context_params.offload_kqv is False
        same(result_row(eng.generate(PROMPT, 16)), ref[0][0], "yarn x4")
    finally:
        eng.close()
    r = subprocess.run([sys.executable, "-m", "saem_gguf", "generate", "-m", str(model), "-p", PROMPT, "-n", "16",
                        "--temp", "0", "--json", "--quiet", "--policy", "lru", "--ecr", "25%", "-c", str(N_CTX),
                        "-fa", "off",  # llama-cpp-python's default, where llama.cpp's CLI says auto
                        "--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "64", "-nkvo"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == ref[0][0]["text"]


def test_no_repack_answers_as_stock_with_no_repack(llama_cpp, stock_lib):
    """``-nr`` (llama.cpp's ``--no-repack``): the weights other than the experts load without
    extra buffer types on both sides. On a CPU with AMX the F16 matrices otherwise go to ggml's
    AMX buffer, which rounds differently, so there the two runs differ and each matches its own."""
    model = model_for("qwen2moe", "chatml", True)
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": 32, "temperature": 0.9, "seed": 0}]
    for no_repack in (False, True):
        want = reference(stock_lib, model, cases, no_repack=no_repack)[0][0]
        eng = engine(model, "lru", use_extra_bufts=not no_repack)
        try:
            same(result_row(eng.generate(PROMPT, 32, SamplingConfig(temp=0.9, seed=0))), want,
                 f"no_repack={no_repack}")
        finally:
            eng.close()


def test_quantized_matrices_load_as_stock_loads_them_or_without_the_faulting_amx(llama_cpp, stock_lib):
    """Q4_0 attention and output matrices: stock puts them in ggml's AMX buffer on a CPU with AMX,
    else in a repacked layout on AVX2, and the engine loads them the same way (only the experts
    stay as the file has them), so sampled text is stock's. Where the AMX tiles fault when used
    (some virtual machines, this project's CI among them) stock dies on the first prompt: there the
    engine says so and loads them as with -nr, and answers as stock with -nr."""
    model = ensure_model(spec("qwen3moe", "q8_0", matrix_type="q4_0"))
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": 32, "temperature": 0.9, "seed": 0}]
    fault = na.saem_cpu_amx_tiles_fault()
    if fault:  # the premise: stock really dies on this model here
        r = run_reference(stock_lib, model, cases)
        assert r.returncode < 0, f"stock did not crash (rc {r.returncode}): the probe is wrong"
    want = reference(stock_lib, model, cases, no_repack=fault)[0][0]
    notes: list[str] = []
    eng = Engine(EngineConfig(model=model, n_ctx=N_CTX, n_threads=2, policy="lru", ecr=0.25, seed=0),
                 log=notes.append)
    try:
        same(result_row(eng.generate(PROMPT, 32, SamplingConfig(temp=0.9, seed=0))), want, "Q4_0 matrices")
    finally:
        eng.close()
    assert any("AMX tiles fault" in n and "Q4_0" in n for n in notes) == fault, notes


def _logits_after_each_call(eng: Engine, case: dict) -> np.ndarray:
    """The engine's logits after its prompt (one call) and after each later token (one call each),
    as fidelity_reference.py's "logits" case reads stock's."""
    lc, llm = eng._llama_cpp, eng.llm
    llm.reset()
    out = []
    for chunk in [case["prompt_tokens"]] + [[t] for t in case["then"]]:
        llm.eval(chunk)
        row = lc.llama_get_logits_ith(llm.ctx, -1)
        out.append(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy())
    return np.array(out)


@pytest.mark.parametrize("quant", ["q4_0", "q4_k"])
def test_experts_llama_cpp_repacks_round_as_stock(llama_cpp, stock_lib, quant):
    """On an AVX2 CPU llama.cpp repacks Q4_0 and Q4_K experts (CPU_REPACK), and its repacked kernels
    round otherwise than the plain ones. A CPU-only build keeps them repacked, in repacked slots, so
    the logits equal stock's bit for bit while the cache holds experts (lru: the host and the slot
    branch both run). The premise, that plain experts would not: with the RAM tier, which needs the
    file's mapped, plain experts, the logits differ from stock's."""
    model = ensure_model(spec("qwen3moe", quant, n_embd=512, n_ff_exp=512))
    if not stock_load_repacks(model):
        pytest.skip(f"llama.cpp does not repack {quant} experts on this CPU (no AVX2)")
    eng = engine(model, "lru")
    try:
        infos = [na.saem_moe_get_layer_info(eng.llm.ctx, il) for il in range(na.saem_moe_n_layers(eng.llm.ctx))]
        assert all(all(i.repacked) for i in infos)
        assert any(f"experts ({quant.upper()}) stay in the layout llama.cpp repacks" in n for n in eng.notes), eng.notes
        toks = eng.llm.tokenize(PROMPT.encode())
        case = {"kind": "logits", "prompt_tokens": toks[:6], "then": toks[6:]}
        want = np.array(reference(stock_lib, model, [case])[0][0]["logits"], dtype=np.float32)
        got = _logits_after_each_call(eng, case)
        assert any(na.saem_moe_get_layer_info(eng.llm.ctx, i.il).n_resident > 0 for i in infos)
    finally:
        eng.close()
    assert got.shape == want.shape and np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"
    plain = engine(model, "lru", ram_budget=1 << 30)
    try:
        infos = [na.saem_moe_get_layer_info(plain.llm.ctx, il) for il in range(na.saem_moe_n_layers(plain.llm.ctx))]
        assert not any(any(i.repacked) for i in infos) and not any("CPU_REPACK" in n for n in plain.notes)
        assert not np.array_equal(_logits_after_each_call(plain, case), want)
    finally:
        plain.close()


def test_model_without_template_falls_back_like_llama_cpp_python(llama_cpp, stock_lib):
    model = model_for("qwen3moe", "none", False)
    ref = reference(stock_lib, model, CASES[1:2])
    notes: list[str] = []
    eng = Engine(EngineConfig(model=model, n_ctx=N_CTX, n_threads=2, seed=0), log=notes.append)
    try:
        p = eng.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}])
        res = eng.generate(p, N_COMPLETION)
    finally:
        eng.close()
    assert any("no chat template" in n and "llama-2" in n and "--chat-template" in n for n in notes)
    same({"prompt_tokens": p.tokens, "text": res.text, "finish_reason": res.finish_reason}, ref[0][0],
          "fallback chat format")


def _dot_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and set(line) == {"."}]


def test_verbose_load_prints_llama_cpps_progress_dots(stock_lib, capfd) -> None:
    """The progress callback replaces llama.cpp's default one, which logs a dot each time the
    load's percentage moves: with verbose=True the same dots as the stock build's."""
    from saem_gguf.default_model import default_model_path

    model = str(default_model_path())
    script = ("import llama_cpp; llama_cpp.Llama(model_path=%r, n_ctx=256, verbose=True).close()" % model)
    stock = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=stock_env(stock_lib), timeout=120, cwd="/")
    assert stock.returncode == 0, stock.stderr[-2000:]
    want = _dot_lines(stock.stderr)
    assert len(want) == 1 and len(want[0]) > 10, stock.stderr[-2000:]

    from saem_gguf.engine import _make_llama_class
    from saem_gguf.llama_lib import load_llama_cpp

    capfd.readouterr()
    _make_llama_class(load_llama_cpp())(model_path=model, n_ctx=256, verbose=True).close()
    assert _dot_lines(capfd.readouterr().err) == want
