"""llama-server's prompt cache in host memory (``--cache-ram``, tools/server/server-task.cpp's
``server_prompt_cache`` of the vendored source): the KV cells of prompts a slot is about to lose,
kept as llama.cpp's per-sequence state so that a later request that shares their beginning starts
from them (a chat interleaved with a client's side requests, two conversations on one slot).

These are the books alone (which entries, their limits, which one a request loads); the scheduler
moves the state in and out of the context (``llama_state_seq_get_data_ext`` /
``set_data_ext``), on its decode thread. The rules are llama-server's:

* ``alloc``: an entry is not made for tokens an entry already holds whole, nor for a state larger
  than the whole limit; entries whose tokens the new one holds whole are dropped; the oldest go
  until the new one fits; where the memory cannot be had, the limit becomes 40 % of what the
  cache holds.
* ``best``: the entry that keeps at least a quarter of its own tokens for the new prompt and both
  keeps a larger share of itself and covers a larger share of the new prompt than the slot's
  own cells do (the first such, in age order, that beats the best so far).
* ``update``: the oldest go while the cache is over its size, and while it holds more tokens than
  the larger of the context size and the tokens the size limit holds at the cache's mean size
  per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIB = 1 << 20


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


@dataclass(eq=False)
class CachedPrompt:
    tokens: list[int]
    data: np.ndarray  # uint8: llama.cpp's sequence state

    @property
    def size(self) -> int:
        return int(self.data.nbytes)


class PromptCache:
    def __init__(self, limit_mib: int, limit_tokens: int) -> None:
        """``limit_mib``: --cache-ram (< 0: no size limit); ``limit_tokens``: the context size."""
        self.limit_size = MIB * max(limit_mib, 0)  # 0: no limit
        self.limit_tokens = limit_tokens  # 0: no limit
        self.states: list[CachedPrompt] = []  # oldest first

    def size(self) -> int:
        return sum(s.size for s in self.states)

    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.states)

    def alloc(self, tokens: list[int], size: int) -> CachedPrompt | None:
        """A new entry for ``tokens`` with room for ``size`` bytes of state (filled by the
        caller), or None where llama-server makes none."""
        if any(common_prefix(s.tokens, tokens) == len(tokens) for s in self.states):
            return None  # held already
        if self.limit_size > 0 and size > self.limit_size:
            return None
        self.states = [s for s in self.states if common_prefix(s.tokens, tokens) != len(s.tokens)]
        if self.limit_size > 0:
            while self.states and self.size() + size > self.limit_size:
                self.states.pop(0)
        try:
            entry = CachedPrompt(list(tokens), np.empty(size, np.uint8))
        except MemoryError:  # as llama-server: a smaller limit from now on, and no entry
            self.limit_size = max(1, int(0.4 * self.size()))
            self.update()
            return None
        self.states.append(entry)
        return entry

    def best(self, current: list[int], new: list[int]) -> CachedPrompt | None:
        """The entry a slot holding ``current`` should load for a request of ``new`` tokens, or
        None (its own cells serve as well)."""
        lcp = common_prefix(current, new)
        f_keep_best = lcp / len(current) if current else -1.0  # an empty slot: any entry wins
        f_sim_best = lcp / len(new)
        found = None
        for s in self.states:
            lcp_cur = common_prefix(s.tokens, new)
            f_keep, f_sim = lcp_cur / len(s.tokens), lcp_cur / len(new)
            if f_keep < 0.25:  # do not trade away most of a large prompt
                continue
            if f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best, found = f_keep, f_sim, s
        return found

    def remove(self, entry: CachedPrompt) -> None:
        self.states = [s for s in self.states if s is not entry]

    def update(self) -> None:
        if self.limit_size > 0:
            while self.states and self.size() > self.limit_size:
                self.states.pop(0)
        per_token = max(1.0, self.size() / max(1, self.n_tokens()))
        limit = max(self.limit_tokens, int(self.limit_size / per_token)) if self.limit_size > 0 else self.limit_tokens
        if self.limit_tokens > 0:
            while self.states and self.n_tokens() > limit:
                self.states.pop(0)
