"""A chat's thinking block: which templates have one, whether a prompt opens it, and llama.cpp's
reasoning budget (``--reasoning-budget N``, ``--reasoning-budget-message``; the server's
``reasoning_budget_tokens`` / ``thinking_budget_tokens`` and ``reasoning_budget_message``).

The budget is llama.cpp's ``common/reasoning-budget.cpp`` state machine, token for token: idle
until the start tag (``<think>``) is sampled or opened by the prompt; then each token counts
against the budget until the end tag (``</think>``) ends the block; once the budget is spent
(and the last token completes its UTF-8 character) the message's tokens and the end tag are
forced, one a step (every other candidate at -inf before the sampler chain, so the chain still
runs and draws); after that it waits for another start tag. llama-server applies it to chat
completions whose template has a thinking block, llama-cli to its chat; so do ``serve`` and
``chat`` here (tests/test_serve_reference.py compares with the stock server).

One difference, on purpose: llama.cpp tokenizes the message with special tokens parsed, and
the server takes it from the request body; here it is plain text, so a client cannot write
control tokens into the answer through it (as message contents, saem_gguf.tokenization).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_reasons(template: str) -> bool:
    """Whether a chat template has a thinking block (llama-server's analysis of the template,
    approximated: it mentions ``</think>``)."""
    return THINK_CLOSE in template


def forced_open_prefix(prompt: str) -> str | None:
    """The reasoning a prompt has already begun (its text after a final ``<think>``), or None
    when the generation prompt does not end inside a thinking block."""
    at = prompt.rfind(THINK_OPEN)
    if at < 0 or prompt[at:].strip() != THINK_OPEN:
        return None
    return prompt[at + len(THINK_OPEN):]


def utf8_complete(piece: bytes) -> bool:
    """Whether ``piece`` ends on a whole UTF-8 character (llama.cpp's common_utf8_is_complete)."""
    if not piece:
        return True
    for i in range(1, min(4, len(piece)) + 1):
        c = piece[-i]
        if c & 0xC0 != 0x80:  # the last lead byte: how many bytes its character takes
            return i >= (4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1)
    return False


class _Matcher:
    """Which of some token sequences ends at each token fed, counting only the tokens since the
    last match or reset (llama.cpp's token_matcher: an Aho-Corasick automaton that returns to its
    root after a match)."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs: list[tuple[int, ...]] = []
        for s in seqs:
            if s and tuple(s) not in self.seqs:
                self.seqs.append(tuple(s))
        self._longest = max((len(s) for s in self.seqs), default=0)
        self._recent: list[int] = []

    def advance(self, token: int) -> int:
        """The index of the longest sequence ending at ``token``, or -1."""
        recent = self._recent
        recent.append(token)
        del recent[:-self._longest or len(recent)]
        best = -1
        for i, s in enumerate(self.seqs):
            if len(recent) >= len(s) and tuple(recent[-len(s):]) == s \
                    and (best < 0 or len(s) > len(self.seqs[best])):
                best = i
        if best >= 0:
            recent.clear()
        return best

    def reset(self) -> None:
        self._recent.clear()


class BudgetState(IntEnum):
    IDLE = 0  # waiting for the start tag
    COUNTING = 1  # in a thinking block: each token spends the budget
    FORCING = 2  # the budget is spent: the message and the end tag are forced
    WAITING_UTF8 = 3  # the budget is spent mid-character: the character is finished first
    DONE = 4  # the block ended (naturally or forced); a new start tag starts a new budget


class ReasoningBudget:
    """The reasoning budget of one generation. ``accept`` every token of the generation prompt
    (the prefill) and then every sampled token; while ``forced()`` is not None that token is the
    only one the sampler may pick."""

    def __init__(self, start: Sequence[int], end: Sequence[int], forced: Sequence[int], budget: int,
                 piece: Callable[[int], bytes]) -> None:
        """``start``/``end``: the tags' tokens; ``forced``: the message's tokens, then the end
        tag's; ``budget``: tokens a thinking block may take (0: it ends at once); ``piece``: a
        token's text (whether it completes a character)."""
        self._start, self._end = _Matcher([start]), _Matcher([end])
        self._forced = tuple(forced)
        self.budget = budget
        self.remaining = budget
        self.state = BudgetState.IDLE
        self._at = 0  # the next forced token
        self._piece = piece

    def forced(self) -> int | None:
        if self.state == BudgetState.FORCING and self._at < len(self._forced):
            return self._forced[self._at]
        return None

    def _force(self) -> None:
        self.state = BudgetState.FORCING
        self._at = 0
        self._end.reset()

    def _open(self) -> None:
        self.state = BudgetState.COUNTING
        self.remaining = self.budget
        if self.remaining <= 0:
            self.state, self._at = BudgetState.FORCING, 0

    def accept(self, token: int) -> None:
        state = self.state
        if state in (BudgetState.IDLE, BudgetState.DONE):
            if self._start.advance(token) >= 0:
                if state == BudgetState.DONE:
                    self._end.reset()
                self._open()
        elif state in (BudgetState.COUNTING, BudgetState.WAITING_UTF8):
            if self._end.advance(token) >= 0:
                self.state = BudgetState.DONE
                return
            complete = utf8_complete(self._piece(token))
            if state == BudgetState.WAITING_UTF8:
                if complete:
                    self._force()
                return
            self.remaining -= 1
            if self.remaining <= 0:
                if complete:
                    self._force()
                else:
                    self.state = BudgetState.WAITING_UTF8
                    self._end.reset()
        else:  # FORCING
            self._end.advance(token)
            self._at += 1
            if self._at >= len(self._forced):
                self.state = BudgetState.DONE


def open_block_tokens(prompt_tokens: Sequence[int], opened: bool, start: Sequence[int]) -> list[int]:
    """The prompt's tokens from the start tag of a thinking block it leaves ``opened`` (``<think>\\n``:
    the template opened it; gpt-oss's analysis channel a continued reasoning is in) to its end,
    which llama.cpp's budget takes as the prefill (they count against the budget); [] when the
    prompt opens none."""
    if not opened or not start:
        return []
    n = len(start)
    for at in range(len(prompt_tokens) - n, -1, -1):
        if tuple(prompt_tokens[at:at + n]) == tuple(start):
            return list(prompt_tokens[at:])
    return []
