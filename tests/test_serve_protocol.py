"""`serve`'s wire protocol without a model: request validation (400s naming the field), the
request's sampling over the server's defaults, the response and chunk shapes as the official
`openai` client parses them, server-sent event framing, the API-key check, the metrics text and
the listening socket's errors."""

from __future__ import annotations

import json
import math
import socket

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from saem_gguf.engine import SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.serving.protocol import (
    SSE_DONE, ApiError, ChatRequest, CompletionRequest, NativeCompletionRequest, Reply, TokenLogprob, generation,
    parse_request, request_logit_bias, sse,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def _body(base: dict, **fields) -> bytes:
    return json.dumps({**base, **fields}).encode()


def _error(body: bytes, kind) -> ApiError:
    with pytest.raises(ApiError) as e:
        generation(parse_request(body, kind), SamplingConfig(), 1)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


BAD_BODIES = [
    # (id, body, request kind, words the message must hold)
    ("empty", b"", CompletionRequest, "empty"),
    ("not-json", b"{prompt: hi}", CompletionRequest, "malformed JSON"),
    ("truncated-json", b'{"prompt": "hi"', CompletionRequest, "malformed JSON"),
    ("not-utf8", b'{"prompt": "caf\xe9"}', CompletionRequest, "malformed JSON"),
    ("lone-surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', ChatRequest, "malformed JSON"),
    ("array", b"[1, 2]", CompletionRequest, "JSON object"),
    ("string", b'"hi"', ChatRequest, "JSON object"),
    ("no-prompt", b"{}", CompletionRequest, "prompt: Field required"),
    ("prompt-number", _body({}, prompt=5), CompletionRequest, "prompt: must be a string"),
    ("strings-in-a-prompt", _body({}, prompt=[["a", "b"]]), CompletionRequest, "prompt: must be a string"),
    ("float-token", _body({}, prompt=[1, 2.5]), CompletionRequest, "prompt: must be a string"),
    ("no-prompts", _body({}, prompt=[]), CompletionRequest, "prompt: must not be empty"),
    ("native-nested", _body({}, prompt=[[1, [2]]]), NativeCompletionRequest, "prompt: must be a string"),
    ("temperature-string", _body(COMPLETION, temperature="0.5"), CompletionRequest, "temperature"),
    ("temperature-nan", b'{"prompt": "hi", "temperature": NaN}', CompletionRequest, "temperature"),
    ("max-tokens-float", _body(COMPLETION, max_tokens=1.5), CompletionRequest, "max_tokens"),
    ("max-tokens-bool", _body(COMPLETION, max_tokens=True), CompletionRequest, "max_tokens"),
    ("max-tokens-negative", _body(COMPLETION, max_tokens=-2), CompletionRequest, "max_tokens"),
    ("top-p-string", _body(COMPLETION, top_p="1"), CompletionRequest, "top_p"),
    ("temperature-bool", _body(COMPLETION, temperature=True), CompletionRequest, "temperature"),
    ("top-k-not-whole", _body(COMPLETION, top_k=40.5), CompletionRequest, "top_k"),
    ("seed-string", _body(COMPLETION, seed="7"), CompletionRequest, "seed"),
    ("seed-not-whole", _body(COMPLETION, seed=7.5), CompletionRequest, "seed"),
    # llama.cpp's common_sampler_init refuses these (llama-server: "Failed to initialize samplers")
    ("repeat-penalty-zero", _body(COMPLETION, repeat_penalty=0), CompletionRequest, "repeat_penalty"),
    ("repeat-penalty-negative", _body(CHAT, repeat_penalty=-1.0), ChatRequest, "repeat_penalty"),
    ("repeat-last-n-past-int32", _body({}, prompt="hi", repeat_last_n=2**31), NativeCompletionRequest,
     "repeat_last_n"),
    ("n-predict-past-int32", _body({}, prompt="hi", n_predict=2**31), NativeCompletionRequest, "n_predict"),
    ("stop-empty", _body(COMPLETION, stop=""), CompletionRequest, "stop"),
    ("stop-numbers", _body(COMPLETION, stop=[1]), CompletionRequest, "stop"),
    ("n-2", _body(COMPLETION, n=2), CompletionRequest, "n=1"),
    ("echo", _body(COMPLETION, echo=True), CompletionRequest, "echo"),
    ("best-of", _body(COMPLETION, best_of=2), CompletionRequest, "best_of"),
    ("suffix", _body(COMPLETION, suffix="x"), CompletionRequest, "suffix"),
    ("logprobs-string", _body(COMPLETION, logprobs="3"), CompletionRequest, "logprobs"),
    ("logit-bias-string", _body(COMPLETION, logit_bias={"15": "up"}), CompletionRequest, "logit_bias"),
    ("logit-bias-true", _body(COMPLETION, logit_bias={"15": True}), CompletionRequest, "false to ban"),
    ("logit-bias-nan", b'{"prompt": "hi", "logit_bias": {"15": NaN}}', CompletionRequest, "logit_bias"),
    ("logit-bias-huge", b'{"prompt": "hi", "logit_bias": {"15": 1' + b"0" * 400 + b'}}', CompletionRequest,
     "finite number"),
    ("logit-bias-triple", _body(COMPLETION, logit_bias=[[15, 1, 2]]), CompletionRequest, "pairs"),
    ("logit-bias-number", _body(COMPLETION, logit_bias=15), CompletionRequest, "logit_bias"),
    ("stream-string", _body(COMPLETION, stream="yes"), CompletionRequest, "stream"),
    ("no-messages", b"{}", ChatRequest, "messages: Field required"),
    ("messages-empty", _body({}, messages=[]), ChatRequest, "messages"),
    ("messages-object", _body({}, messages={"role": "user"}), ChatRequest, "messages"),
    ("role-unknown", _body({}, messages=[{"role": "bot", "content": "x"}]), ChatRequest, "messages.0.role"),
    ("user-without-content", _body({}, messages=[{"role": "user"}]), ChatRequest, "content"),
    ("content-number", _body({}, messages=[{"role": "user", "content": 3}]), ChatRequest, "messages.0.content"),
    ("content-image", _body({}, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), ChatRequest, "not supported"),
    ("tools", _body(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]), ChatRequest, "tools"),
    ("format-unknown", _body(CHAT, response_format={"type": "xml"}), ChatRequest, "response_format.type"),
    ("schema-missing", _body(CHAT, response_format={"type": "json_schema"}), ChatRequest, "json_schema.schema"),
    ("top-logprobs-negative", _body(CHAT, logprobs=True, top_logprobs=-1), ChatRequest, "top_logprobs"),
    ("logprobs-int-in-chat", _body(CHAT, logprobs=3), ChatRequest, "logprobs"),
    # llama-server's hard limits of the samplers llama-cpp-python lacks (its soft ones clamp)
    ("dry-last-n-negative", _body(COMPLETION, dry_penalty_last_n=-1), CompletionRequest, "dry_penalty_last_n"),
    ("dry-length-negative", _body(CHAT, dry_allowed_length=-2), ChatRequest, "dry_allowed_length"),
    ("dry-breakers-empty", _body(COMPLETION, dry_sequence_breakers=[]), CompletionRequest, "dry_sequence_breakers"),
    ("dry-breakers-string", _body(COMPLETION, dry_sequence_breakers="\n"), CompletionRequest,
     "dry_sequence_breakers"),
    ("mirostat-float", _body(CHAT, mirostat=1.5), ChatRequest, "mirostat"),
    ("xtc-nan", b'{"prompt": "hi", "xtc_probability": NaN}', CompletionRequest, "xtc_probability"),
    ("min-keep-negative", _body(CHAT, min_keep=-1), ChatRequest, "min_keep"),
]


@pytest.mark.parametrize("body,kind,words", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_request_bodies_are_400_naming_the_problem(body, kind, words):
    e = _error(body, kind)
    assert words in e.message, e.message
    assert "\n" not in e.message
    body = e.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_logit_bias_reads_as_llama_servers():
    """OpenAI's {"id": bias}; llama-server's [[id or text, bias]] and text keys (each of the text's
    tokens), false for -inf; entries in order."""
    def text_tokens(text: str) -> list[int]:
        return [ord(c) for c in text]

    def read(bias) -> tuple | None:
        return request_logit_bias(parse_request(_body(COMPLETION, logit_bias=bias), CompletionRequest), text_tokens)

    assert read(None) is None and read({}) == () and read([]) == ()
    assert read({"15": 2.0, "7": -100, "3": False}) == ((15, 2.0), (7, -100.0), (3, -math.inf))
    assert read([[15, 1.5], ["ab", False], [15, 1]]) == ((15, 1.5), (97, -math.inf), (98, -math.inf), (15, 1.0))
    assert read({"ab": 3}) == ((97, 3.0), (98, 3.0))
    assert read({"-1": 1}) == ((-1, 1.0),)  # an id: refused at submit, against the vocabulary


def test_chat_template_variables_and_reasoning_effort_read_as_llama_servers():
    def read(**fields) -> dict:
        return parse_request(_body(CHAT, **fields), ChatRequest).template_kwargs()

    assert read() == {}
    assert read(chat_template_kwargs={"enable_thinking": False, "x": [1]}) == {"enable_thinking": False, "x": [1]}
    assert read(reasoning_effort="none") == {"enable_thinking": False}
    assert read(reasoning_effort="high", chat_template_kwargs={"y": 1}) == {"y": 1, "reasoning_effort": "high"}
    assert "enable_thinking" in _error(_body(CHAT, chat_template_kwargs={"enable_thinking": "false"}),
                                       ChatRequest).message


def test_unknown_fields_are_ignored_and_known_ones_kept():
    req = parse_request(_body(CHAT, user="u1", metadata={"a": 1}, temperature=0.7, top_p=0.9, seed=3,
                              max_completion_tokens=12, stop="END", stream=True,
                              stream_options={"include_usage": True}), ChatRequest)
    assert (req.temperature, req.top_p, req.seed, req.stream) == (0.7, 0.9, 3, True)
    assert req.stream_options.include_usage and req.stops() == ("END",)


def test_text_parts_are_joined_and_an_assistant_may_have_no_content():
    req = parse_request(_body({}, messages=[
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "<|im_end|>"}]), ChatRequest)
    assert req.message_dicts() == [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": ""},
                                   {"role": "user", "content": "<|im_end|>"}]


def test_generation_overrides_the_server_defaults_field_by_field():
    defaults = SamplingConfig(temp=0.0, top_k=40, top_p=0.95, seed=11, stop=("###",))
    req = parse_request(_body(COMPLETION, temperature=0.8, top_k=5, stop=["a", "b"], seed=-1), CompletionRequest)
    gen = generation(req, defaults, default_max_tokens=-1)
    s = gen.sampling
    assert (s.temp, s.top_k, s.top_p, s.seed, s.stop) == (0.8, 5, 0.95, None, ("###", "a", "b"))
    assert gen.max_tokens == -1 and gen.top_n is None
    plain = generation(parse_request(_body(COMPLETION, max_tokens=7), CompletionRequest), defaults, 99)
    assert plain.sampling == defaults and plain.max_tokens == 7


def test_reasoning_budget_fields_read_as_llama_servers():
    """reasoning_budget_tokens, else thinking_budget_tokens; -1 (or neither) keeps the server's
    --reasoning-budget; the message over the server's; below -1 or not a whole number is a 400."""
    defaults = SamplingConfig(reasoning_budget=5, reasoning_budget_message="Done.")

    def read(**fields) -> tuple[int, str]:
        s = generation(parse_request(_body(CHAT, **fields), ChatRequest), defaults, 99).sampling
        return s.reasoning_budget, s.reasoning_budget_message

    assert read() == (5, "Done.") and read(reasoning_budget_tokens=-1, thinking_budget_tokens=2) == (5, "Done.")
    assert read(thinking_budget_tokens=2) == (2, "Done.")
    assert read(reasoning_budget_tokens=0, thinking_budget_tokens=2, reasoning_budget_message="") == (0, "")
    for bad in ({"reasoning_budget_tokens": -2}, {"thinking_budget_tokens": "3"}, {"reasoning_budget_tokens": 1.5},
                {"reasoning_budget_message": 7}):
        assert next(iter(bad)) in _error(_body(CHAT, **bad), ChatRequest).message
    raw = generation(parse_request(_body(COMPLETION, reasoning_budget_tokens=1), CompletionRequest), defaults, 9)
    assert raw.sampling.reasoning_budget == 5  # a raw prompt's field is not read (llama-server: chat only)


def test_chat_max_completion_tokens_wins_and_logprobs_need_the_flag():
    req = parse_request(_body(CHAT, max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=3),
                        ChatRequest)
    gen = generation(req, SamplingConfig(), 1)
    assert gen.max_tokens == 9 and gen.top_n == 3
    # llama-server's 20 alternatives where logprobs is asked for without top_logprobs
    assert generation(parse_request(_body(CHAT, logprobs=True), ChatRequest), SamplingConfig(), 1).top_n == 20
    assert generation(parse_request(_body(CHAT, logprobs=True, top_logprobs=0), ChatRequest),
                      SamplingConfig(), 1).top_n == 0
    with pytest.raises(ApiError, match="top_logprobs requires logprobs"):
        generation(parse_request(_body(CHAT, top_logprobs=2), ChatRequest), SamplingConfig(), 1)


def test_completion_logprobs_zero_asks_for_the_chosen_tokens_only():
    gen = generation(parse_request(_body(COMPLETION, logprobs=0), CompletionRequest), SamplingConfig(), 1)
    assert gen.top_n == 0


def test_post_sampling_probs_is_taken_where_the_answer_has_a_name_for_probabilities():
    """The native routes and a chat name the chain's probabilities "prob"; /v1/completions' legacy
    shape has log-probs only, and keeps them."""
    for kind, base, want in ((NativeCompletionRequest, COMPLETION, True), (ChatRequest, CHAT, True),
                             (CompletionRequest, COMPLETION, False)):
        assert _read(kind, base, post_sampling_probs=True).post_sampling is want, kind
        assert _read(kind, base).post_sampling is False
    reply = Reply.start(True, "m", 1, post_sampling=True)
    body = reply.chunk("a", [TokenLogprob(b"a", 0.75, ((b"a", 0.75), (b"b", 0.25)))])
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert entry["prob"] == 0.75 and [t["prob"] for t in entry["top_probs"]] == [0.75, 0.25]
    assert "logprob" not in entry and "top_logprobs" not in entry


def _read(kind, base: dict, **fields):
    return generation(parse_request(_body(base, **fields), kind), SamplingConfig(seed=3), 9)


@pytest.mark.parametrize("kind, base", [(CompletionRequest, COMPLETION), (ChatRequest, CHAT),
                                        (NativeCompletionRequest, COMPLETION)], ids=["openai", "chat", "native"])
def test_fields_take_llama_servers_values(kind, base):
    """server-schema.cpp's rules: soft limits clamp, typical_p and the log-prob counts are
    unbounded, a seed is a uint32, a whole number may be written as a float."""
    s = _read(kind, base, top_p=1.5, min_p=-0.5, temperature=-1.0, top_k=-5).sampling
    assert (s.top_p, s.min_p, s.temp, s.top_k) == (1.0, 0.0, 0.0, 0)
    s = _read(kind, base, top_p=-0.5, min_p=2.0, top_k=2**40, typical_p=1.5).sampling
    assert (s.top_p, s.min_p, s.top_k, s.typical_p) == (0.0, 1.0, 2**31 - 1, 1.5)
    assert _read(kind, base, typical_p=-0.5).sampling.typical_p == -0.5
    for seed, taken in ((-7, 2**32 - 7), (2**32 + 5, 5), (-1, None), (2**32 - 1, None), (0, 0), (7.0, 7)):
        assert _read(kind, base, seed=seed).sampling.seed == taken, seed
    assert _read(kind, base, top_k=40.0, max_tokens=12.0).sampling.top_k == 40
    assert _read(kind, base, max_tokens=12.0).max_tokens == 12
    assert _read(kind, base, n_probs=50).top_n == 50
    assert _read(kind, base, n_probs=-3).top_n is None


@pytest.mark.parametrize("kind, base", [(CompletionRequest, COMPLETION), (ChatRequest, CHAT),
                                        (NativeCompletionRequest, COMPLETION)], ids=["openai", "chat", "native"])
def test_null_is_a_field_left_out_as_in_llama_server(kind, base):
    every = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "stream_options", "n",
             "ignore_eos", "n_probs", "logit_bias", "grammar", "json_schema", "cache_prompt", "samplers",
             "dry_multiplier", "dry_sequence_breakers", "mirostat", "min_keep", "user"]
    every += {CompletionRequest: ["logprobs", "echo", "best_of", "suffix"],
              ChatRequest: ["logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "functions",
                            "chat_template_kwargs", "reasoning_effort", "reasoning_format",
                            "max_completion_tokens"],
              NativeCompletionRequest: ["n_predict", "repeat_last_n", "return_tokens", "n_indent",
                                        "t_max_predict_ms", "response_fields"]}[kind]
    nulls = _read(kind, base, **dict.fromkeys(every))
    assert nulls == _read(kind, base)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert parse_request(_body({}, messages=messages), ChatRequest).messages[1].content is None
    assert "content" in _error(_body({}, messages=[{"role": "user", "content": None}]), ChatRequest).message


TOKENS = [TokenLogprob(b" Paris", -0.25, ((b" Paris", -0.25), (b" Lyon", -2.0))),
          TokenLogprob(b"\xc3\xa9", -math.inf, ((b"\xc3\xa9", -math.inf),))]


def test_chat_shapes_parse_with_the_openai_client():
    reply = Reply.start(chat=True, model="m.gguf", top_n=2)
    reply.text, reply.finish_reason, reply.usage = "Paris", "stop", (7, 2)
    reply.logprobs.extend(TOKENS)
    full = ChatCompletion.model_validate(reply.response())
    assert full.choices[0].message.content == "Paris" and full.choices[0].finish_reason == "stop"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (7, 2, 9)
    lp = full.choices[0].logprobs.content
    assert [t.token for t in lp] == [" Paris", "é"] and lp[0].top_logprobs[1].token == " Lyon"
    assert lp[1].bytes == [0xC3, 0xA9] and math.isfinite(lp[1].logprob)  # JSON has no -inf
    json.dumps(reply.response(), allow_nan=False)
    first = ChatCompletionChunk.model_validate(reply.chunk(text="", role=True))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    mid = ChatCompletionChunk.model_validate(reply.chunk("Par", TOKENS[:1]))
    assert mid.choices[0].delta.content == "Par" and mid.choices[0].finish_reason is None
    last = ChatCompletionChunk.model_validate(reply.chunk(finish_reason="length"))
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.content is None
    usage = ChatCompletionChunk.model_validate(reply.usage_chunk())
    assert usage.choices == [] and usage.usage.total_tokens == 9
    assert full.id.startswith("chatcmpl-") and full.id == usage.id


def test_completion_shapes_parse_with_the_openai_client():
    reply = Reply.start(chat=False, model="m.gguf", top_n=1)
    reply.text, reply.finish_reason, reply.usage = " Paris", "length", (3, 1)
    reply.logprobs.extend(TOKENS[:1])
    full = Completion.model_validate(reply.response())
    assert full.object == "text_completion" and full.choices[0].text == " Paris"
    lp = full.choices[0].logprobs
    assert lp.tokens == [" Paris"] and lp.token_logprobs == [-0.25] and lp.text_offset == [0]
    assert lp.top_logprobs == [{" Paris": -0.25, " Lyon": -2.0}]
    # a streamed completion chunk has finish_reason null, as OpenAI's have (the client reads chunks
    # without validating them; its Completion model only knows final choices)
    chunk = reply.chunk("x", TOKENS[:1], text_offset=5)
    assert chunk["choices"][0]["finish_reason"] is None and chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == "x" and chunk["choices"][0]["logprobs"]["text_offset"] == [5]
    assert Completion.model_validate(reply.chunk("", finish_reason="stop")).choices[0].finish_reason == "stop"
    no_lp = Reply.start(chat=False, model="m", top_n=None)
    assert no_lp.response()["choices"][0]["logprobs"] is None


def test_sse_events_are_one_data_line_each():
    event = sse({"text": "line one\nline two", "emoji": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == {"text": "line one\nline two", "emoji": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"


# --- the API key --------------------------------------------------------------------------------
def _keyed_app(keys: tuple[str, ...]):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from saem_gguf.serving.auth import ApiKeyMiddleware

    async def ok(_):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/health", ok), Route("/v1/models", ok), Route("/metrics", ok)],
                     middleware=[Middleware(ApiKeyMiddleware, api_keys=keys)])


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": "sekrit"}, 200),
    ({"Authorization": "Bearer sekrit"}, 200), ({"X-Api-Key": "sekrit"}, 200), ({"X-Api-Key": "other"}, 200),
    ({"Authorization": "Bearer sekrit2"}, 401), ({"Authorization": "Bearer "}, 401),
])
def test_api_key(headers, status):
    from starlette.testclient import TestClient

    with TestClient(_keyed_app(("sekrit", "other"))) as client:
        for path in ("/v1/models", "/metrics"):
            r = client.get(path, headers=headers)
            assert r.status_code == status, (path, headers, r.text)
            if status == 401:
                assert r.json() == {"error": {"message": "Invalid API Key", "type": "authentication_error",
                                              "param": None, "code": "invalid_api_key"}}
        assert client.get("/health").status_code == 200  # public, as in llama-server


# --- metrics ------------------------------------------------------------------------------------
def test_metrics_text_has_every_figure_the_stats_have():
    from prometheus_client.parser import text_string_to_metric_families

    from saem_gguf.serving.metrics import ServerMetrics

    stats = {"requests": 5, "tokens": 120, "tokens_per_s": 42.5, "queue_len": 2, "busy_slots": 4, "n_parallel": 4,
             "hit_rate": 0.75, "bytes_moved": 1_000_000, "copies": 10, "boundaries": 3, "plans": 2,
             "decode_steps": 40, "mean_batch": 3.0, "policy": "saem", "prompt_tokens_cached": 77,
             "prompt_cache_entries": 2, "prompt_cache_bytes": 4096}
    now = [100.0]
    metrics = ServerMetrics(lambda: stats, clock=lambda: now[0])
    now[0] = 104.0  # 120 tokens in 4 s since the collector began
    metrics.count("/v1/completions", 200)
    metrics.count("/v1/completions", 200)
    metrics.count("/v1/completions", 503)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    expect = {"saem_requests_total": 5, "saem_tokens_predicted_total": 120, "saem_tokens_per_second": 30.0,
              "saem_queue_length": 2, "saem_busy_slots": 4, "saem_slots": 4, "saem_expert_hit_rate": 0.75,
              "saem_expert_bytes_moved_total": 1e6, "saem_expert_copies_total": 10,
              "saem_stage_boundaries_total": 3, "saem_placement_updates_total": 2, "saem_decode_steps_total": 40,
              "saem_mean_batch": 3.0, "saem_prompt_tokens_cached_total": 77, "saem_prompt_cache_entries": 2,
              "saem_prompt_cache_bytes": 4096}
    for name, value in expect.items():
        assert samples[(name, ())] == value, name
    assert samples[("saem_http_responses_total", (("route", "/v1/completions"), ("status", "200")))] == 2
    assert samples[("saem_http_responses_total", (("route", "/v1/completions"), ("status", "503")))] == 1
    stats["tokens"] = 150
    now[0] = 106.0  # the next scrape: 30 more tokens in 2 s
    assert "saem_tokens_per_second 15.0" in metrics.render().decode()
    stats.clear()  # a dense model: no placement figures, none invented
    names = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    assert names - {"saem_http_responses_created"} == {"saem_http_responses"}


# --- the socket ---------------------------------------------------------------------------------
def test_bind_reports_a_taken_port_and_a_bad_host_in_one_line():
    from saem_gguf.serving.server import bind, url_of

    first = bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        assert url_of(first) == f"http://127.0.0.1:{port}"
        with pytest.raises(SaemError, match="already in use"):
            bind("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # already listening: a client may connect before the server's loop runs
    finally:
        first.close()
    with pytest.raises(SaemError, match="--host no.such.host.invalid"):
        bind("no.such.host.invalid", 0)


def test_while_the_model_loads_every_request_is_answered_503_loading_model():
    """llama-server answers every route, /health included, 503 "Loading model" until its model is
    loaded (server-http.cpp, middleware_server_state); a bound socket nobody accepts on would
    leave the client hanging for the whole load. Stopped, the answerer leaves the socket listening
    for the real server."""
    import httpx2

    from saem_gguf.serving.server import LoadingAnswers, bind

    sock = bind("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        loading = LoadingAnswers(sock).start()
        try:
            for r in (httpx2.get(url + "/health", timeout=10),
                      httpx2.post(url + "/v1/chat/completions", json={"messages": []}, timeout=10)):
                assert r.status_code == 503 and r.headers["connection"] == "close"
                assert r.json() == {"error": {"message": "Loading model", "type": "unavailable_error",
                                              "code": "loading_model"}}
        finally:
            loading.stop()
        loading.stop()  # a second stop does nothing
        LoadingAnswers(sock).start().stop()  # a stop at once, before uvicorn listens (a model that fails at once)
        with socket.create_connection(sock.getsockname(), timeout=5):
            conn, _ = sock.accept()  # the real server's socket still listens
            conn.close()
    finally:
        sock.close()


def test_a_connection_the_loading_answerer_took_just_before_its_stop_is_answered():
    """The switch to the real server: a client that connected to the answerer just before its
    stop, and sends its request a moment later, gets the 503, not a closed connection."""
    import threading
    import time

    from saem_gguf.serving.server import STOP_GRACE_S, LoadingAnswers, bind

    sock = bind("127.0.0.1", 0)
    try:
        loading = LoadingAnswers(sock).start()
        with socket.create_connection(sock.getsockname(), timeout=10) as client:
            deadline = time.monotonic() + 10
            while not loading._server.server_state.connections and time.monotonic() < deadline:
                time.sleep(0.005)  # until the answerer has accepted it
            stopper = threading.Thread(target=loading.stop)
            stopper.start()
            time.sleep(STOP_GRACE_S / 2)  # after uvicorn alone would have closed it (its tick: 0.1 s)
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := client.recv(4096):
                answer += chunk
            stopper.join()
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Loading model" in answer, answer
    finally:
        sock.close()


# --- /v1/responses read as a chat (serving.responses) -------------------------------------------
def test_a_responses_request_is_a_chat():
    from saem_gguf.serving.responses import chat_body

    body = chat_body({"input": [{"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
                                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
                                {"type": "reasoning", "summary": [], "content": [{"text": "t"}]},
                                {"type": "message", "role": "assistant", "content": "y"},
                                {"role": "user", "content": "c"}],
                      "instructions": "Sys.", "max_output_tokens": 9, "temperature": 0.5, "store": False,
                      "reasoning": {"effort": "none"},
                      "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})
    assert body["messages"] == [{"role": "system", "content": "Sys."}, {"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": "a\nb"},
                                {"role": "assistant", "content": "xy", "reasoning_content": "t"},  # merged, as there
                                {"role": "user", "content": "c"}]
    assert body["max_tokens"] == 9 and body["temperature"] == 0.5 and "store" not in body
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    req = parse_request(json.dumps(body).encode(), ChatRequest)
    assert req.max_tokens == 9 and len(req.messages) == 5
    assert req.template_kwargs() == {"enable_thinking": False}  # reasoning.effort "none"
    # a developer message is a system one, but for GPT-OSS's template (llama.cpp's mapping)
    assert req.message_dicts()[1] == {"role": "system", "content": "Be brief."}
    assert req.message_dicts("...<|channel|>...")[1] == {"role": "developer", "content": "Be brief."}


@pytest.mark.parametrize("body, words", [
    ({}, "'input' is required"), ([1], "JSON object"), ({"input": 5}, "string or an array"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "function calling"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "not images or files"),
    ({"input": [{"content": "x"}]}, "cannot tell what this input item is"),
    ({"input": [7]}, "must be an object"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "needs its text"),
])
def test_bad_responses_requests_are_400(body, words):
    from saem_gguf.serving.responses import chat_body

    with pytest.raises(ApiError) as e:
        chat_body(body)
    assert e.value.status == 400 and words in e.value.message


# --- Anthropic's /v1/messages read as a chat (serving.anthropic) --------------------------------
def test_a_messages_request_is_a_chat_as_llama_server_makes_it():
    """llama-server's conversion (server_chat_convert_anthropic_to_oai): system blocks joined with
    nothing between, text blocks kept as parts, thinking blocks as reasoning_content (a turn of
    thinking alone kept, its content empty), a turn of nothing left out, stop_sequences as stop,
    the passed fields and no others, the budget."""
    from saem_gguf.serving.anthropic import DEFAULT_MAX_TOKENS, chat_body

    body = chat_body({"model": "claude-x", "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}},
                                                                {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": [{"type": "thinking", "thinking": "t",
                                                                      "signature": ""}]},
                                   {"role": "user", "content": []},
                                   {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                                   {"role": "user", "content": "c"}],
                      "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3, "seed": 7, "metadata": {"user_id": "u"},
                      "thinking": {"type": "enabled"}})
    assert body["messages"] == [{"role": "system", "content": "A.B."},
                                {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}},
                                                             {"type": "text", "text": "b"}]},
                                {"role": "assistant", "content": "", "reasoning_content": "t"},
                                {"role": "user", "content": "c"}]
    assert body["stop"] == ["END"] and body["max_tokens"] == DEFAULT_MAX_TOKENS == 4096
    assert body["temperature"] == 0.5 and body["top_k"] == 3 and "seed" not in body and "model" not in body
    assert body["thinking_budget_tokens"] == 10000
    req = parse_request(json.dumps(body).encode(), ChatRequest)
    assert [m["content"] for m in req.message_dicts()] == ["A.B.", "a\nb", "", "c"]
    assert chat_body({"messages": [], "max_tokens": 5, "thinking": {"type": "disabled"}}) == \
        {"messages": [], "max_tokens": 5}


@pytest.mark.parametrize("system, unstamped", [
    ("x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code.",
     "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=fffff;You are Claude Code."),
    ("x-anthropic-billing-header: cch=a514;x", None),  # not five characters then ";": as it came
    ("x-anthropic-billing-header: cch=a5145;", "x-anthropic-billing-header: cch=fffff;"),
    ("x-anthropic-billing-header: cch=a5145", None),  # the text ends before the ";"
    ("You are Claude Code. cch=a5145;", None),  # no header
])
def test_claude_codes_request_stamp_is_blanked_as_by_llama_server(system, unstamped):
    """Claude Code stamps each request in its system prompt; llama-server writes the stamp as
    fffff so that the prompt cache gets past it (normalize_anthropic_billing_header)."""
    from saem_gguf.serving.anthropic import chat_body

    for given in (system, [{"type": "text", "text": system}]):
        assert chat_body({"system": given, "messages": []})["messages"][0]["content"] == (unstamped or system)


@pytest.mark.parametrize("body, words", [
    ({}, "'messages' is required"), ([1], "JSON object"), ({"messages": "x"}, "array of messages"),
    ({"messages": [7]}, "must be an object"),
    ({"messages": [], "tools": [{"name": "f", "input_schema": {}}]}, "function calling"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]},
     "function calling"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": "2"}]}]},
     "function calling"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "image blocks are not supported"),
])
def test_bad_messages_requests_are_400(body, words):
    from saem_gguf.serving.anthropic import chat_body

    with pytest.raises(ApiError) as e:
        chat_body(body)
    assert e.value.status == 400 and words in e.value.message


def test_a_messages_answer_in_anthropics_shapes():
    """The whole answer and its events as llama-server writes them (to_json_anthropic*): thinking
    first with an empty signature, then text; the stop reason (stop_sequence where a stop string
    ended it, as Anthropic's API says), the counts with the cached prompt apart."""
    from saem_gguf.serving.anthropic import MessagesReply

    told = MessagesReply("m")
    events = told.opening(10, 4) + told.events("th", "") + told.events("ink", "an") + told.events("", "swer")
    events += told.closing("stop", "END", (10, 5, 4))
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in events)
    assert events[0][1]["message"]["usage"] == {"cache_read_input_tokens": 4, "input_tokens": 6, "output_tokens": 0}
    assert [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta"] == [
        (0, {"type": "thinking_delta", "thinking": "th"}), (0, {"type": "thinking_delta", "thinking": "ink"}),
        (1, {"type": "text_delta", "text": "an"}), (1, {"type": "text_delta", "text": "swer"}),
        (0, {"type": "signature_delta", "signature": ""})]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[-2][1]["usage"] == {"output_tokens": 5}
    whole = told.whole("length", None, (10, 5, 4))
    assert whole["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                                {"type": "text", "text": "answer"}]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("max_tokens", None)
    assert whole["usage"] == {"cache_read_input_tokens": 4, "input_tokens": 6, "output_tokens": 5}
    plain = MessagesReply("m")
    assert [d["index"] for _, d in plain.events("", "x") if "index" in d] == [0, 0]  # no thinking: text is block 0
    assert plain.whole("stop", None, (1, 1, 0))["stop_reason"] == "end_turn"


# --- a final assistant message continued (serving.prefill) --------------------------------------
def test_how_a_chat_ends_by_llama_servers_rules():
    """A final assistant message is continued unasked (unless --no-prefill-assistant), its
    content or, alone, its reasoning; continue_final_message asks for it; with the generation
    prompt asked too it is a 400, as are two assistant messages at the end."""
    from saem_gguf.serving.prefill import ChatEnd, Continuation, chat_end

    user = {"role": "user", "content": "Hi"}
    said = {"role": "assistant", "content": "Hel<|im_end|>"}
    thought = {"role": "assistant", "content": "", "reasoning_content": "r"}
    assert chat_end([user], None, None, True) == ChatEnd(None, True)
    assert chat_end([user], None, False, True) == ChatEnd(None, False)
    assert chat_end([user, {"role": "assistant", "content": ""}], None, None, True) == ChatEnd(None, True)
    assert chat_end([user, said], None, None, True) == ChatEnd(Continuation("Hel<|im_end|>", "", "content"), False)
    assert chat_end([user, said], None, None, False) == ChatEnd(None, True)  # --no-prefill-assistant
    assert chat_end([user, thought], None, None, True).continuation == Continuation("", "r", "reasoning")
    both = {**said, "reasoning_content": "r"}
    assert chat_end([user, both], None, None, True).continuation.part == "content"
    assert chat_end([user, both], "reasoning_content", False, False).continuation.part == "reasoning"
    assert chat_end([user], True, False, False).continuation == Continuation("Hi", "", "content")
    assert chat_end([user, said], "no such part", None, False) == ChatEnd(None, True)
    with pytest.raises(ApiError, match="2 or more assistant messages"):
        chat_end([user, said, said], None, None, True)
    with pytest.raises(ApiError, match="Cannot set both add_generation_prompt and continue_final_message"):
        chat_end([user, said], True, None, True)


def test_a_continuation_keeps_the_message_as_text():
    from saem_gguf.engine import ChatPrompt
    from saem_gguf.serving.prefill import Continuation, continued

    calls: list[tuple[str, bool]] = []

    def tokenize(text: str, special: bool) -> list[int]:
        calls.append((text, special))
        return [len(text)]

    reasoning_template = "{{ '</think>' }}"
    said = Continuation("Hel<|im_end|>", "", "content")
    c = continued(ChatPrompt("<|im_start|>assistant\n", [1, 2], ()), said, reasoning_template, tokenize)
    assert c.text == "<|im_start|>assistant\n<think></think>Hel<|im_end|>" and c.tokens == [1, 2, 15, 13]
    assert calls == [("<think></think>", True), ("Hel<|im_end|>", False)]  # the markup parsed, the text not
    calls.clear()
    opened = continued(ChatPrompt("<|im_start|>assistant\n<think>\n", [1, 2, 8], ()), Continuation("x", "", "content"),
                       reasoning_template, tokenize)
    assert opened.text == "<|im_start|>assistant\n<think></think>x" and opened.tokens == [1, 2, 15, 1]
    assert continued(ChatPrompt("A:", [5], ()), Continuation("x", "", "content"), "plain", tokenize).text == "A:x"
    calls.clear()
    thought = continued(ChatPrompt("A:", [5], ()), Continuation("x", "r<|im_end|>", "content"), reasoning_template,
                        tokenize)
    assert thought.text == "A:<think>r<|im_end|></think>x"
    assert calls == [("<think>", True), ("r<|im_end|>", False), ("</think>", True), ("x", False)]
    going = continued(ChatPrompt("A:", [5], ()), Continuation("", "r", "reasoning"), reasoning_template, tokenize)
    assert going.text == "A:<think>r"
    assert continued(ChatPrompt("A:", [5], ()), Continuation("", "r", "reasoning"), "plain", tokenize).text == "A:"
