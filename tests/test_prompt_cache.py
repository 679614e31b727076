"""The prompt cache's books (serving.prompt_cache, llama-server's server_prompt_cache rules):
which entries are made and dropped, which one a request loads, the size and token limits. The
cache at work, against stock llama-server: tests/test_serve_reference.py."""

from __future__ import annotations

import random

import numpy as np

from saem_gguf.serving.prompt_cache import MIB, PromptCache, common_prefix


def _cache(mib: int = 0, tokens: int = 0, *entries: tuple[list[int], int]) -> PromptCache:
    c = PromptCache(mib, tokens)
    for toks, size in entries:
        assert c.alloc(toks, size) is not None
    return c


def test_alloc_skips_held_prompts_and_drops_the_ones_it_holds_whole():
    c = _cache(0, 0, ([1, 2, 3, 4], 10), ([7, 8], 5))
    assert c.alloc([1, 2], 3) is None  # [1, 2, 3, 4] holds it
    assert c.alloc([7, 8, 9], 6) is not None  # holds [7, 8]: that one goes
    assert [s.tokens for s in c.states] == [[1, 2, 3, 4], [7, 8, 9]]


def test_the_size_limit_drops_the_oldest_and_refuses_what_cannot_fit():
    c = _cache(1, 0, ([1], MIB // 2), ([2], MIB // 2))
    assert c.alloc([3], MIB + 1) is None  # larger than the whole limit
    c.alloc([3], MIB // 2)
    assert [s.tokens for s in c.states] == [[2], [3]] and c.size() == MIB


def test_update_keeps_the_token_limit_scaled_by_the_size_limit():
    c = _cache(0, 5, ([1, 2, 3], 8), ([4, 5, 6], 8))
    c.update()  # no size limit: 6 tokens > 5, the oldest goes
    assert [s.tokens for s in c.states] == [[4, 5, 6]]
    d = _cache(1, 5, ([1, 2, 3], 8), ([4, 5, 6], 8))
    d.update()  # 1 MiB at 8/3 bytes a token holds far more than 5 tokens: both stay
    assert len(d.states) == 2


def test_best_needs_a_quarter_of_the_entry_and_more_than_the_slot_holds():
    c = _cache(0, 0, ([1, 2, 3, 4, 5, 6, 7, 8], 1), ([1, 2, 9], 1), ([5, 6, 7], 1))
    assert c.best([], [5, 6, 7, 0]).tokens == [5, 6, 7]  # an empty slot: any entry that keeps a quarter
    assert c.best([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]) is None  # the slot keeps 5/5, the entry 5/8
    assert c.best([9], [1, 2, 3, 4, 5, 0]).tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert c.best([9], [1, 2, 9, 9]).tokens == [1, 2, 9]  # keeps 3/3 and covers 3/4: beats the first (2/8)
    assert c.best([9], [1, 0]).tokens == [1, 2, 9]  # keeps 1/3, a quarter or more; [1, ..., 8] 1/8: skipped
    assert c.best([9], [0, 0]) is None


def test_common_prefix_against_a_plain_loop():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(8))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n


def test_out_of_memory_makes_no_entry_and_lowers_the_limit(monkeypatch):
    c = _cache(-1, 0, ([1], 100), ([2], 30))
    real = np.empty

    def refuse(n, dtype):  # the next state does not fit in memory
        raise MemoryError

    monkeypatch.setattr(np, "empty", refuse)
    assert c.alloc([3], 10**12) is None
    monkeypatch.setattr(np, "empty", real)
    assert c.limit_size == 52 and [s.tokens for s in c.states] == [[2]]  # 40 % of 130 bytes: the oldest went
