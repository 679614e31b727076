"""The public Python API: ``from saem_gguf import Llama`` is llama-cpp-python's Llama with expert
management on, and the README's example runs as printed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO
from fidelity_helpers import model_for


def test_readme_python_example_runs():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "82" in r.stdout and "expert cache hit rate:" in r.stdout, r.stdout


def test_llama_is_llama_cpp_pythons_with_expert_management(llama_cpp):
    from saem_gguf import Llama
    from saem_gguf.engine import _make_llama_class

    assert issubclass(Llama, llama_cpp.Llama) and issubclass(Llama, _make_llama_class(llama_cpp))
    model = model_for("qwen3moe", "chatml", True)
    llm = Llama(str(model), n_ctx=256, n_threads=2, expert_policy="lru", ecr="50%", verbose=False)
    try:
        assert llm._saem_engine.llm is llm  # one object: the engine drives this very Llama
        text = llm("First, compute 12 + 7.", max_tokens=6, temperature=0)["choices"][0]["text"]
        streamed = "".join(c["choices"][0]["text"] for c in
                           llm.create_completion("First, compute 12 + 7.", max_tokens=6, temperature=0,
                                                 stream=True))
        assert text and streamed == text
        stats = llm.expert_stats()
        assert stats["policy"] == "lru" and stats["slots_per_layer"] == 4 and stats["tokens"] > 0
        assert llm.tokenize(b"hi")[0] == llm.token_bos()  # llama-cpp-python's tokenize, unchanged
    finally:
        llm.close()


def test_seed_zero_is_fixed_in_the_api(llama_cpp):
    from saem_gguf import Llama

    model = model_for("qwen3moe", "chatml", False)
    outs = []
    for _ in range(2):
        llm = Llama(str(model), n_ctx=256, n_threads=2, seed=0, verbose=False)
        try:
            assert llm._seed == 0  # llama-cpp-python would hold its random default here
            outs.append(llm("Hello", max_tokens=12, temperature=1.0, top_k=0, top_p=1.0,
                            min_p=0.0)["choices"][0]["text"])
        finally:
            llm.close()
    assert outs[0] == outs[1]


def test_bad_api_arguments_are_clear(llama_cpp):
    from saem_gguf import Llama
    from saem_gguf.errors import SaemError

    model = model_for("qwen3moe", "chatml", False)
    with pytest.raises(SaemError, match="out of range|ecr"):
        Llama(str(model), ecr="250%", verbose=False)
    with pytest.raises(SaemError, match="no such file|not found|does not exist"):
        Llama("/nonexistent/model.gguf", verbose=False)


def test_vram_budget_takes_the_cli_values(llama_cpp):
    """vram_budget="auto" means what --vram-budget auto does (on this CPU build: the default ECR,
    with a note), and a size string is parsed as the flag's is."""
    from saem_gguf import Llama

    model = model_for("qwen3moe", "chatml", False)
    llm = Llama(str(model), n_ctx=256, n_threads=2, vram_budget="auto", verbose=False)
    try:
        assert any("--vram-budget auto" in n for n in llm._saem_engine.notes), llm._saem_engine.notes
    finally:
        llm.close()


# a template that reads enable_thinking as Qwen3's does
THINKING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_through_the_api(llama_cpp):
    """create_chat_completion(chat_template_kwargs=...) renders as llama-cpp-python's own Jinja
    formatter does with those variables (its prompt's token count), with the other arguments
    positional or not; a variable the handler sets itself is refused."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from saem_gguf import Llama
    from saem_gguf.errors import SaemError

    fmt = Jinja2ChatFormatter(template=THINKING, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    llm = Llama(str(model_for("qwen3moe", "chatml", False)), n_ctx=256, n_threads=2, verbose=False,
                chat_handler=fmt.to_chat_handler())
    msgs = [{"role": "user", "content": "Hi"}]
    try:
        def sent(*args, **kw) -> int:
            return llm.create_chat_completion(msgs, *args, max_tokens=1, **kw)["usage"]["prompt_tokens"]

        def rendered(**variables) -> int:
            return len(llm.tokenize(fmt(messages=msgs, **variables).prompt.encode(), special=True))

        off = {"enable_thinking": False}
        assert sent() == rendered() < sent(chat_template_kwargs=off) == rendered(**off)
        assert sent(None, None, None, None, 0.0, chat_template_kwargs=off) == rendered(**off)  # temperature 0
        with pytest.raises(SaemError, match="'tools' is set by the chat handler"):
            llm.create_chat_completion(msgs, chat_template_kwargs={"tools": []})
    finally:
        llm.close()


def test_a_closed_llama_refuses_calls_instead_of_crashing(llama_cpp):
    """llama-cpp-python's close() frees the model and context but keeps their pointers: a call
    after it read freed memory and killed the process (SIGSEGV). Every public method now raises
    a SaemError; the books (expert_stats) stay readable. In a subprocess: a crash fails the test."""
    model = model_for("qwen3moe", "chatml", True)
    code = f"""
from saem_gguf import Llama
from saem_gguf.errors import SaemError
llm = Llama({str(model)!r}, n_ctx=256, n_threads=2, verbose=False)
state = llm.save_state()
llm("First,", max_tokens=2, temperature=0)
llm.close()
llm.close()  # twice: nothing more to free
calls = {{"call": lambda: llm("First,", max_tokens=2), "tokenize": lambda: llm.tokenize(b"hi"),
          "chat": lambda: llm.create_chat_completion([{{"role": "user", "content": "hi"}}], max_tokens=2),
          "eval": lambda: llm.eval([1]), "load_state": lambda: llm.load_state(state),
          "n_ctx": lambda: llm.n_ctx()}}
for name, call in calls.items():
    try:
        call()
        print(name, "ran")
    except SaemError as e:
        print(name, "refused:", e)
print("tokens", llm.expert_stats()["tokens"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert len(lines) == 7 and all("refused: Llama." in ln and "was closed" in ln for ln in lines[:6]), r.stdout
    assert int(lines[6].split()[1]) > 0, r.stdout


def test_kv_overrides_are_checked_and_followed_in_the_api(llama_cpp):
    """llama-cpp-python's kv_overrides: checked before the load as --override-kv (0 experts per
    token aborts stock llama.cpp), and the placement routes as many experts as they say."""
    from saem_gguf import Llama
    from saem_gguf.errors import SaemError

    model = model_for("qwen3moe", "chatml", False)
    with pytest.raises(SaemError, match="expert_used_count=0 must be in"):
        Llama(str(model), kv_overrides={"qwen3moe.expert_used_count": 0}, verbose=False)
    llm = Llama(str(model), n_ctx=256, n_threads=2, kv_overrides={"qwen3moe.expert_used_count": 1}, verbose=False)
    try:
        assert llm._saem_engine.info.n_expert_used == llm._saem_engine.placement.top_k == 1
        assert llm("Hello", max_tokens=4, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
