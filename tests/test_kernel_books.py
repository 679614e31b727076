"""kernel_books: a kernel's state arrays reached through one table of addresses.

The entry kernels (``*_entry``) must compute exactly what their kernels compute with every book an
argument: checked here on random steps against the argument form, state by state; the parity and
naive tests check the decisions end to end."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from numba import njit

from saem_gguf.costmodel import HW_PRESETS, CostModel
from saem_gguf.kernel_books import Book, KernelBooks, f64_2d, i16_4d, i32_1d, i32_4d, i64_1d, u8_1d
from saem_gguf.link_budget import LinkMeter, estimate_entry, estimate_step

SPEC = (Book("a", np.float64, 2), Book("b", np.int32, 1), Book("c", np.int16, 4), Book("d", np.uint8, 1))


@njit
def _sum_and_bump(tab):
    """Sum of every entry of the SPEC books (as float), then add 1 to each array's first entry."""
    a, b, c, d = f64_2d(tab, 0), i32_1d(tab, 1), i16_4d(tab, 2), u8_1d(tab, 3)
    s = a.sum() + b.sum() + c.sum() + d.sum()
    a[0, 0] += 1
    b[0] += 1
    c[0, 0, 0, 0] += 1
    d[0] += 1
    return s


def _arrays(rng):
    return {"a": rng.random((3, 5)), "b": rng.integers(-9, 9, 7).astype(np.int32),
            "c": rng.integers(-9, 9, (2, 3, 1, 4)).astype(np.int16), "d": rng.integers(0, 9, 6).astype(np.uint8)}


def test_a_kernel_reads_and_writes_the_books_through_the_table():
    rng = np.random.default_rng(0)
    arrays = _arrays(rng)
    books = KernelBooks(SPEC, arrays)
    want = sum(float(x.sum()) for x in arrays.values())
    before = {k: v.copy() for k, v in arrays.items()}
    assert _sum_and_bump(books.table) == pytest.approx(want)
    for k, v in arrays.items():  # the writes land in the caller's arrays, nowhere else
        diff = v.astype(np.float64) - before[k]
        assert diff.flat[0] == 1 and np.count_nonzero(diff) == 1


def test_the_books_keep_their_arrays_alive_and_set_replaces_one():
    rng = np.random.default_rng(1)
    books = KernelBooks(SPEC, _arrays(rng))
    want = sum(float(books[b.name].sum()) for b in SPEC)
    gc.collect()  # nothing but the books holds the arrays now
    np.ones(1 << 20)  # reuse freed memory, were any freed
    assert _sum_and_bump(books.table) == pytest.approx(want)
    new_b = np.full(9, 2, np.int32)
    books.set("b", new_b)
    assert books["b"] is new_b
    want = sum(float(books[b.name].sum()) for b in SPEC)
    assert _sum_and_bump(books.table) == pytest.approx(want)
    assert new_b[0] == 3


@pytest.mark.parametrize("bad", [np.zeros((3, 5), np.float32), np.zeros(15), np.zeros((5, 3)).T,
                                 [[0.0] * 5] * 3])
def test_a_book_of_another_dtype_rank_or_order_is_refused(bad):
    rng = np.random.default_rng(2)
    arrays = _arrays(rng)
    books = KernelBooks(SPEC, arrays)
    with pytest.raises(ValueError, match="kernel books: a must be a C-ordered float64 array of rank 2"):
        books.set("a", bad)
    with pytest.raises(ValueError, match="kernel books: a must be"):
        KernelBooks(SPEC, {**arrays, "a": bad})


def test_missing_or_unknown_books_are_refused():
    arrays = _arrays(np.random.default_rng(3))
    with pytest.raises(ValueError, match=r"missing \['d'\]"):
        KernelBooks(SPEC, {k: v for k, v in arrays.items() if k != "d"})
    with pytest.raises(ValueError, match=r"not in the spec \['e'\]"):
        KernelBooks(SPEC, {**arrays, "e": np.zeros(1)})


@njit
def _rank4(tab):
    x = i32_4d(tab, 0)
    y = i64_1d(tab, 1)
    return x.shape, y.shape, x[1, 2, 3, 4], y[-1]


def test_shapes_travel_with_the_address():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.int32).reshape(2, 3, 4, 5)
    y = np.arange(7, dtype=np.int64)
    books = KernelBooks((Book("x", np.int32, 4), Book("y", np.int64, 1)), {"x": x, "y": y})
    assert _rank4(books.table) == ((2, 3, 4, 5), (7,), x[1, 2, 3, 4], 6)


def _random_rows(rng, B, L, E, K):
    return np.stack([rng.permutation(E)[:K] for _ in range(B * L)]).reshape(B, L, K).astype(np.int16)


def test_the_link_meter_entry_equals_its_kernel_on_random_steps():
    """estimate_entry (books in a table) against estimate_step (every book an argument), on two
    meters fed the same random steps."""
    rng = np.random.default_rng(4)
    L, E, K = 6, 16, 3
    cost = CostModel.from_expert_bytes(2_654_208, HW_PRESETS["rtx4090-ddr5"])
    a, b = LinkMeter(cost, E), LinkMeter(cost, E)
    slot_of = np.where(rng.random((L, E)) < 0.3, 0, -1).astype(np.int32)
    for step in range(50):
        B = int(rng.integers(1, 4))
        rows = _random_rows(rng, B, L, E, K)
        if rng.random() < 0.2:
            rows[0] = -1
        advance = bool(rng.random() < 0.5)
        got = estimate_entry(rows, slot_of, advance, a._tab)
        want = estimate_step(rows, slot_of, b.cost, b.clock, b._cnt, b._uniq, advance)
        assert got == want
        np.testing.assert_array_equal(a.clock, b.clock)


def test_a_deep_copy_of_a_started_policy_decides_on_its_own_arrays():
    """copy.deepcopy of a policy: its books point at its own copied arrays (a copied table would
    point at the original's), so the two decide alike on the same steps and neither moves the
    other."""
    import copy

    from saem_gguf.policies import make_policy
    from saem_gguf.policies.base import PolicyContext
    from saem_gguf.policies.state import StepEvents

    rng = np.random.default_rng(5)
    L, E, K = 4, 16, 2
    cost = CostModel.from_expert_bytes(2_654_208, HW_PRESETS["rtx4090-ddr5"])
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 4, np.int32), cost=cost,
                        calib_counts=rng.random((L, E)))
    for name in ("saem", "lfu-cpu"):
        a = make_policy(name)
        a.start(ctx)
        b = copy.deepcopy(a)
        assert b._tab is b._books.table and b._tab[0, 0] != a._tab[0, 0]
        quiet = StepEvents(n_rows=1, combined=False if a.uses_combined_events else None)
        for _ in range(40):
            rows = _random_rows(rng, 1, L, E, K)
            ca, cb = a.observe(rows, quiet), b.observe(rows, quiet)
            assert (ca is None) == (cb is None)
            if ca is not None:
                np.testing.assert_array_equal(ca.ops, cb.ops)
        np.testing.assert_array_equal(a.state.slot_of, b.state.slot_of)
        b.observe(np.zeros((1, L, K), np.int16) + 7, quiet)  # b alone moves on
        assert b._books["stamp"][0, 7] != a._books["stamp"][0, 7]


def test_entry_point_is_the_compiled_overload_for_the_arguments_types():
    """entry_point returns what the dispatcher calls for those types, and it computes the same."""
    from saem_gguf.kernel_books import entry_point

    @njit
    def kernel(rows, piece, g, on):
        return rows.sum() + len(piece) + g + on

    rows = np.arange(6, dtype=np.int16).reshape(1, 2, 3)
    fn = entry_point(kernel, rows, b"", 0, False)
    assert fn is kernel.overloads[kernel.signatures[0]].entry_point and len(kernel.signatures) == 1
    assert fn(rows, b"abc", 4, True) == kernel(rows, b"abc", 4, True) == 15 + 3 + 4 + 1
    assert entry_point(kernel, rows, b"x", 7, True) is fn  # the same types: the same overload


def _strided(rows):
    """The same rows as a view that is not C-ordered: what an untyped C-order read would misread."""
    wide = np.full(rows.shape[:-1] + (2 * rows.shape[-1],), -7, np.int16)
    wide[..., ::2] = rows
    return wide[..., ::2]


def test_a_bound_step_takes_the_entry_point_only_for_its_own_arrays():
    """bind_step (the engine's decode step): a policy (a cache, the adaptive saem, SAEM's stage
    rule), the link meter, the cue matcher and the detector pair call their kernel's compiled entry point, untyped, only with the very arrays
    they were bound to. Steps given other arrays (strided views, which the entry point would read
    as C-ordered rows) or a piece of 256 bytes or more (lengths as an int64 array, not bytes)
    are typed by the dispatcher. Against unbound twins fed the same steps, every decision,
    clock and event is equal, and the bound steps did take the entry point."""
    from saem_gguf.policies import make_policy
    from saem_gguf.policies.base import PolicyContext
    from saem_gguf.policies.state import StepEvents
    from saem_gguf.stage import CueSet, DetectorConfig, StageDetector
    from saem_gguf.stage.pair import DetectorPair

    rng = np.random.default_rng(6)
    L, E, K = 4, 16, 2
    cost = CostModel.from_expert_bytes(2_654_208, HW_PRESETS["rtx4090-ddr5"])
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 4, np.int32), cost=cost,
                        calib_counts=rng.random((L, E)))
    bound_rows = np.zeros((1, L, K), np.int16)  # the sink's view: rewritten in place each step
    seq0 = np.zeros(1, np.int64)
    for name in ("lfu-cpu", "saem", "saem-stage"):
        a, b = make_policy(name), make_policy(name)
        a.start(ctx)
        b.start(ctx)
        a.bind_step(bound_rows)
        assert a._bound_entry is not b._bound_entry and a._bound_rows is bound_rows
        quiet = StepEvents(n_rows=1, combined=False if a.uses_combined_events else None)
        for step in range(60):
            rows = _random_rows(rng, 1, L, E, K)
            if step % 3:
                bound_rows[:] = rows
                given = bound_rows
            else:
                given = _strided(rows)
            ca, cb = a.observe(given, quiet), b.observe(rows, quiet)
            assert (ca is None) == (cb is None)
            if ca is not None:
                np.testing.assert_array_equal(ca.ops, cb.ops)
        np.testing.assert_array_equal(a.state.slot_of, b.state.slot_of)
        books = [k for k in ("_key", "_stamp", "_score", "_counts", "_det") if hasattr(a, k)]
        assert books
        for k in books:  # the books too (SAEM's stage rule decides nothing on quiet steps)
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=f"{name} {k}")

    a, b = LinkMeter(cost, E), LinkMeter(cost, E)
    bound_map = np.where(rng.random((L, E)) < 0.3, 0, -1).astype(np.int32)
    a.bind_step(bound_rows, bound_map)
    for step in range(40):
        rows = _random_rows(rng, 1, L, E, K)
        bound_rows[:] = rows
        given_rows = bound_rows if step % 2 else _strided(rows)
        given_map = bound_map if step % 3 else np.asfortranarray(bound_map)
        assert a.budget(given_rows, given_map) == b.budget(rows, bound_map.copy())
        np.testing.assert_array_equal(a.clock, b.clock)

    cues = CueSet.load("general")
    text = ("First, x.\n" + "y " * 200 + "\nWait, no.\n" + "z" * 300 + ".\nAlternatively, w.\nHmm, so.").encode()
    pieces = [text[:12], text[12:400], text[400:405], text[405:720], text[720:]]  # two of them >= 256 bytes
    det_a, det_b = (StageDetector(1, cues, DetectorConfig(min_stage_tokens=1), n_layer=L, n_expert=E, top_k=K)
                    for _ in range(2))
    pair_a, pair_b = DetectorPair(det_a), DetectorPair(det_b)
    det_a.bind_step(seq0)
    pair_a.bind_step(seq0, bound_rows)
    seen = []
    for piece in pieces * 2:
        rows = _random_rows(rng, 1, L, E, K)
        bound_rows[:] = rows
        got = det_a.feed_checked(seq0, [piece], None)
        assert got == det_b.feed_checked(seq0.copy(), [piece], None)
        got_pair = pair_a.feed_checked(seq0, [piece], bound_rows)
        assert got_pair == pair_b.feed_checked(seq0.copy(), [piece], rows)
        seen.extend(e.cue for e in got)
    assert {"Wait", "Alternatively"} <= set(seen)  # Wait completes in a piece of 315 bytes
