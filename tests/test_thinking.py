"""The reasoning budget's state machine (saem_gguf.thinking) on token streams written out by hand:
llama.cpp's common/reasoning-budget.cpp rules one by one. Its tokens against the stock server's
are in tests/test_serve_reference.py."""

from __future__ import annotations

import pytest

from saem_gguf.thinking import (
    BudgetState, ReasoningBudget, _Matcher, forced_open_prefix, open_block_tokens, template_reasons, utf8_complete,
)

START, END, MSG = 100, 101, 102  # <think>, </think>, a one-token message
PIECES = {7: "é".encode()[:1], 8: "é".encode()[1:]}  # a character split over two tokens


def piece(token: int) -> bytes:
    return PIECES.get(token, b"x")


def run(budget: ReasoningBudget, stream: list[int]) -> list[int]:
    """Feed ``stream``; where the budget forces a token, that token replaces the stream's next one
    (as the sampler would pick it). Returns the tokens accepted."""
    out, rest = [], list(stream)
    while rest or budget.forced() is not None:
        forced = budget.forced()
        tok = forced if forced is not None else rest.pop(0)
        budget.accept(tok)
        out.append(tok)
    return out


def test_idle_until_the_start_tag_then_the_budget_then_the_end_is_forced():
    b = ReasoningBudget([START], [END], [END], 3, piece)
    assert run(b, [1, 2, START, 3, 4, 5, 6, 7]) == [1, 2, START, 3, 4, 5, END, 6, 7]
    assert b.state == BudgetState.DONE


def test_a_block_that_ends_within_the_budget_is_left_alone():
    b = ReasoningBudget([START], [END], [END], 5, piece)
    assert run(b, [START, 3, END, 4, 5, 6, 1, 2]) == [START, 3, END, 4, 5, 6, 1, 2]


def test_budget_zero_forces_the_end_at_once_and_the_message_comes_first():
    b = ReasoningBudget([START], [END], [MSG, END], 0, piece)
    assert run(b, [START, 3, 4]) == [START, MSG, END, 3, 4]


def test_a_character_split_over_tokens_is_finished_before_the_end_is_forced():
    """The budget runs out on 7 (é's lead byte): it waits for a token whose own piece ends on a
    whole character. llama.cpp looks at each token's piece alone, so 8 (é's last byte, alone a
    stray continuation byte) does not end the wait; 4 does."""
    b = ReasoningBudget([START], [END], [END], 2, piece)
    assert run(b, [START, 3, 7, 8, 4, 5]) == [START, 3, 7, 8, 4, END, 5]
    assert b.state == BudgetState.DONE


def test_a_new_block_after_the_end_gets_a_new_budget():
    b = ReasoningBudget([START], [END], [END], 1, piece)
    assert run(b, [START, 3, 4, START, 5, 6]) == [START, 3, END, 4, START, 5, END, 6]


def test_multi_token_tags_are_matched_across_tokens_from_the_last_match_on():
    b = ReasoningBudget([1, 2], [3, 4], [3, 4], 10, piece)
    assert run(b, [1, 5, 2, 1, 2, 3, 9, 3, 4]) == [1, 5, 2, 1, 2, 3, 9, 3, 4]
    assert b.state == BudgetState.DONE and b.remaining == 10 - 3  # 3, 9, 3 counted; 4 ended it
    m = _Matcher([[1, 2], [2], [1, 2]])
    assert m.seqs == [(1, 2), (2,)] and [m.advance(t) for t in (1, 2, 2, 3)] == [-1, 0, 1, -1]


@pytest.mark.parametrize("text,complete", [
    (b"", True), (b"a", True), ("é".encode(), True), ("é".encode()[:1], False), ("😀".encode()[:3], False),
    ("😀".encode(), True), (b"\x80", False), ("a€".encode()[:2], False), ("€".encode(), True),
])
def test_utf8_complete_as_llama_cpp(text, complete):
    assert utf8_complete(text) is complete


def test_an_open_block_in_the_prompt_is_the_prefill():
    """The generation prompt's <think>\\n counts: budget 1 is spent by the newline, so the end is
    forced first; budget 0 is spent at <think> and its forced end is taken by the newline itself."""
    prompt = [50, 51, START, 9]

    def opened(text: str) -> bool:
        return forced_open_prefix(text) is not None

    assert open_block_tokens(prompt, opened("<|im_start|>assistant\n<think>\n"), [START]) == [START, 9]
    assert open_block_tokens(prompt, opened("<|im_start|>assistant\n"), [START]) == []
    assert open_block_tokens(prompt, opened("<think>a</think>\n"), [START]) == []
    for budget, first in ((1, END), (0, 3)):
        b = ReasoningBudget([START], [END], [END], budget, piece)
        for t in open_block_tokens(prompt, opened("x<think>\n"), [START]):
            b.accept(t)
        assert run(b, [3, 4])[0] == first


def test_templates_and_prompts_with_a_thinking_block():
    assert template_reasons("{{ x }}</think>") and not template_reasons("{{ x }}")
    assert forced_open_prefix("a<think>\n") == "\n" and forced_open_prefix("a<think>b") is None
    assert forced_open_prefix("a") is None
