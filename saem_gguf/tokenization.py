"""Chat prompts tokenized so that message content can never become control tokens.

llama.cpp tokenizes a rendered chat prompt with ``parse_special``: every special token's text is
cut out as that token wherever it occurs, also inside what a user wrote, so a message containing
``<|im_end|>\\n<|im_start|>system`` closes its turn and opens a system turn (llama-cpp-python does the
same). Here the template's own markup is parsed exactly as llama.cpp does
(``llama_vocab::impl::tokenizer_st_partition``: special tokens, longest first, cut raw-text
fragments; each fragment is then tokenized as plain text), while special-token text inside message
content stays plain text. Content without special-token text gives exactly llama.cpp's tokens.

llama.cpp also cuts user-defined tokens (``<think>`` in Qwen3) out of text without
``parse_special``; inside message content such text is split before its last character instead,
so it reaches the model as the characters it is, not as the token. Not mirrored: the LSTRIP/RSTRIP
token attributes (a few models' tokenizers eat the spaces beside some special tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from saem_gguf.errors import SaemError

# the attributes of the tokens llama.cpp partitions text at (its cache_special_tokens)
ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED = 1 << 0, 1 << 3, 1 << 4

Tokenize = Callable[[bytes], list[int]]  # plain text -> tokens, no special parsing, no BOS


@dataclass(frozen=True)
class SpecialTokens:
    """The vocabulary's special tokens, longest text first (llama.cpp's partition order)."""

    texts: tuple[bytes, ...]
    ids: tuple[int, ...]
    user_defined: frozenset[bytes]  # the ones llama.cpp cuts out even of plain text

    @classmethod
    def of(cls, llama_cpp, vocab, n_vocab: int) -> SpecialTokens:
        rows = []
        for tid in range(n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(vocab, tid))
            if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                text = llama_cpp.llama_vocab_get_text(vocab, tid) or b""
                if text:
                    rows.append((text, tid, bool(attr & ATTR_USER_DEFINED)))
        # longest first, as llama.cpp: a longer token wins over one that is a part of it
        rows.sort(key=lambda r: -len(r[0]))
        return cls(tuple(r[0] for r in rows), tuple(r[1] for r in rows),
                   frozenset(r[0] for r in rows if r[2]))

    def first_in(self, text: bytes) -> bytes | None:
        return next((t for t in self.texts if t in text), None)


class MessageText(NamedTuple):
    text: str
    may_be_left_out: bool = False  # a template may leave it out (an earlier turn's reasoning)


def content_strings(messages: Sequence[dict]) -> list[MessageText]:
    """The user-supplied text of chat messages, in order: an assistant turn's ``reasoning_content``
    (templates that show it put it before the content), string contents and text parts."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            out.append(MessageText(m["reasoning_content"], True))
        c = m.get("content")
        if isinstance(c, str):
            out.append(MessageText(c))
        elif isinstance(c, list):
            out += [MessageText(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return out


def protected_spans(prompt: bytes, contents: Sequence[MessageText], specials: SpecialTokens) -> list[tuple[int, int]]:
    """Byte ranges of ``prompt`` holding message contents that contain special-token text.

    Contents are found in message order, each after the previous one; a template that trims
    content is covered by also looking for the stripped text, and one that keeps only the text
    after an earlier reply's reasoning (Qwen3's) by looking for that text (``reasoning_kept``)."""
    spans = []
    cursor = 0
    for content, may_be_left_out in contents:
        raw = content.encode("utf-8")
        risky = specials.first_in(raw)
        found = -1
        for candidate in (raw, raw.strip()):
            if candidate:
                found = prompt.find(candidate, cursor)
                if found >= 0:
                    raw = candidate
                    break
        if found < 0 and may_be_left_out:  # not in the prompt: nothing of it to protect
            continue
        if found < 0:
            kept = reasoning_kept(raw, specials)
            at = -1 if kept is None else prompt.find(kept, cursor)
            if at >= 0:  # only the plain text after the reasoning is in the prompt: nothing to protect
                cursor = at + len(kept)
                continue
            if risky is not None:
                raise SaemError(f"the chat template rewrote a message containing {risky.decode(errors='replace')!r}; "
                                "it cannot be kept literal, so it is not sent")
            continue
        if risky is not None:
            spans.append((found, found + len(raw)))
        cursor = found + len(raw)
    return spans


def reasoning_kept(content: bytes, specials: SpecialTokens) -> bytes | None:
    """What a reasoning model's template keeps of an earlier assistant message: Qwen3's renders
    only the text after the message's last ``</think>``, leading newlines stripped. Here: the text
    after the last special-token text in ``content``, when every special-token text in it is a
    user-defined token (``<think>``, ``</think>``), so the kept text holds none. None otherwise: a
    message with control-token text (``<|im_end|>``) must be found whole, or it is refused."""
    last_end = -1
    for text in specials.texts:
        at = content.rfind(text)
        if at >= 0:
            if text not in specials.user_defined:
                return None
            last_end = max(last_end, at + len(text))
    if last_end < 0:
        return None
    kept = content[last_end:].lstrip(b"\n")
    return None if specials.first_in(kept) is not None else kept


def tokenize_protected(prompt: bytes, spans: Sequence[tuple[int, int]], specials: SpecialTokens,
                       tokenize_plain: Tokenize) -> list[int]:
    """llama.cpp's ``parse_special`` tokenization of ``prompt``, except that no special token is cut
    out of the byte ranges ``spans`` (message contents)."""

    def protected(a: int, b: int) -> bool:
        return any(a < e and s < b for s, e in spans)

    # fragments: ("raw", start, end) or ("tok", id), refined by each special token in turn
    frags: list[tuple] = [("raw", 0, len(prompt))]
    for text, tid in zip(specials.texts, specials.ids):
        out: list[tuple] = []
        for f in frags:
            if f[0] != "raw":
                out.append(f)
                continue
            _, start, end = f
            pos = start
            while True:
                m = prompt.find(text, pos, end)
                while m >= 0 and protected(m, m + len(text)):
                    m = prompt.find(text, m + 1, end)
                if m < 0:
                    break
                if m > start:
                    out.append(("raw", start, m))
                out.append(("tok", tid))
                start = pos = m + len(text)
            if start < end:
                out.append(("raw", start, end))
        frags = out
    tokens: list[int] = []
    for f in frags:
        if f[0] == "tok":
            tokens.append(f[1])
        else:
            tokens += _plain(prompt, f[1], f[2], spans, specials, tokenize_plain)
    return tokens


def _plain(prompt: bytes, start: int, end: int, spans: Sequence[tuple[int, int]],
           specials: SpecialTokens, tokenize_plain: Tokenize) -> list[int]:
    """Tokens of a raw fragment; user-defined token text inside a protected span is split before
    its last character so that plain tokenization does not turn it into the token."""
    cuts = []
    for s, e in spans:
        lo, hi = max(s, start), min(e, end)
        for text in specials.user_defined:
            m = prompt.find(text, lo, hi)
            while m >= 0 and m + len(text) <= hi:
                cut = m + len(text) - 1
                while cut > m and (prompt[cut] & 0xC0) == 0x80:  # not inside a UTF-8 character
                    cut -= 1
                cuts.append(cut)
                m = prompt.find(text, m + 1, hi)
    if not cuts:
        return tokenize_plain(prompt[start:end])
    tokens: list[int] = []
    prev = start
    for c in sorted(set(cuts)):
        tokens += tokenize_plain(prompt[prev:c]) if c > prev else []
        prev = c
    return tokens + tokenize_plain(prompt[prev:end])
