"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as llama-server serves
it: the request becomes a chat completion (tools/server/server-chat.cpp
``server_chat_convert_anthropic_to_oai``), and the answer is told in the Messages shapes
(server-task.cpp ``to_json_anthropic*``): a ``thinking`` content block for the thinking (its
``signature`` empty: a local model signs nothing), a ``text`` block for the answer, and streamed,
``message_start``, each block's ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta`` and ``message_stop``. Claude Code and the ``anthropic`` client talk to it.

The conversion is llama-server's: ``system`` (a string, or text blocks joined with nothing
between) becomes a system message, with Claude Code's per-request ``cch=`` stamp in an
``x-anthropic-billing-header`` system prompt written as ``fffff`` so that the prompt cache gets past
it; ``stop_sequences`` is ``stop``; ``max_tokens`` defaults to 4096; ``temperature``, ``top_p``,
``top_k``, ``stream`` and ``chat_template_kwargs`` pass through and every other field is ignored
(``seed`` too, as there); ``thinking: {"type": "enabled", "budget_tokens": N}`` is the reasoning
budget (10,000 by default), and ``"disabled"`` is ignored, as there. A turn's ``thinking`` blocks
are its ``reasoning_content`` (their texts joined), which the template gets and a continued final
turn continues (serving.prefill).

What differs from llama-server, on purpose:

* an answer ended by one of ``stop_sequences`` has ``stop_reason`` ``stop_sequence``, as
  Anthropic's API says (llama-server says ``end_turn``; both give the sequence in
  ``stop_sequence``);
* ``tools``, and ``tool_use``, ``tool_result`` and ``image`` blocks, are a 400 (function calling and
  images are not supported here, as on /v1/chat/completions).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from saem_gguf.serving.protocol import bad_request

DEFAULT_MAX_TOKENS = 4096  # llama-server's, where the request gives none (Anthropic requires one)
DEFAULT_THINKING_BUDGET = 10_000  # llama-server's, for "thinking": {"type": "enabled"} without one
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
_BILLING = "x-anthropic-billing-header:"
_STAMP_LENGTH = 5


def chat_body(body: object) -> dict:
    """A Messages request as the /v1/chat/completions body llama-server makes of it (a 400 for what
    cannot be one here); the chat route then checks every field as its own."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages")
    if body.get("tools"):
        raise bad_request("tools (function calling) is not supported", "tools")
    messages: list[dict] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": _unstamped(system)})
    elif isinstance(system, list):
        messages.append({"role": "system", "content": "".join(
            _unstamped(b.get("text", "")) for b in system if isinstance(b, dict) and b.get("type") == "text")})
    given = body["messages"]
    if not isinstance(given, list):
        raise bad_request("'messages' must be an array of messages", "messages")
    for i, msg in enumerate(given):
        _add_message(messages, msg, f"messages.{i}")
    chat: dict = {"messages": messages}
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body["max_tokens"] if "max_tokens" in body else DEFAULT_MAX_TOKENS
    chat.update({k: body[k] for k in _PASSED if k in body})
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        chat["thinking_budget_tokens"] = thinking.get("budget_tokens", DEFAULT_THINKING_BUDGET)
    return chat


def _unstamped(system: str) -> str:
    """``system`` with the five characters after ``cch=`` of an ``x-anthropic-billing-header``
    line as ``fffff`` (llama-server's ``normalize_anthropic_billing_header``: Claude Code stamps
    each request there, which would end every prompt-cache match at the system prompt)."""
    if not system.startswith(_BILLING):
        return system
    at = system.find("cch=", len(_BILLING))
    start = at + 4
    if at < 0 or start + _STAMP_LENGTH >= len(system) or system[start + _STAMP_LENGTH] != ";":
        return system
    return system[:start] + "f" * _STAMP_LENGTH + system[start + _STAMP_LENGTH:]


def _add_message(messages: list[dict], msg: object, where: str) -> None:
    if not isinstance(msg, dict):
        raise bad_request(f"{where}: a message must be an object", where)
    content = msg.get("content")
    if not isinstance(content, list):  # a string, or what the chat route will judge
        if content is not None or msg.get("role") != "assistant":
            messages.append(msg)
        return
    parts, thinking = [], ""
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(block)
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking += block["thinking"]
        elif kind in ("tool_use", "tool_result"):
            raise bad_request(f"{where}.content.{j}: {kind} blocks (function calling) are not supported",
                              f"{where}.content.{j}")
        elif kind == "image":
            raise bad_request(f"{where}.content.{j}: image blocks are not supported (this server reads text)",
                              f"{where}.content.{j}")
    if parts or thinking:  # a turn of thinking alone is kept, its content empty (as there)
        messages.append({"role": msg.get("role"), "content": parts or "",
                         **({"reasoning_content": thinking} if thinking else {})})
    # else (no text and no thinking) the message is left out, as there


def stop_reason(finish_reason: str | None, stop_word: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_word is not None else "end_turn"


@dataclass
class MessagesReply:
    """One answer in the Messages shapes, whole (``whole``) or as events (``opening``,
    ``events``, ``closing``)."""

    model: str
    id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")
    reasoning: str = ""  # the thinking
    text: str = ""
    _thinking_open: bool = False
    _text_open: bool = False

    def _blocks(self) -> list[dict]:
        return ([{"type": "thinking", "thinking": self.reasoning, "signature": ""}] if self.reasoning else []) + \
            ([{"type": "text", "text": self.text}] if self.text else [])

    def whole(self, finish_reason: str | None, stop_word: str | None, usage: tuple[int, int, int],
              timings: dict | None = None) -> dict:
        """The whole answer (``reasoning`` and ``text`` set); ``usage`` (prompt, completion,
        cached prompt tokens). No ``timings``, as llama-server's."""
        n_prompt, n_gen, cached = usage
        return {"id": self.id, "type": "message", "role": "assistant", "content": self._blocks(),
                "model": self.model, "stop_reason": stop_reason(finish_reason, stop_word), "stop_sequence": stop_word,
                "usage": {"cache_read_input_tokens": cached, "input_tokens": n_prompt - cached,
                          "output_tokens": n_gen}}

    def opening(self, n_prompt: int, cached: int) -> list[tuple[str, dict]]:
        """``message_start``, sent with the first piece, as llama-server does."""
        return [("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"cache_read_input_tokens": cached, "input_tokens": n_prompt - cached, "output_tokens": 0}}})]

    def _text_index(self) -> int:
        return 1 if self.reasoning else 0

    def events(self, reasoning: str, text: str) -> list[tuple[str, dict]]:
        """What a piece of the answer (its thinking and text deltas) sends."""
        out = []
        if reasoning:
            self.reasoning += reasoning
            if not self._thinking_open:
                self._thinking_open = True
                out.append(_block_start(0, {"type": "thinking", "thinking": ""}))
            out.append(_block_delta(0, {"type": "thinking_delta", "thinking": reasoning}))
        if text:
            self.text += text
            if not self._text_open:
                self._text_open = True
                out.append(_block_start(self._text_index(), {"type": "text", "text": ""}))
            out.append(_block_delta(self._text_index(), {"type": "text_delta", "text": text}))
        return out

    def closing(self, finish_reason: str | None, stop_word: str | None, usage: tuple[int, int, int],
                timings: dict | None = None) -> list[tuple[str, dict]]:
        """The events after the last piece: each block closed (the thinking after an empty
        ``signature_delta``, which Anthropic's clients expect), the stop reason and the count."""
        out = []
        if self.reasoning:
            out += [_block_delta(0, {"type": "signature_delta", "signature": ""}), _block_stop(0)]
        if self.text:
            out.append(_block_stop(self._text_index()))
        return out + [("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason(finish_reason, stop_word),
                                                   "stop_sequence": stop_word},
                                         "usage": {"output_tokens": usage[1]}}),
                      ("message_stop", {"type": "message_stop"})]


def _block_start(index: int, block: dict) -> tuple[str, dict]:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _block_stop(index: int) -> tuple[str, dict]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}
