"""A chat whose last message is the assistant's is continued, not answered anew: llama-server's
assistant prefill (its default; ``--no-prefill-assistant`` turns it off there). What clients send
to continue a cut answer ("continue" in chat front ends) or to start the answer with given text.

llama-server renders the messages before it with the generation prompt, closes the thinking
block where the template has one (``<think></think>``: common/chat-auto-parser-generator.cpp,
cutting a block the generation prompt opened), and appends the message's content; the answer's
content is that text followed by what is generated (streamed, the text comes with the first
piece). Here the prompt is built the same way, but the content is tokenized as plain text, like
every message's: llama-server parses it, so ``<|im_end|>`` in it would end the turn there.

Unlike llama-server, an empty final assistant message starts the answer as usual (llama-server
then leaves out even the assistant's header), and ``reasoning_content`` is not taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from saem_gguf.engine import ChatPrompt
from saem_gguf.serving.protocol import bad_request
from saem_gguf.thinking import THINK_CLOSE, THINK_OPEN, forced_open_prefix, template_reasons


def prefill_of(messages: list[dict]) -> str | None:
    """The text an answer continues (the final assistant message's), or None; two assistant
    messages at the end are a 400, as in llama-server."""
    if not messages or messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
        return None
    if len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise bad_request("Cannot have 2 or more assistant messages at the end of the list.", "messages")
    return messages[-1]["content"]


@dataclass(frozen=True)
class Continued:
    tokens: list[int]
    text: str


def continued(prompt: ChatPrompt, prefill: str, template: str,
              tokenize: Callable[[str, bool], list[int]]) -> Continued:
    """``prompt`` (the messages before the final one, with the generation prompt) continued by
    ``prefill``; ``tokenize(text, parse_special)``."""
    tokens, text = list(prompt.tokens), prompt.text
    if template_reasons(template):
        opened = forced_open_prefix(text)
        if opened is not None:  # llama-server cuts the generation prompt before its <think>
            tail = tokenize(THINK_OPEN + opened, True)
            if tokens[-len(tail):] == tail:
                tokens, text = tokens[:-len(tail)], text[:-len(THINK_OPEN + opened)]
        markup = THINK_OPEN + THINK_CLOSE
        tokens += tokenize(markup, True)
        text += markup
    return Continued(tokens + tokenize(prefill, False), text + prefill)
