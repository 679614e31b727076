"""Shared by the fidelity tests: the stock-build reference runner and the model matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from native_helpers import spec
from saem_gguf.build import BuildConfig, find_build
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.testmodels import ensure_model
from saem_gguf.testmodels.vocab import GEMMA_TEMPLATE, load_vocab
from saem_gguf.testmodels.writer import random_tensors, write_gguf

REFERENCE = REPO / "tests" / "fidelity_reference.py"
N_CTX = 512


def model_for(arch: str, template: str, add_bos: bool):
    return ensure_model(spec(arch, "q8_0", chat_template=template, add_bos_token=add_bos))


@pytest.fixture(scope="session")
def stock_lib():
    lib = find_build(BuildConfig(variant="stock"))
    if lib is None:
        pytest.fail("the stock llama.cpp build is missing: run `python -m saem_gguf build --variant stock` "
                    "(setup.sh does)")
    return lib


def stock_env(stock_lib) -> dict[str, str]:
    """The environment of a subprocess whose llama-cpp-python binds the stock build (and never
    imports saem_gguf from this checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["LLAMA_CPP_LIB_PATH"] = str(stock_lib)
    return env


def run_reference(stock_lib, model, cases: list[dict], n_ctx: int = N_CTX,
                  no_repack: bool = False) -> subprocess.CompletedProcess:
    """The stock side's process, run to its end (``no_repack``: llama.cpp's ``-nr``)."""
    return subprocess.run([sys.executable, str(REFERENCE)], input=json.dumps(
        {"model": str(model), "n_ctx": n_ctx, "no_repack": no_repack, "cases": cases}),
        capture_output=True, text=True, env=stock_env(stock_lib), timeout=600, cwd=REPO)


def reference(stock_lib, model, cases: list[dict], n_ctx: int = N_CTX,
              no_repack: bool = False) -> list[list[dict]]:
    """Per case, the stock side's calls: prompt tokens, text, finish_reason (``no_repack``:
    llama.cpp's ``-nr``)."""
    r = run_reference(stock_lib, model, cases, n_ctx, no_repack)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    for res in out:  # the reference really ran on the stock library
        assert res["library"] == stock_lib.as_posix(), res["library"]
    return [res["calls"] for res in out]


def engine(model, policy: str = "saem", n_ctx: int = N_CTX, **kw) -> Engine:
    eng = Engine(EngineConfig(model=model, n_ctx=n_ctx, n_threads=2, policy=policy, ecr=0.25,
                              **{"seed": 0, **kw}))
    assert eng.placement is not None and eng.policy_name == policy  # expert management is on
    return eng


def same(ours: dict, ref: dict, what: str) -> None:
    assert ours["prompt_tokens"] == ref["prompt_tokens"], f"{what}: prompt tokens differ"
    assert ours["text"] == ref["text"], f"{what}: text differs"
    assert ours["finish_reason"] == ref["finish_reason"], f"{what}: finish_reason differs"


def result_row(res) -> dict:
    """An engine GenerationResult as the reference reports a call."""
    return {"prompt_tokens": res.prompt_token_ids, "text": res.text, "finish_reason": res.finish_reason}


def make_eot_model(directory, gemma_model) -> tuple:
    """(path, question): the Gemma-like model with <end_of_turn> (EOT, not EOS) made the greedy first answer token:
    its output row is twice the row of the token greedy picks there (a positive maximum logit)."""
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    eng = engine(gemma_model)
    try:
        first = eng.generate(eng.chat_prompt(question), 1).tokens[0]
    finally:
        eng.close()
    s = spec("qwen3moe", "q8_0", chat_template="gemma", add_bos_token=True)
    vocab = load_vocab()
    eot = vocab.id_of("<end_of_turn>")
    assert eot != vocab.eos_id

    def tensors():
        for name, arr, kind in random_tensors(s, vocab):
            if name == "output.weight":
                arr = np.array(arr, copy=True)
                arr[eot] = 2.0 * arr[first]
            yield name, arr, kind

    return write_gguf(directory / "eot.gguf", s, vocab, tensors(),
                      chat_template=GEMMA_TEMPLATE), question
