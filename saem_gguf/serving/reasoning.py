"""Thinking apart from the answer in chat responses: llama-server's ``--reasoning-format``.

llama-server returns a reasoning model's ``<think>...</think>`` as ``message.reasoning_content``
and the rest as ``content`` (its default; ``none`` leaves both in ``content``). It decides per
chat template by its own analysis of the template; the rule here matches what the stock build
does on the templates tested (tests/test_serve_reference.py runs it):

* a template that mentions ``</think>`` is a reasoning template; others get no split (``auto``);
* output that starts (after whitespace) with ``<think>`` is reasoning up to the first
  ``</think>``, the rest is content; without ``</think>`` all of it is reasoning;
* where the generation prompt itself ends inside ``<think>`` (thinking forced open), the
  reasoning starts with the prompt's text after ``<think>``;
* both parts are kept verbatim (not stripped); a reasoning part that is only whitespace is
  no reasoning (the key is left out);
* an answer that splits into neither (``<think>`` alone, ``<think>\n</think>``, whitespace under
  a template that opened the block) is its text, verbatim, as content: llama-server's whole
  answer falls back so on an empty parse. Its stream sends nothing there; this stream sends the
  text at the end, so that a streamed answer and a whole one agree.

``Reasoning`` splits a text that grows token by token, so a stream sends the same split in
deltas: a possible start of ``<think>`` or end ``</think>`` is held back until it is decided, and
so is whitespace-only reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from saem_gguf.harmony import template_is_harmony
from saem_gguf.thinking import THINK_CLOSE, THINK_OPEN, template_reasons

FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")


def splits(reasoning_format: str, template: str) -> bool:
    """Whether responses are split under ``reasoning_format`` (llama-server's names; its
    ``deepseek-legacy`` gave the same split as ``deepseek`` on the stock build); gpt-oss's
    template always reasons (saem_gguf.harmony)."""
    if reasoning_format == "none":
        return False
    return reasoning_format != "auto" or template_reasons(template) or template_is_harmony(template)


@dataclass
class Reasoning:
    """The split of one response's text, fed piece by piece (``add``) and finished (``end``)."""

    prefix: str | None = None  # forced_open_prefix of the prompt
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def _parts(self, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far, holding back what is not decided yet."""
        if self.prefix is not None:
            body = self.prefix + self.text
        else:
            head = self.text.lstrip()
            if not head.startswith(THINK_OPEN):
                if not final and THINK_OPEN.startswith(head):  # "", "<th": may still open a block
                    return "", ""
                return "", self.text
            body = head[len(THINK_OPEN):]
        end = body.find(THINK_CLOSE)
        if end >= 0:
            return body[:end], body[end + len(THINK_CLOSE):]
        if not final:
            body = body[:len(body) - _partial_suffix(body, THINK_CLOSE)]
        return body, ""

    def add(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) that ``piece`` releases."""
        self.text += piece
        reasoning, content = self._parts(final)
        if not reasoning.strip():  # whitespace alone may yet be no reasoning at all
            reasoning = ""
        if final and not reasoning and not content and not self.sent_content:
            content = self.text  # nothing parsed: the text as it came (sent_reasoning is 0 here)
        r = reasoning[self.sent_reasoning:]
        c = content[self.sent_content:]
        self.sent_reasoning += len(r)
        self.sent_content += len(c)
        return r, c

    def end(self) -> tuple[str, str]:
        return self.add("", final=True)


def split_reasoning(text: str, prefix: str | None = None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole response."""
    r = Reasoning(prefix)
    reasoning, content = r.add(text, final=True)
    return reasoning or None, content


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
