"""`serve` end to end: a live server process on a free localhost port with the embedded model, driven
by the official `openai` client (and by raw HTTP where a client would refuse to send the mistake).

One server per module for the endpoints (-np 4); a small one (-np 1 --queue 1 --api-key) for the
key and the full queue; short-lived ones for the stop signals. Greedy answers are compared with
`generate --json` on the same model: the server must say what the CLI says."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO
from fidelity_helpers import stock_env, stock_lib  # noqa: F401
from serve_helpers import ServerProcess, wait_until
from saem_gguf.serving.threads import serve_threads, usable_cpus

QUESTION = "What is 12 + 7?"
PROMPT = "The capital of France is"
N = 24  # tokens per answer in the comparisons


@pytest.fixture(scope="module")
def server():
    # 8192 cells per sequence, a slot capped at the 2048 the model was trained on (as llama-server);
    # thinking left in content, so answers compare with generate's text
    # (the split, llama-server's default, is tested against llama-server: test_serve_reference.py)
    s = ServerProcess(["-np", "4", "-c", "32768", "--reasoning-format", "none"]).start()
    yield s
    rc = s.stop(signal.SIGTERM)
    assert rc == 0, s.stderr()
    assert "Traceback" not in s.stderr(), s.stderr()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _generate(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "saem_gguf", "generate", "--json", "--quiet", "-c", "1024", *args],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def cli_chat() -> dict:
    return _generate("--chat", "-p", QUESTION, "-n", str(N))


@pytest.fixture(scope="module")
def cli_raw() -> dict:
    return _generate("-p", PROMPT, "-n", str(N))


def _stats(server) -> dict:
    return httpx.get(server.url + "/v1/saem/stats", timeout=30).json()


# --- the endpoints ------------------------------------------------------------------------------
def test_models_health_stats_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["default-model.gguf"]  # the GGUF's file name (no -a)
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    stats = _stats(server)
    assert stats["n_parallel"] == 4 and "policy" in stats and "hit_rate" in stats
    # serve's thread rule (serving.threads), said in the line that says it is ready
    rule = serve_threads(usable_cpus(), None, None)
    assert f"-t {rule.n_threads} -tb {rule.n_threads_batch}," in server.stderr()
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"saem_requests", "saem_tokens_predicted", "saem_tokens_per_second", "saem_queue_length",
            "saem_busy_slots", "saem_expert_hit_rate", "saem_expert_bytes_moved", "saem_stage_boundaries",
            "saem_placement_updates"} <= names, names


def test_chat_greedy_equals_generate(client, cli_chat):
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=N, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == cli_chat["text"]
    assert choice.finish_reason == cli_chat["finish_reason"]
    assert r.usage.prompt_tokens == cli_chat["n_prompt"]
    assert r.usage.completion_tokens == cli_chat["n_generated"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_streamed_equals_not_streamed(client, cli_chat):
    chunks = list(client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=N, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == cli_chat["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [cli_chat["finish_reason"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == cli_chat["n_generated"]
    assert len({c.id for c in chunks}) == 1


def test_completion_greedy_streamed_and_not(client, cli_raw):
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == cli_raw["text"] and r.choices[0].finish_reason == cli_raw["finish_reason"]
    assert r.usage.prompt_tokens == cli_raw["n_prompt"] and r.usage.completion_tokens == cli_raw["n_generated"]
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cli_raw["text"]
    assert chunks[-1].choices[0].finish_reason == cli_raw["finish_reason"]


def test_raw_sse_framing_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and "\n" not in e
        json.loads(e[6:])


def test_max_tokens_and_stop(client, cli_raw):
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
    text = cli_raw["text"]
    stop = text.strip()[len(text.strip()) // 2:][:3]  # a string inside the greedy answer
    assert stop and stop in text
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_seeded_sampling_repeats_and_differs_by_seed(client):
    def ask(seed: int) -> str:
        return client.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=1.0,
                                         seed=seed).choices[0].text

    assert ask(7) == ask(7)
    assert len({ask(s) for s in (1, 2, 3, 4)}) > 1


def test_logprobs(client):
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the chosen is the top one
    assert "".join(t.token for t in content) == r.choices[0].message.content
    c = client.completions.create(model="any", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_user_text_is_not_parsed_into_control_tokens(client):
    """A message holding the template's markup stays literal text: more prompt tokens than the markup's
    control tokens would make (the drop-in's fidelity rule)."""
    plain = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    marked = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "hi<|im_end|>"}], max_tokens=1)
    assert marked.usage.prompt_tokens - plain.usage.prompt_tokens > 1


def test_concurrent_greedy_replies_equal_the_lone_ones(client):
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(8)]

    def ask(p: str) -> str:
        return client.chat.completions.create(model="any", messages=[{"role": "user", "content": p}],
                                              max_tokens=N, temperature=0).choices[0].message.content

    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_json_schema_response_format_through_the_client(client, server):
    """OpenAI's structured output (response_format json_schema): the model thinks, then answers in
    JSON, and the content is the JSON alone (as llama-server: test_serve_reference.py). The CLI's
    -j constrains the whole output from the first token, as llama-cpp-python does, and so answers
    without thinking."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=600,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {
                                           "name": "answer", "schema": schema, "strict": True}},
                                       extra_body={"reasoning_format": "auto"})
    assert json.loads(r.choices[0].message.content) == {"answer": 19} and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.model_extra["reasoning_content"]
    cli = _generate("--chat", "-p", QUESTION, "-n", str(N), "-j", json.dumps(schema))
    assert cli["text"].startswith("{") and "<think>" not in cli["text"]
    bad = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "grammar": "root ::= x"})
    assert bad.status_code == 400 and "Undefined rule identifier 'x'" in bad.json()["error"]["message"]
    # a grammar deep enough to overflow llama.cpp's parser (a segfault: test_grammar.py) is a 400,
    # and the server goes on
    deep = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4,
                                              "grammar": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000})
    assert deep.status_code == 400 and "nests groups 100000 deep" in deep.json()["error"]["message"]
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_logit_bias_equals_generate_l(client, server, cli_raw):
    """OpenAI's logit_bias is the CLI's -l; llama-server's forms (pairs, text, false) too; an id
    outside the vocabulary is a 400 (llama-server skips it silently)."""
    first = cli_raw["tokens"][0]
    cli = _generate("-p", PROMPT, "-n", str(N), "-l", f"{first}-100")
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=N, temperature=0,
                                  logit_bias={str(first): -100})
    assert r.choices[0].text == cli["text"] != cli_raw["text"]
    banned = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                               "logit_bias": [[first, False]]})
    assert banned.status_code == 200 and banned.json()["choices"][0]["text"] == cli["text"]
    text = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                             "logit_bias": {cli_raw["text"]: False}})  # every token of it
    assert text.status_code == 200 and cli_raw["text"].strip() not in text.json()["choices"][0]["text"]
    bad = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"99999999": 1}})
    assert bad.status_code == 400 and "logit bias token 99999999" in bad.json()["error"]["message"]


STOCK_TOKENS = """
import ctypes, json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
buf = ctypes.create_string_buffer(512)
def piece(t):
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, t, buf, 512, 0, True)
    return buf.raw[:n].hex()
out = {}
for text in json.loads(sys.argv[2]):
    for add, special in ((False, True), (True, True), (False, False)):
        toks = llm.tokenize(text.encode(), add_bos=add, special=special)
        out[f"{add} {special} {text}"] = [toks, [piece(t) for t in toks]]
print(json.dumps(out))
"""


def test_tokenize_and_detokenize_are_llama_servers(server, stock_lib):  # noqa: F811
    """/tokenize is llama_tokenize as llama-server calls it (add_special off and parse_special on by
    default), its pieces llama.cpp's common_token_to_piece; /detokenize joins those pieces. Checked
    against stock llama-cpp-python's tokenize and llama_token_to_piece on the stock build."""
    from saem_gguf.default_model import default_model_path

    texts = ["Hello <|im_start|>user world", "  Alternatively, 12 + 7 = 19.\n", "é😀"]
    r = subprocess.run([sys.executable, "-c", STOCK_TOKENS, str(default_model_path()), json.dumps(texts)],
                       capture_output=True, text=True, timeout=300, env=stock_env(stock_lib), cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    stock = json.loads(r.stdout)
    for key, (want, pieces) in stock.items():
        add, special, text = key.split(" ", 2)
        body = {"content": text, "add_special": add == "True", "parse_special": special == "True"}
        assert _post(server, "/tokenize", body).json() == {"tokens": want}, key
        got = _post(server, "/tokenize", {**body, "with_pieces": True}).json()["tokens"]
        assert [g["id"] for g in got] == want
        for g, p in zip(got, pieces):  # a piece that is part of a character comes as its bytes
            assert (g["piece"] if isinstance(g["piece"], list) else list(g["piece"].encode())) == \
                list(bytes.fromhex(p)), key
        assert _post(server, "/detokenize", {"tokens": want}).json() == {
            "content": b"".join(bytes.fromhex(p) for p in pieces).decode("utf-8", "replace")}
    assert any(isinstance(g["piece"], list) for g in _post(server, "/tokenize", {
        "content": "😀", "with_pieces": True}).json()["tokens"])  # a byte-level BPE splits the emoji
    # llama-server's mixed content: ids kept, BOS only for a first string
    first = stock[f"False True {texts[0]}"][0]
    assert _post(server, "/tokenize", {"content": [texts[0], 7, texts[0]]}).json() == {
        "tokens": first + [7] + first}
    for path, body in (("/tokenize", {"content": [10**6]}), ("/detokenize", {"tokens": [-1]}),
                       ("/tokenize", {"content": {"a": 1}}), ("/detokenize", {"tokens": "1 2"})):
        bad = _post(server, path, body)
        assert bad.status_code == 400 and bad.json()["error"]["message"], (path, body)


def test_apply_template_and_props(server, cli_chat):
    """/apply-template is the prompt a chat becomes (its tokens are generate --chat's prompt);
    /props has llama-server's fields for this server."""
    prompt = _post(server, "/apply-template", {"messages": [{"role": "user", "content": QUESTION}]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and QUESTION in prompt
    toks = _post(server, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert toks == cli_chat["prompt_tokens"]
    assert _post(server, "/apply-template", {"messages": []}).status_code == 400
    # template variables: this template reads none (the same prompt); one the chat handler sets itself is a 400
    same_prompt = _post(server, "/apply-template", {"messages": [{"role": "user", "content": QUESTION}],
                                                    "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert same_prompt["prompt"] == prompt
    taken = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                   "chat_template_kwargs": {"bos_token": "x"}})
    assert taken.status_code == 400 and "'bos_token' is set by the chat handler" in taken.json()["error"]["message"]
    props = httpx.get(server.url + "/props", timeout=30).json()
    # -c 32768 over 4 slots is 8192 each, capped at the model's training context (2048), as
    # llama-server's n_ctx_slot caps it
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 2048
    assert props["default_generation_settings"]["params"]["temperature"] == 0.0
    assert props["chat_template"].startswith("{%- for message in messages") and props["eos_token"] == "<|im_end|>"
    assert props["model_path"].endswith("default-model.gguf") and props["modalities"]["vision"] is False


def test_native_completion_is_llama_servers(server, cli_raw):
    """/completion (and /completions): llama-server's own shape: the generate CLI's text and tokens,
    stop_type limit / word / eos with the stopping word, timings, completion_probabilities; streamed
    as chunks of content then the final object, without [DONE]; a mixed prompt of text and ids."""
    r = _post(server, "/completion", {"prompt": PROMPT, "n_predict": N, "n_probs": 2, "return_tokens": True}).json()
    assert (r["content"], r["tokens"]) == (cli_raw["text"], cli_raw["tokens"])
    assert r["stop"] is True and r["stop_type"] == "limit" and r["stopping_word"] == ""
    assert (r["tokens_predicted"], r["tokens_evaluated"]) == (N, len(cli_raw["prompt_tokens"]))
    assert r["prompt"] == PROMPT and r["generation_settings"]["n_predict"] == N
    assert r["timings"]["predicted_n"] == N and r["timings"]["predicted_per_second"] > 0
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == cli_raw["tokens"] and all(len(p["top_logprobs"]) == 2 for p in probs)
    assert probs[0]["top_logprobs"][0]["id"] == probs[0]["id"] and probs[0]["logprob"] <= 0
    # a stop word
    word = cli_raw["text"].split()[2]
    w = _post(server, "/completions", {"prompt": PROMPT, "max_tokens": N, "stop": [word]}).json()
    assert w["stop_type"] == "word" and w["stopping_word"] == word
    assert w["content"] == cli_raw["text"][:cli_raw["text"].index(word)]
    # streamed: the chunks' content is the text, then the final object; no [DONE]
    with httpx.stream("POST", server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "stream": True,
                                                                "return_tokens": True}, timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines]
    assert all(ln.startswith("data: {") for ln in lines)
    assert "".join(e["content"] for e in events) == cli_raw["text"]
    assert sum((e["tokens"] for e in events[:-1]), []) == cli_raw["tokens"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["content"] == "" and events[-1]["stop_type"] == "limit"
    # text and token ids mixed, as llama-server takes them: the same tokens, the same answer
    head, tail = cli_raw["prompt_tokens"][:2], cli_raw["prompt_tokens"][2:]
    tail_text = _post(server, "/detokenize", {"tokens": tail}).json()["content"]
    mixed = _post(server, "/completion", {"prompt": [*head, tail_text], "n_predict": N}).json()
    assert mixed["tokens_evaluated"] == len(cli_raw["prompt_tokens"]) and mixed["content"] == cli_raw["text"]
    for body, words in (({"prompt": "", "n_predict": 2}, "empty prompt"),
                        ({"prompt": "x", "n_predict": -2}, "n_predict"),
                        ({"prompt": [10**7], "n_predict": 2}, "not in the vocabulary"),
                        ({"n_predict": 2}, "prompt")):
        bad = _post(server, "/completion", body)
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], (body, bad.text)


# --- bad requests -------------------------------------------------------------------------------
def _post(server, path: str, body: bytes | dict, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", b"{not json", "malformed JSON"),
    ("/v1/chat/completions", b"", "empty"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -7}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 3}, "n=1"),
])
def test_malformed_requests_are_400_error_objects(server, path, body, words):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"]


def test_bad_field_through_the_client_is_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="repeat_penalty"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"repeat_penalty": 0})


def test_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt="one two three " * 3000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "word " * 9000}])
    assert e.value.code == "context_length_exceeded"


def test_oversized_body_is_413_unread(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:  # declares 64 MiB, sends none
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (64 << 20))
        answer = ""
        while "request_too_large" not in answer:  # the headers and the body may come in two reads
            part = raw.recv(65536).decode()
            if not part:
                break
            answer += part
    assert answer.startswith("HTTP/1.1 413 ") and '"code":"request_too_large"' in answer, answer

    def chunks():  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * (1 << 20)
        yield b'"}'

    try:
        r = httpx.post(server.url + "/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413
    except httpx.WriteError:
        pass  # the server answered and closed while the client was still sending: refused all the same
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_prompt_with_nul_and_non_ascii_text(client):
    r = client.completions.create(model="any", prompt="caf\u00e9 \u0000 \u4e16\u754c \U0001f600", max_tokens=2)
    assert r.usage.prompt_tokens > 5 and r.choices[0].finish_reason in ("stop", "length")


def test_unknown_route_and_wrong_method_are_json_errors(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()


# --- disconnects --------------------------------------------------------------------------------
# seconds of decoding even on this tiny model (thousands of tokens per second): a cancel shows as far
# fewer tokens generated than asked
LONG_TOKENS = 8000
LONG = {"messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": LONG_TOKENS,
        "ignore_eos": True}


def _idle(server) -> bool:
    s = _stats(server)
    return s["busy_slots"] == 0 and s["queue_len"] == 0


def test_streamed_client_disconnect_cancels_its_sequence(server):
    assert wait_until(lambda: _idle(server), 60)
    tokens_before = _stats(server)["tokens"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # some tokens came: it is decoding
        assert all(g.startswith("data: ") or g == "" for g in got)
        assert _stats(server)["busy_slots"] == 1
    t0 = time.monotonic()
    assert wait_until(lambda: _idle(server), 5), _stats(server)
    freed_after = time.monotonic() - t0
    assert freed_after < 1.0, freed_after
    assert _stats(server)["tokens"] - tokens_before < LONG_TOKENS / 2


def test_non_streamed_client_disconnect_cancels_its_sequence(server):
    assert wait_until(lambda: _idle(server), 60)
    tokens_before = _stats(server)["tokens"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(60, read=0.3))
    t0 = time.monotonic()
    assert wait_until(lambda: _idle(server), 5), _stats(server)
    assert time.monotonic() - t0 < 1.0
    assert _stats(server)["tokens"] - tokens_before < LONG_TOKENS / 2


# --- key, queue, stop signals ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server():
    s = ServerProcess(["-np", "1", "--queue", "1", "--api-key", "sekrit", "-c", "8192", "-sys", "Be brief."]).start()
    yield s
    assert s.stop(signal.SIGINT) == 0, s.stderr()


def test_api_key(small_server):
    for key, ok in (("sekrit", True), ("wrong", False)):
        c = OpenAI(base_url=small_server.base_url, api_key=key, max_retries=0, timeout=60)
        if ok:
            assert c.models.list().data
        else:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
    r = httpx.post(small_server.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(small_server.url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(small_server.url + "/health", timeout=30).status_code == 200


def test_full_queue_is_503_and_every_accepted_request_is_answered(small_server):
    c = OpenAI(base_url=small_server.base_url, api_key="sekrit", max_retries=0, timeout=120)
    body = dict(model="any", messages=[{"role": "user", "content": "go"}], max_tokens=6000,
                extra_body={"ignore_eos": True})  # a second or more each: the queue stays full meanwhile
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(c.chat.completions.create, **body)
        assert wait_until(lambda: _stats_keyed(small_server)["busy_slots"] == 1, 30)
        queued = pool.submit(c.chat.completions.create, **body)
        assert wait_until(lambda: _stats_keyed(small_server)["queue_len"] == 1, 30)
        with pytest.raises(openai.InternalServerError) as e:  # the client's class for any 5xx
            c.chat.completions.create(**body)
        assert e.value.status_code == 503 and e.value.code == "queue_full"
        for f in (running, queued):  # each runs to the end of its slot's context (2048, as trained)
            done = f.result()
            assert done.usage.total_tokens == 2048 and done.choices[0].finish_reason == "length"


def test_default_system_prompt_for_chats_without_one(small_server):
    c = OpenAI(base_url=small_server.base_url, api_key="sekrit", max_retries=0, timeout=60)

    def prompt_tokens(messages: list[dict]) -> int:
        return c.chat.completions.create(model="any", messages=messages, max_tokens=1).usage.prompt_tokens

    user = {"role": "user", "content": "hi"}
    assert prompt_tokens([user]) == prompt_tokens([{"role": "system", "content": "Be brief."}, user])
    assert prompt_tokens([{"role": "system", "content": "x"}, user]) < prompt_tokens([user])


def _stats_keyed(s) -> dict:
    return httpx.get(s.url + "/v1/saem/stats", headers={"Authorization": "Bearer sekrit"}, timeout=30).json()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_finishes_in_flight_requests_and_exits_0(sig):
    # the drain is given a minute: a 3000-token reply took 10 s to drain on a slower machine of
    # this kind (the default --shutdown-timeout 10 then cancelled it); the reply's length keeps
    # it in flight when the signal lands
    s = ServerProcess(["-np", "2", "-c", "8192", "--shutdown-timeout", "60"]).start()
    try:
        result: dict = {}

        def stream() -> None:
            try:
                with httpx.stream("POST", s.url + "/v1/completions", timeout=120, json={
                        "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                    result["body"] = r.read().decode()
            except httpx.HTTPError as e:
                result["body"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=stream)
        t.start()
        assert wait_until(lambda: httpx.get(s.url + "/v1/saem/stats", timeout=30).json()["busy_slots"] == 1, 30)
        rc = s.stop(sig, timeout=90)
        t.join(90)
        assert rc == 0, s.stderr()
        body = result.get("body", "(no answer)")
        assert body.endswith("data: [DONE]\n\n"), (body[-300:], s.stderr())  # drained: the answer is whole
        assert '"finish_reason":"length"' in result["body"]
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=5)
        assert "Traceback" not in s.stderr()
    finally:
        s.kill()


def test_shutdown_timeout_cancels_in_flight_requests_with_an_error_and_exits_0():
    s = ServerProcess(["-np", "2", "-c", "32768", "--shutdown-timeout", "0.5"]).start()
    try:
        c = OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120)
        outcome: dict = {}

        def streamed() -> None:
            try:
                for _ in c.chat.completions.create(model="any", messages=[{"role": "user", "content": "go"}],
                                                   max_tokens=15000, stream=True, extra_body={"ignore_eos": True}):
                    pass
                outcome["stream"] = "completed"
            except openai.APIError as e:
                outcome["stream"] = e.message

        def whole() -> None:
            try:
                c.chat.completions.create(model="any", messages=[{"role": "user", "content": "go"}],
                                          max_tokens=15000, extra_body={"ignore_eos": True})
                outcome["whole"] = "completed"
            except openai.APIStatusError as e:
                outcome["whole"] = (e.status_code, e.code)

        threads = [threading.Thread(target=f) for f in (streamed, whole)]
        for t in threads:
            t.start()
        assert wait_until(lambda: httpx.get(s.url + "/v1/saem/stats", timeout=30).json()["busy_slots"] == 2, 30)
        t0 = time.monotonic()
        assert s.stop(signal.SIGTERM) == 0, s.stderr()
        assert time.monotonic() - t0 < 15
        for t in threads:
            t.join(30)
        assert outcome == {"stream": "the server is shutting down", "whole": (503, "shutting_down")}, outcome
    finally:
        s.kill()


def test_taken_port_is_one_error_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "saem_gguf", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: the address is already in use"]


def test_health_is_503_loading_model_until_the_model_is_loaded():
    """As llama-server: the port answers at once, 503 "Loading model" while the model loads (the
    embedded model's load and layout replay take about a second), then 200."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "saem_gguf", "serve", "--port", str(port)], cwd=REPO,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answers = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 200 not in answers:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            except httpx.ConnectError:  # not bound yet
                time.sleep(0.01)
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # accepted by the answerer the moment it stopped, before the request was read:
                # closed unanswered (uvicorn's stop), as a server restarting closes one
                continue
            answers.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["message"] == "Loading model"
        assert answers[-1] == 200 and 503 in answers and set(answers) == {503, 200}, answers
    finally:
        p.terminate()
        p.wait(60)


def test_responses_through_the_client(client):
    """OpenAI's Responses API as the official client reads it: output_text, usage, and a stream
    whose text deltas make the answer."""
    r = client.responses.create(model="any", input=QUESTION, max_output_tokens=N, temperature=0)
    chat = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=N, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.status == "incomplete"
    assert r.usage.output_tokens == chat.usage.completion_tokens == N
    deltas, done = [], None
    for event in client.responses.create(model="any", input=QUESTION, max_output_tokens=N, temperature=0,
                                         stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            done = event.response
    assert "".join(deltas) == r.output_text == done.output_text


def test_messages_through_the_anthropic_client(server):
    """Anthropic's Messages API as the official `anthropic` client reads it (what Claude Code
    speaks): the text, the counts and the stop reason, whole and streamed, and the token count of
    count_tokens; the answer is the chat completion's."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION}]
    greedy = {"temperature": 0}  # the client's newer releases take no temperature argument
    m = client.messages.create(model="any", max_tokens=N, messages=messages, extra_body=greedy)
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": N,
                                                                 "temperature": 0}, timeout=120).json()
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat["choices"][0]["message"]["content"]
    # Anthropic's input_tokens leave out the prompt the cache served (an earlier test's)
    assert (m.stop_reason, m.usage.output_tokens, m.usage.input_tokens + m.usage.cache_read_input_tokens) == (
        "max_tokens", N, chat["usage"]["prompt_tokens"])
    with client.messages.stream(model="any", max_tokens=N, messages=messages, extra_body=greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text and final.content[0].text == streamed and final.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model="any", messages=messages)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_slots_show_the_busy_one(server):
    """GET /slots while a streamed answer runs: its slot is processing, the others idle."""
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6000,
                                                                     "temperature": 0, "ignore_eos": True,
                                                                     "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(3):  # tokens are coming: the request holds a slot
            next(lines)
        slots = httpx.get(server.url + "/slots", timeout=60).json()
        stats = httpx.get(server.url + "/v1/saem/stats", timeout=60).json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3], slots
    assert sum(s["is_processing"] for s in slots) == 1, (slots, stats)
    assert all(s["n_ctx"] == 2048 and s["speculative"] is False for s in slots)  # the training context
    # where its generation stands, as llama-server's slot tells it while it runs
    (busy,) = [s for s in slots if s["is_processing"]]
    (now,) = busy["next_token"]
    assert now["has_next_token"] is True and now["n_decoded"] >= 2 and now["n_remain"] == 6000 - now["n_decoded"]
    assert busy["n_prompt_tokens"] >= busy["n_prompt_tokens_processed"] + busy["n_prompt_tokens_cache"]
    assert busy["params"]["n_predict"] == 6000 and busy["params"]["ignore_eos"] is True
