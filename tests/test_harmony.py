"""saem_gguf.harmony's parser on its own: a stream's deltas add up to the whole answer's split
for any cut of the text into pieces, what is not decided yet is held back, and the lenient PEG
rules at the end of the text. The comparison with the stock llama-server is in
test_serve_reference (the gpt-oss tests)."""

from __future__ import annotations

import random

import pytest

from saem_gguf.harmony import HarmonyText, continuation_markup, parse

A, F, S, E = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|start|>assistant", "<|end|>"
P = "<|channel|>commentary<|message|>"
WORDS = ["We", " add", ".", " ", "\n", "<", "|", "x", "<|", "end", " to="]


def _answer(rng: random.Random, stray: bool) -> list[str]:
    """A well-formed gpt-oss answer as the pieces it streams in: messages on random channels (with
    ``stray``, a stray commentary header now and then), the last one final, cut short at a random
    piece."""
    pieces: list[str] = []
    for i in range(rng.randrange(1, 4)):
        last = i == 2 or rng.random() < 0.3
        if i:
            pieces += [E, S]
        channel = F if last else rng.choice([A, P])
        if stray and channel != P and rng.random() < 0.15:  # a stray header goes before analysis or final
            pieces += ["<|channel|>commentary", " to=assistant"] if rng.random() < 0.5 else ["<|channel|>commentary"]
        pieces.append(channel)
        pieces += [rng.choice(WORDS) for _ in range(rng.randrange(0, 6))]
        if last:
            break
    return pieces[:rng.randrange(1, len(pieces) + 1)]


@pytest.mark.parametrize("extract", [True, False])
def test_streamed_deltas_add_up_to_the_whole_split(extract):
    """For any cut of a well-formed answer into pieces (and any point it is cut short at). Under
    reasoning_format none, a stray header is content until the channel after it shows it is not
    (the test below): there llama-server's stream fails ("Invalid diff"), this one stops adding."""
    rng = random.Random(7)
    for _ in range(3000):
        pieces = _answer(rng, stray=extract)
        whole = HarmonyText(extract).whole("".join(pieces))
        stream = HarmonyText(extract)
        deltas = [stream.add(p) for p in pieces] + [stream.add("", final=True)]
        assert ("".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas)) == whole, pieces


def _streamed(h: HarmonyText, pieces: list[str]) -> tuple[str, str]:
    deltas = [h.add(p) for p in pieces] + [h.add("", final=True)]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def test_a_stream_stops_adding_to_a_part_a_later_parse_no_longer_extends():
    """Where a later parse revises what was sent (llama-server's stream then fails with "Invalid
    diff"), nothing more is sent for that part: output that stops parsing after a preamble, and a
    stray header under reasoning_format none."""
    pieces = [P, "Note", E, "<|message|>", "x"]
    assert _streamed(HarmonyText(True), pieces) == ("", "Note")
    assert HarmonyText(True).whole("".join(pieces)) == (None, "".join(pieces))
    pieces = ["<|channel|>commentary", " to=assistant", F, "X"]
    assert _streamed(HarmonyText(False), pieces) == ("", "<|channel|>commentary to=assistant")
    assert HarmonyText(False).whole("".join(pieces)) == (None, "X")


def test_a_partial_end_marker_is_held_back_until_decided():
    h = HarmonyText(True)
    assert h.add(F + "5 <") == ("", "5 ")  # "<" may begin <|end|>
    assert h.add("|e") == ("", "")
    assert h.add("x") == ("", "<|ex")  # it did not


def test_lenient_rules_at_the_end_of_the_text():
    assert parse(A + "We", True) == ("We", "")  # the analysis not yet ended
    assert parse("<|channel|>fin", True) == ("", "")  # a channel name cut short: nothing yet
    assert parse(A + " \n", True) == ("", "")  # whitespace alone is no reasoning
    assert parse("Hello", True) is None  # no channel: does not parse
    assert parse(F + "X" + E + "tail", True) == ("", "X")  # after the final message: not read


def test_a_continued_message_is_parsed_first_and_hidden_when_asked():
    markup = "".join(t for t, _ in continuation_markup("We add.", "It is"))
    assert markup == A + "We add." + E + S + F + "It is"
    shown = HarmonyText(True, markup)
    assert shown.add(" 5") == ("We add.", "It is 5")
    hidden = HarmonyText(True, markup, hide_prefix=True)
    assert hidden.add(" 5") == ("", " 5") and hidden.whole(" 5") == ("We add.", "It is 5")
    assert "".join(t for t, _ in continuation_markup("", None)) == A  # the analysis channel, empty or not
