"""The thinking split of chat answers (serving.reasoning), whole and streamed: a streamed answer,
cut into pieces anywhere, sends exactly the whole answer's split. The split itself is compared
with stock llama-server in tests/test_serve_reference.py."""

from __future__ import annotations

import random

import pytest

from saem_gguf.serving.reasoning import Reasoning, split_reasoning

TEXTS = ["<think>abc</think>def", " <think>abc</think>def", "xyz<think>abc</think>def", "abc</think>def",
         "<think>abc", "<think></think>def", "<think>\n\n</think>\n\ndef", "<think>a</think>b</think>c",
         "<think>", "<think>\n", " <think> ", "<think>\n </think>", "<th", "\n", " ", "", "</think>", "plain answer"]


def _streamed(text: str, prefix: str | None, cuts: list[int]) -> tuple[str, str]:
    r, reasoning, content = Reasoning(prefix), "", ""
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        dr, dc = r.add(text[a:b])
        reasoning, content = reasoning + dr, content + dc
    dr, dc = r.end()
    return reasoning + dr, content + dc


@pytest.mark.parametrize("prefix", [None, "\n"], ids=["plain", "opened-by-the-template"])
@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_sends_the_whole_split(text, prefix):
    reasoning, content = split_reasoning(text, prefix)
    rng = random.Random(len(text))
    cuts = [[], list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), k)) for k in (1, 2, 3)
                                             if len(text) > k]
    for c in cuts:
        assert _streamed(text, prefix, c) == (reasoning or "", content), c


@pytest.mark.parametrize("text, prefix", [("<think>", None), ("<think>\n", None), (" <think>", None),
                                          ("<think>\n </think>", None), ("\n", "\n"), ("</think>", "\n")])
def test_an_answer_that_splits_into_nothing_is_its_text(text, prefix):
    """As llama-server's whole answer falls back on an empty parse (its stream sends nothing)."""
    assert split_reasoning(text, prefix) == (None, text)


def test_a_split_keeps_its_parts_verbatim():
    assert split_reasoning("<think>\nabc\n</think>\n\ndef") == ("\nabc\n", "\n\ndef")
    assert split_reasoning("<think>\n\n</think>\n\ndef") == (None, "\n\ndef")
    assert split_reasoning("x", "\n") == ("\nx", "")
