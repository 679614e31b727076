"""Token text as llama.cpp writes it: a piece longer than 32 bytes is whole (saem_gguf.detokenize),
where stock llama-cpp-python's detokenize drops it (its 32-byte buffer; llama-cpp-python #2362).
Qwen vocabularies hold such tokens (64-space runs): indented code would lose its indentation."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import REPO
from fidelity_helpers import engine, stock_env, stock_lib  # noqa: F401
from native_helpers import spec
from saem_gguf.engine import SamplingConfig
from saem_gguf.testmodels.vocab import load_vocab
from saem_gguf.testmodels.writer import random_tensors, write_gguf

LONG = "<|" + "a_piece_longer_than_32_bytes_" * 2 + "|>"  # 62 bytes, a user-defined token

STOCK = """
import ctypes, json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
tok = int(sys.argv[2])
buf = ctypes.create_string_buffer(256)
n = llama_cpp.llama_token_to_piece(llm._model.vocab, tok, buf, 256, 0, True)  # llama.cpp's piece
out = llm.create_completion("hi", max_tokens=3, temperature=0.0, logit_bias={tok: 100.0})
print(json.dumps({"piece": buf.raw[:n].hex(), "tokenized": llm.tokenize(sys.argv[3].encode(), add_bos=False),
                  "detokenized": llm.detokenize([tok]).hex(), "text": out["choices"][0]["text"]}))
"""


@pytest.fixture(scope="module")
def long_piece_model(tmp_path_factory):
    """A test model whose vocabulary has LONG (a user-defined token; llama.cpp cuts it out of any
    text), padded to 64 rows as the test vocabulary is."""
    vocab = load_vocab()
    tokens, types = [*vocab.tokens, LONG], [*vocab.token_types, 4]
    while len(tokens) % 64:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    vocab = replace(vocab, tokens=tuple(tokens), token_types=tuple(types))
    s = spec("qwen3moe", "q8_0")
    path = write_gguf(tmp_path_factory.mktemp("long_piece") / "long-piece.gguf", s, vocab, random_tensors(s, vocab))
    return path, vocab.id_of(LONG)


def test_a_long_piece_is_whole_where_llama_cpp_python_drops_it(long_piece_model, stock_lib):  # noqa: F811
    path, tok = long_piece_model
    r = subprocess.run([sys.executable, "-c", STOCK, str(path), str(tok), "x" + LONG + "y"], capture_output=True,
                       text=True, timeout=300, env=stock_env(stock_lib), cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    stock = json.loads(r.stdout)
    assert bytes.fromhex(stock["piece"]) == LONG.encode()  # llama.cpp's text of the token
    assert tok in stock["tokenized"]
    # the defect this mends: stock llama-cpp-python drops the piece, in detokenize and in its output
    assert stock["detokenized"] == "" and stock["text"] == ""
    eng = engine(path, "saem")
    try:
        assert eng.llm.detokenize([tok]) == LONG.encode() == eng.piece(tok)
        assert eng.llm.detokenize(eng.llm.tokenize(("x" + LONG + "y").encode(), add_bos=False)) == \
            ("x" + LONG + "y").encode()
        res = eng.generate("hi", 3, SamplingConfig(logit_bias=((tok, 100.0),)))
        assert res.tokens == [tok] * 3 and res.text == LONG * 3
    finally:
        eng.close()
