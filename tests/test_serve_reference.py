"""`serve` against stock llama-server (built from the same llama.cpp source, tests/stock_server.py)
on the embedded model: llama-server's own endpoints answer alike (/completion: text, tokens, stop
type and word, counts, probabilities; /tokenize, /detokenize, /apply-template), its request fields
act alike (logit_bias forms, grammar, seeded sampling), and chat answers split the thinking from the
answer as its reasoning format does, whole and streamed, also where the template opens the thinking
block itself. `serve --parse-special` tokenizes raw prompts as llama-server does."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from conftest import run_cli
from saem_gguf.default_model import default_model_path
from serve_helpers import ServerProcess
from stock_server import StockServer

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 12 + 7?"}]
# a template that opens the thinking block in its generation prompt (DeepSeek-R1's newer templates
# do) and strips thinking from earlier answers (what makes llama-server treat it as a reasoning one)
FORCED_OPEN = ("{%- for message in messages -%}{%- if message['role'] == 'assistant' -%}"
               "{%- set content = message['content'] -%}{%- if '</think>' in content -%}"
               "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
               "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- else -%}"
               "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
               "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}"
               "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}")
FORCED = ["<think>abc</think>def", " <think>abc</think>def", "xyz<think>abc</think>def", "abc</think>def",
          "<think>abc", "<think></think>def", "<think>\n\n</think>\n\ndef", "<think>a</think>b</think>c",
          # split into nothing: the answer is its text (llama-server's fallback on an empty parse)
          "<think>", "<think>\n", " <think>", "<think>\n </think>"]


@pytest.fixture(scope="module")
def pair():
    """(stock llama-server, serve) on the embedded model, one slot each, 2048 tokens."""
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048")
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--parse-special"]).start()
    yield stock.url, ours.url
    stock.stop()
    assert ours.stop() == 0, ours.stderr()


def _both(pair, path: str, body: dict) -> tuple[dict, dict]:
    out = []
    for url in pair:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, (url, path, body, r.text[:500])
        out.append(r.json())
    return out[0], out[1]


COUNTS = ("content", "tokens", "stop", "stop_type", "stopping_word", "tokens_predicted", "tokens_evaluated",
          "tokens_cached", "prompt", "has_new_line", "truncated", "id_slot")


@pytest.mark.parametrize("fields", [
    {"n_predict": 24, "temperature": 0},
    {"n_predict": 24, "temperature": 0, "stop": ["shelves"]},
    {"n_predict": 12, "temperature": 0.9, "seed": 7},
    {"n_predict": 8, "temperature": 0, "logit_bias": [[13, False], [" more", -5]]},
    {"n_predict": 8, "temperature": 0, "logit_bias": {"13": -100}},
    {"n_predict": 8, "temperature": 0, "grammar": 'root ::= ("yes" | "no") " ok"'},
    {"n_predict": 4, "temperature": 0, "n_probs": 3},
    {"n_predict": 12, "temperature": 0.9, "seed": 7, "grammar": 'root ::= ("yes" | "no" | " maybe" | " Paris")+'},
    # the penalties look back over the prompt too, as llama-server's init_sampler feeds it to the
    # chain (answered otherwise before: " 4,. That + 4 more more, so" against " 4, and add them; ...")
    {"n_predict": 12, "temperature": 0, "repeat_penalty": 2.0, "prompt": "2 + 2 = 4. 2 + 2 = 4. 2 + 2 = 4. 2 + 2 ="},
    {"n_predict": 12, "temperature": 0, "presence_penalty": 1.5, "grammar": 'root ::= ("yes" | "no" | " 4" | ",")+',
     "prompt": "2 + 2 = 4. 2 + 2 = 4. 2 + 2 ="},
], ids=["greedy", "stop-word", "seeded", "logit-bias-pairs", "logit-bias-object", "grammar", "n-probs",
        "seeded-grammar", "penalty-over-the-prompt", "penalty-over-the-prompt-grammar"])
def test_completion_answers_as_llama_server(pair, fields):
    stock, ours = _both(pair, "/completion", {"prompt": PROMPT, **fields})
    assert set(ours) == set(stock), set(ours) ^ set(stock)
    assert {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}
    for s, o in zip(stock.get("completion_probabilities", []), ours.get("completion_probabilities", [])):
        assert [(s["id"], s["token"], s["bytes"])] + [(t["id"], t["token"], t["bytes"]) for t in s["top_logprobs"]] \
            == [(o["id"], o["token"], o["bytes"])] + [(t["id"], t["token"], t["bytes"]) for t in o["top_logprobs"]]
        assert abs(s["logprob"] - o["logprob"]) < 1e-4  # llama-server's float softmax, llama-cpp-python's


@pytest.mark.parametrize("fields", [
    {"top_p": 1.5}, {"top_p": -0.5}, {"min_p": 2.0}, {"min_p": -1.0}, {"temperature": -1.0}, {"top_k": -5},
    {"typical_p": 1.5}, {"typical_p": -0.5}, {"seed": -7}, {"seed": 2**32 + 5},
    {"top_k": 40.0, "n_predict": 12.0},
    {"stream": None, "top_k": None, "stop": None, "ignore_eos": None, "cache_prompt": None, "logit_bias": None,
     "grammar": None, "n_probs": None, "samplers": None, "max_tokens": None},
], ids=["top-p-above-1", "top-p-below-0", "min-p-above-1", "min-p-below-0", "temperature-below-0",
        "top-k-below-0", "typical-above-1", "typical-below-0", "seed-below-0",
        "seed-past-uint32", "whole-floats", "nulls"])
def test_request_values_read_as_llama_server(pair, fields):
    """server-schema.cpp's rules: soft limits clamp, typical_p has none, a seed is a uint32, a whole
    float is an integer, null is a field left out; the same draws and settings as llama-server."""
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0.9, "seed": 3, **fields}
    stock, ours = _both(pair, "/completion", body)
    assert {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}
    given = {k for k, v in fields.items() if v is not None}
    for k in given & set(stock["generation_settings"]):  # llama-server's floats are float32
        s, o = stock["generation_settings"][k], ours["generation_settings"][k]
        assert o == (pytest.approx(s, rel=1e-6) if isinstance(s, float) else s), k


@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": PROMPT, "n_predict": 3, "n_probs": 30}),
    ("/completion", {"prompt": PROMPT, "n_predict": 3, "n_probs": 10**6}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 25}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 25}),
], ids=["n-probs-30", "n-probs-past-the-vocabulary", "openai-logprobs-25", "chat-logprobs-alone", "chat-top-25"])
def test_alternatives_counted_as_llama_server(pair, path, body):
    """No bound of 20: as many alternatives as asked for, at most the vocabulary; a chat's
    "logprobs": true alone gives llama-server's 20."""
    def counts(answer: dict) -> list[int]:
        if "completion_probabilities" in answer:
            return [len(t["top_logprobs"]) for t in answer["completion_probabilities"]]
        lp = answer["choices"][0]["logprobs"]
        return [len(t["top_logprobs"]) for t in lp["content"]] if "content" in lp else list(map(len, lp["top_logprobs"]))

    stock, ours = _both(pair, path, {"temperature": 0, **body})
    assert counts(ours) == counts(stock) and len(counts(stock)) == 3 and counts(stock)[0] >= 20


@pytest.mark.parametrize("fields", [
    {"n_predict": 6, "temperature": 0, "n_probs": 5},
    {"n_predict": 8, "temperature": 0.9, "seed": 7, "n_probs": 10},
    {"n_predict": 8, "temperature": 0.9, "seed": 7, "n_probs": 10, "top_k": 3},
    {"n_predict": 8, "temperature": 1.5, "seed": 11, "n_probs": 6, "top_p": 0.8, "min_p": 0.02},
    {"n_predict": 8, "temperature": 0.9, "seed": 7, "n_probs": 4, "grammar": 'root ::= ("yes" | "no" | " maybe" | " Paris")+'},
    {"n_predict": 8, "temperature": 0.8, "seed": 5, "n_probs": 5, "samplers": "ktp"},
    {"n_predict": 8, "temperature": 0, "n_probs": 3, "samplers": ["top_k", "temperature"]},
], ids=["greedy", "seeded", "top-k-3", "top-p-min-p", "grammar", "named-order", "named-order-greedy"])
def test_post_sampling_probabilities_as_llama_server(pair, fields):
    """post_sampling_probs: each token's probability and its most probable candidates as the sampler
    chain left them (after top-k, top-p, min-p, temperature, the grammar), named "prob" and
    "top_probs", those of probability 0 left out, at most n_probs; llama-server's figures."""
    stock, ours = _both(pair, "/completion", {"prompt": PROMPT, "post_sampling_probs": True, **fields})
    assert {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}
    for key in ("n_probs", "post_sampling_probs"):
        assert ours["generation_settings"][key] == stock["generation_settings"][key]
    theirs, mine = stock["completion_probabilities"], ours["completion_probabilities"]
    assert len(mine) == len(theirs) == fields["n_predict"]
    for s, o in zip(theirs, mine):
        assert set(o) == set(s) == {"id", "token", "bytes", "prob", "top_probs"}
        assert (o["id"], o["token"], o["bytes"]) == (s["id"], s["token"], s["bytes"])
        assert o["prob"] == pytest.approx(s["prob"], abs=1e-6)
        assert [(t["id"], t["token"], t["bytes"]) for t in o["top_probs"]] \
            == [(t["id"], t["token"], t["bytes"]) for t in s["top_probs"]]
        assert [t["prob"] for t in o["top_probs"]] == pytest.approx([t["prob"] for t in s["top_probs"]], abs=1e-6)
    assert any(len(t["top_probs"]) > 1 for t in theirs) or fields["temperature"] == 0


def test_post_sampling_probabilities_in_a_chat_as_llama_server(pair):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0.9, "seed": 3, "logprobs": True,
            "top_logprobs": 4, "post_sampling_probs": True}
    stock, ours = _both(pair, "/v1/chat/completions", body)
    theirs, mine = stock["choices"][0]["logprobs"]["content"], ours["choices"][0]["logprobs"]["content"]
    assert len(mine) == len(theirs) == 6
    for s, o in zip(theirs, mine):
        assert (o["token"], o["bytes"]) == (s["token"], s["bytes"]) and "logprob" not in o
        assert o["prob"] == pytest.approx(s["prob"], abs=1e-6)
        assert [(t["token"], round(t["prob"], 6)) for t in o["top_probs"]] \
            == [(t["token"], round(t["prob"], 6)) for t in s["top_probs"]]


def test_a_repeat_penalty_of_zero_is_refused_as_by_llama_server(pair):
    for url in pair:
        r = httpx.post(url + "/completion", json={"prompt": PROMPT, "repeat_penalty": 0}, timeout=300)
        assert r.status_code == 400 and "repeat" in r.json()["error"]["message"], (url, r.text)


def _native_chunks(url: str, body: dict) -> list[tuple]:
    with httpx.stream("POST", url + "/completion", json={**body, "stream": True}, timeout=300) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    return [(c["content"], c["tokens"], c["stop"], c.get("stop_type"),
             [(t["id"], t["top_logprobs"][0]["id"]) for t in c.get("completion_probabilities", [])]) for c in chunks]


@pytest.mark.parametrize("fields", [{}, {"n_probs": 2}, {"return_tokens": True}, {"stop": [" so"]}],
                         ids=["plain", "n-probs", "return-tokens", "stop-word"])
def test_streamed_completion_chunks_as_llama_server(pair, fields):
    """Each chunk's text and token ids (sent whether or not return_tokens is), as llama-server's."""
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, **fields}
    stock, ours = (_native_chunks(url, body) for url in pair)
    assert ours == stock and len(stock) > 2


def test_models_and_slots_answer_as_llama_server(pair):
    """GET /v1/models: OpenAI's list with the model's shape in meta, and Ollama's models list
    (the model's name and owner aside); GET /slots: each slot and whether it is busy, idle here."""
    stock, ours = (httpx.get(url + "/v1/models", timeout=60).json() for url in pair)
    assert set(ours) == set(stock) and set(ours["data"][0]) == set(stock["data"][0])
    assert ours["data"][0]["meta"] == stock["data"][0]["meta"]
    same = lambda m: {k: v for k, v in m.items() if k not in ("name", "model")}  # noqa: E731
    assert [same(m) for m in ours["models"]] == [same(m) for m in stock["models"]]
    stock, ours = (httpx.get(url + "/slots", timeout=60) for url in pair)
    assert ours.status_code == stock.status_code == 200
    keys = ("id", "n_ctx", "speculative", "is_processing")
    assert [{k: s[k] for k in keys} for s in ours.json()] == [{k: s[k] for k in keys} for s in stock.json()]
    for url in pair:  # a slot is free: fail_on_no_slot has nothing to fail on
        assert httpx.get(url + "/slots?fail_on_no_slot=1", timeout=60).status_code == 200


@pytest.mark.parametrize("fields", [
    {"n_predict": 8, "temperature": 0},
    {"n_predict": 40, "temperature": 0.7, "seed": 3, "top_k": 7, "n_probs": 2, "prompt": "Q: What is 2 + 2?\nA:"},
    {"n_predict": -1, "temperature": 0, "prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},
], ids=["limit", "settings", "eos"])
def test_a_slot_tells_of_its_last_task_as_llama_server(pair, fields):
    """After a request, GET /slots shows the slot's last task as llama-server's does: its cells and
    prompt counts, where its generation stopped (next_token: tokens drawn, the end of generation's
    included, and left) and its settings (llama-server's ids of tasks aside; it counts others)."""
    body = {"prompt": PROMPT, "cache_prompt": False, **fields}
    stock_answer, ours_answer = _both(pair, "/completion", body)
    assert ours_answer["tokens"] == stock_answer["tokens"]
    (stock,), (ours,) = (httpx.get(url + "/slots", timeout=60).json() for url in pair)
    assert set(ours) == set(stock)
    counts = ("is_processing", "n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache", "next_token")
    assert {k: ours[k] for k in counts} == {k: stock[k] for k in counts}
    assert set(ours["params"]) <= set(stock["params"])
    for k, v in ours["params"].items():  # llama-server's floats are float32
        assert v == (pytest.approx(stock["params"][k], rel=1e-6) if isinstance(v, float) else stock["params"][k]), k
    assert isinstance(ours["id_task"], int)


def test_no_slots_endpoint_as_llama_server():
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--no-slots")
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--no-slots"]).start()
    try:
        s, o = (httpx.get(url + "/slots", timeout=60) for url in (stock.url, ours.url))
        assert o.status_code == s.status_code == 501
        assert o.json()["error"]["message"] == s.json()["error"]["message"]
        assert o.json()["error"]["type"] == s.json()["error"]["type"] == "not_supported_error"
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


def test_a_chat_prompt_sent_raw_ends_at_eos_as_in_llama_server(pair):
    """With --parse-special the template's markup in a raw prompt is its tokens, as llama-server
    reads it; the answer ends at the end-of-turn token, which llama-server counts."""
    prompt = _both(pair, "/apply-template", {"messages": CHAT})
    assert prompt[0] == prompt[1]
    stock, ours = _both(pair, "/completion", {"prompt": prompt[0]["prompt"], "n_predict": 600, "temperature": 0})
    assert stock["stop_type"] == "eos" and {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}


def test_prompt_cache_reuses_cells_as_llama_server(pair):
    """cache_prompt (on by default, as in llama-server): a request starts from the cells its slot
    kept of the last one, as far as the prompts agree, and evaluates at least its last token;
    ``timings.cache_n`` / ``prompt_n`` and OpenAI's ``prompt_tokens_details.cached_tokens`` say
    so as llama-server's do; cache_prompt false evaluates the whole prompt."""
    # prompts no other test sends, so that only these requests' cells can serve them
    start = "Once upon a time, in a land far away, there lived"
    longer = start + " a king who had three daughters, and the youngest"
    steps = [{"prompt": "Something else entirely"}, {"prompt": start}, {"prompt": start}, {"prompt": longer},
             {"prompt": longer, "cache_prompt": False}]
    for body in steps:
        stock, ours = _both(pair, "/completion", {"n_predict": 8, "temperature": 0, **body})
        assert {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}
        assert [ours["timings"][k] for k in ("cache_n", "prompt_n")] == \
            [stock["timings"][k] for k in ("cache_n", "prompt_n")]
    assert stock["timings"]["cache_n"] == 0 and steps[-2] != steps[-1]
    chat = [{"role": "user", "content": "What is 12 + 7?"}]
    for _ in range(2):  # the second turn reuses the first's prompt
        stock, ours = (_chat(url, messages=chat, max_tokens=40) for url in pair)
        assert ours["usage"] == stock["usage"] and ours["choices"][0]["message"] == stock["choices"][0]["message"]
        chat = [*chat, {"role": "assistant", "content": ours["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And 3 + 4?"}]
    assert stock["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stock, ours = (_chat(url, messages=chat[:1], max_tokens=8, cache_prompt=False) for url in pair)
    assert ours["usage"] == stock["usage"] and stock["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_no_cache_prompt_flag_as_llama_server():
    """serve --no-cache-prompt: requests that do not say evaluate their whole prompt; one that asks
    for the cache gets it, as with llama-server's flag."""
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--no-cache-prompt")
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--parse-special", "--no-cache-prompt"]).start()
    try:
        for body in ({}, {}, {"cache_prompt": True}):
            s, o = _both((stock.url, ours.url), "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                                                **body})
            assert [o["timings"][k] for k in ("cache_n", "prompt_n")] == [s["timings"][k] for k in ("cache_n", "prompt_n")]
        assert s["timings"]["cache_n"] > 0
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


@pytest.mark.parametrize("form", ["one-string", "one-token-list", "one-mixed"])
def test_an_array_of_one_prompt_as_in_llama_server(pair, form):
    """An array without a token id is a list of prompts to llama-server; with one element it is
    that prompt (a string, token ids, or both mixed)."""
    ids = httpx.post(pair[0] + "/tokenize", json={"content": PROMPT}, timeout=60).json()["tokens"]
    prompt = {"one-string": [PROMPT], "one-token-list": [ids], "one-mixed": [[ids[0], " capital of France is"]]}[form]
    stock, ours = _both(pair, "/completion", {"prompt": prompt, "n_predict": 6, "temperature": 0})
    assert [ours[k] for k in COUNTS] == [stock[k] for k in COUNTS]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_several_prompts_answered_as_by_llama_server(pair, path):
    """An array without a token id is several prompts: each answered as alone, /completion's as
    llama-server's list of answers, /v1/completions' as one answer with a choice each (the usage
    of all of them, where llama-server gives one prompt's)."""
    ids = httpx.post(pair[0] + "/tokenize", json={"content": PROMPT}, timeout=60).json()["tokens"]
    prompts = ["The capital", ids, [ids[0], " capital of France is"]]
    n = "n_predict" if path == "/completion" else "max_tokens"
    stock, ours = _both(pair, path, {"prompt": prompts, n: 5, "temperature": 0})
    if path == "/completion":
        assert [[o[k] for k in COUNTS if k != "id_slot"] for o in ours] == \
            [[s[k] for k in COUNTS if k != "id_slot"] for s in stock]
        assert [o["index"] for o in ours] == [0, 1, 2]
    else:
        assert [(c["index"], c["text"], c["finish_reason"]) for c in ours["choices"]] == \
            [(c["index"], c["text"], c["finish_reason"]) for c in stock["choices"]]
        alone = [_both(pair, path, {"prompt": p, n: 5, "temperature": 0, "cache_prompt": False})[1]["usage"]
                 for p in prompts]
        assert ours["usage"]["completion_tokens"] == sum(u["completion_tokens"] for u in alone) == 15
        assert ours["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in alone)
    assert httpx.post(pair[1] + path, json={"prompt": [], n: 2}, timeout=60).status_code == 400


def _per_prompt(url: str, path: str, body: dict) -> tuple[dict, int]:
    """A streamed answer of several prompts: each prompt's text and how it ended, by index, and
    how many [DONE] lines came."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()[:300]
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    ids = {json.loads(ln[6:])["id"] for ln in lines if ln.startswith("data: {\"choices") or "\"id\":" in ln}
    assert len(ids) <= 1, ids  # one answer's chunks (llama-server's too)
    told: dict = {}
    for ln in lines:
        if ln in ("data: [DONE]", "data: null"):  # llama-server opens with "data: null"
            continue
        event = json.loads(ln[6:])
        for part in event.get("choices", [event]):
            text, end = told.get(part["index"], ("", None))
            if "choices" in event:
                told[part["index"]] = (text + part["text"], part["finish_reason"] or end)
            else:
                told[part["index"]] = (text + part["content"], part.get("stop_type") or end)
    return told, sum(ln == "data: [DONE]" for ln in lines)


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_several_prompts_streamed_as_by_llama_server(pair, path):
    """Streamed, the answers' chunks interleave, each with its prompt's index: every prompt's
    text and end as llama-server's, one [DONE] on /v1/completions (none on /completion)."""
    n = "n_predict" if path == "/completion" else "max_tokens"
    body = {"prompt": ["The capital", " of France is", "What is 12 + 7?"], n: 6, "temperature": 0}
    (stock, stock_done), (ours, ours_done) = (_per_prompt(url, path, body) for url in pair)
    assert ours == stock and sorted(ours) == [0, 1, 2]
    assert ours_done == stock_done == (0 if path == "/completion" else 1)


@pytest.mark.parametrize("form", ["token-list", "mixed"])
def test_openai_completions_take_token_ids_as_llama_server(pair, form):
    ids = httpx.post(pair[0] + "/tokenize", json={"content": PROMPT}, timeout=60).json()["tokens"]
    prompt = ids if form == "token-list" else [ids[0], " capital of France is"]
    stock, ours = _both(pair, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert ours["choices"][0]["text"] == stock["choices"][0]["text"]
    assert ours["usage"]["prompt_tokens"] == stock["usage"]["prompt_tokens"]


def test_an_empty_prompt_starts_from_bos_as_in_llama_server(pair):
    """An empty prompt is BOS alone where the model adds one, and the answer starts from there, as
    llama-server's; where it adds none (the embedded model), llama-server answers nothing and this
    server says why (a 400 naming the prompt)."""
    bos = "tokenizer.ggml.add_bos_token=bool:true"
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--override-kv", bos)
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--override-kv", bos]).start()
    try:
        s, o = _both((stock.url, ours.url), "/completion", {"prompt": "", "n_predict": 8, "temperature": 0,
                                                            "return_tokens": True})
        assert [o[k] for k in COUNTS] == [s[k] for k in COUNTS] and s["tokens_evaluated"] == 1 and s["content"]
        s, o = _both((stock.url, ours.url), "/v1/completions", {"prompt": "", "max_tokens": 8, "temperature": 0})
        assert o["choices"][0]["text"] == s["choices"][0]["text"] and o["usage"] == s["usage"]
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()
    stock_nothing = httpx.post(pair[0] + "/completion", json={"prompt": "", "n_predict": 8}, timeout=60).json()
    assert stock_nothing["content"] == "" and stock_nothing["tokens_evaluated"] == 0
    ours_refused = httpx.post(pair[1] + "/completion", json={"prompt": "", "n_predict": 8}, timeout=60)
    assert ours_refused.status_code == 400 and ours_refused.json()["error"]["param"] == "prompt"
    assert "adds no BOS token" in ours_refused.json()["error"]["message"]


@pytest.mark.parametrize("samplers", [["top_k", "top_p", "min_p", "temperature"], ["temperature", "top_k"], "kt",
                                      ["temp"], [], ["penalties", "top_k", "temperature"],
                                      ["top-k", "Nucleus", "typ", "minp", "temperature", "dry", "xtc", "bogus"]])
@pytest.mark.parametrize("seed", [3, 11])
def test_a_sampler_order_draws_as_llama_server(pair, samplers, seed):
    """A request's ``samplers`` builds llama-server's chain in that order (saem_gguf.samplers):
    names with llama.cpp's aliases, or characters; a sampler left out is not applied; unknown
    names are skipped as there."""
    body = {"prompt": PROMPT, "n_predict": 16, "temperature": 0.9, "seed": seed, "samplers": samplers,
            "repeat_penalty": 1.3, "presence_penalty": 0.5}
    stock, ours = _both(pair, "/completion", body)
    assert {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}
    greedy = _both(pair, "/completion", {**body, "temperature": 0, "grammar": 'root ::= ("yes" | " Paris")+'})
    assert greedy[0]["content"] == greedy[1]["content"]


REPEATING = "2 + 2 = 4. 2 + 2 = 4. 2 + 2 = 4. 2 + 2 ="  # what DRY has something to penalize in


@pytest.mark.parametrize("fields", [
    {"dry_multiplier": 0.8, "dry_allowed_length": 1, "prompt": REPEATING},
    {"dry_multiplier": 1.5, "dry_base": 0.5, "dry_sequence_breakers": ["\n", "."], "dry_penalty_last_n": 16,
     "prompt": REPEATING},
    {"xtc_probability": 0.9, "xtc_threshold": 0.05},
    {"xtc_probability": 1.5, "xtc_threshold": 0.02},
    {"top_n_sigma": 0.5},
    {"dynatemp_range": 0.8, "dynatemp_exponent": 1.5},
    {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    {"mirostat": 2, "top_k": 1},
    {"mirostat": 7},
    {"dry_multiplier": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.05, "samplers": ["xtc", "dry", "temperature"],
     "prompt": REPEATING},
    {"min_keep": 6, "top_p": 0.05, "min_p": 0.3},
], ids=["dry", "dry-base-below-1-breakers", "xtc", "xtc-clamped", "top-n-sigma", "dynatemp", "mirostat",
        "mirostat-2-ignores-top-k", "mirostat-clamped", "named-order", "min-keep"])
@pytest.mark.parametrize("seed", [3, 11])
def test_samplers_llama_cpp_python_lacks_draw_as_llama_server(pair, fields, seed):
    """DRY, XTC, top-n-sigma, dynamic temperature and Mirostat, which llama-cpp-python's chain
    lacks, build llama.cpp's common chain (samplers.llama_server_chain) with llama-server's limits
    (a soft one clamped, dry_base below 1 the server's); each changes what is drawn."""
    body = {"prompt": fields.get("prompt", PROMPT), "n_predict": 24, "temperature": 0.9, "seed": seed,
            "repeat_penalty": 1.1}
    stock, ours = _both(pair, "/completion", {**body, **fields})
    assert {k: ours[k] for k in COUNTS} == {k: stock[k] for k in COUNTS}
    for k in set(fields) - {"prompt"}:  # llama-server's floats are float32
        s, o = stock["generation_settings"][k], ours["generation_settings"][k]
        assert o == (pytest.approx(s, rel=1e-6) if isinstance(s, float) else s), k
    plain = _both(pair, "/completion", body)
    assert plain[0]["content"] == plain[1]["content"] != ours["content"]


@pytest.mark.parametrize("flags, fields", [
    (["--dry-multiplier", "0.8", "--dry-allowed-length", "1"], {"dry_multiplier": 0.8, "dry_allowed_length": 1}),
    # a --dry-base below 1 is ignored (llama.cpp's arg.cpp), the breakers replace the defaults
    (["--dry-multiplier", "1.5", "--dry-base", "0.5", "--dry-sequence-breaker", "\n", "--dry-sequence-breaker", ".",
      "--dry-penalty-last-n", "16"],
     {"dry_multiplier": 1.5, "dry_sequence_breakers": ["\n", "."], "dry_penalty_last_n": 16}),
    (["--xtc-probability", "0.9", "--xtc-threshold", "0.05"], {"xtc_probability": 0.9, "xtc_threshold": 0.05}),
    (["--top-nsigma", "0.5"], {"top_n_sigma": 0.5}),
    (["--dynatemp-range", "0.8", "--dynatemp-exp", "1.5"], {"dynatemp_range": 0.8, "dynatemp_exponent": 1.5}),
    (["--mirostat", "1", "--mirostat-ent", "3", "--mirostat-lr", "0.2"],
     {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2}),
    (["--samplers", "xtc;dry;temperature", "--dry-multiplier", "0.8", "--xtc-probability", "0.5", "--xtc-threshold",
      "0.05"], {"samplers": ["xtc", "dry", "temperature"], "dry_multiplier": 0.8, "xtc_probability": 0.5,
                "xtc_threshold": 0.05}),
    (["--sampling-seq", "et"], {"samplers": "et"}),
], ids=["dry", "dry-base-below-1-breakers", "xtc", "top-n-sigma", "dynatemp", "mirostat", "named-order", "sampling-seq"])
def test_generate_with_llama_cpp_samplers_draws_as_llama_server(pair, flags, fields):
    """generate's sampler order, DRY, XTC, top-n-sigma, dynamic temperature and Mirostat flags draw
    with llama.cpp's common chain, the prompt fed to it first (the repeat penalty looks back over
    it), as llama-cli and llama-server draw: the same tokens as a stock llama-server request with
    the same settings. Each setting changes what is drawn."""
    common = ["--temp", "0.9", "-s", "3", "--repeat-penalty", "1.1", "-n", "24"]
    body = {"prompt": REPEATING, "n_predict": 24, "temperature": 0.9, "seed": 3, "repeat_penalty": 1.1,
            "return_tokens": True}

    def generate(*extra: str) -> dict:
        r = run_cli("generate", "-p", REPEATING, *common, *extra, "--json", "--quiet")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    ours = generate(*flags)
    stock = httpx.post(pair[0] + "/completion", json={**body, **fields}, timeout=300).json()
    assert ours["tokens"] == stock["tokens"] and ours["text"] == stock["content"]
    assert ours["finish_reason"] == ("length" if stock["stop_type"] == "limit" else "stop")
    assert ours["tokens"] != generate()["tokens"]


def test_chat_prompt_with_llama_cpp_samplers_draws_as_llama_server(pair):
    """generate --chat with a llama.cpp sampler: the chat prompt's tokens (template markup parsed,
    the message literal) fed to the common chain, drawn as llama-server draws from those tokens."""
    r = run_cli("generate", "--chat", "-p", "What is 12 + 7?", "--temp", "0.8", "-s", "5", "--dry-multiplier", "0.8",
                "--repeat-penalty", "1.2", "-n", "32", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)
    stock = httpx.post(pair[0] + "/completion", timeout=300, json={
        "prompt": ours["prompt_tokens"], "n_predict": 32, "temperature": 0.8, "seed": 5, "dry_multiplier": 0.8,
        "repeat_penalty": 1.2, "return_tokens": True}).json()
    assert ours["tokens"] == stock["tokens"]


@pytest.mark.parametrize("flags", [
    ["--dry-multiplier", "1.0", "--dry-allowed-length", "1", "--dry-sequence-breaker", "none", "--xtc-probability",
     "0.5", "--xtc-threshold", "0.05", "--sampler-seq", "edkxt"],
    ["--mirostat", "2", "--mirostat-ent", "3", "--mirostat-lr", "0.3", "--dynatemp-range", "0.5"],
    ["--top-nsigma", "0.7", "--dry-multiplier", "0.5", "--dry-base", "0.5", "--dry-sequence-breaker", "4"],
], ids=["dry-xtc-order", "mirostat", "top-n-sigma-dry"])
def test_sampler_flags_are_the_defaults_of_a_request_as_in_llama_server(flags):
    """serve's DRY, XTC, top-n-sigma, dynamic temperature, Mirostat and --sampler-seq flags: the
    settings of a request that names none, drawn as llama-server draws with the same flags."""
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", *flags)
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--parse-special", *flags]).start()
    try:
        for seed in (5, 9):
            body = {"prompt": REPEATING, "n_predict": 24, "temperature": 0.9, "seed": seed}
            s, o = _both((stock.url, ours.url), "/completion", body)
            assert {k: o[k] for k in COUNTS} == {k: s[k] for k in COUNTS}
            for k, v in s["generation_settings"].items():
                if k in o["generation_settings"] and k != "seed":
                    assert o["generation_settings"][k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), k
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


def test_default_slots_share_the_context_as_in_llama_server():
    """Without -np, llama-server runs -np auto: 4 slots over one KV cache (kv_unified), each
    request able to use the whole -c. The same here (-kvu): a 1,501-token prompt at -c 2048
    answers as stock's (with -np 4 each slot has 512 cells and it does not fit, in both). Two
    such prompts at once overfill the shared cache: one ends with llama-server's "Context size
    has been exceeded.", the other is answered, and the server goes on."""
    import concurrent.futures

    long_prompt = "The capital of France is Paris. " * 100
    body = {"prompt": long_prompt, "n_predict": 8, "temperature": 0, "return_tokens": True}
    stock = StockServer.start(default_model_path(), "-c", "2048")
    ours = ServerProcess(["-c", "2048", "--no-warmup"]).start()
    try:
        s, o = _both((stock.url, ours.url), "/completion", body)
        assert {k: o[k] for k in COUNTS} == {k: s[k] for k in COUNTS} and s["tokens_evaluated"] == 1501
        assert [x["n_ctx"] for x in httpx.get(ours.url + "/slots").json()] == \
            [x["n_ctx"] for x in httpx.get(stock.url + "/slots").json()] == [2048] * 4
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: httpx.post(ours.url + "/completion", timeout=300, json={
                **body, "prompt": p, "cache_prompt": False}), [long_prompt, "Paris is in France. " * 110]))
        assert sorted(r.status_code == 200 for r in answers) == [False, True], [r.text[:200] for r in answers]
        assert any("Context size has been exceeded." in r.text for r in answers)
        assert httpx.post(ours.url + "/completion", json=body, timeout=300).json()["tokens"] == s["tokens"]
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()
    split = ServerProcess(["-c", "2048", "-np", "4", "--no-warmup"]).start()
    try:
        r = httpx.post(split.url + "/completion", json=body, timeout=300)
        assert r.status_code == 400 and "512 tokens per sequence" in r.text
    finally:
        assert split.stop() == 0


def test_default_context_is_llama_servers_for_a_model_trained_on_less():
    """No -c: llama-server's default is the model's own context length (the embedded model's
    2048); ours is that too where it is under 4096: the same n_ctx in /props and /slots. With a
    larger -c, a slot still holds at most the training context (llama-server's n_ctx_slot): a
    longer prompt is refused by both."""
    for flags in ([], ["-c", "8192"]):  # more than it was trained on: a slot still holds 2048, as there
        stock = StockServer.start(default_model_path(), *flags)
        ours = ServerProcess(["--no-warmup", *flags]).start()
        try:
            urls = (stock.url, ours.url)
            props = [httpx.get(u + "/props").json()["default_generation_settings"]["n_ctx"] for u in urls]
            slots = [[x["n_ctx"] for x in httpx.get(u + "/slots").json()] for u in urls]
            assert props == [2048, 2048] and slots[0] == slots[1] == [2048] * 4, flags
            too_long = {"prompt": "Paris is in France. " * 250, "n_predict": 2}  # 2,501 tokens
            assert [httpx.post(u + "/completion", json=too_long, timeout=120).status_code for u in urls] == [400, 400]
        finally:
            stock.stop()
            assert ours.stop() == 0, ours.stderr()


# escape sequences as a shell passes them: what llama.cpp's string_process_escapes reads (and leaves)
ESCAPED = ["a\\nb", "\\x41\\x42", "\\x4", "x\\", "end\\\\", "\\q", "\\x 9", "\\x+f", "\\xc3\\xa9", '\\"q\\"', "\\\\n",
           "\\x0x", "\\t\\r", "\\x\t5"]


@pytest.mark.parametrize("escape", [[], ["--no-escape"]], ids=["escape", "no-escape"])
def test_escape_sequences_read_as_llama_server_reads_them(escape):
    """-e/--escape (on by default) processes the escapes of --dry-sequence-breaker as llama-server
    does (and of the prompt and -r, the same function: test_cli_flags); --no-escape keeps them."""
    flags = [*escape, *(x for b in ESCAPED for x in ("--dry-sequence-breaker", b))]
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "512", *flags)
    ours = ServerProcess(["-np", "1", "-c", "512", "--no-warmup", *flags]).start()
    try:
        s, o = _both((stock.url, ours.url), "/completion", {"prompt": "hi", "n_predict": 1})
        assert o["generation_settings"]["dry_sequence_breakers"] == s["generation_settings"]["dry_sequence_breakers"]
        assert (s["generation_settings"]["dry_sequence_breakers"] == ESCAPED) == bool(escape)
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


@pytest.mark.parametrize("flags", [["-np", "1"], ["-np", "2"], ["-np", "1", "--cache-ram", "0"],
                                   ["-np", "2", "-sps", "0"]], ids=["np1", "np2", "no-cache-ram", "lru-only"])
def test_prompt_cache_in_host_memory_as_llama_server(flags):
    """Prompts that come back after others (a chat between a client's side requests, two
    conversations on one server): the slot a request goes to (llama-server's similarity, else
    least recently used), the cells saved to and loaded from host memory (--cache-ram), hence
    which prompt tokens each request evaluates, as llama-server's."""
    a = "Once upon a time, in a land far away, there lived a king"
    c = "Once upon a time, in a land far away, there lived a queen who"
    prompts = [a, PROMPT, a, PROMPT, c, a, "Let me think step by step about this problem", PROMPT, c]
    stock = StockServer.start(default_model_path(), "-c", "4096", *flags)
    ours = ServerProcess(["-c", "4096", "--no-warmup", "--parse-special", *flags]).start()
    try:
        cached = []
        for prompt in prompts:
            s, o = _both((stock.url, ours.url), "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0})
            assert {k: o[k] for k in COUNTS} == {k: s[k] for k in COUNTS}
            assert [o["timings"][k] for k in ("cache_n", "prompt_n")] == [s["timings"][k] for k in ("cache_n", "prompt_n")]
            cached.append(s["timings"]["cache_n"])
        # the first prompt's cells served its return (from host memory on one slot), unless none are kept
        assert ("--cache-ram" in flags) == (cached[2] == 0)
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 600}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 20}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop": ["shelves"]}),
], ids=["chat-eos", "chat-length", "completion"])
def test_openai_answers_carry_llama_servers_timings(pair, route, body):
    """llama-server's ``timings`` on an OpenAI answer (what web UIs show tokens/s from): the
    counts as there, on the body and, streamed, on the last chunk (the usage chunk when asked)."""
    counts = ("cache_n", "prompt_n", "predicted_n")
    body = {"temperature": 0, "cache_prompt": False, **body}
    stock, ours = (httpx.post(url + route, json=body, timeout=300).json() for url in pair)
    assert [ours["timings"][k] for k in counts] == [stock["timings"][k] for k in counts]
    assert set(ours["timings"]) == set(stock["timings"])
    for include_usage in (False, True):
        last = []
        for url in pair:
            streamed = {**body, "stream": True, "stream_options": {"include_usage": include_usage}}
            with httpx.stream("POST", url + route, json=streamed, timeout=300) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            assert "timings" not in chunks[0] and "timings" in chunks[-1]
            last.append([chunks[-1]["timings"][k] for k in counts])
        assert last[0] == last[1]


def test_infill_on_a_model_without_fim_tokens_is_refused_as_by_llama_server(pair):
    answers = [httpx.post(url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)
               for url in pair]
    assert [r.status_code for r in answers] == [501, 501]
    stock, ours = (r.json()["error"] for r in answers)
    assert ours["message"] == stock["message"] and ours["type"] == stock["type"] == "not_supported_error"


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"content": "Hello <|im_start|>user é😀", "with_pieces": True}),
    ("/tokenize", {"content": "a<|im_start|>b", "parse_special": False, "add_special": True}),
    ("/tokenize", {"content": ["The", 13, " capital"]}),
    ("/detokenize", {"tokens": [946, 264, 1532, 13]}),
    ("/apply-template", {"messages": [{"role": "system", "content": "Be brief."}, *CHAT]}),
])
def test_utility_endpoints_answer_as_llama_server(pair, path, body):
    stock, ours = _both(pair, path, body)
    assert ours == stock


def _chat(url: str, **fields) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "temperature": 0, **fields}, timeout=300)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _message(answer: dict) -> tuple:
    m = answer["choices"][0]["message"]
    return m["content"], m.get("reasoning_content"), answer["choices"][0]["finish_reason"]


@pytest.mark.parametrize("fields", [{"max_tokens": 600}, {"max_tokens": 40},
                                    {"max_tokens": 600, "reasoning_format": "none"}],
                         ids=["whole", "cut-in-thinking", "format-none"])
def test_chat_splits_thinking_as_llama_server(pair, fields):
    stock, ours = (_message(_chat(url, **fields)) for url in pair)
    assert ours == stock
    if fields.get("reasoning_format") != "none":
        assert stock[1]  # the split happened


@pytest.mark.parametrize("messages", [
    [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
], ids=["first", "between"])
def test_a_developer_message_is_a_system_one_as_in_llama_server(pair, messages):
    """OpenAI's developer role (a 400 here before): a system message, as llama.cpp maps it."""
    stock, ours = (_message(_chat(url, messages=messages, max_tokens=100)) for url in pair)
    assert ours == stock


@pytest.mark.parametrize("fields", [
    {"repeat_penalty": 4.0, "frequency_penalty": 2.0},
    {"dry_multiplier": 1.0, "dry_allowed_length": 1, "temperature": 0.8, "seed": 3},
    {"mirostat": 2, "mirostat_tau": 8.0, "temperature": 1.5, "seed": 5},
], ids=["penalties", "dry", "mirostat"])
def test_chat_samples_over_the_rendered_prompt_as_llama_server(pair, fields):
    """A chat's penalties and DRY look back over its rendered prompt (the template's markup and
    the messages), and the samplers llama-cpp-python lacks act on /v1/chat/completions as on
    /completion; each changes the answer."""
    stock, ours = (_message(_chat(url, max_tokens=48, **fields)) for url in pair)
    assert ours == stock
    assert ours != _message(_chat(pair[1], max_tokens=48, **{k: v for k, v in fields.items()
                                                              if k in ("temperature", "seed")}))


@pytest.mark.parametrize("forced", FORCED)
def test_chat_split_rules_as_llama_server(pair, forced):
    """Outputs forced by a grammar: where <think> may stand, a second </think>, empty thinking."""
    stock, ours = (_message(_chat(url, max_tokens=40, grammar="root ::= " + json.dumps(forced))) for url in pair)
    assert ours == stock


def _streamed(url: str) -> tuple[str, str, int]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": CHAT, "temperature": 0, "max_tokens": 600,
                                                                  "stream": True}, timeout=300) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), sum("reasoning_content" in d for d in deltas))


def test_streamed_chat_splits_thinking_as_llama_server(pair):
    stock, ours = (_streamed(url) for url in pair)
    assert ours == stock and stock[2] > 100  # the same thinking, answer and number of thinking deltas


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
JSON_ANSWERS = [{"response_format": {"type": "json_object"}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}},
                {"json_schema": SCHEMA}, {"json_schema": SCHEMA, "reasoning_format": "none"}]
JSON_IDS = ["json-object", "json-schema", "json-schema-field", "format-none"]


@pytest.mark.parametrize("fields", JSON_ANSWERS, ids=JSON_IDS)
def test_a_json_answer_comes_after_the_thinking_as_in_llama_server(pair, fields):
    """response_format / json_schema on a reasoning template: llama-server's grammar lets the
    model think first (the thinking unconstrained), then the JSON, whose content is the JSON alone
    (serving.output_format); before, the grammar held from the first token, and the model
    answered {"answer": 12} without thinking, where llama-server answers 19."""
    stock, ours = (_message(_chat(url, max_tokens=600, **fields)) for url in pair)
    assert ours == stock
    if fields.get("reasoning_format") != "none":
        assert stock[1] and stock[0].startswith("{")


def _streamed_message(url: str, **fields) -> tuple:
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": CHAT, "temperature": 0, "stream": True,
                                                                  **fields}, timeout=300) as r:
        deltas = [json.loads(ln[6:])["choices"] for ln in r.iter_lines() if ln.startswith("data: {")]
    deltas = [c[0] for c in deltas if c]
    return ("".join(d["delta"].get("content") or "" for d in deltas),
            "".join(d["delta"].get("reasoning_content") or "" for d in deltas) or None, deltas[-1]["finish_reason"])


def test_a_streamed_json_answer_comes_after_the_thinking_as_in_llama_server(pair):
    stock, ours = (_streamed_message(url, max_tokens=600, json_schema=SCHEMA) for url in pair)
    assert ours == stock == _message(_chat(pair[1], max_tokens=600, json_schema=SCHEMA))


def test_a_json_answer_without_a_reasoning_template_as_in_llama_server(tmp_path):
    """A template with no thinking: no thinking block, the same whitespace and fence rules."""
    tpl = tmp_path / "plain.jinja"
    tpl.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--chat-template-file", str(tpl))
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--chat-template", str(tpl)]).start()
    try:
        for fields in JSON_ANSWERS[:3]:
            s, o = (_message(_chat(url, max_tokens=100, **fields)) for url in (stock.url, ours.url))
            assert o == s and s[1] is None, fields
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


PREFILLED = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"},
              {"role": "assistant", "content": "The sum is"}]]


@pytest.mark.parametrize("messages", PREFILLED, ids=["greeting", "answer"])
def test_a_final_assistant_message_is_continued_as_in_llama_server(pair, messages):
    """llama-server's assistant prefill: the prompt ends with the message's text after a closed
    thinking block, and the answer's content starts with it (a new turn here before)."""
    assert _both(pair, "/apply-template", {"messages": messages})[1]["prompt"] == \
        _both(pair, "/apply-template", {"messages": messages})[0]["prompt"]
    stock, ours = (_message(_chat(url, messages=messages, max_tokens=24)) for url in pair)
    assert ours == stock and stock[0].startswith(messages[-1]["content"])


def test_a_streamed_continuation_as_llama_server(pair):
    stock, ours = (_streamed_message(url, messages=PREFILLED[0], max_tokens=24) for url in pair)
    assert ours == stock and stock[0].startswith("Hello")


def test_no_prefill_assistant_answers_anew_as_llama_server():
    """--no-prefill-assistant: a final assistant message is one more turn, answered after it."""
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--no-prefill-assistant")
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--no-prefill-assistant"]).start()
    try:
        s, o = (_message(_chat(url, messages=PREFILLED[0], max_tokens=24)) for url in (stock.url, ours.url))
        assert o == s and not (s[0] or "").startswith("Hello")
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()


def _assistant(**fields) -> dict:
    return {"role": "assistant", **fields}


# how a chat ends, by llama-server's rules (serving.prefill, serving.answer_text)
ENDINGS = [
    {"messages": CHAT, "add_generation_prompt": False},
    {"messages": [*CHAT, _assistant(content="The sum")], "continue_final_message": True,
     "add_generation_prompt": False},
    {"messages": [*CHAT, _assistant(content="The sum")], "continue_final_message": True,
     "add_generation_prompt": False, "echo": True},
    {"messages": [*CHAT, _assistant(content="The sum", reasoning_content="Add them")],
     "continue_final_message": "reasoning_content", "add_generation_prompt": False},
    {"messages": [*CHAT, _assistant(content="", reasoning_content="12 plus 7")]},
    {"messages": [*CHAT, _assistant(content="The sum", reasoning_content="12 plus 7")]},
    {"messages": [*CHAT, _assistant(content="x", reasoning_content="r")], "reasoning_format": "none"},
    {"messages": [*CHAT, _assistant(content="", reasoning_content="12 plus 7")], "reasoning_format": "none"},
    {"messages": [*CHAT, _assistant(content="The sum")], "reasoning_format": "none"},
    {"messages": [*CHAT, _assistant(content="x", reasoning_content="r"), {"role": "user", "content": "ok?"}]},
    {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True, "add_generation_prompt": False},
    {"messages": [*CHAT, _assistant(content="The sum")], "continue_final_message": False},
]
ENDING_IDS = ["no-header", "continue", "continue-echo", "continue-reasoning", "reasoning-alone", "both",
              "none-both", "none-reasoning", "none-content", "earlier-reasoning", "continue-user", "continue-false"]


@pytest.mark.parametrize("body", ENDINGS, ids=ENDING_IDS)
def test_how_a_chat_ends_as_in_llama_server(pair, body):
    """add_generation_prompt, continue_final_message (its content or its reasoning_content),
    echo, and a message's reasoning_content: the same prompt (and token count), the same answer
    whole, and the same deltas streamed (the continued text left out where the request asked
    for the continuation and not for echo, as llama-server's stream)."""
    stock, ours = _both(pair, "/apply-template", body)
    assert ours["prompt"] == stock["prompt"]
    stock, ours = (_chat(url, max_tokens=12, **body) for url in pair)
    counts = ("prompt_tokens", "completion_tokens")  # the prompt cache served each differently
    assert _message(ours) == _message(stock) and [ours["usage"][k] for k in counts] == [stock["usage"][k] for k in counts]
    stock, ours = (_streamed_message(url, max_tokens=12, **body) for url in pair)
    assert ours == stock


def test_continuing_and_asking_for_the_header_is_refused_as_by_llama_server(pair):
    body = {"messages": [*CHAT, _assistant(content="The sum")], "continue_final_message": True, "max_tokens": 4}
    for url in pair:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 400 and "Cannot set both add_generation_prompt and continue_final_message" in \
            r.json()["error"]["message"], r.text


def test_two_assistant_messages_at_the_end_are_refused_as_by_llama_server(pair):
    messages = [*PREFILLED[0], {"role": "assistant", "content": "again"}]
    for url in pair:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=300)
        assert r.status_code == 400 and "2 or more assistant messages" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def forced_pair(tmp_path_factory):
    tpl = tmp_path_factory.mktemp("forced") / "forced-open.jinja"
    tpl.write_text(FORCED_OPEN)
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--chat-template-file", str(tpl))
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--chat-template", str(tpl)]).start()
    yield stock.url, ours.url
    stock.stop()
    assert ours.stop() == 0, ours.stderr()


@pytest.mark.parametrize("body", ENDINGS[1:], ids=ENDING_IDS[1:])
def test_how_a_chat_ends_where_the_template_opens_the_block_as_in_llama_server(forced_pair, body):
    """The same endings where the generation prompt opens the thinking block (a continuation cuts
    it). Not here: no header at all under such a template, where llama-server's parser takes the
    whole answer for reasoning (it assumes the block the header would have opened)."""
    stock, ours = _both(forced_pair, "/apply-template", body)
    assert ours["prompt"] == stock["prompt"]
    stock, ours = (_message(_chat(url, max_tokens=12, **body)) for url in forced_pair)
    assert ours == stock
    stock, ours = (_streamed_message(url, max_tokens=12, **body) for url in forced_pair)
    assert ours == stock


@pytest.mark.parametrize("forced", FORCED[:6])
def test_thinking_opened_by_the_template_is_content_unsplit_as_in_llama_server(forced_pair, forced):
    """Reasoning format none: llama-server's content starts with the <think>\\n the prompt opened."""
    stock, ours = (_message(_chat(url, max_tokens=40, grammar="root ::= " + json.dumps(forced),
                                  reasoning_format="none")) for url in forced_pair)
    assert ours == stock and stock[0].startswith("<think>\n")


def test_streamed_unsplit_thinking_opened_by_the_template_as_in_llama_server(forced_pair):
    def first_content(url: str) -> tuple[str, str]:
        with httpx.stream("POST", url + "/v1/chat/completions", json={
                "messages": CHAT, "temperature": 0, "max_tokens": 5, "reasoning_format": "none", "stream": True},
                timeout=300) as r:
            deltas = [json.loads(ln[6:])["choices"][0]["delta"] for ln in r.iter_lines() if ln.startswith("data: {")]
        texts = [d["content"] for d in deltas if d.get("content")]
        return texts[0], "".join(texts)

    stock, ours = (first_content(url) for url in forced_pair)
    assert ours == stock and stock[0] == "<think>\nFirst"


@pytest.mark.parametrize("forced", FORCED[:6])
def test_thinking_opened_by_the_template_splits_as_in_llama_server(forced_pair, forced):
    stock, ours = (_message(_chat(url, max_tokens=40, grammar="root ::= " + json.dumps(forced)))
                   for url in forced_pair)
    assert ours == stock and stock[1] is not None and stock[1].startswith("\n")


@pytest.mark.parametrize("forced", ["\n", " ", "</think>"])
def test_thinking_opened_by_the_template_that_splits_into_nothing_is_the_text_as_llama_server(forced_pair, forced):
    stock, ours = (_message(_chat(url, max_tokens=40, grammar="root ::= " + json.dumps(forced)))
                   for url in forced_pair)
    assert ours == stock == (forced, None, "stop")


@pytest.mark.parametrize("fields", JSON_ANSWERS[:3], ids=JSON_IDS[:3])
def test_a_json_answer_after_thinking_the_template_opened_as_llama_server(forced_pair, fields):
    stock, ours = (_message(_chat(url, max_tokens=600, **fields)) for url in forced_pair)
    assert ours == stock and stock[1]


@pytest.mark.parametrize("messages", PREFILLED[:2], ids=["greeting", "answer"])
def test_a_continuation_closes_the_block_the_template_opened_as_llama_server(forced_pair, messages):
    assert _both(forced_pair, "/apply-template", {"messages": messages})[1]["prompt"] == \
        _both(forced_pair, "/apply-template", {"messages": messages})[0]["prompt"]
    stock, ours = (_message(_chat(url, messages=messages, max_tokens=24)) for url in forced_pair)
    assert ours == stock


@pytest.fixture(scope="module")
def budget_pair():
    """(stock llama-server, serve) with --reasoning-budget 5: a chat's thinking ends after 5 tokens."""
    stock = StockServer.start(default_model_path(), "-np", "1", "-c", "2048", "--reasoning-budget", "5")
    ours = ServerProcess(["-np", "1", "-c", "2048", "--no-warmup", "--parse-special", "--reasoning-budget", "5"]).start()
    yield stock.url, ours.url
    stock.stop()
    assert ours.stop() == 0, ours.stderr()


@pytest.mark.parametrize("fields", [
    {}, {"reasoning_budget_tokens": 0}, {"reasoning_budget_tokens": 3, "reasoning_budget_message": " Time to answer."},
    {"thinking_budget_tokens": 2}, {"reasoning_budget_tokens": -1}, {"reasoning_budget_tokens": 400},
    {"reasoning_budget_tokens": 2, "reasoning_format": "none"},
    {"reasoning_budget_tokens": 4, "temperature": 0.9, "seed": 11},
], ids=["server-budget", "zero", "message", "thinking-alias", "minus-one-is-the-server's", "not-reached", "format-none",
        "seeded"])
def test_reasoning_budget_as_llama_server(budget_pair, fields):
    """The thinking block is cut where llama-server cuts it: the budget's tokens, then the message
    and </think> forced (the sampler chain still draws: the seeded case), then the answer."""
    stock, ours = (_message(_chat(url, max_tokens=80, **fields)) for url in budget_pair)
    assert ours == stock
    if "reasoning_budget_message" in fields:
        assert stock[1].endswith(" Time to answer.")


def test_streamed_chat_with_a_reasoning_budget_as_llama_server(budget_pair):
    stock, ours = (_streamed(url) for url in budget_pair)
    assert ours[:2] == stock[:2] and stock[0] == "\nFirst, this is"


@pytest.mark.parametrize("fields", JSON_ANSWERS[:2], ids=JSON_IDS[:2])
def test_a_json_answer_after_a_cut_thinking_as_llama_server(budget_pair, fields):
    stock, ours = (_message(_chat(url, max_tokens=200, **fields)) for url in budget_pair)
    assert ours == stock


def test_generate_chat_with_a_reasoning_budget_writes_llama_servers_text(budget_pair):
    stock = _chat(budget_pair[0], max_tokens=80, reasoning_format="none")["choices"][0]["message"]["content"]
    got = run_cli("generate", "-p", CHAT[0]["content"], "--chat", "--reasoning-budget", "5", "-n", "80", "--json",
                  "--quiet")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["text"] == stock and "</think>" in stock


def test_a_raw_prompt_has_no_reasoning_budget_as_in_llama_server(budget_pair):
    prompt = _both(budget_pair, "/apply-template", {"messages": CHAT})[0]["prompt"]
    stock, ours = _both(budget_pair, "/completion", {"prompt": prompt, "n_predict": 40, "temperature": 0,
                                                     "reasoning_budget_tokens": 1})
    assert ours["content"] == stock["content"] and "</think>" not in stock["content"]


@pytest.mark.parametrize("budget", [0, 1, 2, 4])
def test_a_budget_counts_the_thinking_the_template_opened_as_llama_server(forced_pair, budget):
    """Where the generation prompt opens the block (<think>\\n), its tokens after <think> count
    (1 spends the budget; 0 is spent by the newline itself, so nothing is forced: llama.cpp's rule)."""
    stock, ours = (_message(_chat(url, max_tokens=40, reasoning_budget_tokens=budget)) for url in forced_pair)
    assert ours == stock


# --- OpenAI's Responses API (/v1/responses) -----------------------------------------------------
def _resp(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/responses", json={"temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, (url, r.text[:500])
    return r.json()


def _told(answer: dict) -> tuple:
    """What a Responses answer says: each output item's type and text, and the token counts."""
    items = [(o["type"], o["role"] if o["type"] == "message" else None, [c["text"] for c in o["content"]])
             for o in answer["output"]]
    u = answer["usage"]
    return items, (u["input_tokens"], u["output_tokens"], u["total_tokens"])


@pytest.mark.parametrize("body", [
    {"input": "What is 12 + 7?", "max_output_tokens": 600},
    {"input": "What is 12 + 7?", "instructions": "Answer briefly.", "max_output_tokens": 600},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is 3 + 4?"}]},
               {"role": "assistant", "type": "message", "content": [{"type": "output_text", "text": "7"}]},
               {"role": "user", "content": "And 12 + 7?"}], "max_output_tokens": 600},
    {"input": "What is 12 + 7?", "max_output_tokens": 600, "reasoning_format": "none"},
    # a reasoning item: the thinking of the assistant turn it begins, continued here
    {"input": [{"role": "user", "content": "What is 12 + 7?"},
               {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "12 plus 7"}]}],
     "max_output_tokens": 600},
], ids=["text", "instructions", "items", "format-none", "reasoning-item"])
def test_responses_answer_as_llama_server(pair, body):
    """The request read as llama-server reads it (a chat), the answer in its shapes: a reasoning
    item for the thinking, a message item for the answer, the token counts."""
    stock, ours = (_resp(url, body) for url in pair)
    assert _told(ours) == _told(stock) and ours["status"] == stock["status"] == "completed"
    assert {k for k in stock if k != "timings"} <= set(ours) and ours["object"] == "response"
    assert ours["id"].startswith("resp_") and ours["output"][-1]["id"].startswith("msg_")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 600}),
    ("/v1/completions", {"prompt": "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n",
                         "max_tokens": 600}),
    ("/v1/responses", {"input": "What is 12 + 7?", "max_output_tokens": 600}),
], ids=["chat", "completion", "responses"])
def test_usage_counts_the_end_of_generation_as_llama_server(pair, path, body):
    """An answer that ends at the end-of-generation token counts it among the completion's
    tokens, as llama-server's usage (and its timings.predicted_n) do."""
    stock, ours = _both(pair, path, {"temperature": 0, **body})
    assert ours["usage"] == stock["usage"]
    assert (ours["choices"][0]["finish_reason"] == "stop") if "choices" in ours else ours["status"] == "completed"


def test_a_cut_response_is_incomplete_unlike_llama_server(pair):
    """Cut by max_output_tokens: the same items and counts; status incomplete, as OpenAI's (llama-
    server says completed)."""
    stock, ours = (_resp(url, {"input": "What is 12 + 7?", "max_output_tokens": 20}) for url in pair)
    assert _told(ours) == _told(stock) and stock["status"] == "completed"
    assert ours["status"] == "incomplete" and ours["incomplete_details"] == {"reason": "max_output_tokens"}


def _resp_events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/responses", json={"temperature": 0, "stream": True, **body},
                      timeout=300) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert len(names) == len(data) and all(d["type"] == n for n, d in zip(names, data)), lines[:6]
    return list(zip(names, data))


def test_streamed_responses_as_llama_server(pair):
    """The same events in the same order (created, in progress, each item added, its deltas, each
    done, completed), the same deltas, and the whole answer at the end."""
    body = {"input": "What is 12 + 7?", "max_output_tokens": 600}
    stock, ours = (_resp_events(url, body) for url in pair)

    def shape(events):  # consecutive deltas of one kind merged: where a piece is cut may differ
        out = []
        for name, data in events:
            if name.endswith(".delta") and out and out[-1][0] == name:
                out[-1] = (name, out[-1][1] + data["delta"])
            else:
                out.append((name, data.get("delta")))
        return out

    assert shape(ours) == shape(stock) and stock[0][0] == "response.created"
    assert _told(ours[-1][1]["response"]) == _told(stock[-1][1]["response"])


# --- Anthropic's Messages API (/v1/messages) ------------------------------------------------------
def _msg(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/messages", json={"temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, (url, r.text[:500])
    return r.json()


def _said(answer: dict) -> tuple:
    """What a Messages answer says: each content block, the stop, the counts."""
    return answer["content"], answer["stop_reason"], answer["stop_sequence"], answer["usage"]


MESSAGES = [
    {"messages": CHAT, "max_tokens": 600},
    {"messages": CHAT, "max_tokens": 20},
    {"messages": CHAT, "system": [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}],
     "max_tokens": 600},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?"}]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "3 and 4.", "signature": ""},
                                                    {"type": "text", "text": "7"}]},
                  {"role": "user", "content": "And 12 + 7?"}], "max_tokens": 600},
    {"messages": CHAT, "max_tokens": 600, "stop_sequences": ["so"], "top_k": 1, "seed": 5},
    # a final turn continued: its thinking alone (the thinking goes on), its thinking and its text
    {"messages": [*CHAT, {"role": "assistant", "content": [{"type": "thinking", "thinking": "12 plus 7",
                                                            "signature": ""}]}], "max_tokens": 40},
    {"messages": [*CHAT, {"role": "assistant", "content": [{"type": "thinking", "thinking": "12 plus 7"},
                                                           {"type": "text", "text": "The sum"}]}], "max_tokens": 40},
]
MESSAGES_IDS = ["text", "cut", "system", "turns", "stop", "continue-thinking", "continue-both"]


@pytest.mark.parametrize("body", MESSAGES, ids=MESSAGES_IDS)
def test_messages_answer_as_llama_server(pair, body):
    """The request read as llama-server reads it (a chat), the answer in its shapes: a thinking
    block, a text block, the stop and the counts; a stop sequence's end is stop_reason
    stop_sequence, as Anthropic's API says (llama-server: end_turn)."""
    stock, ours = (_msg(url, body) for url in pair)
    if stock["stop_sequence"] is not None:
        assert stock["stop_reason"] == "end_turn" and ours["stop_reason"] == "stop_sequence"
        stock["stop_reason"] = "stop_sequence"
    assert _said(ours) == _said(stock)
    assert {k for k in stock} == set(ours) and ours["type"] == "message" and ours["role"] == "assistant"


def _msg_events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/messages", json={"temperature": 0, "stream": True, **body},
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln and not ln.startswith(":")]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert len(names) == len(data) and all(d["type"] == n for n, d in zip(names, data)), lines[:6]
    return list(zip(names, data))


@pytest.mark.parametrize("body", [MESSAGES[0], MESSAGES[1], MESSAGES[4]], ids=["text", "cut", "stop"])
def test_streamed_messages_as_llama_server(pair, body):
    """The same events in the same order (message_start, each block's start, deltas and stop, the
    message's delta and stop), the same deltas, counts and stop."""
    stock, ours = (_msg_events(url, body) for url in pair)

    def shape(events):  # consecutive deltas of one block merged: where a piece is cut may differ
        out = []
        for name, data in events:
            if name == "content_block_delta" and out and out[-1][0] == name and out[-1][1] == data["index"] \
                    and out[-1][2]["type"] == data["delta"]["type"] != "signature_delta":
                key = "thinking" if data["delta"]["type"] == "thinking_delta" else "text"
                out[-1][2][key] += data["delta"][key]
            elif name == "message_start":
                out.append((name, None, data["message"]["usage"]))
            else:
                out.append((name, data.get("index"), dict(data.get("delta") or data.get("content_block") or {})))
        return out

    if body.get("stop_sequences"):
        assert stock[-2][1]["delta"]["stop_reason"] == "end_turn" and ours[-2][1]["delta"]["stop_reason"] == "stop_sequence"
        stock[-2][1]["delta"]["stop_reason"] = "stop_sequence"
    assert shape(ours) == shape(stock) and stock[0][0] == "message_start" and stock[-1][0] == "message_stop"
    assert ours[-2][1]["usage"] == stock[-2][1]["usage"]


@pytest.mark.parametrize("path, body", [
    ("/v1/messages/count_tokens", {"messages": CHAT, "system": "Answer briefly."}),
    ("/v1/messages/count_tokens", MESSAGES[3]),
    ("/v1/chat/completions/input_tokens", {"messages": CHAT}),
    ("/v1/chat/completions/input_tokens", {"messages": [*CHAT, {"role": "assistant", "content": "The sum"}]}),
    ("/v1/responses/input_tokens", {"input": "What is 12 + 7?", "instructions": "Answer briefly."}),
], ids=["messages", "messages-turns", "chat", "chat-prefill", "responses"])
def test_prompt_tokens_counted_as_llama_server(pair, path, body):
    """The prompt a chat would evaluate, counted as llama-server counts it (a continued
    assistant message included)."""
    stock, ours = _both(pair, path, body)
    assert ours == stock and stock["input_tokens"] > 10


def test_llama_servers_environment_variables_configure_serve_as_llama_server():
    """A llama-server configured by its environment (LLAMA_ARG_*), with a flag on the command line
    (in llama.cpp's --flag_name spelling) that overrides one of them: the same slots, context,
    name and request defaults in both, and the same tokens drawn from those defaults."""
    env = {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_KV_UNIFIED": "on",
           "LLAMA_ARG_TEMPERATURE": "0.9", "LLAMA_ARG_TOP_K": "40", "LLAMA_ARG_N_PREDICT": "6",
           "LLAMA_ARG_ALIAS": "from-the-environment"}
    stock = StockServer.start(default_model_path(), "--top_k", "7", env=env)
    ours = ServerProcess(["--no-warmup", "--top_k", "7"], env=env).start()
    try:
        urls = (stock.url, ours.url)
        settings = [httpx.get(u + "/props").json()["default_generation_settings"] for u in urls]
        for s in settings:
            # n_predict: a request's own default, -n applies to one that sets none (below)
            assert (s["n_ctx"], s["params"]["top_k"], s["params"]["n_predict"]) == (1024, 7, -1), s
            assert s["params"]["temperature"] == pytest.approx(0.9)
        assert [[x["n_ctx"] for x in httpx.get(u + "/slots").json()] for u in urls] == [[1024] * 2] * 2
        assert [httpx.get(u + "/v1/models").json()["data"][0]["id"] for u in urls] == ["from-the-environment"] * 2
        s, o = _both(urls, "/completion", {"prompt": PROMPT, "seed": 11})
        assert {k: o[k] for k in COUNTS} == {k: s[k] for k in COUNTS} and s["tokens_predicted"] == 6
    finally:
        stock.stop()
        assert ours.stop() == 0, ours.stderr()
    assert "warn: LLAMA_ARG_TOP_K environment variable is set, but will be overwritten by command line argument " \
           "--top-k" in ours.stderr()


# gpt-oss's answers (saem_gguf.harmony): outputs forced by a grammar on a test model with gpt-oss's
# template and harmony tokens. A grammar cannot end with <|return|> (an end of generation), so each
# ends where the model may end it.
_A, _F, _S, _E = '<|channel|> "analysis" <|message|>', '<|channel|> "final" <|message|>', '<|start|> "assistant"', "<|end|>"
HARMONY_FORCED = {
    "reasoning-then-answer": f'{_A} "We add." {_E} {_S} {_F} "It is 5."',
    "answer-alone": f'{_F} "It is 5."',
    "reasoning-alone": f'{_A} "We add." {_E}',
    "reasoning-unended": f'{_A} "We add and add and add."',
    "two-reasonings": f'{_A} "One." {_E} {_S} {_A} "Two." {_E} {_S} {_F} "Five."',
    "preamble": f'<|channel|> "commentary" <|message|> "Note." {_E} {_S} {_F} "X."',
    "stray-commentary": f'<|channel|> "commentary" {_A} "R." {_E} {_S} {_F} "C."',
    "stray-to-assistant": f'<|channel|> "commentary to=assistant" {_A} "R." {_E} {_S} {_F} "C."',
    "text-after-the-answer": f'{_F} "X." {_E} "tail"',
    "blank-parts": f'{_A} " " {_E} {_S} {_F} " c "',
    "empty-reasoning": f'{_A} {_E} {_S} {_F} "C."',
    # nothing captured: the text as it came, in both
    "unsolicited-call": f'<|channel|> "commentary to=functions.x" <|message|> "{{}}" {_E}',
}


@pytest.fixture(scope="module")
def harmony_pair():
    """(stock llama-server, serve) on a gpt-oss test model with gpt-oss's own template."""
    from saem_gguf.testmodels import ModelSpec, ensure_model

    model = ensure_model(ModelSpec(arch="gpt-oss", chat_template="gpt-oss"))
    stock = StockServer.start(model, "-np", "1", "-c", "2048")
    ours = ServerProcess(["-m", str(model), "-np", "1", "-c", "2048", "--no-warmup"]).start()
    yield stock.url, ours.url
    stock.stop()
    assert ours.stop() == 0, ours.stderr()


def _harmony_chat(url: str, grammar: str, stream: bool = False, **fields):
    body = {"messages": [{"role": "user", "content": "What is 2+3?"}], "temperature": 0, "max_tokens": 60,
            "grammar": "root ::= " + grammar, "stream": stream, **fields}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text[:300]
        return _message(r.json())
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    # the opening chunk aside (llama-server's content null, OpenAI's and ours "")
    return [(e["choices"][0]["delta"].get("reasoning_content"), e["choices"][0]["delta"].get("content"),
             e["choices"][0]["finish_reason"]) for e in events[1:] if e["choices"]]


@pytest.mark.parametrize("fields", [{}, {"reasoning_format": "none"}, {"max_tokens": 9}],
                         ids=["split", "format-none", "cut-short"])
@pytest.mark.parametrize("name", list(HARMONY_FORCED))
def test_gpt_oss_answers_split_by_channel_as_llama_server(harmony_pair, name, fields):
    """The analysis channel is the reasoning and the final one the content (reasoning_format none:
    the analysis markup stays in the content), commentary preambles are content, a stray
    commentary channel is skipped; cut short by max_tokens, the parts so far."""
    stock, ours = (_harmony_chat(url, HARMONY_FORCED[name], **fields) for url in harmony_pair)
    assert ours == stock
    if name == "reasoning-then-answer" and not fields:
        assert ours == ("It is 5.", "We add.", "stop")


@pytest.mark.parametrize("name", ["reasoning-then-answer", "two-reasonings", "preamble", "stray-commentary",
                                  "blank-parts"])
@pytest.mark.parametrize("fields", [{}, {"reasoning_format": "none"}], ids=["split", "format-none"])
def test_a_streamed_gpt_oss_answer_in_the_deltas_of_llama_server(harmony_pair, name, fields):
    stock, ours = (_harmony_chat(url, HARMONY_FORCED[name], stream=True, **fields) for url in harmony_pair)
    assert ours == stock


def test_gpt_oss_output_that_does_not_parse_is_its_text_here(harmony_pair):
    """llama-server answers 500 to gpt-oss output that begins with no channel; here the answer is
    that text, whole and streamed alike (saem_gguf.harmony's one difference on purpose)."""
    stock, ours = harmony_pair
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "grammar": 'root ::= "Hello there."'}
    assert httpx.post(stock + "/v1/chat/completions", json=body, timeout=300).status_code == 500
    assert _harmony_chat(ours, '"Hello there."') == ("Hello there.", None, "stop")
    deltas = _harmony_chat(ours, '"Hello there."', stream=True)
    assert "".join(c or "" for _, c, _ in deltas) == "Hello there."


CONTINUED = [{"role": "user", "content": "What is 2+3?"},
             {"role": "assistant", "content": "It is", "reasoning_content": "We add."}]


@pytest.mark.parametrize("last,fields", [
    ({"content": "It is", "reasoning_content": "We add."}, {}),
    ({"content": "It is"}, {}),
    ({"content": "", "reasoning_content": "We add"}, {}),
    ({"content": "It is", "reasoning_content": "We add."}, {"continue_final_message": "reasoning_content",
                                                           "add_generation_prompt": False}),
], ids=["both", "content-alone", "reasoning-alone", "reasoning-asked"])
def test_gpt_oss_continues_a_final_message_in_its_channels_as_llama_server(harmony_pair, last, fields):
    """A final assistant message is continued as llama-server's gpt-oss prefill continues it: the
    analysis channel with its reasoning, then the final channel with its content; the same prompt
    (/apply-template), and the same answer, whole and streamed, its parts starting with the
    message's."""
    messages = [CONTINUED[0], {"role": "assistant", **last}]
    prompts = [httpx.post(u + "/apply-template", json={"messages": messages, **fields}, timeout=60).json()["prompt"]
               for u in harmony_pair]
    in_reasoning = not last["content"] or fields.get("continue_final_message") == "reasoning_content"
    assert prompts[0] == prompts[1] and prompts[0].endswith(last["reasoning_content" if in_reasoning else "content"])
    grammar = '" and more."' if in_reasoning else '" 5." <|end|>'
    for stream in (False, True):
        stock, ours = (_harmony_chat(url, grammar, stream=stream, messages=messages, **fields) for url in harmony_pair)
        assert ours == stock, stream


def test_gpt_oss_continuation_asked_streams_only_what_is_generated_as_llama_server(harmony_pair):
    for echo in (False, True):
        fields = {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False, "echo": echo}
        stock, ours = (_harmony_chat(url, '" 5." <|end|>', stream=True, **fields) for url in harmony_pair)
        assert ours == stock, echo


def _analysis_by_tokens(url: str) -> str:
    """The grammar's <|channel|>analysis<|message|> as the tokens a model writes it in (token ids:
    llama.cpp's budget matches its start tag by tokens, and a grammar's "analysis" may come out
    in other pieces)."""
    ids = httpx.post(url + "/tokenize", json={"content": "<|channel|>analysis<|message|>", "parse_special": True},
                     timeout=60).json()["tokens"]
    return " ".join(f"<[{i}]>" for i in ids)


@pytest.mark.parametrize("fields", [
    {"reasoning_budget_tokens": 0}, {"reasoning_budget_tokens": 3},
    {"reasoning_budget_tokens": 2, "reasoning_budget_message": " Time to answer."},
    {"reasoning_budget_tokens": 3, "reasoning_format": "none"}, {"reasoning_budget_tokens": 400},
], ids=["zero", "three", "message", "format-none", "not-reached"])
def test_gpt_oss_reasoning_budget_as_llama_server(harmony_pair, fields):
    """gpt-oss's analysis channel is its thinking block for the budget (llama.cpp's thinking tags
    for it: <|channel|>analysis<|message|> ... <|end|>): cut after the budget's tokens, the
    message and <|end|> forced, then the answer; whole and streamed. Unbudgeted, this model's
    analysis runs to max_tokens."""
    grammar = f'{_analysis_by_tokens(harmony_pair[0])} [A-Za-z .]* {_E} {_S} {_F} "It is 5."'
    for stream in (False, True):
        stock, ours = (_harmony_chat(url, grammar, stream=stream, max_tokens=40, **fields) for url in harmony_pair)
        assert ours == stock, stream
    whole = _harmony_chat(harmony_pair[1], grammar, max_tokens=40, **fields)
    assert whole[2] == ("length" if fields["reasoning_budget_tokens"] == 400 else "stop")
    if "reasoning_budget_message" in fields:
        assert whole[1].endswith(" Time to answer.")


def test_gpt_oss_budget_counts_a_continued_reasoning_as_llama_server(harmony_pair):
    """A continued reasoning is inside the analysis channel: its tokens count (llama.cpp's prefill);
    with 4 of budget and 2 spent by the message's, the end comes 2 tokens on."""
    fields = {"messages": [CONTINUED[0], {"role": "assistant", "content": "", "reasoning_content": "We add"}],
              "reasoning_budget_tokens": 4}
    grammar = f'[A-Za-z .]* {_E} {_S} {_F} "5."'
    stock, ours = (_harmony_chat(url, grammar, max_tokens=40, **fields) for url in harmony_pair)
    assert ours == stock and stock[2] == "stop"
    unbudgeted = _harmony_chat(harmony_pair[1], grammar, max_tokens=40, messages=fields["messages"])
    assert unbudgeted[2] == "length"
