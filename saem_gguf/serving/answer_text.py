"""A chat answer's text as llama-server tells it: what llama-server's chat parser makes of the
part of the prompt that the answer continues, followed by the generated text (its
``common_chat_parse`` of the generation prompt and the output). The parts, each the rule of its
module:

* the thinking apart (serving.reasoning, ``--reasoning-format``), its start where the prompt
  left a thinking block open (the generation prompt opened it, or a continued reasoning);
* a continued final message (serving.prefill): continuing its content, the answer's reasoning is
  the message's and its content starts with the message's (unsplit: the whole
  ``<think>...</think>content`` markup the prompt ends with); continuing its reasoning, the
  reasoning starts with the message's;
* a schema's JSON alone (serving.output_format);
* under gpt-oss's template, its channels (saem_gguf.harmony) in place of the thinking block.

A stream sends the continued text with the first piece, as llama-server does, except where the
request asked for the continuation itself (``continue_final_message``) and not for ``echo``: then
llama-server's stream starts from the continued message (its ``is_continuation``) and sends only
what is generated, while the whole answer still holds it.
"""

from __future__ import annotations

from saem_gguf.harmony import HarmonyText
from saem_gguf.serving.output_format import JsonAnswer, json_answer_text
from saem_gguf.serving.prefill import Continuation
from saem_gguf.serving.reasoning import Reasoning, split_reasoning
from saem_gguf.thinking import THINK_CLOSE, THINK_OPEN


class ChatText:
    """One answer's text, streamed (``add``, piece by piece) or whole (``whole``)."""

    def __init__(self, split: bool, reasons: bool, opened: str | None, continued: Continuation | None,
                 hide_continued: bool, json_answer: bool, harmony: bool = False) -> None:
        """``split``: the reasoning format splits; ``reasons``: the template has a thinking block;
        ``opened``: the reasoning the prompt has begun (prefill.opened_reasoning), None where no
        block is open; ``continued``: the final message continued; ``hide_continued``: a stream
        leaves the continued text out; ``json_answer``: the content is a schema's JSON;
        ``harmony``: the template is gpt-oss's (its answers parsed by channel, a continued message's
        markup first)."""
        self._thinking: Reasoning | HarmonyText | None = None
        reasoning, content = "", ""  # what the answer starts with, before anything generated
        if harmony:  # the continued message is part of what is parsed
            markup = "" if continued is None else "".join(text for text, _ in continued.harmony_markup())
            self._thinking = HarmonyText(split, markup, hide_continued)
            hide_continued = False
        elif continued is not None and continued.part == "content":
            if reasons and split:
                reasoning, content = continued.reasoning, continued.content
            elif reasons:
                content = THINK_OPEN + continued.reasoning + THINK_CLOSE + continued.content
            else:
                content = continued.content
        elif split:
            self._thinking = Reasoning(opened)
        elif reasons and opened is not None:
            content = THINK_OPEN + opened
        self._start = (reasoning, content)
        self._pending: tuple[str, str] | None = (reasoning, content)
        hidden_reasoning = len(opened) if self._thinking is not None and continued is not None and opened else 0
        self._hidden = [hidden_reasoning + len(reasoning), len(content)] if hide_continued else [0, 0]
        self._json = JsonAnswer() if json_answer else None

    def add(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) a stream sends for ``piece``."""
        reasoning = ""
        if self._thinking is not None:
            reasoning, piece = self._thinking.add(piece, final)
        if self._pending is not None and (piece or reasoning or final):
            (r0, c0), self._pending = self._pending, None
            reasoning, piece = r0 + reasoning, c0 + piece
        if self._json is not None:
            piece = self._json.add(piece, final)
        return self._shown(0, reasoning), self._shown(1, piece)

    def _shown(self, part: int, delta: str) -> str:
        cut = min(len(delta), self._hidden[part])
        self._hidden[part] -= cut
        return delta[cut:]

    def whole(self, generated: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of the whole answer."""
        reasoning, content = self._start
        if isinstance(self._thinking, HarmonyText):
            split, generated = self._thinking.whole(generated)
            reasoning += split or ""
        elif self._thinking is not None:
            split, generated = split_reasoning(generated, self._thinking.prefix)
            reasoning += split or ""
        content += generated
        if self._json is not None:
            content = json_answer_text(content)
        return reasoning or None, content
