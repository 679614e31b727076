"""The OpenAI wire protocol of `serve`: request bodies validated into what the scheduler takes, and
the response, chunk and error shapes the official `openai` client reads.

Where OpenAI leaves something open the choice follows llama.cpp's `llama-server` and
llama-cpp-python's server (tools/server/server-*.cpp, llama_cpp/server/*.py of the vendored
sources): error bodies are ``{"error": {"message", "type", "param", "code"}}`` with llama-server's
error types, chat content parts are joined with a newline, ``echo``, ``best_of`` and ``suffix`` are
refused, and llama.cpp's own sampling fields (``top_k``, ``min_p``, ``typical_p``,
``repeat_penalty``, ``ignore_eos``, ``n_probs``) are accepted beside OpenAI's. Unknown fields are
ignored, as both servers do.

The fields take llama-server's values (tools/server/server-schema.cpp): ``null`` is the field left
out; a soft limit clamps (``top_k`` >= 0, ``top_p`` and ``min_p`` in [0, 1], ``temperature`` >= 0,
XTC's and ``mirostat``'s), a hard one is a 400 (counts >= 0, at most INT32_MAX); ``typical_p`` and
the log-prob counts have no bound (``n_probs`` <= 0: none); a seed is taken modulo 2^32, as
llama.cpp's uint32 (2^32 - 1, and -1, draw one at random); a whole number written as a float
(``40.0``) is that integer. Types are checked strictly: a string where a number belongs is a 400,
as in llama-server, and so are a boolean there and ``40.5`` where an integer belongs (llama-server
reads them as 1 and 40), not a silent conversion.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from saem_gguf.engine import SEED_RANDOM, SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.grammar import json_schema_grammar
from saem_gguf.harmony import template_is_harmony
from saem_gguf.samplers import DEFAULT_ORDER, sampler_order
from saem_gguf.serving.batch import LineLimits, SlotState
from saem_gguf.serving.output_format import JSON_OBJECT

INT32_MAX = 2**31 - 1  # llama-server's hard limit of its integer fields
DEFAULT_TOP_LOGPROBS = 20  # llama-server's alternatives for a chat's "logprobs": true alone


@dataclass(frozen=True)
class ApiError(Exception):
    """An error answered as an OpenAI-style error object with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


# --- requests ------------------------------------------------------------------------------------
class _Strict(BaseModel):
    # strict: "0.5" is not a temperature; unknown fields are ignored (clients send user, metadata, ...)
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        # llama-server reads a null field as one left out (its has_value / json_value), and clients
        # that write every field send "stream": null, "logprobs": null, ...
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _whole(v):
    """A float that holds a whole number (``40.0``) as that integer; anything else as it came."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Whole = Annotated[int, BeforeValidator(_whole)]  # an integer field: 40 or 40.0
Count = Annotated[int, BeforeValidator(_whole), Field(ge=0, le=INT32_MAX)]  # llama-server's hard limit


class StreamOptions(_Strict):
    include_usage: bool = False


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _is_id(e: object) -> bool:
    return isinstance(e, int) and not isinstance(e, bool)


def _one_prompt_form(p: object) -> bool:
    """A prompt: a string, or token ids with strings mixed in (``tokenize_input_subprompt``)."""
    return isinstance(p, str) or (isinstance(p, list) and all(_is_id(e) or isinstance(e, str) for e in p)
                                  and (not p or any(map(_is_id, p))))


def split_prompts(v: object) -> list[str | list[str | int]]:
    """The prompts of a completion request's ``prompt``, as llama-server's tokenize_input_prompts
    reads it: an array without a token id is several prompts (strings, token lists, both mixed),
    anything else one. ValueError for another shape."""
    if isinstance(v, list) and v and not any(map(_is_id, v)):
        prompts = v
    elif isinstance(v, list) and not v:
        raise ValueError("must not be empty")
    else:
        prompts = [v]
    for p in prompts:
        if not _one_prompt_form(p):
            raise ValueError("must be a string, token ids (with strings mixed in), or an array of those "
                             "(several prompts)")
    return prompts


class Message(_Strict):
    # developer: OpenAI's newer name for system instructions (message_dicts)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string, a list of text parts, or null (an assistant turn); checked below, so that the error
    # names what is allowed rather than each alternative of a union
    content: Any = None
    # an assistant turn's thinking, apart (llama-server's): the chat template gets it, and a
    # continued final message (serving.prefill) has its thinking block
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_content(cls, v):
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(map(_is_text_part, v))):
            return v
        raise ValueError('must be a string or a list of text parts ({"type": "text", "text": "..."}); '
                         "other parts (images, audio) are not supported")

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and self.role != "assistant":
            raise ValueError("every message but an assistant's must have content")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined by a newline, as llama-server does for a
        template that takes plain strings."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p["text"] for p in self.content)


def message_dicts(messages: list[Message], template: str = "") -> list[dict]:
    """The messages as a chat template takes them (content one string), a ``developer`` message
    as a ``system`` one unless ``template`` is GPT-OSS's (llama.cpp's map_developer_role_to_system:
    templates other than GPT-OSS's, which has a developer role, know no such role)."""
    keep = template_is_harmony(template)
    # where given, as llama.cpp's render_message_to_json; gpt-oss's template reads it as "thinking"
    # (common_chat_params_init_gpt_oss copies it there)
    reasoning = ("reasoning_content", "thinking") if keep else ("reasoning_content",)
    return [{"role": "system" if m.role == "developer" and not keep else m.role, "content": m.text(),
             **({k: m.reasoning_content for k in reasoning} if m.reasoning_content else {})}
            for m in messages]


class _Common(_Strict):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    # -1: until end of generation or a full context
    max_tokens: Whole | None = Field(default=None, ge=-1, le=INT32_MAX)
    temperature: float | None = None  # clamped to >= 0 (generation)
    top_p: float | None = None  # clamped to [0, 1]
    top_k: Whole | None = None  # clamped to [0, INT32_MAX]
    min_p: float | None = None  # clamped to [0, 1]
    typical_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Whole | None = None  # modulo 2^32
    stop: Any = None  # a string or a list of strings
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool = False
    n_probs: Whole | None = None  # <= 0: none
    # llama-server's: the probabilities the sampler chain left (after top-k, top-p, temperature,
    # ...) in place of the raw logits' log-probs, as "prob" / "top_probs" (a chat's and the native
    # routes'; /v1/completions' legacy shape has log-probs only and keeps them)
    post_sampling_probs: bool = False
    # OpenAI's {"token id": bias}, and llama-server's [[id or text, bias], ...] and text keys (each of
    # the text's tokens); a bias of false bans the token (request_logit_bias)
    logit_bias: dict[str, Any] | list[Any] | None = None
    # constrained output, as llama-server and llama-cpp-python's server take it: GBNF, or a JSON
    # schema turned into GBNF (at most one of these and a chat's response_format)
    grammar: str | None = None
    json_schema: dict | None = None
    # llama-server's, on every completion route: start from the cells an earlier request left in
    # its slot as far as the prompts agree (batch.py, "Prompt cache"); None: the server's
    # --cache-prompt / --no-cache-prompt
    cache_prompt: bool | None = None
    # llama-server's sampler order: names, or one character each (saem_gguf.samplers)
    samplers: str | list[str] | None = None
    # llama-server's samplers that llama-cpp-python's chain lacks (saem_gguf.samplers), with its
    # limits: the hard ones (ge=0, a breaker list not empty) refuse, the soft ones are clamped in
    # ``generation`` as llama-server clamps them
    dry_multiplier: float | None = None
    dry_base: float | None = None  # below 1: the server's
    dry_allowed_length: Count | None = None
    dry_penalty_last_n: Count | None = None
    dry_sequence_breakers: list[str] | None = Field(default=None, min_length=1)
    xtc_probability: float | None = None  # clamped to [0, 1]
    xtc_threshold: float | None = None  # clamped to [0, 1]
    top_n_sigma: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    mirostat: Whole | None = None  # clamped to [0, 2]
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    min_keep: Count | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v):
        stops = [v] if isinstance(v, str) else v if v is not None else []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v not in (None, 1):
            raise ValueError("only n=1 is supported (one choice per request)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_pairs(cls, v):
        pairs = v.items() if isinstance(v, dict) else v or []
        for pair in pairs:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], (str, int))
                    and not isinstance(pair[0], bool)):
                raise ValueError(f"expected [token id or text, bias] pairs, got {json.dumps(pair)[:80]}")
            bias = pair[1]
            if bias is not False and (isinstance(bias, bool) or not isinstance(bias, (int, float))
                                      or not _finite_number(bias)):
                raise ValueError(f"a bias is a finite number, or false to ban the token; "
                                 f"got {json.dumps(bias)[:80]}")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class _RawPrompt(_Common):
    """A request with a raw prompt: one, or several (split_prompts)."""

    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        split_prompts(v)
        return v

    def prompts(self) -> list[str | list[str | int]]:
        return split_prompts(self.prompt)


class CompletionRequest(_RawPrompt):
    logprobs: Whole | None = None  # < 0: none (llama-server's n_probs); 0: the chosen token's alone (OpenAI's)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("only no echo is supported")
        return v

    @field_validator("best_of", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v is not None:
            raise ValueError(f"unsupported parameter: {info.field_name}")
        return v

    def top_n(self) -> int | None:
        """Alternatives per token to return, None for no log-probs at all."""
        if self.logprobs is not None:
            return self.logprobs if self.logprobs >= 0 else None
        return self.n_probs if self.n_probs is not None and self.n_probs > 0 else None


class NativeCompletionRequest(_RawPrompt):
    """llama-server's own POST /completion (and /completions): ``prompt`` a string, or strings and
    token ids mixed (``tokenize_mixed``), ``n_predict`` (``max_tokens`` its alias),
    ``repeat_last_n``, ``n_probs``, ``return_tokens``; the sampling fields are the OpenAI routes'."""

    n_predict: Whole | None = Field(default=None, ge=-1, le=INT32_MAX)
    repeat_last_n: Count | None = None
    return_tokens: bool = False
    # llama-server's limits for code completion (batch.LineLimits): each new line's least
    # indentation, and a time after which the next newline ends the answer (-1, 0: none)
    n_indent: Count = 0
    t_max_predict_ms: Whole = Field(default=-1, ge=-1, le=2**63 - 1)
    # llama-server's: only these fields of the last object, a path with slashes naming a nested
    # one (e.g. "timings/predicted_n", kept under that name); absent ones left out
    response_fields: list[str] = []

    def line_limits(self) -> LineLimits | None:
        if self.n_indent <= 0 and self.t_max_predict_ms <= 0:
            return None
        return LineLimits(n_indent=self.n_indent, t_max_predict_ms=float(max(self.t_max_predict_ms, 0)))

    def only_fields(self, answer: dict) -> dict:
        """``answer`` reduced to ``response_fields`` (all of it when none are named), as
        llama-server's ``json_get_nested_values``."""
        if not self.response_fields:
            return answer
        out = {}
        for path in self.response_fields:
            node, found = answer, True
            for key in path.split("/"):
                if isinstance(node, dict) and key in node:
                    node = node[key]
                else:
                    found = False
                    break
            if found:
                out[path] = node
        return out

    def top_n(self) -> int | None:
        return self.n_probs if self.n_probs is not None and self.n_probs > 0 else None


class InfillChunk(_Strict):
    """One file of /infill's ``input_extra``: context placed before the code being completed."""

    text: str
    filename: str = "tmp"  # llama-server's name for a chunk without one


class InfillRequest(NativeCompletionRequest):
    """llama-server's POST /infill (fill in the middle): ``input_prefix`` and ``input_suffix``, the
    code before and after the cursor (strings, or strings and token ids mixed), ``input_extra``,
    other files as context, and ``prompt``, text the middle starts with (its special-token text
    parsed, as llama-server does). Every /completion field applies. Unlike llama-server, a missing
    prefix or suffix, or a prompt that is not a string, is a 400 naming the field (llama-server
    answers a 500 there)."""

    prompt: str = ""
    input_prefix: str | list[str | int]
    input_suffix: str | list[str | int]
    input_extra: list[InfillChunk] = []


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: the schema and what names it (``strict`` is
    accepted and always holds: the grammar admits nothing else)."""

    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``text``; ``json_object`` (any JSON object, or llama-cpp-python's ``schema`` extension);
    ``json_schema`` (OpenAI's structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    schema_: dict | None = Field(default=None, alias="schema")
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs response_format.json_schema.schema")
        return self


class _Messages(_Strict):
    """A chat's messages and how its prompt ends (llama-server's fields; serving.prefill)."""

    messages: list[Message] = Field(min_length=1)
    # llama-server's: more chat-template variables, over the server's --chat-template-kwargs
    chat_template_kwargs: dict[str, Any] | None = None
    # llama-server's: end the prompt with the assistant's header (or not), continue the final
    # message (true, "content" or "reasoning_content")
    add_generation_prompt: bool | None = None
    continue_final_message: bool | str | None = None

    def message_dicts(self, template: str = "") -> list[dict]:
        return message_dicts(self.messages, template)


class ChatRequest(_Common, _Messages):
    max_completion_tokens: Whole | None = Field(default=None, ge=-1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: Whole | None = Field(default=None, ge=0)  # absent with logprobs: 20, as llama-server
    response_format: ResponseFormat | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    # OpenAI's reasoning_effort ("none": enable_thinking false; else the chat-template variable
    # reasoning_effort, over chat_template_kwargs)
    reasoning_effort: str | None = None
    # llama-server's: the thinking apart (reasoning_content) or not, over the server's --reasoning-format
    reasoning_format: Literal["auto", "deepseek", "deepseek-legacy", "none"] | None = None
    # llama-server's: the thinking block's token budget over the server's --reasoning-budget (-1:
    # the server's), its other name, and the text forced before the end tag once it is spent
    reasoning_budget_tokens: Whole | None = Field(default=None, ge=-1, le=INT32_MAX)
    thinking_budget_tokens: Whole | None = Field(default=None, ge=-1, le=INT32_MAX)
    reasoning_budget_message: str | None = None
    # llama-server's: with continue_final_message asked, a stream that sends the continued text
    # too (serving.answer_text)
    echo: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_is_boolean(cls, v):
        if v is not None and "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
            raise ValueError('invalid type for "enable_thinking" (expected boolean)')
        return v

    def template_kwargs(self) -> dict[str, Any]:
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            variables["enable_thinking"] = False
        elif self.reasoning_effort:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} (function calling) is not supported")
        return v

    def top_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be set to true", "top_logprobs")
        if self.logprobs:
            return DEFAULT_TOP_LOGPROBS if self.top_logprobs is None else self.top_logprobs
        return self.n_probs if self.n_probs is not None and self.n_probs > 0 else None


class TokenizeRequest(_Strict):
    """llama-server's POST /tokenize: ``content`` a string, or strings and token ids mixed (its
    ``tokenize_mixed``: ids kept, only the first element may get BOS)."""

    content: str | list[str | int] = ""
    add_special: bool = False  # BOS (and EOS) as the vocabulary adds them
    parse_special: bool = True  # llama-server's default: <|im_start|> in the text is that token
    with_pieces: bool = False  # [{"id", "piece"}]: the piece a string, or its bytes if not UTF-8


class DetokenizeRequest(_Strict):
    """llama-server's POST /detokenize: the text of ``tokens``, special tokens' text included."""

    tokens: list[int] = []


class ApplyTemplateRequest(_Messages):
    """llama-server's POST /apply-template: the prompt a chat's messages become."""


def piece_json(piece: bytes) -> str | list[int]:
    """A token's piece as llama-server's /tokenize gives it: the text, or the bytes where the piece
    is not valid UTF-8 alone (a part of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def parse_json(body: bytes) -> object:
    """The body's JSON value, or a 400 as ``parse_request`` words it."""
    if not body.strip():
        raise bad_request("the request body is empty (expected a JSON object)")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"malformed JSON: {e}") from None


def parse_request(body: bytes, kind: type[_Strict]) -> _Strict:
    """The body as ``kind``, or a 400 naming the first field that is wrong."""
    if not body.strip():
        raise bad_request("the request body is empty (expected a JSON object)")
    try:
        return kind.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"malformed JSON: {err['ctx'].get('error', err['msg'])}") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("the request body must be a JSON object") from None
        field = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{field}: {msg}" if field else msg, field or None) from None


@dataclass(frozen=True)
class Generation:
    """What a request asks the scheduler for, besides the prompt."""

    max_tokens: int
    sampling: SamplingConfig
    top_n: int | None  # log-prob alternatives per token; None: no log-probs
    post_sampling: bool = False  # the chain's probabilities instead (post_sampling_probs)
    # a chat answer constrained by a schema (response_format, json_schema): its grammar is the
    # JSON alone, which serving.output_format puts after the thinking, as llama-server does
    json_answer: bool = False


def generation(req: _Common, defaults: SamplingConfig, default_max_tokens: int) -> Generation:
    """The request's sampling on top of the server's defaults (the CLI's sampling flags)."""
    def clamp(v, lo, hi):  # llama-server's soft limits
        return None if v is None else min(max(v, lo), hi)

    over = {name: value for name, value in (
        ("temp", clamp(req.temperature, 0.0, math.inf)), ("top_p", clamp(req.top_p, 0.0, 1.0)),
        ("top_k", clamp(req.top_k, 0, INT32_MAX)), ("min_p", clamp(req.min_p, 0.0, 1.0)),
        ("typical_p", req.typical_p), ("repeat_penalty", req.repeat_penalty),
        ("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty))
        if value is not None}
    if isinstance(req, NativeCompletionRequest) and req.repeat_last_n is not None:
        over["repeat_last_n"] = req.repeat_last_n
    over.update({name: value for name, value in (
        ("dry_multiplier", req.dry_multiplier), ("dry_allowed_length", req.dry_allowed_length),
        ("dry_penalty_last_n", req.dry_penalty_last_n), ("top_n_sigma", req.top_n_sigma),
        ("dynatemp_range", req.dynatemp_range), ("dynatemp_exponent", req.dynatemp_exponent),
        ("mirostat_tau", req.mirostat_tau), ("mirostat_eta", req.mirostat_eta), ("min_keep", req.min_keep),
        ("dry_base", None if req.dry_base is None else req.dry_base if req.dry_base >= 1 else defaults.dry_base),
        ("dry_sequence_breakers", None if req.dry_sequence_breakers is None else tuple(req.dry_sequence_breakers)),
        ("xtc_probability", clamp(req.xtc_probability, 0.0, 1.0)),
        ("xtc_threshold", clamp(req.xtc_threshold, 0.0, 1.0)),
        ("mirostat", clamp(req.mirostat, 0, 2))) if value is not None})
    if req.seed is not None:  # llama.cpp's uint32 seed; LLAMA_DEFAULT_SEED (-1 too) draws one
        seed = req.seed % 2**32
        over["seed"] = None if seed == SEED_RANDOM else seed
    if req.ignore_eos:
        over["ignore_eos"] = True
    if req.samplers is not None:
        try:
            over["samplers"] = sampler_order(req.samplers)
        except SaemError as e:
            raise bad_request(str(e), "samplers") from None
    over["stop"] = defaults.stop + req.stops()
    grammar = request_grammar(req)
    if grammar is not None:
        over["grammar"] = grammar
    if isinstance(req, ChatRequest):
        budget = req.reasoning_budget_tokens if req.reasoning_budget_tokens is not None else req.thinking_budget_tokens
        if budget is not None and budget != -1:
            over["reasoning_budget"] = budget
        if req.reasoning_budget_message is not None:
            over["reasoning_budget_message"] = req.reasoning_budget_message
    try:
        sampling = replace(defaults, **over)
    except SaemError as e:
        raise bad_request(str(e)) from None
    max_tokens = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if isinstance(req, NativeCompletionRequest) and req.n_predict is not None:
        max_tokens = req.n_predict
    return Generation(default_max_tokens if max_tokens is None else max_tokens, sampling, req.top_n(),
                      post_sampling=req.post_sampling_probs and not isinstance(req, CompletionRequest),
                      json_answer=isinstance(req, ChatRequest) and grammar is not None and req.grammar is None)


def request_grammar(req: _Common) -> str | None:
    """The GBNF a request constrains its output to (None: the server's default, if any): its
    ``grammar``, ``json_schema``, or a chat's ``response_format`` (json_schema; json_object, with
    llama-cpp-python's optional ``schema``, else llama-server's grammar of any object), schemas
    by llama-cpp-python's converter. More than one is a 400."""
    given = {"grammar": req.grammar, "json_schema": req.json_schema}
    fmt = req.response_format if isinstance(req, ChatRequest) else None
    if fmt is not None and fmt.type != "text":
        given["response_format"] = fmt
    named = [k for k, v in given.items() if v is not None]
    if len(named) > 1:
        raise bad_request(f"give one of {', '.join(named)}: each constrains the output", named[1])
    if not named:
        return None
    try:
        if named[0] == "grammar":
            if not req.grammar.strip():
                raise bad_request("grammar: the grammar is empty", "grammar")
            return req.grammar
        if named[0] == "json_schema":
            return json_schema_grammar(json.dumps(req.json_schema), "json_schema")
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else fmt.schema_
        if schema is None:
            return JSON_OBJECT
        return json_schema_grammar(json.dumps(schema), "response_format's schema")
    except SaemError as e:
        raise bad_request(str(e), named[0]) from None


def request_logit_bias(req: _Common, text_tokens: Callable[[str], list[int]]) -> tuple[tuple[int, float], ...] | None:
    """The request's ``logit_bias`` as (token id, bias) entries in order, as llama-server reads it:
    a key or first element that is a whole number is a token id, any other text biases each of
    its tokens (``text_tokens``), and false is -inf. None: the request gives none (the server's
    default ``-l`` stands; a request's replaces it). The ids are checked against the vocabulary
    at submit."""
    if req.logit_bias is None:
        return None
    pairs = req.logit_bias.items() if isinstance(req.logit_bias, dict) else req.logit_bias
    entries: list[tuple[int, float]] = []
    for key, bias in pairs:
        value = -math.inf if bias is False else float(bias)
        if isinstance(key, int) or re.fullmatch(r"-?\d+", key):
            entries.append((int(key), value))
        else:
            entries.extend((t, value) for t in text_tokens(key))
    return tuple(entries)


# --- responses -----------------------------------------------------------------------------------
def new_id(kind: Literal["chatcmpl", "cmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens an earlier request's cells served
    (llama-server's prompt cache; OpenAI's prompt caching field)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-prob and its most likely alternatives (text as bytes)."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...]


def _finite_number(x: int | float) -> bool:
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an integer beyond any float
        return False


def _finite(lp: float) -> float:
    # JSON has no -inf; llama-server writes the lowest float for a zero probability
    return lp if math.isfinite(lp) else -3.4028234663852886e38


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def chat_logprobs(tokens: list[TokenLogprob], post_sampling: bool = False) -> dict:
    """OpenAI's chat shape; under ``post_sampling`` (the tokens carry the chain's probabilities)
    llama-server's names for them, "prob" and "top_probs"."""
    value, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")
    return {"content": [{"token": _text(t.token), value: _finite(t.logprob), "bytes": list(t.token),
                         top: [{"token": _text(b), value: _finite(lp), "bytes": list(b)} for b, lp in t.top]}
                        for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob], text_offset: int = 0) -> dict:
    """OpenAI's legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset), as
    llama-cpp-python's create_completion writes it."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(_text(t.token))
    return {"tokens": [_text(t.token) for t in tokens], "token_logprobs": [_finite(t.logprob) for t in tokens],
            "top_logprobs": [{_text(b): _finite(lp) for b, lp in t.top} for t in tokens],
            "text_offset": offsets}


def stop_type(finish_reason: str, stop_word: str | None) -> str:
    """llama-server's ``stop_type`` of an answer: ``limit`` (its length or a line limit),
    ``word`` (a stop string) or ``eos`` (an end-of-generation token, which llama-server counts
    among the tokens predicted; usage does not, as llama-cpp-python)."""
    return "limit" if finish_reason == "length" else "word" if stop_word is not None else "eos"


def llama_timings(n_prompt: int, cached: int, n_gen: int, prompt_s: float, gen_s: float) -> dict:
    """llama-server's ``timings`` object: ``cache_n`` prompt tokens an earlier request's cells
    served, ``prompt_n`` evaluated, ``predicted_n`` generated (the end-of-generation token it
    sampled counted, as there), with their times and rates."""
    n_eval = n_prompt - cached
    return {"cache_n": cached, "prompt_n": n_eval, "prompt_ms": prompt_s * 1e3,
            "prompt_per_token_ms": prompt_s * 1e3 / max(n_eval, 1),
            "prompt_per_second": n_eval / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": n_gen, "predicted_ms": gen_s * 1e3,
            "predicted_per_token_ms": gen_s * 1e3 / max(n_gen, 1),
            "predicted_per_second": n_gen / gen_s if gen_s > 0 else 0.0}


@dataclass
class Reply:
    """One request's answer, accumulated from the scheduler's events."""

    id: str
    model: str
    created: int
    chat: bool
    top_n: int | None
    post_sampling: bool = False  # the tokens carry the chain's probabilities (chat_logprobs)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: tuple[int, int, int] = (0, 0, 0)  # prompt, completion and cached prompt tokens (``usage``)
    reasoning: str | None = None  # a chat answer's thinking, apart (llama-server's reasoning_content)
    timings: dict | None = None  # llama-server's timings (llama_timings), once the answer is done

    @classmethod
    def start(cls, chat: bool, model: str, top_n: int | None, post_sampling: bool = False) -> Reply:
        return cls(new_id("chatcmpl" if chat else "cmpl"), model, int(time.time()), chat, top_n, post_sampling,
                   logprobs=[] if top_n is not None else None)

    def _logprobs_json(self, tokens: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
        if tokens is None:
            return None
        return chat_logprobs(tokens, self.post_sampling) if self.chat else completion_logprobs(tokens, text_offset)

    def response(self) -> dict:
        """The non-streamed body."""
        choice: dict = {"index": 0, "logprobs": self._logprobs_json(self.logprobs),
                        "finish_reason": self.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
            if self.reasoning is not None:
                choice["message"]["reasoning_content"] = self.reasoning
        else:
            choice["text"] = self.text
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(*self.usage)}
        return body if self.timings is None else {**body, "timings": self.timings}

    def chunk(self, text: str | None = None, tokens: list[TokenLogprob] | None = None,
              finish_reason: str | None = None, role: bool = False, text_offset: int = 0,
              reasoning: str = "") -> dict:
        """A streamed chunk: ``chat.completion.chunk`` (a delta: ``content``, and thinking as
        ``reasoning_content`` where the answer is split) or ``text_completion`` (a text)."""
        choice: dict = {"index": 0, "logprobs": self._logprobs_json(tokens, text_offset),
                        "finish_reason": finish_reason}
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None and (text or not reasoning):
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage (OpenAI's shape)."""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage(*self.usage)}


def _valid_utf8(b: bytes) -> str:
    """``b`` up to an incomplete character at its end (llama-server's validate_utf8 cut)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        return b[:e.start].decode("utf-8", errors="replace")


def native_probs(token_ids: tuple[int, ...], logprobs: tuple, piece: Callable[[int], bytes],
                 post_sampling: bool = False) -> list[dict]:
    """llama-server's ``completion_probabilities`` for generated tokens: id, token (its text up to
    an incomplete character), bytes, logprob and the ``top_logprobs`` alternatives alike; under
    ``post_sampling`` (``logprobs`` holds the chain's probabilities) "prob" and "top_probs"."""
    value, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def one(tok: int, lp: float) -> dict:
        b = piece(tok)
        return {"id": tok, "token": _valid_utf8(b), "bytes": list(b), value: _finite(lp)}

    return [{**one(tok, chosen), top_key: [one(t, lp) for t, lp in top]}
            for tok, (chosen, top) in zip(token_ids, logprobs)]


def native_settings(sampling: SamplingConfig, n_predict: int, n_probs: int = 0, post_sampling: bool = False) -> dict:
    """The sampling settings under llama-server's names (its ``generation_settings`` and
    /props ``default_generation_settings.params``), with a request's ``n_probs`` and
    ``post_sampling_probs``."""
    d = sampling
    # llama.cpp's seed is a uint32: LLAMA_DEFAULT_SEED (a random one per request) reads 4294967295
    return {"n_predict": n_predict, "seed": SEED_RANDOM if d.seed is None else d.seed, "temperature": d.temp,
            "dynatemp_range": d.dynatemp_range, "dynatemp_exponent": d.dynatemp_exponent,
            "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p, "top_n_sigma": d.top_n_sigma,
            "xtc_probability": d.xtc_probability, "xtc_threshold": d.xtc_threshold, "typical_p": d.typical_p,
            "repeat_last_n": d.repeat_last_n, "repeat_penalty": d.repeat_penalty,
            "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
            "dry_multiplier": d.dry_multiplier, "dry_base": d.dry_base, "dry_allowed_length": d.dry_allowed_length,
            "dry_penalty_last_n": d.dry_penalty_last_n, "dry_sequence_breakers": list(d.dry_sequence_breakers),
            "mirostat": d.mirostat, "mirostat_tau": d.mirostat_tau, "mirostat_eta": d.mirostat_eta,
            "min_keep": d.min_keep, "samplers": list(DEFAULT_ORDER if d.samplers is None else d.samplers),
            "ignore_eos": d.ignore_eos, "stop": list(d.stop),
            "logit_bias": [[t, b if math.isfinite(b) else False] for t, b in d.logit_bias],
            "grammar": d.grammar or "", "n_probs": n_probs, "post_sampling_probs": post_sampling}


# what llama-server's /slots leaves out of a task's settings unless LLAMA_SERVER_SLOTS_DEBUG is set
# (task_params::to_json's only_metrics)
SLOT_HIDDEN_SETTINGS = ("stop", "logit_bias", "grammar", "dry_sequence_breakers")


def slot_json(index: int, slot: SlotState, n_ctx: int) -> dict:
    """One slot of GET /slots in llama-server's shape: its id, context and state, and of its current
    or last request the task number, the cells and prompt counts, the settings and where its
    generation stands (``next_token``)."""
    out = {"id": index, "n_ctx": n_ctx, "speculative": False, "is_processing": slot.busy}
    t = slot.task
    if t is None:
        return out
    req = t.request
    settings = native_settings(req.sampling, req.max_tokens, req.n_probs, req.post_sampling_probs)
    return {**out, "id_task": t.task, "n_prompt_tokens": t.n_cells, "n_prompt_tokens_processed": t.n_prompt_processed,
            "n_prompt_tokens_cache": t.n_prompt_cached,
            "params": {k: v for k, v in settings.items() if k not in SLOT_HIDDEN_SETTINGS},
            "next_token": [{"has_next_token": t.has_next_token, "has_new_line": t.has_new_line,
                            "n_remain": t.n_remain, "n_decoded": t.n_decoded}]}


@dataclass
class NativeReply:
    """One /completion answer in llama-server's own shape, from the scheduler's events."""

    model: str
    settings: dict  # native_settings of the request
    prompt: str  # the prompt's text (special tokens' text included)
    return_tokens: bool
    content: bytearray = field(default_factory=bytearray)
    tokens: list[int] = field(default_factory=list)
    probs: list[dict] = field(default_factory=list)
    id_slot: int = -1  # the slot that served it (set once the request is admitted)

    def partial(self, text: bytes, token_ids: tuple[int, ...], probs: list[dict] | None,
                n_predicted: int, n_prompt: int) -> dict:
        """A streamed chunk: the text this event releases, and its token ids (llama-server sends
        them in every chunk; ``return_tokens`` is for the last object)."""
        out = {"index": 0, "content": text.decode("utf-8", errors="ignore"),
               "tokens": list(token_ids), "stop": False, "id_slot": self.id_slot,
               "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt}
        if probs:
            out["completion_probabilities"] = probs
        return out

    def final(self, finish_reason: str, stop_word: str | None, usage: tuple[int, int],
              timings: tuple[float, float], streamed: bool, cached: int = 0) -> dict:
        """The last object: the whole text (empty when streamed: the chunks carried it), why it
        stopped (``stop_type`` eos / word / limit), the counts and llama-server's timings
        (``cache_n``: the prompt tokens an earlier request's cells served, ``prompt_n`` the
        ones evaluated)."""
        n_prompt, n_gen = usage
        stopped = stop_type(finish_reason, stop_word)
        # llama-server counts the end-of-generation token it sampled; the last sampled token is
        # never decoded into the cache
        n_gen += stopped == "eos"
        content = "" if streamed else self.content.decode("utf-8", errors="ignore")
        tokens = self.tokens if self.return_tokens and not streamed else []
        out = {"index": 0, "content": content, "tokens": tokens, "id_slot": self.id_slot,
               "stop": True, "model": self.model, "tokens_predicted": n_gen, "tokens_evaluated": n_prompt,
               "generation_settings": self.settings, "prompt": self.prompt, "has_new_line": "\n" in content,
               "truncated": False, "stop_type": stopped,
               "stopping_word": stop_word or "", "tokens_cached": n_prompt + max(n_gen - 1, 0),
               "timings": llama_timings(n_prompt, cached, n_gen, *timings)}
        if self.probs and not streamed:
            out["completion_probabilities"] = self.probs
        return out


# --- server-sent events ----------------------------------------------------------------------------
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (one line: JSON escapes every line break)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
