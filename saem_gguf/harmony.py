"""gpt-oss's answers (OpenAI's harmony format) as llama-server parses them into ``reasoning_content``
and ``content``.

gpt-oss writes its answer as messages on channels: ``<|channel|>analysis<|message|>...<|end|>``
(its reasoning), then ``<|start|>assistant<|channel|>final<|message|>...`` (the answer), with
``<|channel|>commentary`` preambles between. llama-server recognises the format by its template
(one that mentions ``<|channel|>``: llama.cpp's ``common_chat_try_specialized_template``) and
parses the generation prompt (``<|start|>assistant``) followed by the generated text with the PEG
grammar of ``common/parsers/gpt-oss.cpp`` (the case without tools or a response format):

    root       <- (start any)* start (final / unsolicited)
    start      <- "<|start|>assistant"
    any        <- preamble / analysis
    analysis   <- stray "<|channel|>analysis<|message|>" REASONING(until "<|end|>") "<|end|>"
                  (reasoning_format none: CONTENT(that whole match))
    preamble   <- "<|channel|>commentary<|message|>" CONTENT(until "<|end|>") "<|end|>"
    final      <- stray "<|channel|>final<|message|>" CONTENT(until "<|end|>")
    unsolicited<- atomic(("<|channel|>" ("commentary" / "analysis"))? " to=" until "<|end|>" "<|end|>")
    stray      <- ("<|channel|>commentary" " to=assistant"?)?

with llama.cpp's PEG semantics (``common/peg-parser.cpp``), lenient as llama-server runs it: a
literal cut by the end of the text "needs more input", which ends a sequence there as a partial
success; ``until`` stops before its delimiter or before a start of it that the text ends with;
repetition stops at the end of the text; the captured texts concatenate in order; reasoning that
is whitespace alone is none. llama-server answers with what was captured, or, where nothing was
(no reasoning, no content), with the generated text as it came.

A stream reparses the text after each piece and sends what each part gained. Differences, on
purpose: text that does not parse at all (it does not begin with a channel) is answered here as
that text, whole or streamed at the end, where llama-server answers 500 ("The model produced
output that does not match the expected peg-native format"); where a later parse revises what a
stream has sent (malformed output; a stray ``<|channel|>commentary to=assistant`` header under
reasoning_format none, content until the next channel shows otherwise), llama-server's stream
fails ("Invalid diff") and this one sends nothing more for that part. tests/test_serve_reference.py
compares the rest with the stock llama-server; a final assistant message is continued in these
channels (``continuation_markup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHANNEL = "<|channel|>"
START, END, MESSAGE = "<|start|>assistant", "<|end|>", "<|message|>"
GENERATION_PROMPT = START  # what the template's generation prompt adds, parsed before the answer
ANALYSIS_START = CHANNEL + "analysis" + MESSAGE  # llama.cpp's thinking start tag for gpt-oss (END ends it)


def template_is_harmony(template: str) -> bool:
    """Whether llama-server parses a template's answers as gpt-oss's (it mentions ``<|channel|>``)."""
    return CHANNEL in template


# ---- a PEG interpreter with llama.cpp's semantics, for the one grammar above ----------------------

FAIL, SUCCESS, MORE = 0, 1, 2  # llama.cpp's FAIL, SUCCESS, NEED_MORE_INPUT


@dataclass
class _Result:
    kind: int
    end: int
    captures: list[tuple[str, str]] = field(default_factory=list)  # (tag, text) in order


class _Parser:
    def parse(self, text: str, at: int) -> _Result:
        raise NotImplementedError


@dataclass
class _Lit(_Parser):
    literal: str

    def parse(self, text: str, at: int) -> _Result:
        rest = text[at:at + len(self.literal)]
        if rest == self.literal:
            return _Result(SUCCESS, at + len(self.literal))
        if self.literal.startswith(rest):  # the text ends inside it (or at it)
            return _Result(MORE, len(text))
        return _Result(FAIL, at)


@dataclass
class _Seq(_Parser):
    parts: tuple[_Parser, ...]

    def parse(self, text: str, at: int) -> _Result:
        captures: list[tuple[str, str]] = []
        for part in self.parts:
            r = part.parse(text, at)
            if r.kind == FAIL:
                return _Result(FAIL, at)
            captures += r.captures
            if r.kind == MORE:
                return _Result(MORE, r.end, captures)
            at = r.end
        return _Result(SUCCESS, at, captures)


@dataclass
class _Choice(_Parser):
    options: tuple[_Parser, ...]

    def parse(self, text: str, at: int) -> _Result:
        for option in self.options:
            r = option.parse(text, at)
            if r.kind != FAIL:
                return r
        return _Result(FAIL, at)


@dataclass
class _Repeat(_Parser):
    child: _Parser
    most: int  # -1: no limit (llama.cpp's zero_or_more); 1: optional

    def parse(self, text: str, at: int) -> _Result:
        captures: list[tuple[str, str]] = []
        count = 0
        while self.most == -1 or count < self.most:
            if at >= len(text):
                break
            r = self.child.parse(text, at)
            if r.kind == SUCCESS and r.end > at:
                captures += r.captures
                at, count = r.end, count + 1
                continue
            if r.kind == MORE:
                return _Result(MORE, r.end, captures + r.captures)
            break
        return _Result(SUCCESS, at, captures)


@dataclass
class _Until(_Parser):
    delimiter: str

    def parse(self, text: str, at: int) -> _Result:
        found = text.find(self.delimiter, at)
        if found >= 0:
            return _Result(SUCCESS, found)
        for k in range(min(len(self.delimiter) - 1, len(text) - at), 0, -1):  # a start of it ends the text
            if text.endswith(self.delimiter[:k]):
                return _Result(SUCCESS, len(text) - k)
        return _Result(MORE, len(text))


@dataclass
class _Tag(_Parser):
    tag: str  # "reasoning" or "content"
    child: _Parser

    def parse(self, text: str, at: int) -> _Result:
        r = self.child.parse(text, at)
        if r.kind != FAIL:
            r.captures = r.captures + [(self.tag, text[at:r.end])]  # inner captures: none in this grammar
        return r


@dataclass
class _Atomic(_Parser):
    child: _Parser

    def parse(self, text: str, at: int) -> _Result:
        r = self.child.parse(text, at)
        if r.kind == MORE:
            r.captures = []
        return r


def _seq(*parts: _Parser | str) -> _Seq:
    return _Seq(tuple(_Lit(p) if isinstance(p, str) else p for p in parts))


def _optional(p: _Parser | str) -> _Repeat:
    return _Repeat(_Lit(p) if isinstance(p, str) else p, 1)


def _grammar(extract_reasoning: bool) -> _Parser:
    """``common_chat_params_init_gpt_oss``'s parser without tools or a response format."""
    content = _Until(END)
    stray = _optional(_seq(CHANNEL + "commentary", _optional(" to=assistant")))
    start_analysis = _seq(stray, ANALYSIS_START)
    if extract_reasoning:
        analysis = _seq(start_analysis, _Tag("reasoning", content), END)
    else:
        analysis = _Tag("content", _seq(start_analysis, content, END))
    preamble = _seq(CHANNEL + "commentary" + MESSAGE, _Tag("content", content), END)
    final = _seq(stray, CHANNEL + "final" + MESSAGE, _Tag("content", content))
    channel = _seq(CHANNEL, _Choice((_Lit("commentary"), _Lit("analysis"))))
    unsolicited = _Atomic(_seq(_optional(channel), " to=", content, END))
    return _seq(_Repeat(_seq(START, _Choice((preamble, analysis))), -1), START, _Choice((final, unsolicited)))


_GRAMMARS = {True: _grammar(True), False: _grammar(False)}


def parse(generated: str, extract_reasoning: bool) -> tuple[str, str] | None:
    """(reasoning, content) llama-server parses from an answer's text (empty where nothing was
    captured), or None where it does not parse (llama-server's error)."""
    r = _GRAMMARS[extract_reasoning].parse(GENERATION_PROMPT + generated, 0)
    if r.kind == FAIL:
        return None
    reasoning = "".join(t for tag, t in r.captures if tag == "reasoning")
    content = "".join(t for tag, t in r.captures if tag == "content")
    if not reasoning.strip(" \n\r\t"):  # whitespace alone: no reasoning (common_chat_peg_mapper)
        reasoning = ""
    return reasoning, content


def continuation_markup(reasoning: str, content: str | None) -> list[tuple[str, bool]]:
    """What follows the generation prompt where an answer continues a final assistant message
    (``common_chat_params_init_gpt_oss``'s prefill): its reasoning in the analysis channel, and,
    continuing its ``content`` (None: continuing the reasoning), the final channel opened on it.
    As (text, is markup) parts; llama-server always opens the analysis channel, empty or not."""
    parts = [(ANALYSIS_START, True), (reasoning, False)]
    if content is not None:
        parts += [(END + START + CHANNEL + "final" + MESSAGE, True), (content, False)]
    return parts


@dataclass
class HarmonyText:
    """One answer's split, whole (``whole``) or as it grows (``add``, in deltas): each piece
    reparses the text so far after ``prefix`` (a continued message's markup,
    ``continuation_markup``), as llama-server's stream does, and sends what each part gained; what
    parses to nothing yet is held back, and sent as it came at the end where nothing is ever
    captured, so that the deltas add up to the whole. Where a later parse no longer extends what
    was sent (output that stops parsing after a part was captured), nothing more is sent for that
    part, as llama-server's stream sends nothing it cannot append. ``hide_prefix``: a stream leaves
    out what ``prefix`` alone parses to (llama-server's continuation asked for without echo)."""

    extract_reasoning: bool
    prefix: str = ""
    hide_prefix: bool = False
    text: str = ""
    sent: tuple[str, str] = ("", "")  # (reasoning, content) the deltas so far add up to

    def __post_init__(self) -> None:
        if self.hide_prefix:
            self.sent = parse(self.prefix, self.extract_reasoning) or ("", "")

    def whole(self, generated: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of the answer whose generated text is ``generated``: the
        text as it came where nothing was captured or it does not parse (see the module's note)."""
        parsed = parse(self.prefix + generated, self.extract_reasoning)
        if parsed is None or parsed == ("", ""):
            return None, generated
        reasoning, content = parsed
        return reasoning or None, content

    def add(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) that ``piece`` releases."""
        self.text += piece
        if final:
            reasoning, content = self.whole(self.text)
            now = (reasoning or "", content)
        else:
            now = parse(self.prefix + self.text, self.extract_reasoning) or ("", "")
        deltas = tuple(new[len(old):] if new.startswith(old) else "" for old, new in zip(self.sent, now))
        self.sent = (self.sent[0] + deltas[0], self.sent[1] + deltas[1])
        return deltas
