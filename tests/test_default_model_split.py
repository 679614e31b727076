"""The shared held-out split: about a tenth held out, one-digit facts never, stable across runs."""

import pytest

from saem_gguf.defaultmodel.split import is_heldout


def test_one_digit_facts_are_never_held_out():
    assert not any(is_heldout(op, a, b) for op in ("add", "sub", "mul") for a in range(10) for b in range(10))


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_about_a_tenth_is_held_out(op):
    share = sum(is_heldout(op, a, b) for a in range(10, 1000, 7) for b in range(0, 1000, 11)) / (142 * 91)
    assert 0.08 < share < 0.12


def test_split_is_fixed():
    # the split must never move: a held-out triple that moves into training leaks the evaluation
    assert [(a, b) for a in range(10, 40) for b in range(10, 14) if is_heldout("add", a, b)][:8] == \
        [(13, 10), (15, 10), (15, 13), (19, 11), (20, 10), (25, 12), (26, 12), (29, 10)]


def test_unknown_operation_is_refused():
    with pytest.raises(ValueError):
        is_heldout("div", 10, 2)
