"""Streaming cue matcher, cue files and the combined StageDetector (text side)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saem_gguf.errors import SaemError
from saem_gguf.stage import CueMatcher, CueSet, DetectorConfig, StageDetector, builtin_cue_sets, find_cues
from saem_gguf.stage.cues import with_boundary
from saem_gguf.synthetic import SyntheticConfig, make_stage_traces

GENERAL = CueSet.load("general")


def split_at(data: bytes, cuts) -> list[bytes]:
    cuts = sorted(set(c for c in cuts if 0 < c < len(data)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def piece_of(pieces: list[bytes], byte_offset: int) -> int:
    """Index of the piece holding byte ``byte_offset`` of their concatenation."""
    acc = 0
    for i, p in enumerate(pieces):
        acc += len(p)
        if byte_offset < acc:
            return i
    raise AssertionError("offset past the end")


def cue_ids(cues: CueSet, texts: list[str]) -> list[int]:
    return [cues.index(t) for t in texts]


# ---------------------------------------------------------------------------- splits

SPLIT_TEXT = "We get x = 3. Alternatively, try y. Hmm… so wait. 日本。Wait—ok"
SPLIT_BYTES = SPLIT_TEXT.encode()


def expected_events(data: bytes, pieces: list[bytes]) -> list[tuple[int, int]]:
    # Each cue is confirmed by the character after it (all three end in a letter).
    out = []
    for text, after in (("Alternatively", b","), ("Hmm", "…".encode()), ("Wait", "—".encode())):
        start = data.find(text.encode())
        end = start + len(text.encode())
        assert data[end:end + len(after)] == after
        # The confirming character completes at its last byte.
        out.append((GENERAL.index(text), piece_of(pieces, end + len(after) - 1)))
    return out


def test_every_single_and_double_split():
    m = CueMatcher(GENERAL, 1, start_is_boundary=False)
    n = len(SPLIT_BYTES)
    for cuts in itertools.chain(((c,) for c in range(1, n)), itertools.combinations(range(1, n), 2)):
        pieces = split_at(SPLIT_BYTES, cuts)
        got = [(c, t) for _, c, t in m.match_sequence(pieces).tuples()]
        assert got == expected_events(SPLIT_BYTES, pieces), (cuts, pieces)


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(1, len(SPLIT_BYTES) - 1)))
def test_any_set_of_split_points(cuts):
    pieces = split_at(SPLIT_BYTES, cuts)
    m = CueMatcher(GENERAL, 1, start_is_boundary=False)
    got = [(c, t) for _, c, t in m.match_sequence(pieces).tuples()]
    assert got == expected_events(SPLIT_BYTES, pieces)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60))
def test_empty_and_one_byte_pieces(sizes):
    # Arbitrary piece sizes including empty pieces (tokens that render no text).
    data = b"Start.\n\nBut wait, " + "é".encode() * 3 + b". Therefore x."
    sizes = [*sizes, 1]  # at least one non-empty size, so the loop advances
    pieces, pos = [], 0
    while pos < len(data):
        k = sizes[len(pieces) % len(sizes)]
        pieces.append(data[pos:pos + k])
        pos += k
    got = [GENERAL[c].text for c, _ in find_cues(GENERAL, pieces)]
    assert got == ["But wait", "Therefore"]


# ---------------------------------------------------------------------------- rules


def texts_found(cues: CueSet, text: str, piece: int = 3) -> list[str]:
    data = text.encode()
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
    return [cues[c].text for c, _ in find_cues(cues, pieces)]


def test_case_insensitive():
    assert texts_found(GENERAL, "x.\nALTERNATIVELY, y. alternatively, z. AlTeRnAtIvElY, w.") == ["Alternatively"] * 3
    assert texts_found(GENERAL, "Done.</THINK>ok") == ["</think>"]


def test_mid_sentence_cue_is_not_a_boundary_by_default():
    assert texts_found(GENERAL, "We could alternatively use x and then wait for y.") == []
    assert texts_found(GENERAL, "We could, alternatively, use x.") == ["Alternatively"]  # after punctuation
    word = with_boundary(GENERAL, "word")
    assert texts_found(word, "We could alternatively use x.") == ["Alternatively"]
    line = with_boundary(GENERAL, "line")
    assert texts_found(line, "a. Wait, b.\nWait, c.\n  **Wait**, d.") == ["Wait", "Wait"]
    sentence = with_boundary(GENERAL, "sentence")
    assert texts_found(sentence, "a, wait, b. Wait, c.") == ["Wait"]


def test_word_boundary_on_the_right():
    assert texts_found(GENERAL, "Waiting is over. Instead-of. Hmmm. Wait") == ["Instead", "Wait"]
    # "Instead" then '-' is a non-word character; "Hmmm" is not "Hmm"; the final "Wait" is
    # confirmed by the end of the text (flush).


def test_unicode_text_and_cues():
    cues = CueSet.from_texts(["等等", "Übrigens", "Wait"], name="u")
    text = "计算。等等，再看。übrigens, x. ÜBRIGENS: y. Ünd übrigens no. «Wait» yes"
    assert texts_found(cues, text, piece=1) == ["等等", "Übrigens", "Übrigens", "Wait"]
    # Malformed UTF-8 never raises and never invents a boundary.
    bad = [b"\xff\xfe", b"x. Wait", b"\xc3", b", ok", b"\x80 Wait, no"]
    assert [cues[c].text for c, _ in find_cues(cues, bad)] == ["Wait"]


def test_event_token_is_where_the_cue_completes():
    pieces = [b"Done.", b"\n\n", b"Alter", b"natively", b",", b" so"]
    # "Alternatively" ends in piece 3 but is confirmed by the ',' in piece 4.
    assert find_cues(GENERAL, pieces) == [(GENERAL.index("Alternatively"), 4)]
    assert find_cues(GENERAL, pieces, start_token=100) == [(GENERAL.index("Alternatively"), 104)]
    pieces = [b"x.", b"</th", b"ink>"]  # a cue ending in '>' needs no look-ahead
    assert find_cues(GENERAL, pieces) == [(GENERAL.index("</think>"), 2)]


def test_minimum_stage_length():
    pieces = []
    for _ in range(10):
        pieces += [b" Wait,", b" a", b" b", b".\n"]  # a cue every 4 tokens, confirmed at its token
    m = CueMatcher(GENERAL, 1, min_stage_tokens=10)
    ev = m.match_sequence(pieces)
    toks = ev.token.tolist()
    assert toks == [12, 24, 36]  # the start counts as a boundary: 0 + 10 -> 12, +12 ...
    assert all(b - a >= 10 for a, b in zip([0, *toks], toks))
    m0 = CueMatcher(GENERAL, 1, min_stage_tokens=10, start_is_boundary=False)
    assert m0.match_sequence(pieces).token.tolist() == [0, 12, 24, 36]
    m1 = CueMatcher(GENERAL, 1, min_stage_tokens=0)
    assert len(m1.match_sequence(pieces)) == 10


def test_batch_of_sequences_equals_one_at_a_time():
    rng = np.random.default_rng(0)
    texts = [
        "Start. Alternatively, x. y wait. Wait, z.\nHmm, ok</think>",
        "Let me verify: 2+2. So the answer is 4. On second thought, 5.",
        "Nothing here at all, just text.",
        "Instead, we try. BUT WAIT, no.",
    ]
    chunked = []
    for t in texts:
        data, pieces, pos = t.encode(), [], 0
        while pos < len(data):
            k = int(rng.integers(1, 6))
            pieces.append(data[pos:pos + k])
            pos += k
        chunked.append(pieces)
    solo = []
    for i, pieces in enumerate(chunked):
        m = CueMatcher(GENERAL, 1, min_stage_tokens=2)
        solo += [(i, c, t) for _, c, t in m.match_sequence(pieces).tuples()]
    # Interleave: each step feeds the next piece of every sequence that still has one.
    m = CueMatcher(GENERAL, len(texts), min_stage_tokens=2)
    got = []
    for step in range(max(map(len, chunked))):
        idx = [i for i in range(len(texts)) if step < len(chunked[i])]
        got += m.feed(np.array(idx), [chunked[i][step] for i in idx]).tuples()
    for i in range(len(texts)):
        got += m.flush(i).tuples()
    assert sorted(got) == sorted(solo)
    assert len(solo) >= 8


def test_one_piece_steps_equal_one_call_for_any_piece_length():
    """A decode step feeds one piece (pack_pieces' table path, under 256 bytes; longer pieces take
    the general path): feeding a text piece by piece finds what one call over all its pieces finds,
    with pieces of 1 to 300 bytes; a piece that is text, not bytes, is refused either way."""
    rng = np.random.default_rng(5)
    text = ("Start here. " + "x" * 280 + ". Alternatively, try it. Wait, no.\nLet me verify: ok. " * 3).encode()
    pieces, pos = [], 0
    while pos < len(text):
        k = int(rng.choice([1, 2, 7, 255, 256, 300]))
        pieces.append(text[pos:pos + k])
        pos += k
    assert max(map(len, pieces)) >= 256 and min(map(len, pieces)) < 256
    whole = CueMatcher(GENERAL, 1, min_stage_tokens=0).match_sequence(pieces).tuples()
    m = CueMatcher(GENERAL, 1, min_stage_tokens=0)
    m.reset(0)
    got = []
    for p in pieces:
        got += m.feed(np.zeros(1, np.int64), [p]).tuples()
    got += m.flush(0).tuples()
    assert got == whole and len(whole) >= 6
    for bad in (["text"], ["text", b"bytes"]):
        with pytest.raises(SaemError, match="must be bytes"):
            m.feed(np.zeros(len(bad), np.int64), bad)


def test_reset_clears_a_partial_cue():
    m = CueMatcher(GENERAL, 2, start_is_boundary=False)
    m.feed([0, 1], [b"x.\nAltern", b"y.\nAltern"])
    m.reset(0)
    ev = m.feed([0, 1], [b"atively, a", b"atively, b"])
    assert ev.tuples() == [(1, GENERAL.index("Alternatively"), 1)]


def test_bad_input():
    m = CueMatcher(GENERAL, 2)
    with pytest.raises(SaemError, match="out of range"):
        m.feed([0, 2], [b"a", b"b"])
    with pytest.raises(SaemError, match="indices"):
        m.feed([0], [b"a", b"b"])
    with pytest.raises(SaemError):
        CueMatcher(CueSet("empty", []), 1)


# ---------------------------------------------------------------------------- cue files


def test_builtin_sets_load_and_have_no_prefix_conflicts():
    names = builtin_cue_sets()
    assert {"general", "qwen3", "deepseek-r1", "gpt-oss"} <= set(names)
    for n in names:
        cs = CueSet.load(n)
        keys = [c.key() for c in cs]
        assert len(keys) == len(set(keys))
        for a in keys:
            for b in keys:
                # A cue that is a word-prefix of another fires first and shadows it.
                assert a == b or not (b.startswith(a) and not b[len(a)].isalnum()), (n, a, b)
    assert "Hmm" in CueSet.load("qwen3").texts and "</think>" in CueSet.load("qwen3").texts
    gpt = CueSet.load("gpt-oss")
    assert "</think>" not in gpt.texts and "<|channel|>final" in gpt.texts


def test_cue_file_round_trip_and_errors(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"format": "saem-cues", "version": 1, "name": "mine", "extends": ["general"],
                             "remove": ["Hmm"], "cues": ["Okay", {"text": "WAIT", "boundary": "line"}]}))
    cs = CueSet.load(p)
    assert "Hmm" not in cs.texts and "Okay" in cs.texts
    assert cs[cs.index("wait")].boundary == "line"  # the later definition wins
    out = tmp_path / "out.json"
    cs.save(out)
    assert CueSet.load(out).texts == cs.texts
    bad = {
        "not json": "{",
        "bad boundary": json.dumps({"cues": [{"text": "x", "boundary": "nowhere"}]}),
        "empty text": json.dumps({"cues": [""]}),
        "whitespace": json.dumps({"cues": [" Wait"]}),
        "unknown field": json.dumps({"cues": [{"text": "x", "colour": 1}]}),
        "version": json.dumps({"version": 99, "cues": ["x"]}),
        "empty": json.dumps({"cues": []}),
        "too long": json.dumps({"cues": ["x" * 200]}),
        "unknown parent": json.dumps({"extends": ["nope"], "cues": ["x"]}),
    }
    for name, text in bad.items():
        f = tmp_path / f"{name.replace(' ', '_')}.json"
        f.write_text(text)
        with pytest.raises(SaemError):
            CueSet.load(f)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "extends": ["b"], "cues": ["x"]}))
    (tmp_path / "b.json").write_text(json.dumps({"name": "b", "extends": ["a"], "cues": ["y"]}))
    with pytest.raises(SaemError, match="cyclic"):
        CueSet.load(tmp_path / "a.json")
    with pytest.raises(SaemError, match="unknown cue set"):
        CueSet.load("no-such-set")


# ---------------------------------------------------------------------------- on synthetic text


def test_finds_every_planted_cue_in_synthetic_text():
    ts = make_stage_traces(SyntheticConfig(n_layer=2, n_expert=16, top_k=2, n_sequences=6, seed=3,
                                           stage_len_scale=0.3, decoy_rate=0.5))
    cues = CueSet.load("general")
    for s, planted in zip(ts.sequences, ts.meta["boundary_cues"]):
        found = find_cues(cues, s.pieces)
        starts = s.stage_starts[1:].tolist()
        assert [cues[c].text for c, _ in found] == planted[1:]
        for (_, tok), start in zip(found, starts):
            assert 0 <= tok - start <= 8  # the cue's pieces and the confirming comma


def test_detector_text_only_matches_the_matcher():
    ts = make_stage_traces(SyntheticConfig(n_layer=2, n_expert=16, top_k=2, n_sequences=3, seed=4,
                                           stage_len_scale=0.3))
    det = StageDetector(3, GENERAL, DetectorConfig(min_stage_tokens=8))
    seqs = ts.sequences
    got = []
    for step in range(max(s.n_tokens for s in seqs)):
        idx = [i for i, s in enumerate(seqs) if step < s.n_tokens]
        got += [(e.seq, e.cue, e.token) for e in det.feed(np.array(idx), [seqs[i].pieces[step] for i in idx])]
    for i, s in enumerate(seqs):
        want = [(i, GENERAL[c].text, t) for c, t in find_cues(GENERAL, s.pieces)]
        assert [g for g in got if g[0] == i] == want
    mine = [g for g in got if g[0] == 0]
    assert det.stage_start(0) == (mine[-1][2] if mine else 0)
