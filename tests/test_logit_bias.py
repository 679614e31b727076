"""llama.cpp's logit bias (``-l/--logit-bias``, the server's ``logit_bias``): the same tokens as
stock llama-cpp-python's ``create_completion(logit_bias=...)`` on the embedded model, llama.cpp's
flag syntax, and ids outside the vocabulary refused in one line (llama.cpp skips them silently)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import REPO
from fidelity_helpers import engine, reference, result_row, same, stock_lib  # noqa: F401
from saem_gguf.default_model import default_model_path
from saem_gguf.engine import SamplingConfig
from saem_gguf.errors import SaemError

PROMPT = "What is 12 + 7?"
N = 16


@pytest.fixture(scope="module")
def model():
    return default_model_path()


def test_same_tokens_as_stock_llama_cpp_python_with_a_logit_bias(model, stock_lib):  # noqa: F811
    eng = engine(model, "saem")
    try:
        plain = eng.generate(PROMPT, N)
        first, second = plain.tokens[0], plain.tokens[1]
        # ban greedy's first token, push another up, and a seeded draw with a bias
        bias = ((first, -math.inf), (second, 4.0))
        got = [eng.generate(PROMPT, N, SamplingConfig(logit_bias=bias)),
               eng.generate(PROMPT, N, SamplingConfig(logit_bias=bias, temp=0.9, seed=11))]
    finally:
        eng.close()
    ref = reference(stock_lib, model, [
        {"kind": "completion", "prompt": PROMPT, "max_tokens": N, "logit_bias": bias},
        {"kind": "completion", "prompt": PROMPT, "max_tokens": N, "logit_bias": bias, "temperature": 0.9,
         "seed": 11}])
    for what, ours, want in zip(("greedy", "seeded"), got, ref):
        same(result_row(ours), want[0], what)
    assert got[0].tokens[0] != first and got[0].text != plain.text  # the bias did act


def test_an_id_outside_the_vocabulary_is_one_line(model):
    eng = engine(model, "cpu-moe")
    try:
        n = eng.llm.n_vocab()
        with pytest.raises(SaemError, match=f"logit bias token {n} is not in the vocabulary"):
            eng.generate(PROMPT, 4, SamplingConfig(logit_bias=((5, 1.0), (n, 1.0))))
    finally:
        eng.close()
    with pytest.raises(SaemError, match="NaN"):
        SamplingConfig(logit_bias=((5, math.nan),))


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "saem_gguf", "generate", "--quiet", "--json", "-p", PROMPT,
                           "-n", str(N), *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_the_flag_is_llama_cpps():
    import json

    plain = json.loads(_generate().stdout)
    first = plain["tokens"][0]
    banned = _generate("-l", f"{first}-inf", "--logit-bias", f"{first}+2")  # repeatable; -inf + 2 is -inf
    assert banned.returncode == 0, banned.stderr
    assert json.loads(banned.stdout)["tokens"][0] != first
    for value, words in (("5x", "expected TOKEN_ID(+/-)BIAS"), ("5+nan", "expected TOKEN_ID(+/-)BIAS"),
                         ("+5", "expected TOKEN_ID(+/-)BIAS"), ("99999999+1", "logit bias token 99999999")):
        r = _generate("-l", value)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode in (1, 2) and len(lines) == 1 and words in lines[0], r.stderr
