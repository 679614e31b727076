"""OpenAI's Responses API (POST /v1/responses), as llama-server serves it: the request becomes a
chat completion (tools/server/server-chat.cpp ``server_chat_convert_responses_to_chatcmpl``), and
the answer is told in the Responses shapes (server-task.cpp ``to_json_oaicompat_resp*``): a
``reasoning`` output item for the thinking, a ``message`` item for the answer, and streamed, the
``response.created`` ... ``response.completed`` events.

What differs from llama-server, on purpose:

* an answer cut by ``max_output_tokens`` has ``status`` ``incomplete`` and
  ``incomplete_details.reason`` ``max_output_tokens``, as OpenAI's; llama-server says
  ``completed``;
* ``text.format`` (the Responses API's structured output: ``json_schema``, ``json_object``) is
  taken as the chat's ``response_format``, and ``reasoning.effort`` as its ``reasoning_effort``
  (``"none"``: no thinking); llama-server ignores both.

There are no stored responses (``previous_response_id`` is a 400, as in llama-server) and no
function calling (``tools``, ``function_call`` items: a 400, as on /v1/chat/completions here).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from saem_gguf.serving.protocol import bad_request

# the request fields that are not a chat completion's, read here
_OWN = ("input", "instructions", "max_output_tokens", "previous_response_id", "text", "store", "include",
        "truncation", "background", "reasoning", "parallel_tool_calls", "prompt")


def chat_body(body: object) -> dict:
    """A Responses request as the /v1/chat/completions body it asks for (a 400 for what cannot be
    one); the chat route then checks every field as its own."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("input") is None:
        raise bad_request("'input' is required", "input")
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id is not supported: this server stores no responses",
                          "previous_response_id")
    chat = {k: v for k, v in body.items() if k not in _OWN}
    messages: list[dict] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": body["instructions"]})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for i, item in enumerate(given):
            _add_item(messages, item, f"input.{i}")
    else:
        raise bad_request("'input' must be a string or an array of items", "input")
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    effort = body["reasoning"].get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _add_item(messages: list[dict], item: object, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{where}: an input item must be an object", where)
    role, kind, content = item.get("role"), item.get("type"), item.get("content")
    if kind in ("function_call", "function_call_output") or item.get("call_id") is not None:
        raise bad_request(f"{where}: function calling is not supported", where)
    if kind == "reasoning":  # the thinking of the assistant turn it begins or follows, as llama-server reads it
        _add_reasoning(messages, item, where)
        return
    if role in ("user", "system", "developer"):
        messages.append({"role": role, "content": _texts(content, where)})
    elif role == "assistant":
        text = _texts(content, where, ("output_text", "input_text"))
        if messages and messages[-1]["role"] == "assistant":  # llama-server merges them
            messages[-1]["content"] += text
        else:
            messages.append({"role": "assistant", "content": text})
    else:
        raise bad_request(f"{where}: cannot tell what this input item is (a message needs a role: user, "
                          f"system, developer or assistant)", where)


def _add_reasoning(messages: list[dict], item: dict, where: str) -> None:
    """A reasoning item: its first content part's text is the ``reasoning_content`` of the
    assistant turn before it, or of a new one (content empty) that a message item may then fill."""
    content = item.get("content")
    if not isinstance(content, list) or not content or not isinstance(content[0], dict) \
            or not isinstance(content[0].get("text"), str):
        raise bad_request(f"{where}.content: a reasoning item needs its text in content[0].text", f"{where}.content")
    if messages and messages[-1]["role"] == "assistant":
        messages[-1]["reasoning_content"] = content[0]["text"]
    else:
        messages.append({"role": "assistant", "content": "", "reasoning_content": content[0]["text"]})


def _texts(content: object, where: str, kinds: tuple[str, ...] = ("input_text",)) -> str:
    """A message's text: a string, or its text parts joined (a newline between, as chat content
    parts are joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: must be a string or an array of parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content.{j}: only {' and '.join(kinds)} parts with a text are supported "
                              f"(not images or files)", f"{where}.content.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class ResponsesReply:
    """One answer in the Responses shapes, whole (``whole``) or as events (``opening``,
    ``events``, ``closing``)."""

    model: str
    id: str = field(default_factory=lambda: _id("resp"))
    reasoning_id: str = field(default_factory=lambda: _id("rs"))
    message_id: str = field(default_factory=lambda: _id("msg"))
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning: str = ""
    text: str = ""
    _reasoning_open: bool = False
    _text_open: bool = False

    def _reasoning_item(self, done: bool) -> dict:
        return {"id": self.reasoning_id, "summary": [], "type": "reasoning",
                "content": [{"text": self.reasoning, "type": "reasoning_text"}] if done else [],
                "encrypted_content": "", "status": "completed" if done else "in_progress"}

    def _part(self) -> dict:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": self.text}

    def _message_item(self, done: bool) -> dict:
        return {"content": [self._part()] if done else [], "id": self.message_id, "role": "assistant",
                "status": "completed" if done else "in_progress", "type": "message"}

    def _output(self) -> list[dict]:
        return ([self._reasoning_item(True)] if self.reasoning else []) + \
            ([self._message_item(True)] if self.text else [])

    def whole(self, finish_reason: str | None, stop_word: str | None, usage: tuple[int, int, int],
              timings: dict | None = None) -> dict:
        """The whole answer (``reasoning`` and ``text`` set); ``usage`` (prompt, completion,
        cached prompt tokens)."""
        n_prompt, n_gen, cached = usage
        body = {"completed_at": int(time.time()), "created_at": self.created, "id": self.id, "model": self.model,
                "object": "response", "output": self._output(), "status": "completed",
                "usage": {"input_tokens": n_prompt, "output_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                          "input_tokens_details": {"cached_tokens": cached}}}
        if finish_reason == "length":
            body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        return body if timings is None else {**body, "timings": timings}

    def opening(self, n_prompt: int, cached: int) -> list[tuple[str, dict]]:
        """Sent with the first piece, as llama-server does."""
        state = {"id": self.id, "object": "response", "status": "in_progress"}
        return [("response.created", {"type": "response.created", "response": state}),
                ("response.in_progress", {"type": "response.in_progress", "response": state})]

    def events(self, reasoning: str, text: str) -> list[tuple[str, dict]]:
        """What a piece of the answer (its thinking and text deltas) sends."""
        out = []
        if reasoning:
            if not self._reasoning_open:
                self._reasoning_open = True
                out.append(("response.output_item.added", {"type": "response.output_item.added",
                                                          "item": self._reasoning_item(False)}))
            self.reasoning += reasoning
            out.append(("response.reasoning_text.delta", {"type": "response.reasoning_text.delta",
                                                          "delta": reasoning, "item_id": self.reasoning_id}))
        if text:
            if not self._text_open:
                self._text_open = True
                out += [("response.output_item.added", {"type": "response.output_item.added",
                                                        "item": self._message_item(False)}),
                        ("response.content_part.added", {"type": "response.content_part.added",
                                                         "item_id": self.message_id,
                                                         "part": {"type": "output_text", "text": ""}})]
            self.text += text
            out.append(("response.output_text.delta", {"type": "response.output_text.delta",
                                                       "item_id": self.message_id, "delta": text}))
        return out

    def closing(self, finish_reason: str | None, stop_word: str | None, usage: tuple[int, int, int],
                timings: dict | None) -> list[tuple[str, dict]]:
        """The events after the last piece: each item done, then the whole response."""
        out = []
        if self.reasoning:
            item = {k: v for k, v in self._reasoning_item(True).items() if k != "status"}
            out.append(("response.output_item.done", {"type": "response.output_item.done", "item": item}))
        if self.text:
            out += [("response.output_text.done", {"type": "response.output_text.done", "item_id": self.message_id,
                                                   "text": self.text}),
                    ("response.content_part.done", {"type": "response.content_part.done",
                                                    "item_id": self.message_id, "part": self._part()}),
                    ("response.output_item.done", {"type": "response.output_item.done",
                                                   "item": self._message_item(True)})]
        whole = self.whole(finish_reason, stop_word, usage)
        whole.pop("completed_at")
        done = {"type": "response.completed", "response": whole}
        if timings is not None:
            done["timings"] = timings
        return out + [("response.completed", done)]


def sse_event(name: str, data: dict) -> bytes:
    """One server-sent event as llama-server writes the Responses stream's (``event:``, ``data:``)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
