"""The ASGI app of `serve`: OpenAI's completion endpoints over the continuous-batching scheduler, and
the server's health, model list, Prometheus metrics and placement statistics.

Every accepted request ends in an answer: a body, a stream that ends with ``[DONE]``, or an error
object (an error event inside a stream that has begun). A request whose client goes away is
cancelled at once, freeing its slot: a streamed one when Starlette sees the disconnect (it cancels
the stream), a non-streamed one by a watcher on the connection.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from saem_gguf import __version__
from saem_gguf.build.source import LLAMA_CPP_PYTHON_VERSION
from saem_gguf.engine import ChatPrompt, SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.harmony import template_is_harmony
from saem_gguf.serving.auth import ApiKeyMiddleware
from saem_gguf.serving.batch import (
    BatchRequest, EmptyPrompt, PromptTooLong, QueueFull, Scheduler, SchedulerStopped, SequenceHandle, TokenEvent,
)
from saem_gguf.serving.infill import FimTokens, InfillLimits, infill_tokens
from saem_gguf.serving.metrics import CONTENT_TYPE, ServerMetrics
from saem_gguf.serving.protocol import (
    SSE_DONE, ApiError, ApplyTemplateRequest, ChatRequest, CompletionRequest, DetokenizeRequest, Generation,
    InfillRequest, NativeCompletionRequest, NativeReply, Reply, TokenizeRequest, TokenLogprob, generation,
    llama_timings, native_probs, native_settings, parse_json, parse_request, piece_json, request_logit_bias,
    slot_json, sse, stop_type, usage,
)
from saem_gguf.serving import anthropic, responses
from saem_gguf.serving.anthropic import MessagesReply
from saem_gguf.serving.answer_text import ChatText
from saem_gguf.serving.output_format import answer_grammar, thinking_of
from saem_gguf.serving.prefill import ChatEnd, asks_continuation, chat_end, continued, opened_reasoning
from saem_gguf.serving.reasoning import splits
from saem_gguf.serving.responses import ResponsesReply, sse_event
from saem_gguf.thinking import template_reasons

SHUTTING_DOWN = ApiError(503, "the server is shutting down", "unavailable_error", "shutting_down")
QUEUE_FULL_CODE = "queue_full"
MAX_BODY_BYTES = 32 << 20  # far above any prompt a context holds; a larger body is refused unread


@dataclass(frozen=True)
class ChatApi:
    """An API whose request is a chat completion in other words and whose answer has its own
    shapes (OpenAI's Responses, Anthropic's Messages)."""

    chat_body: Callable[[object], dict]  # its request as a /v1/chat/completions body
    reply: Callable[[str], ResponsesReply | MessagesReply]  # an answer's shapes, for the model's id


RESPONSES = ChatApi(responses.chat_body, ResponsesReply)
MESSAGES = ChatApi(anthropic.chat_body, MessagesReply)


@dataclass(frozen=True)
class ServeConfig:
    model_id: str  # what /v1/models lists and every answer names
    sampling: SamplingConfig  # the CLI's sampling flags: a request's fields override them
    max_tokens: int  # -n: for a request without max_tokens (-1: until end of generation or a full context)
    n_ctx_per_sequence: int  # shown in /v1/models
    api_keys: tuple[str, ...] = ()  # --api-key: any of them opens every route but /health
    system: str | None = None  # -sys: the system prompt of a chat that brings none
    reasoning_format: str = "auto"  # --reasoning-format: chat answers' thinking apart (serving.reasoning)
    chat_template: str = ""  # the Jinja text chats are rendered with ("" for a named format)
    parse_special: bool = False  # --parse-special: raw prompts' special-token text becomes those tokens
    n_batch: int = 2048  # -b, which /infill's prompt layout budgets from as llama-server's does
    spm_infill: bool = False  # --spm-infill: /infill puts the suffix before the prefix
    cache_prompt: bool = True  # --cache-prompt / --no-cache-prompt: a request's cache_prompt by default
    prefill_assistant: bool = True  # --no-prefill-assistant: a final assistant message is not continued
    endpoint_slots: bool = True  # --no-slots: GET /slots answers 501, as llama-server's


@dataclass
class ServerState:
    """What the routes share: the scheduler, the token texts (for log-probs), the metrics, and
    whether the server is stopping (new requests then get a 503)."""

    scheduler: Scheduler
    piece: Callable[[int], bytes]
    cfg: ServeConfig
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False


def create_app(state: ServerState) -> Starlette:
    def counted(route: str, handler: Callable[[Request], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as e:
                response = JSONResponse(e.body(), status_code=e.status)
            except Exception as e:  # a defect here: one line, and an answer the client can read
                print(f"[saem] {request.method} {request.url.path}: internal error: {type(e).__name__}: {e}",
                      file=sys.stderr)
                err = ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
                response = JSONResponse(err.body(), status_code=err.status)
            state.metrics.count(route, response.status_code)
            return response

        return endpoint

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        return JSONResponse(_models(state))

    async def slots(request: Request) -> Response:
        if not state.cfg.endpoint_slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           "not_supported_error")
        slots = state.scheduler.slot_states()
        if request.query_params.get("fail_on_no_slot") and all(s.busy for s in slots):
            raise ApiError(503, "no slot available", "unavailable_error")
        return JSONResponse([slot_json(i, s, state.cfg.n_ctx_per_sequence) for i, s in enumerate(slots)])

    async def metrics(_: Request) -> Response:
        return Response(await run_in_threadpool(state.metrics.render), media_type=CONTENT_TYPE)

    async def stats(_: Request) -> Response:
        return JSONResponse(await run_in_threadpool(state.scheduler.stats))

    async def raw(request: Request, kind: type[CompletionRequest | NativeCompletionRequest],
                  answer: Callable[[CompletionRequest | NativeCompletionRequest, Receive | None], Awaitable[Response]]
                  ) -> Response:
        """A raw completion (/v1/completions, /completion): its prompt answered, or its several."""
        if state.stopping:
            raise SHUTTING_DOWN
        req = parse_request(await _body(request), kind)
        if len(req.prompts()) > 1:
            return await _complete_many(request, req, answer)
        return await answer(req, None)

    async def native(request: Request) -> Response:
        return await raw(request, NativeCompletionRequest, lambda one, receive: _complete_native(
            state, request, infill=False, parsed=one, receive=receive))

    async def infill(request: Request) -> Response:
        return await _complete_native(state, request, infill=True)

    async def tokenize(request: Request) -> Response:
        req = parse_request(await _body(request), TokenizeRequest)
        sched = state.scheduler
        try:
            tokens = await run_in_threadpool(sched.tokenize_mixed, req.content, req.add_special, req.parse_special)
            if not req.with_pieces:
                return JSONResponse({"tokens": tokens})
            pieces = await run_in_threadpool(sched.token_pieces, tokens)
        except SaemError as e:  # a token id outside the vocabulary
            raise ApiError(400, str(e), param="content") from None
        return JSONResponse({"tokens": [{"id": t, "piece": piece_json(p)} for t, p in zip(tokens, pieces)]})

    async def detokenize(request: Request) -> Response:
        req = parse_request(await _body(request), DetokenizeRequest)
        try:
            pieces = await run_in_threadpool(state.scheduler.token_pieces, req.tokens)
        except SaemError as e:
            raise ApiError(400, str(e), param="tokens") from None
        return JSONResponse({"content": b"".join(pieces).decode("utf-8", errors="replace")})

    async def apply_template(request: Request) -> Response:
        req = parse_request(await _body(request), ApplyTemplateRequest)
        prompt = await _rendered(state, req, req.chat_template_kwargs)
        return JSONResponse({"prompt": prompt.text})

    def input_tokens(api: ChatApi | None) -> Callable[[Request], Awaitable[Response]]:
        """llama-server's token count of a chat's prompt (/v1/chat/completions/input_tokens, and
        the same for /v1/responses and Anthropic's /v1/messages/count_tokens): the prompt its
        generation would evaluate, the continued assistant message included."""
        async def count(request: Request) -> Response:
            body = await _body(request)
            if api is not None:
                body = json.dumps(api.chat_body(parse_json(body))).encode()
            req = parse_request(body, ChatRequest)
            prompt = await _rendered(state, req, req.template_kwargs())
            answer: dict = {"input_tokens": len(prompt.tokens)}
            return JSONResponse(answer if api is MESSAGES else {**answer, "object": "response.input_tokens"})
        return count

    async def props(_: Request) -> Response:
        return JSONResponse(await run_in_threadpool(_props, state))

    async def chat(request: Request) -> Response:
        return await _complete(state, request, chat=True)

    async def completions(request: Request) -> Response:
        return await raw(request, CompletionRequest, lambda one, receive: _complete(
            state, request, chat=False, parsed=one, receive=receive))

    async def responses(request: Request) -> Response:
        return await _complete(state, request, chat=True, api=RESPONSES)

    async def messages(request: Request) -> Response:
        return await _complete(state, request, chat=True, api=MESSAGES)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       "not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code)

    routes = [
        Route("/health", counted("/health", health)),
        Route("/v1/health", counted("/health", health)),
        Route("/v1/models", counted("/v1/models", models)),
        Route("/models", counted("/v1/models", models)),
        Route("/slots", counted("/slots", slots)),
        Route("/metrics", counted("/metrics", metrics)),
        Route("/v1/saem/stats", counted("/v1/saem/stats", stats)),
        Route("/v1/chat/completions", counted("/v1/chat/completions", chat), methods=["POST"]),
        Route("/chat/completions", counted("/v1/chat/completions", chat), methods=["POST"]),
        Route("/v1/completions", counted("/v1/completions", completions), methods=["POST"]),
        Route("/v1/responses", counted("/v1/responses", responses), methods=["POST"]),
        Route("/responses", counted("/v1/responses", responses), methods=["POST"]),
        Route("/v1/messages", counted("/v1/messages", messages), methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", counted("/v1/chat/completions/input_tokens", input_tokens(None)),
              methods=["POST"]),
        Route("/chat/completions/input_tokens", counted("/v1/chat/completions/input_tokens", input_tokens(None)),
              methods=["POST"]),
        Route("/v1/responses/input_tokens", counted("/v1/responses/input_tokens", input_tokens(RESPONSES)),
              methods=["POST"]),
        Route("/responses/input_tokens", counted("/v1/responses/input_tokens", input_tokens(RESPONSES)),
              methods=["POST"]),
        Route("/v1/messages/count_tokens", counted("/v1/messages/count_tokens", input_tokens(MESSAGES)),
              methods=["POST"]),
        # llama-server's own
        Route("/completion", counted("/completion", native), methods=["POST"]),
        Route("/completions", counted("/completion", native), methods=["POST"]),
        Route("/infill", counted("/infill", infill), methods=["POST"]),
        Route("/tokenize", counted("/tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", counted("/detokenize", detokenize), methods=["POST"]),
        Route("/apply-template", counted("/apply-template", apply_template), methods=["POST"]),
        Route("/props", counted("/props", props)),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_keys=state.cfg.api_keys)] if state.cfg.api_keys else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: not_found})


async def _complete(state: ServerState, request: Request, chat: bool, api: ChatApi | None = None,
                    parsed: CompletionRequest | None = None, receive: Receive | None = None) -> Response:
    """/v1/chat/completions and /v1/completions: OpenAI's shapes; with ``api`` (/v1/responses,
    /v1/messages), a chat told in that API's shapes (serving.responses, serving.anthropic).
    ``parsed``: the request already read (one prompt of a completion's several); ``receive``: where
    the client's disconnect is told, if not the request's own."""
    if state.stopping:
        raise SHUTTING_DOWN
    if parsed is not None:
        req = parsed
    elif api is not None:
        req = parse_request(json.dumps(api.chat_body(parse_json(await _body(request)))).encode(), ChatRequest)
    else:
        req = parse_request(await _body(request), ChatRequest if chat else CompletionRequest)
    # a continued final message (serving.prefill): the answer's content or reasoning starts with it
    end = _chat_end(state, req) if chat else ChatEnd(None, True)
    if chat:
        async def prompt() -> tuple[list[int], tuple[str, ...], str | None]:
            p = await run_in_threadpool(_chat_prompt, state, req.message_dicts(state.cfg.chat_template),
                                        req.template_kwargs(), end)
            return p.tokens, tuple(p.stop), p.text
    else:
        async def prompt() -> tuple[list[int], tuple[str, ...], str | None]:
            return await run_in_threadpool(_raw_prompt, state, req.prompts()[0]), (), None
    handle, gen = await _submit(state, req, prompt, "messages" if chat else "prompt")
    reply = Reply.start(chat, state.cfg.model_id, gen.top_n, gen.post_sampling)
    told = api.reply(state.cfg.model_id) if api is not None else None  # the other API's shapes
    offset = 0  # characters of text streamed so far (completions' text_offset)
    text = bytearray()  # decoded whole at the end: an event may end inside a character
    # a chat's text as llama-server's parser tells it: the thinking apart, a continued message, a
    # schema's JSON alone (serving.answer_text); a raw completion's as generated
    told_text = None
    if chat:
        template, more = state.cfg.chat_template, end.continuation
        told_text = ChatText(splits(req.reasoning_format or state.cfg.reasoning_format, template),
                             template_reasons(template), opened_reasoning(handle.request.chat_text, more, template),
                             more, asks_continuation(req.continue_final_message) and not req.echo,
                             gen.json_answer, harmony=template_is_harmony(template))

    stop_word: list[str | None] = [None]  # the stop string that ended the answer, if one did

    def add(ev: TokenEvent) -> None:
        text.extend(ev.text)
        tokens = _token_logprobs(ev, reply.top_n, state.piece)
        if tokens and reply.logprobs is not None:
            reply.logprobs.extend(tokens)
        if ev.finish_reason is not None:
            reply.finish_reason, reply.usage = ev.finish_reason, _usage(ev)
            reply.timings = _timings(ev)
            stop_word[0] = ev.stop_word

    began: list[bool] = []  # the other API's opening events sent (with the first piece, as llama-server)

    def chunks(ev: TokenEvent) -> list[bytes]:
        nonlocal offset
        out = []
        piece = ev.text.decode("utf-8", errors="ignore")
        reasoning = ""
        if told_text is not None:
            reasoning, piece = told_text.add(piece, final=ev.finish_reason is not None)
        if told is not None:
            events = told.opening(len(handle.request.prompt_tokens), ev.cached) if not began else []
            began.append(True)
            events += told.events(reasoning, piece)
            if ev.finish_reason is not None:
                events += told.closing(ev.finish_reason, ev.stop_word, _usage(ev), _timings(ev))
            return [sse_event(*e) for e in events]
        tokens = _token_logprobs(ev, reply.top_n, state.piece)
        if reasoning and piece:  # a chunk per part, as llama-server sends a chunk per diff
            out.append(sse(reply.chunk("", tokens, text_offset=offset, reasoning=reasoning)))
            reasoning, tokens = "", None
        if piece or reasoning or tokens:
            out.append(sse(reply.chunk(piece, tokens, text_offset=offset, reasoning=reasoning)))
            offset += len(piece)
        if ev.finish_reason is not None:
            reply.usage = _usage(ev)
            last = [reply.chunk(finish_reason=ev.finish_reason)]
            if req.stream_options and req.stream_options.include_usage:
                last.append(reply.usage_chunk())
            last[-1]["timings"] = _timings(ev)  # on the last chunk, as llama-server's
            out += [sse(c) for c in last]
            out.append(SSE_DONE)
        return out

    if req.stream:
        # OpenAI's first chunk names the role; the other APIs open with the first piece (chunks)
        opening = [sse(reply.chunk(text="", role=True))] if chat and told is None else []
        return EventStream(_stream(handle, opening, chunks), handle.cancel)
    gone = await _collect(handle, receive or request.receive, add)
    if gone:
        return gone
    reply.text = text.decode("utf-8", errors="ignore")
    if told_text is not None:
        reply.reasoning, reply.text = told_text.whole(reply.text)
    if told is not None:
        told.reasoning, told.text = reply.reasoning or "", reply.text
        return JSONResponse(told.whole(reply.finish_reason, stop_word[0], reply.usage, reply.timings))
    return JSONResponse(reply.response())


async def _complete_native(state: ServerState, request: Request, infill: bool,
                           parsed: NativeCompletionRequest | None = None, receive: Receive | None = None) -> Response:
    """/completion and /completions, and /infill (``infill``: its prompt laid out in the model's
    fill-in-the-middle tokens, serving.infill): llama-server's own shape (content, stop_type,
    timings, ...)."""
    if state.stopping:
        raise SHUTTING_DOWN
    sched = state.scheduler
    fim = sched.fim_tokens() if infill else None
    if fim is not None and fim.missing():  # before the body, as llama-server checks
        raise ApiError(501, f"Infill is not supported by this model: {fim.missing()}", "not_supported_error")
    req = parsed or parse_request(await _body(request), InfillRequest if infill else NativeCompletionRequest)

    async def prompt() -> tuple[list[int], tuple[str, ...], str | None]:
        if fim is not None:
            return await run_in_threadpool(_infill_prompt, state, fim, req), (), None
        return await run_in_threadpool(_raw_prompt, state, req.prompts()[0]), (), None

    handle, gen = await _submit(state, req, prompt, "prompt")
    try:  # the prompt's text for the answer; the sequence must not outlive a failure here
        text = await run_in_threadpool(lambda: b"".join(sched.token_pieces(handle.request.prompt_tokens)))
    except BaseException:
        handle.cancel()
        raise
    settings = native_settings(gen.sampling, gen.max_tokens, req.n_probs or 0, req.post_sampling_probs)
    reply = NativeReply(state.cfg.model_id, settings,
                        text.decode("utf-8", errors="replace"), req.return_tokens)
    n_predicted = 0
    final: dict = {}

    def probs(ev: TokenEvent) -> list[dict] | None:
        return native_probs(ev.token_ids, ev.logprobs, state.piece, gen.post_sampling) \
            if gen.top_n and ev.logprobs else None

    def add(ev: TokenEvent) -> None:
        nonlocal final
        reply.id_slot = handle.slot
        reply.content += ev.text
        reply.tokens += ev.token_ids
        reply.probs += probs(ev) or []
        if ev.finish_reason is not None:
            if ev.keep is not None:  # a line limit cut the text (batch.LineLimits)
                del reply.content[ev.keep:]
            final = req.only_fields(reply.final(ev.finish_reason, ev.stop_word, ev.usage or (0, 0),
                                                ev.timings or (0.0, 0.0), False, ev.cached))

    def chunks(ev: TokenEvent) -> list[bytes]:
        nonlocal n_predicted
        reply.id_slot = handle.slot
        n_predicted += len(ev.token_ids)
        out = []
        if ev.text or ev.token_ids:
            n_prompt = len(handle.request.prompt_tokens)
            out.append(sse(reply.partial(ev.text, ev.token_ids, probs(ev), n_predicted, n_prompt)))
        if ev.finish_reason is not None:  # llama-server ends its own stream without [DONE]
            out.append(sse(req.only_fields(reply.final(ev.finish_reason, ev.stop_word, ev.usage or (0, 0),
                                                       ev.timings or (0.0, 0.0), True, ev.cached))))
        return out

    if req.stream:
        return EventStream(_stream(handle, [], chunks), handle.cancel)
    gone = await _collect(handle, receive or request.receive, add)
    return gone or JSONResponse(final)


def _raw_prompt(state: ServerState, prompt: str | list[str | int]) -> list[int]:
    """One raw prompt's tokens: a text with BOS as the GGUF says, or token ids with texts mixed in
    (BOS before a leading text only, llama-server's tokenize_mixed)."""
    sched = state.scheduler
    if isinstance(prompt, str):
        return sched.tokenize_prompt(prompt, state.cfg.parse_special)
    return sched.tokenize_mixed(prompt, True, state.cfg.parse_special)


async def _complete_many(request: Request, req: CompletionRequest | NativeCompletionRequest,
                         answer: Callable[[CompletionRequest | NativeCompletionRequest, Receive],
                                          Awaitable[Response]]) -> Response:
    """A completion of several prompts (serving.protocol.split_prompts): each answered as a
    request of its own, all together, as llama-server's tasks of one request; ``answer(one,
    receive)`` answers one. /completion gives llama-server's list of answers (each its ``index``),
    /v1/completions one answer with a choice per prompt and the usage of all (llama-server's gives
    one prompt's). One failure fails the request and cancels the others; so does the client leaving.
    Streamed, the answers' chunks come as they are made, each with its prompt's ``index``, as
    llama-server interleaves them."""
    prompts = req.prompts()
    if req.stream:
        streams: list[EventStream] = []
        try:
            for prompt in prompts:
                streams.append(await answer(req.model_copy(update={"prompt": prompt}), None))
        except BaseException:
            for started in streams:
                started.cancel()
            raise
        return EventStream(_merged(streams, isinstance(req, NativeCompletionRequest)),
                           lambda: [s.cancel() for s in streams])
    left = anyio.Event()

    async def watch() -> None:  # one watcher of the connection for every prompt's collector
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left.set()

    async def told_of_leaving() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    answers: list[Response | None] = [None] * len(prompts)

    async def one(i: int, prompt: str | list[str | int]) -> None:
        answers[i] = await answer(req.model_copy(update={"prompt": prompt}), told_of_leaving)

    try:
        async with anyio.create_task_group() as watching:
            watching.start_soon(watch)
            async with anyio.create_task_group() as answering:
                for i, prompt in enumerate(prompts):
                    answering.start_soon(one, i, prompt)
            watching.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the first failure is the request's
        raise _first(group) from None
    if left.is_set() or any(a is None or a.status_code != 200 for a in answers):
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    bodies = [json.loads(a.body) for a in answers]
    if isinstance(req, NativeCompletionRequest):
        return JSONResponse([{**b, "index": i} for i, b in enumerate(bodies)])
    merged = bodies[0]
    merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    each = [b["usage"] for b in bodies]
    merged["usage"] = usage(sum(u["prompt_tokens"] for u in each), sum(u["completion_tokens"] for u in each),
                            sum(u["prompt_tokens_details"]["cached_tokens"] for u in each))
    return JSONResponse(merged)


def _first(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


def _infill_prompt(state: ServerState, fim: FimTokens, req: InfillRequest) -> list[int]:
    """/infill's prompt tokens as llama-server lays them out (serving.infill): the parts
    tokenized without BOS and with special-token text literal, the prompt with it parsed."""
    sched, cfg = state.scheduler, state.cfg
    limits = InfillLimits(n_batch=cfg.n_batch, n_predict=cfg.max_tokens, n_ctx=cfg.n_ctx_per_sequence,
                          spm=cfg.spm_infill)
    return infill_tokens(lambda text: sched.tokenize_mixed(text, False, False), fim, limits,
                         req.input_prefix, req.input_suffix, [(c.filename, c.text) for c in req.input_extra],
                         sched.tokenize_mixed(req.prompt, False, True), sched.added_bos())


# tokens, the chat format's stops, a chat prompt's text (None for a raw prompt)
PromptOf = Callable[[], Awaitable[tuple[list[int], tuple[str, ...], str | None]]]


async def _submit(state: ServerState, req: ChatRequest | CompletionRequest | NativeCompletionRequest,
                  prompt: PromptOf, prompt_field: str) -> tuple[SequenceHandle, Generation]:
    """Check the request's grammar and logit bias, tokenize its prompt (``prompt``: tokens and the
    chat format's stop strings) and queue it; each failure is the status a client expects."""
    gen = generation(req, state.cfg.sampling, state.cfg.max_tokens)
    sched = state.scheduler
    try:
        # a text key biases its tokens as llama-server's common_tokenize(vocab, text, false) makes them
        bias = await run_in_threadpool(request_logit_bias, req, lambda text: sched.tokenize_mixed(text, False, False))
        if bias is not None:
            gen = replace(gen, sampling=replace(gen.sampling, logit_bias=bias))
        tokens, extra_stops, chat_text = await prompt()
        if gen.json_answer:  # the JSON after the thinking, where the prompt leaves the answer
            where = thinking_of(chat_text, state.cfg.chat_template, req.reasoning_format or state.cfg.reasoning_format)
            gen = replace(gen, sampling=replace(gen.sampling, grammar=answer_grammar(gen.sampling.grammar, where)))
        if gen.sampling.grammar is not None and gen.sampling.grammar is not state.cfg.sampling.grammar:
            await run_in_threadpool(sched.check_grammar, gen.sampling.grammar)
        if state.stopping:
            raise SHUTTING_DOWN
        native = isinstance(req, NativeCompletionRequest)
        handle = sched.submit(BatchRequest(prompt_tokens=tokens, max_tokens=gen.max_tokens, sampling=gen.sampling,
                                           extra_stops=extra_stops, n_probs=_n_probs(gen.top_n),
                                           post_sampling_probs=gen.post_sampling,
                                           chat_text=chat_text, lines=req.line_limits() if native else None,
                                           cache_prompt=state.cfg.cache_prompt if req.cache_prompt is None
                                           else req.cache_prompt, infill=isinstance(req, InfillRequest)))
    except SchedulerStopped:
        raise SHUTTING_DOWN from None
    except QueueFull as e:
        raise ApiError(503, str(e), "unavailable_error", QUEUE_FULL_CODE) from None
    except PromptTooLong as e:
        raise ApiError(400, str(e), "invalid_request_error", "context_length_exceeded", prompt_field) from None
    except EmptyPrompt as e:
        raise ApiError(400, str(e), param=prompt_field) from None
    except SaemError as e:  # the chat template failed on these messages, ...
        raise ApiError(400, str(e)) from None
    return handle, gen


class EventStream(StreamingResponse):
    """A streamed answer (server-sent events) that can cancel its sequences before it is sent:
    where several prompts' answers are merged, one failing to start cancels the others."""

    def __init__(self, chunks: AsyncIterator[bytes], cancel: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.cancel = cancel


async def _merged(streams: list[EventStream], native: bool) -> AsyncIterator[bytes]:
    """Several prompts' streams as one, chunks as they come (llama-server's interleaving), each
    chunk's answer numbered (``index``; OpenAI's choices' ``index``, under one ``id``), one
    ``[DONE]`` at the end. A client that leaves closes every stream, which cancels its sequence."""
    iterators = [s.body_iterator for s in streams]
    ids: list[str] = []  # the id of the first OpenAI chunk, which every chunk then carries
    waiting = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = waiting.pop(future)
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    continue
                waiting[asyncio.ensure_future(iterators[i].__anext__())] = i
                if chunk != SSE_DONE:
                    yield _numbered(chunk, i, native, ids)
        if not native:
            yield SSE_DONE
    finally:  # shielded: Starlette cancels this generator when the client leaves
        with anyio.CancelScope(shield=True):
            for future in waiting:
                future.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            for it in iterators:
                await it.aclose()


def _numbered(chunk: bytes, index: int, native: bool, ids: list[str]) -> bytes:
    """An event of one prompt's stream with that prompt's ``index`` (and the request's one id)."""
    event = json.loads(chunk.removeprefix(b"data: "))
    if native and "error" not in event:
        event["index"] = index
    elif event.get("choices"):
        event["choices"] = [{**c, "index": index} for c in event["choices"]]
        ids[:] = ids or [event["id"]]
        event["id"] = ids[0]
    return sse(event)


def _props(state: ServerState) -> dict:
    """llama-server's GET /props: the fields a client reads (its web UI, editor plugins), for this
    server; ``default_generation_settings.params`` are the CLI's sampling flags under
    llama-server's names, with a request's own default n_predict (-1): llama-server shows a fresh
    task's there, and applies -n to a request that sets none."""
    eng, cfg = state.scheduler.engine, state.cfg
    text = eng.llm._model.token_get_text
    bos, eos = eng.llm.token_bos(), eng.llm.token_eos()
    return {
        "default_generation_settings": {"n_ctx": cfg.n_ctx_per_sequence,
                                        "params": native_settings(cfg.sampling, -1)},
        "total_slots": state.scheduler.n_parallel,
        "model_alias": cfg.model_id,
        "model_path": str(eng.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "chat_template": eng.chat_template_source(),
        "bos_token": text(bos) if bos != -1 else "",
        "eos_token": text(eos) if eos != -1 else "",
        "build_info": f"saem_gguf {__version__}, llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}",
        "endpoint_slots": False,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "is_sleeping": False,
    }


async def _body(request: Request) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES whether or not it declares its length."""
    too_large = ApiError(413, f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB", "invalid_request_error",
                         "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return bytes(body)


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system is None or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _models(state: ServerState) -> dict:
    """GET /v1/models as llama-server answers it: OpenAI's list (with the model's shape in
    ``meta``) and Ollama's ``models`` list, which some clients read instead."""
    llm = state.scheduler.engine.llm
    model = llm._model
    meta = {"vocab_type": model.vocab_type(), "n_vocab": model.n_vocab(), "n_ctx": state.cfg.n_ctx_per_sequence,
            "n_ctx_train": model.n_ctx_train(), "n_embd": model.n_embd(), "n_params": model.n_params(),
            "size": model.size(), "ftype": model.desc().split(" ", 2)[-1]}
    name = state.cfg.model_id
    ollama = {"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
              "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
              "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                          "parameter_size": "", "quantization_level": ""}}
    return {"models": [ollama], "object": "list",
            "data": [{"id": name, "aliases": [name], "tags": [], "object": "model", "created": state.started,
                      "owned_by": "saem_gguf", "meta": meta}]}


def _chat_end(state: ServerState, req: ChatRequest | ApplyTemplateRequest) -> ChatEnd:
    """How the chat's prompt ends (serving.prefill): the final message continued (a final
    assistant message unasked, unless --no-prefill-assistant), or with the generation prompt or not."""
    return chat_end(req.message_dicts(), req.continue_final_message, req.add_generation_prompt,
                    state.cfg.prefill_assistant)


async def _rendered(state: ServerState, req: ChatRequest | ApplyTemplateRequest,
                    template_kwargs: dict | None) -> ChatPrompt:
    """The prompt a chat request's messages become, without generating; a 400 where the chat
    template fails on them."""
    try:
        return await run_in_threadpool(_chat_prompt, state, req.message_dicts(state.cfg.chat_template),
                                       template_kwargs, _chat_end(state, req))
    except SaemError as e:
        raise ApiError(400, str(e), param="messages") from None


def _chat_prompt(state: ServerState, messages: list[dict], template_kwargs: dict | None, end: ChatEnd) -> ChatPrompt:
    """A chat's prompt (``-sys`` added where it brings no system message), ended as ``end`` says
    (serving.prefill)."""
    sched = state.scheduler
    if end.continuation is None:
        return sched.tokenize_chat(_with_system(messages, state.cfg.system), template_kwargs, end.generation_prompt)
    p = sched.tokenize_chat(_with_system(messages[:-1], state.cfg.system), template_kwargs)
    c = continued(p, end.continuation, state.cfg.chat_template,
                  lambda text, special: sched.tokenize_mixed(text, False, special))
    return ChatPrompt(c.text, c.tokens, p.stop)


def _usage(ev: TokenEvent) -> tuple[int, int, int]:
    """A final event's OpenAI usage (prompt, completion and cached prompt tokens): the
    end-of-generation token counted among the completion's, as llama-server counts it."""
    n_prompt, n_gen = ev.usage or (0, 0)
    return n_prompt, n_gen + (stop_type(ev.finish_reason, ev.stop_word) == "eos"), ev.cached


def _timings(ev: TokenEvent) -> dict:
    """llama-server's timings of a final event (its end-of-generation token counted, as there)."""
    n_prompt, n_gen, cached = _usage(ev)
    return llama_timings(n_prompt, cached, n_gen, *(ev.timings or (0.0, 0.0)))


def _n_probs(top_n: int | None) -> int:
    # the scheduler reports log-probs only with alternatives; the chosen token's alone needs one
    return 0 if top_n is None else max(top_n, 1)


def _token_logprobs(ev: TokenEvent, top_n: int | None, piece: Callable[[int], bytes]) -> list[TokenLogprob] | None:
    if top_n is None or ev.logprobs is None:
        return None
    return [TokenLogprob(piece(tok), chosen, tuple((piece(t), lp) for t, lp in top[:top_n]))
            for tok, (chosen, top) in zip(ev.token_ids, ev.logprobs)]


def _error_of(ev: TokenEvent) -> ApiError | None:
    """The error a final event means for the client, if any."""
    if ev.finish_reason == "error":
        return ApiError(500, ev.error or "generation failed", "server_error")
    if ev.finish_reason == "cancelled":  # not by this client (it is gone then): the server is stopping
        return SHUTTING_DOWN
    return None


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left: never sent, only counted


async def _collect(handle: SequenceHandle, receive: Receive, add: Callable[[TokenEvent], None]) -> Response | None:
    """Hand the sequence's events to ``add`` up to its last one. None when it ended; a 499 when the
    client left first (the sequence is cancelled then); raises what the last event's error means."""
    error: ApiError | None = None
    disconnected = False

    async def cancel_on_disconnect() -> None:
        nonlocal disconnected
        # after the body, the next message the server sends the app is the client's disconnect
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        handle.cancel()

    finished = False
    try:
        async with anyio.create_task_group() as watch:
            watch.start_soon(cancel_on_disconnect)
            async for ev in handle.aevents():
                if ev.finish_reason is not None:
                    finished = True
                    error = _error_of(ev)
                    if error is None:
                        add(ev)
                    break
                add(ev)
            watch.cancel_scope.cancel()
    finally:
        if not finished:
            handle.cancel()
    if disconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if error is not None:
        raise error
    return None


async def _stream(handle: SequenceHandle, opening: list[bytes],
                  chunks: Callable[[TokenEvent], list[bytes]]) -> AsyncIterator[bytes]:
    """``opening``, then the chunks ``chunks`` makes of each event; an error on the last event is
    an error event instead. Starlette cancels this generator when the client disconnects;
    ``finally`` then cancels the sequence."""
    finished = False
    try:
        for chunk in opening:
            yield chunk
        async for ev in handle.aevents():
            if ev.finish_reason is not None:
                finished = True
                error = _error_of(ev)
                if error is not None:
                    yield sse(error.body())  # the `openai` client raises APIError on it
                    return
            for chunk in chunks(ev):
                yield chunk
            if finished:
                return
    finally:
        if not finished:
            handle.cancel()
