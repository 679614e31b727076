"""Byte-level BPE, trained on our corpus, that tokenizes exactly as llama.cpp's "qwen2" BPE does.

llama.cpp (``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre = "qwen2"``) splits text at
special tokens, pre-tokenizes each fragment with Qwen2's regex, maps bytes to GPT-2's printable
unicode alphabet, and then merges adjacent symbols by merge rank (lowest first, leftmost on
ties). This module trains merges with the same pre-tokenizer and encodes the same way, so the
ids used in training are the ids llama.cpp produces from the same text (tests check it).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

try:  # the exact Qwen2 regex needs \p{..} classes
    import regex as _re

    QWEN2_PATTERN = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
except ImportError:  # stdlib fallback: identical on ASCII text (our corpus), approximate beyond
    import re as _re

    _L, _N = r"[^\W\d_]", r"\d"
    QWEN2_PATTERN = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                     rf"|(?:(?!{_L}|{_N})[^\r\n])?{_L}+|{_N}| ?(?:(?!{_L}|{_N})[^\s])+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE = _re.compile(QWEN2_PATTERN)

# (text, llama token type), as saem_gguf.testmodels.vocab.SPECIAL_TOKENS: CONTROL (3) tokens are
# not rendered as text, USER_DEFINED (4) are (the stage detector sees "</think>").
SPECIAL_TOKENS = (("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4),
                  ("</think>", 4))


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def pretokenize(text: str) -> list[str]:
    """Qwen2 pre-tokenization of one fragment (no special tokens), as byte-mapped strings."""
    enc = bytes_to_unicode()
    return ["".join(enc[b] for b in w.encode("utf-8")) for w in _PRE.findall(text)]


def _split_special(text: str, specials: tuple[str, ...]) -> list[tuple[str, bool]]:
    """[(fragment, is_special)], longest special first at each position."""
    out, i, start = [], 0, 0
    order = sorted(specials, key=len, reverse=True)
    while i < len(text):
        for s in order:
            if text.startswith(s, i):
                if start < i:
                    out.append((text[start:i], False))
                out.append((s, True))
                i += len(s)
                start = i
                break
        else:
            i += 1
    if start < len(text):
        out.append((text[start:], False))
    return out


@dataclass
class Tokenizer:
    tokens: list[str]  # id -> token string (byte-mapped); specials and padding at the end
    merges: list[str]  # "a b", in rank order
    token_types: list[int]

    def __post_init__(self) -> None:
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(self.merges)}
        self.specials = tuple(t for t, ty in zip(self.tokens, self.token_types) if ty in (3, 4))
        self._cache: dict[str, list[int]] = {}
        dec = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes = [t.encode("utf-8") if ty in (3, 4, 5) else bytes(dec[c] for c in t)
                       for t, ty in zip(self.tokens, self.token_types)]

    # -- encoding ---------------------------------------------------------------------------
    def _bpe(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        syms = list(word)
        while len(syms) > 1:
            best, best_i = None, -1
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            syms[best_i:best_i + 2] = [syms[best_i] + syms[best_i + 1]]
        ids = []
        for s in syms:
            if s in self.ids:
                ids.append(self.ids[s])
            else:  # not a token: its bytes (never happens for merge results)
                ids.extend(self.ids[c] for c in s)
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for frag, special in _split_special(text, self.specials):
            if special:
                out.append(self.ids[frag])
            else:
                for w in pretokenize(frag):
                    out.extend(self._bpe(w))
        return out

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._bytes[i] for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def piece(self, i: int) -> bytes:
        return self._bytes[i]

    def id_of(self, text: str) -> int:
        return self.ids[text]

    @property
    def size(self) -> int:
        return len(self.tokens)

    # -- conversion -------------------------------------------------------------------------
    def to_vocab(self):
        from saem_gguf.testmodels.vocab import Vocab

        return Vocab(tuple(self.tokens), tuple(self.token_types), tuple(self.merges),
                     eos_id=self.ids["<|im_end|>"], im_start_id=self.ids["<|im_start|>"],
                     im_end_id=self.ids["<|im_end|>"])

    def to_json(self) -> str:
        return json.dumps({"tokens": self.tokens, "merges": self.merges, "token_types": self.token_types},
                          ensure_ascii=False)

    @classmethod
    def from_json(cls, s: str) -> Tokenizer:
        d = json.loads(s)
        return cls(list(d["tokens"]), list(d["merges"]), list(d["token_types"]))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from gguf import GGUFReader

        r = GGUFReader(path)
        return cls(list(r.fields["tokenizer.ggml.tokens"].contents()),
                   list(r.fields["tokenizer.ggml.merges"].contents()),
                   [int(x) for x in r.fields["tokenizer.ggml.token_type"].contents()])


def train_bpe(texts, vocab_size: int = 1024, min_frequency: int = 2,
              specials=SPECIAL_TOKENS, pad_to: int = 64) -> Tokenizer:
    """Train byte-level BPE merges on ``texts`` until 256 bytes + merges + specials reach
    ``vocab_size`` (or no pair occurs ``min_frequency`` times); pad the vocabulary to a multiple
    of ``pad_to`` with unused tokens. Deterministic: ties go to the lexicographically smallest pair."""
    special_texts = tuple(t for t, _ in specials)
    words: Counter[str] = Counter()
    for text in texts:
        for frag, special in _split_special(text, special_texts):
            if not special:
                words.update(pretokenize(frag))
    enc = bytes_to_unicode()
    tokens = [enc[b] for b in sorted(enc, key=lambda b: ord(enc[b]))]  # same order as Qwen2's head
    have = set(tokens)
    seqs = {w: list(w) for w in words}
    merges: list[str] = []
    n_merges = vocab_size - len(tokens) - len(specials)
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, syms in seqs.items():
            c = words[w]
            for i in range(len(syms) - 1):
                pairs[(syms[i], syms[i + 1])] += c
        if not pairs:
            break
        top = max(pairs.values())
        if top < min_frequency:
            break
        a, b = min(p for p, c in pairs.items() if c == top)
        merges.append(f"{a} {b}")
        if a + b not in have:
            tokens.append(a + b)
            have.add(a + b)
        for w, syms in seqs.items():
            i, out = 0, []
            while i < len(syms):
                if i < len(syms) - 1 and syms[i] == a and syms[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            seqs[w] = out
    types = [1] * len(tokens)
    for t, ty in specials:
        tokens.append(t)
        types.append(ty)
    while len(tokens) % pad_to:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # UNUSED
    return Tokenizer(tokens, merges, types)
