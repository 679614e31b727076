"""`serve`'s POST /infill (fill in the middle, what llama.vim and llama.vscode send) against stock
llama-server built from the same source, on a generated model with Qwen-Coder's FIM tokens: the
prompt layout (prefix, suffix, files of context, the budgets -b sets, --spm-infill), the answer,
and llama-server's code-completion limits (n_indent, t_max_predict_ms) and response_fields. The
layout itself is also checked on hand-made inputs, and the line limits' rules on their own."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from saem_gguf.serving.batch import LineLimits, LineState
from saem_gguf.serving.infill import CHUNK_SEPARATOR, NO_TOKEN, FimTokens, InfillLimits, infill_tokens
from saem_gguf.testmodels import ModelSpec, ensure_model
from serve_helpers import ServerProcess
from stock_server import StockServer

FIM_MODEL = ModelSpec(fim=True, n_layer=2, name="fim")
# -b 256: the prefix keeps 192 tokens, the suffix 62 less the prompt; -n 64: the files of context
# 1024 - 256 - 2 * 64 = 640 (with llama-server's -n -1 they would take the whole context)
SERVER_ARGS = ["-np", "1", "-c", "1024", "-b", "256", "-n", "64"]
# lines of code with different indentations; the model picks among them (the same way in both)
LINES = 'root ::= line+\nline ::= ("    alpha" | "  beta" | "gamma" | "\\tdelta" | " x y") "\\n"'
CODE = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n"}
# what must agree (timings differ: llama-server reuses the cached prompt of the previous request)
SAME = ("content", "tokens", "stop", "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated",
        "tokens_cached", "prompt", "has_new_line", "truncated", "id_slot")


def _pair(*extra: str):
    model = ensure_model(FIM_MODEL)
    stock = StockServer.start(model, *SERVER_ARGS, *extra)
    ours = ServerProcess(["-m", str(model), *SERVER_ARGS, "--no-warmup", *extra]).start()
    return stock, ours


@pytest.fixture(scope="module")
def pair():
    stock, ours = _pair()
    yield stock.url, ours.url
    stock.stop()
    assert ours.stop() == 0, ours.stderr()


def _both(urls, body: dict, path: str = "/infill") -> tuple[dict, dict]:
    out = []
    for url in urls:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, (url, body, r.text[:500])
        out.append(r.json())
    return out[0], out[1]


LONG = "".join(f"x{i} = {i} * {i}\n" for i in range(200))  # ~1,400 tokens: past every budget


@pytest.mark.parametrize("body", [
    {**CODE, "n_predict": 16},
    {**CODE, "n_predict": 16, "prompt": "return", "input_extra": [
        {"filename": "util.py", "text": "import os\n"}, {"text": "def sub(a, b):\n    return a - b\n"}]},
    {"input_prefix": ["x = ", 13, " + "], "input_suffix": "", "n_predict": 8, "return_tokens": True},
    {"input_prefix": LONG, "input_suffix": LONG, "prompt": "y", "n_predict": 8,
     "input_extra": [{"filename": f"f{i}.py", "text": LONG} for i in range(2)]},
    {**CODE, "n_predict": 40, "grammar": LINES},
    {**CODE, "n_predict": 40, "grammar": LINES, "temperature": 0.8, "seed": 5},
    {**CODE, "n_predict": 40, "grammar": LINES, "n_indent": 2},
    {**CODE, "n_predict": 40, "grammar": LINES, "n_indent": 5, "temperature": 0.8, "seed": 5},
    {**CODE, "n_predict": 40, "grammar": LINES, "n_indent": 2, "stop": ["gamma"]},
    {"prompt": "x = 1\n", "n_predict": 40, "grammar": LINES, "n_indent": 2},
], ids=["code", "extra-files", "token-ids", "budgets", "lines", "lines-seeded", "n-indent", "n-indent-seeded",
        "n-indent-stop", "completion-n-indent"])
def test_infill_answers_as_llama_server(pair, body):
    path = "/infill" if "input_prefix" in body else "/completion"
    stock, ours = _both(pair, {"temperature": 0, **body}, path)
    assert {k: ours[k] for k in SAME} == {k: stock[k] for k in SAME}
    assert set(ours) == set(stock), set(ours) ^ set(stock)
    if body.get("n_indent") and not body.get("stop"):
        assert stock["stop_type"] == "limit" and stock["tokens_predicted"] < body["n_predict"]  # the rule fired


@pytest.mark.parametrize("seed", [1, 2])
def test_the_infill_sampler_as_llama_server(pair, seed):
    """What llama.vscode sends: top-k, top-p and llama.cpp's infill sampler, drawn."""
    body = {**CODE, "n_predict": 24, "top_k": 40, "top_p": 0.99, "seed": seed, "temperature": 0.8,
            "samplers": ["top_k", "top_p", "infill"]}
    stock, ours = _both(pair, body)
    assert {k: ours[k] for k in SAME} == {k: stock[k] for k in SAME}


def test_infill_streams_as_llama_server(pair):
    body = {**CODE, "n_predict": 40, "grammar": LINES, "n_indent": 2, "temperature": 0, "stream": True}
    seen = []
    for url in pair:
        with httpx.stream("POST", url + "/infill", json=body, timeout=300) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        seen.append(("".join(e["content"] for e in events), events[-1]["stop_type"], events[-1]["content"],
                     events[-1]["tokens_predicted"]))
    assert seen[0] == seen[1]
    whole = httpx.post(pair[1] + "/infill", json={**body, "stream": False}, timeout=300).json()["content"]
    # a stream keeps what it sent before the cut (as llama-server's); the whole answer is cut
    assert seen[0][0].startswith(whole) and len(seen[0][0]) > len(whole)


def test_response_fields_as_llama_server(pair):
    fields = ["content", "timings/prompt_n", "truncated", "nope", "generation_settings/n_predict"]
    stock, ours = _both(pair, {**CODE, "n_predict": 8, "temperature": 0, "response_fields": fields})
    assert set(ours) == set(stock) == {"content", "timings/prompt_n", "truncated", "generation_settings/n_predict"}
    assert {k: ours[k] for k in ours if k != "timings/prompt_n"} == \
        {k: stock[k] for k in stock if k != "timings/prompt_n"}


def test_spm_infill_as_llama_server():
    stock, ours = _pair("--spm-infill")
    try:
        a, b = _both((stock.url, ours.url), {**CODE, "n_predict": 16, "temperature": 0, "prompt": "return"})
        assert {k: b[k] for k in SAME} == {k: a[k] for k in SAME}
        assert a["prompt"].index("<|fim_suffix|>") < a["prompt"].index("<|fim_prefix|>")
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


def test_a_time_limit_ends_at_the_next_newline(pair):
    """t_max_predict_ms: once the generation has run that long, the next token with a newline
    ends it (the time is the machine's, so not compared with llama-server)."""
    r = httpx.post(pair[1] + "/infill", json={**CODE, "n_predict": 40, "grammar": LINES, "temperature": 0,
                                              "t_max_predict_ms": 1, "return_tokens": True}, timeout=300).json()
    assert r["stop_type"] == "limit" and r["tokens_predicted"] < 40 and r["content"].endswith("\n")
    assert r["content"].count("\n") == 1  # the first line's newline came after 1 ms


@pytest.mark.parametrize("body,field", [
    ({"input_suffix": "x"}, "input_prefix"),
    ({"input_prefix": "x"}, "input_suffix"),
    ({"input_prefix": "x", "input_suffix": "y", "prompt": 3}, "prompt"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, "input_extra.0.text"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": {"text": "a"}}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "n_indent": -1}, "n_indent"),
    ({"input_prefix": "x", "input_suffix": "y", "t_max_predict_ms": -2}, "t_max_predict_ms"),
])
def test_a_bad_infill_request_is_a_400_naming_the_field(pair, body, field):
    """Where llama-server answers a 500 (a missing prefix or suffix: its check does not return) or
    goes on (a prompt that is not a string), a 400 names the field."""
    r = httpx.post(pair[1] + "/infill", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# --- the layout on hand-made inputs ----------------------------------------------------------------
def _words(text) -> list[int]:
    """A stand-in tokenizer: one token per character, token ids kept (tokenize_mixed's lists)."""
    parts = [text] if isinstance(text, str) else text
    return [p if isinstance(p, int) else 1000 + ord(c) for p in parts for c in ([p] if isinstance(p, int) else p)]


QWEN = FimTokens(pre=1, suf=2, mid=3, rep=4, sep=5)


def _layout(fim=QWEN, n_batch=16, n_predict=-1, n_ctx=64, spm=False, prefix="abcdefghijklmnop",
            suffix="ABCDEFGH", extra=(("f.py", "xyz"),), prompt=(), bos=None) -> list[int]:
    return infill_tokens(_words, fim, InfillLimits(n_batch, n_predict, n_ctx, spm), prefix, suffix, extra,
                         list(prompt), bos)


def test_the_layout_keeps_the_prefix_end_the_suffix_start_and_the_last_context():
    out = _layout()
    # prefix: the last 3 * (16 // 4) = 12 characters; suffix: the first 4 - 2 = 2
    mid_start = out.index(QWEN.pre)
    assert out[mid_start:] == [QWEN.pre, *_words("efghijklmnop"), QWEN.suf, *_words("AB"), QWEN.mid]
    context = [QWEN.rep, *_words("myproject\n"), QWEN.sep, *_words("f.py\n"), *_words("xyz"),
               QWEN.sep, *_words("filename\n")]
    assert out[:mid_start] == context  # 64 - 16 + 2 = 50 tokens allowed: all of it
    short = _layout(n_ctx=16 + 5, n_predict=0)  # room for the last 5 context tokens only
    assert short[:short.index(QWEN.pre)] == context[-5:]


def test_the_layout_orders_bos_context_and_spm_as_llama_server():
    out = _layout(bos=9, spm=True, prompt=[7, 8])
    # a prompt of 2 leaves the suffix 4 - 2 - 2 = 0 tokens; BOS after the context, before the first part
    assert out[out.index(9):] == [9, QWEN.suf, QWEN.pre, *_words("efghijklmnop"), 7, 8, QWEN.mid]
    assert out.index(9) > 0 and out[0] == QWEN.rep


def test_without_repository_and_file_tokens_chunks_are_separated_by_text():
    fim = FimTokens(pre=1, suf=2, mid=3)
    out = _layout(fim=fim, extra=(("a", "x"), ("b", "y")))
    assert out[:out.index(1)] == [*_words(CHUNK_SEPARATOR), *_words("x"), *_words(CHUNK_SEPARATOR), *_words("y")]
    assert fim.missing() == "" and FimTokens(pre=1).missing() == "suffix token is missing. middle token is missing. "
    assert NO_TOKEN == -1


# --- the line limits on their own -----------------------------------------------------------------
def _run(limits: LineLimits, pieces: list[bytes], gen_ms: float = 0.0) -> tuple[int, int | None]:
    """(tokens taken, the cut) feeding ``pieces`` one token at a time, as the scheduler does."""
    state, text = LineState(limits), b""
    for i, piece in enumerate(pieces, 1):
        text += piece
        cut = state.indent_cut(text)
        late = state.out_of_time(piece, gen_ms)
        if cut is not None or late:
            return i, cut
    return len(pieces), None


def test_a_line_is_checked_from_the_token_after_the_one_that_found_it():
    # "a\n" sets has_new_line; " b" moves last_nl_pos to the line; the next token checks it
    assert _run(LineLimits(n_indent=2), [b"a\n", b" b", b"c"]) == (3, 3)
    assert _run(LineLimits(n_indent=1), [b"a\n", b" b", b"c", b"\n", b"d", b"e"]) == (5, 6)
    assert _run(LineLimits(n_indent=2), [b"a\n", b"  b", b"c\n"]) == (3, None)
    assert _run(LineLimits(n_indent=0), [b"a\n", b"b", b"c"]) == (3, None)


def test_the_time_limit_needs_a_newline_after_the_time():
    assert _run(LineLimits(t_max_predict_ms=5), [b"a", b"b\n", b"c"], gen_ms=6) == (2, None)
    assert _run(LineLimits(t_max_predict_ms=5), [b"a", b"b\n", b"c"], gen_ms=4) == (3, None)
