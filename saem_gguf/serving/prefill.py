"""How a chat's prompt ends, as llama-server decides it (tools/server/server-common.cpp
``oaicompat_chat_params_parse``, common/chat.cpp): with the assistant's header (the generation
prompt; ``add_generation_prompt``, true by default), or continuing the final message
(``continue_final_message``: ``true``, ``"content"`` or ``"reasoning_content"``; and, unless
``--no-prefill-assistant``, a final assistant message is continued unasked: llama-server's
assistant prefill, what clients send to continue a cut answer or to start the answer with given
text). Asking for both is a 400, as there; so are two assistant messages at the end.

A continued message: llama-server renders the messages before it with the generation prompt,
and where the template has a thinking block (common/chat-auto-parser-generator.cpp) cuts a
block the generation prompt opened and appends ``<think>``, the message's ``reasoning_content``
and then, continuing the content, ``</think>`` and the content; continuing the reasoning (its
``reasoning_content`` alone, or ``"reasoning_content"`` asked), the block stays open. The
answer's content starts with the continued content (streamed, with the first piece), its
reasoning with the continued reasoning. gpt-oss's template (saem_gguf.harmony) continues in its
channels instead: the analysis channel with the message's reasoning, then, continuing the
content, the final channel with it. Here the prompt is built the same way, but the texts are
tokenized as plain text, like every message's: llama-server parses them, so ``<|im_end|>`` in
one would end the turn there.

Unlike llama-server, a final message with neither content nor reasoning starts the answer as
usual (llama-server then leaves out even the assistant's header).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from saem_gguf.engine import ChatPrompt
from saem_gguf.harmony import continuation_markup, template_is_harmony
from saem_gguf.serving.protocol import bad_request
from saem_gguf.thinking import THINK_CLOSE, THINK_OPEN, forced_open_prefix, template_reasons

CONTINUATIONS = {"content": "content", "reasoning_content": "reasoning"}  # continue_final_message's names


@dataclass(frozen=True)
class Continuation:
    """The final message a chat's answer continues."""

    content: str
    reasoning: str  # its reasoning_content ("" where none)
    part: Literal["content", "reasoning"]  # which of them the answer continues


    def harmony_markup(self) -> list[tuple[str, bool]]:
        """The message in gpt-oss's channels (harmony.continuation_markup), as (text, is markup)."""
        return continuation_markup(self.reasoning, self.content if self.part == "content" else None)


@dataclass(frozen=True)
class ChatEnd:
    continuation: Continuation | None  # the final message continued (then left out of the rendered messages)
    generation_prompt: bool  # otherwise: whether the prompt ends with the assistant's header


def _asked_part(continue_final_message: bool | str | None) -> str | None:
    """What ``continue_final_message`` asks to continue (llama.cpp's common_chat_continuation_parse:
    true, "content", "reasoning_content"; anything else asks nothing)."""
    asked = continue_final_message
    return "auto" if asked is True else CONTINUATIONS.get(asked) if isinstance(asked, str) else None


def asks_continuation(continue_final_message: bool | str | None) -> bool:
    return _asked_part(continue_final_message) is not None


def chat_end(messages: list[dict], continue_final_message: bool | str | None, add_generation_prompt: bool | None,
             prefill_assistant: bool) -> ChatEnd:
    """How the prompt of ``messages`` (``message_dicts``) ends, by llama-server's rules."""
    part = _asked_part(continue_final_message)
    header = add_generation_prompt is not False
    if part is None and prefill_assistant and messages and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise bad_request("Cannot have 2 or more assistant messages at the end of the list.", "messages")
        part, header = "auto", False
    if part is None:
        return ChatEnd(None, header)
    if header:
        raise bad_request("Cannot set both add_generation_prompt and continue_final_message to true.",
                          "continue_final_message")
    content, reasoning = messages[-1]["content"], messages[-1].get("reasoning_content", "")
    if not content and not reasoning:  # answered anew (see the module's note)
        return ChatEnd(None, True)
    if part == "auto":
        part = "reasoning" if reasoning and not content else "content"
    return ChatEnd(Continuation(content, reasoning, part), False)


@dataclass(frozen=True)
class Continued:
    tokens: list[int]
    text: str


def continued(prompt: ChatPrompt, message: Continuation, template: str,
              tokenize: Callable[[str, bool], list[int]]) -> Continued:
    """``prompt`` (the messages before the final one, with the generation prompt) continued by
    ``message``; ``tokenize(text, parse_special)``."""
    tokens, text = list(prompt.tokens), prompt.text
    if template_is_harmony(template):  # gpt-oss's channels after its header (saem_gguf.harmony)
        parts = message.harmony_markup()
    elif template_reasons(template):
        opened = forced_open_prefix(text)
        if opened is not None:  # llama-server cuts the generation prompt before its <think>
            tail = tokenize(THINK_OPEN + opened, True)
            if tokens[-len(tail):] == tail:
                tokens, text = tokens[:-len(tail)], text[:-len(THINK_OPEN + opened)]
        parts = [(THINK_OPEN, True), (message.reasoning, False)]
        if message.part == "content":
            parts += [(THINK_CLOSE, True), (message.content, False)]
    else:  # no thinking block to continue in
        parts = [(message.content, False)] if message.part == "content" else []
    for piece, special in _joined(parts):
        tokens += tokenize(piece, special)
        text += piece
    return Continued(tokens, text)


def _joined(parts: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The non-empty parts, neighbours of one kind joined (``<think></think>`` is one markup)."""
    out: list[tuple[str, bool]] = []
    for piece, special in parts:
        if not piece:
            continue
        if out and out[-1][1] == special:
            out[-1] = (out[-1][0] + piece, special)
        else:
            out.append((piece, special))
    return out


def opened_reasoning(chat_text: str | None, message: Continuation | None, template: str) -> str | None:
    """The reasoning the prompt has begun (an answer's reasoning starts with it), or None where
    the prompt leaves no thinking block open: a continued reasoning's, or the block the
    generation prompt opened (``forced_open_prefix``)."""
    if message is not None and message.part == "reasoning" and template_reasons(template):
        return message.reasoning
    return forced_open_prefix(chat_text) if chat_text is not None else None
