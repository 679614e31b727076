"""Implicit (routing-shift) stage detection and the combined detector on routing."""

from __future__ import annotations

import numpy as np
import pytest

from saem_gguf.errors import SaemError
from saem_gguf.stage import CueSet, DetectorConfig, ImplicitConfig, ImplicitDetector, StageDetector, detect_trace
from saem_gguf.synthetic import SyntheticConfig, make_stage_traces


def reference_D(w: np.ndarray, r: np.ndarray) -> float:
    """D from scratch: mean over layers of (N*JS_pi - Miller-Madow term) / Nw."""
    vals = []
    for wl, rl in zip(w.astype(float), r.astype(float)):
        c = wl + rl
        Nw, Nr, N = wl.sum(), rl.sum(), c.sum()

        def H(x, n):
            p = x[x > 0] / n
            return -(p * np.log(p)).sum()

        js = H(c, N) - Nw / N * H(wl, Nw) - Nr / N * H(rl, Nr)
        mm = ((wl > 0).sum() + (rl > 0).sum() - (c > 0).sum() - 1) / 2
        vals.append((N * js - mm) / Nw)
    return float(np.mean(vals))


def test_incremental_statistic_matches_recomputation():
    rng = np.random.default_rng(1)
    L, E, K = 4, 16, 3
    cfg = ImplicitConfig(window=5, min_ref=3)
    det = ImplicitDetector(2, L, E, K, cfg, detect=False)
    for step in range(60):
        ex = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(2)])
        det.update(np.array([0, 1]), ex.astype(np.int16))
        if step == 30:
            det.new_stage(1, det.n_tokens(1))
        for i in range(2):
            nw, nr = int(det.state[i, 3]), int(det.state[i, 4])
            assert det.w[i].sum() == nw * L * K and det.r[i].sum() == nr * L * K
            if nw == 5 and nr >= 1:
                assert det.raw_score(i) == pytest.approx(reference_D(det.w[i], det.r[i]), abs=1e-9)
            np.testing.assert_array_equal(det.stage_histogram(i), det.w[i] + det.r[i])


def test_incremental_books_match_recomputation_across_detected_boundaries():
    # A detected boundary drops the window's oldest tokens (_drop_oldest) and starts the stage
    # again; the test above runs detect=False and never reaches that path. Here routing jumps
    # between two disjoint hot sets, so boundaries fire, and after every token each slot's
    # window counts, used-expert counts and n-log-n sums equal what its ring recomputes.
    rng = np.random.default_rng(7)
    L, E, K, W = 3, 24, 2, 16
    cfg = ImplicitConfig(window=W, min_ref=8, min_stage_tokens=20, baseline_warmup=8, confirm=2)
    det = ImplicitDetector(2, L, E, K, cfg, detect=True)
    n_events = 0
    for step in range(400):
        hot = np.arange(0, 8) if (step // 60) % 2 == 0 else np.arange(12, 20)
        ex = np.stack([np.stack([rng.choice(hot, K, replace=False) for _ in range(L)]) for _ in range(2)])
        n_events += len(det.update(np.array([0, 1]), ex.astype(np.int16)))
        for i in range(2):
            w = np.zeros((L, E), np.int64)
            for slot in range(W):
                for l in range(L):
                    for e in det.ring[i, slot, l]:
                        if e >= 0:
                            w[l, e] += 1
            np.testing.assert_array_equal(det.w[i], w)
            assert int(det.state[i, 3]) * L * K == w.sum()
            np.testing.assert_array_equal(det.nz[i, 0], (w > 0).sum(axis=1))
            nlogn = np.where(w > 0, w * np.log(np.maximum(w, 1)), 0.0).sum(axis=1)
            np.testing.assert_allclose(det.sw[i], nlogn, atol=1e-9)
    assert n_events >= 4, n_events


def planted_recall(events_tokens: np.ndarray, starts: np.ndarray, within: int = 32) -> tuple[int, int]:
    hits = sum(1 for b in starts if np.any((events_tokens >= b) & (events_tokens <= b + within)))
    return hits, len(starts)


def test_finds_planted_shifts_and_no_false_alarms_on_stationary_routing():
    # Default synthetic routing (48 x 128, top-8); stages keep the paper's 55+ token minimum.
    staged = make_stage_traces(SyntheticConfig(n_sequences=8, seed=5, with_text=False))
    hits = total = false = 0
    for s in staged.sequences:
        ev = detect_trace(s.experts, 128)
        h, t = planted_recall(ev.token, s.stage_starts[1:])
        hits, total = hits + h, total + t
        false += sum(1 for x in ev.token if not np.any((x >= s.stage_starts[1:]) & (x <= s.stage_starts[1:] + 32)))
    assert total >= 30
    assert hits / total >= 0.9, (hits, total)

    still = make_stage_traces(SyntheticConfig(n_sequences=5, seed=6, with_text=False, stationary=True))
    n_tok = sum(s.n_tokens for s in still.sequences)
    alarms = sum(len(detect_trace(s.experts, 128)) for s in still.sequences)
    assert n_tok >= 10000
    assert alarms / n_tok * 1000 <= 1.0, (alarms, n_tok)
    # Spurious events on the staged traces (outside any planted boundary's window) are rare too.
    assert false / sum(s.n_tokens for s in staged.sequences) * 1000 <= 1.0


def test_hysteresis_and_minimum_stage_length():
    # Two abrupt shifts 200 tokens apart: exactly one event each, none in between.
    cfg = SyntheticConfig(n_layer=16, n_expert=64, top_k=4, n_sequences=1, seed=2, with_text=False, n_stages=3,
                          coherence=0.0, stage_len_min=200, stage_len_max=200)
    s = make_stage_traces(cfg).sequences[0]
    ev = detect_trace(s.experts, 64)
    starts = s.stage_starts[1:]
    assert len(ev) == 2
    assert all(0 <= t - b <= 32 for t, b in zip(ev.token.tolist(), starts.tolist()))
    # A minimum stage length longer than the stages suppresses the second boundary.
    ev2 = detect_trace(s.experts, 64, ImplicitConfig(min_stage_tokens=300))
    assert len(ev2) == 1


def test_batch_equals_one_at_a_time():
    ts = make_stage_traces(SyntheticConfig(n_layer=8, n_expert=32, top_k=4, n_sequences=3, seed=7,
                                           with_text=False, coherence=0.2, stage_len_scale=0.5))
    seqs = ts.sequences
    solo = [(i, t) for i, s in enumerate(seqs) for t in detect_trace(s.experts, 32).token.tolist()]
    det = ImplicitDetector(3, 8, 32, 4)
    got = []
    for step in range(max(s.n_tokens for s in seqs)):
        idx = [i for i, s in enumerate(seqs) if step < s.n_tokens]
        ex = np.stack([seqs[i].experts[step] for i in idx])
        ev = det.update(np.array(idx), ex)
        got += list(zip(ev.seq.tolist(), ev.token.tolist()))
    assert sorted(got) == sorted(solo)
    assert len(solo) >= 3


def test_detector_combines_cues_and_routing():
    # Half of the boundaries carry a cue, half are implicit: together they find nearly all.
    cfg = SyntheticConfig(n_sequences=4, seed=8, cue_prob=0.5)
    ts = make_stage_traces(cfg)
    cues = CueSet.load("general")
    det = StageDetector(4, cues, DetectorConfig(min_stage_tokens=16, use_implicit=True, combined_scale=1.0),
                        n_layer=48, n_expert=128, top_k=8)
    seqs = ts.sequences
    events = []
    for step in range(max(s.n_tokens for s in seqs)):
        idx = [i for i, s in enumerate(seqs) if step < s.n_tokens]
        events += det.feed(np.array(idx), [seqs[i].pieces[step] for i in idx],
                           np.stack([seqs[i].experts[step] for i in idx]))
    hits = total = 0
    kinds = set()
    for i, (s, planted) in enumerate(zip(seqs, ts.meta["boundary_cues"])):
        toks = np.array([e.token for e in events if e.seq == i])
        h, t = planted_recall(toks, s.stage_starts[1:])
        hits, total = hits + h, total + t
        for b, cue in zip(s.stage_starts[1:], planted[1:]):
            near = [e for e in events if e.seq == i and 0 <= e.token - b <= 32]
            if near:
                kinds.add((cue is not None, near[0].source))
    assert hits / total >= 0.85, (hits, total)
    assert (True, "cue") in kinds and (False, "implicit") in kinds
    e = events[-1]
    assert det.stage_start(e.seq) == e.token


def test_detector_input_checks():
    det = StageDetector(2, CueSet.load("general"), DetectorConfig(use_implicit=True), n_layer=2, n_expert=8,
                        top_k=2)
    ex = np.zeros((2, 2, 2), np.int16)
    with pytest.raises(SaemError, match="twice"):
        det.feed(np.array([1, 1]), [b"a", b"b"], ex)
    with pytest.raises(SaemError, match="experts"):
        det.feed(np.array([0]), [b"a"])
    with pytest.raises(SaemError, match="experts must be"):
        det.feed(np.array([0]), [b"a"], np.zeros((1, 3, 2), np.int16))
    with pytest.raises(SaemError):
        StageDetector(2, None, DetectorConfig(use_cues=False, use_implicit=True))  # no routing shape
    with pytest.raises(SaemError):
        ImplicitConfig(high=0.01, low=0.1).validate()


def test_a_cue_only_detector_reads_no_routing_and_allocates_nothing_on_a_quiet_step():
    """A detector that knows the routing shape but detects cues only (the engine's cue detector
    beside its combined twin) needs no experts; a step without a boundary returns the one shared
    empty result."""
    cue_only = StageDetector(1, CueSet.load("general"), DetectorConfig(min_stage_tokens=0), n_layer=2, n_expert=8,
                             top_k=2)
    twin = cue_only.fresh(use_implicit=True)
    assert cue_only.tracks_routing and not cue_only.needs_routing and twin.needs_routing
    slot = np.zeros(1, np.int64)
    quiet = [cue_only.feed(slot, [b" word"]) for _ in range(3)]
    assert quiet[0] == () and all(q is quiet[0] for q in quiet)
    events = cue_only.feed(slot, [b"\n\nWait, "])
    assert [(e.source, e.token) for e in events] == [("cue", 3)]
    with pytest.raises(SaemError, match="experts"):
        twin.feed(slot, [b"x"])
    assert twin.feed(slot, [b"x"], np.zeros((1, 2, 2), np.int16).tolist()) == ()  # a list is taken as an array


@pytest.mark.parametrize("min_stage", [0, 32])
def test_detector_pair_gives_the_two_detectors_results(min_stage):
    """The engine's fused pass (stage.pair) reports, step by step, the events of the cue detector
    and the verdict of its combined twin, fed separately (what the simulator replays), through
    cue and routing-shift boundaries, several slots, a slot reset mid-way and two steps whose
    pieces outgrow the buffers the pair started with."""
    from saem_gguf.stage.pair import DetectorPair

    cfg = SyntheticConfig(n_sequences=3, seed=13, cue_prob=0.5, stage_len_scale=0.5)
    seqs = make_stage_traces(cfg).sequences
    cue_only = StageDetector(3, CueSet.load("general"), DetectorConfig(min_stage_tokens=min_stage), n_layer=48,
                             n_expert=128, top_k=8)
    twin = cue_only.fresh(use_implicit=True)
    pair = DetectorPair(cue_only.fresh())
    n_cue = n_twin = diverged = 0
    for step in range(max(s.n_tokens for s in seqs)):
        if step == 300:  # slot 1 starts a new sequence
            for d in (cue_only, twin, pair):
                d.reset(1, step)
        idx = np.array([i for i, s in enumerate(seqs) if step < s.n_tokens], np.int64)
        pieces = [seqs[i].pieces[step] for i in idx]
        if step in (150, 420):  # pieces with more cues than the pair's matcher buffer was made for
            pieces = [b"\nWait. " * 100 + p for p in pieces]
        routing = np.stack([seqs[i].experts[step] for i in idx])
        want_events = list(cue_only.feed(idx, pieces))
        twin_events = twin.feed(idx, pieces, routing)
        want_combined = bool(twin_events)
        # the twin's clock moved at a routing shift: it drops (or keeps) a cue the other keeps (drops)
        diverged += [e for e in twin_events if e.source == "cue"] != want_events
        got_events, got_combined = pair.feed(idx, pieces, routing)
        assert list(got_events) == want_events and got_combined == want_combined, step
        if step not in (150, 420):
            n_cue += len(want_events)
            n_twin += want_combined
    assert n_cue >= 20 and n_twin > n_cue  # cues and routing shifts both exercised
    assert (diverged > 0) == (min_stage > 0)  # the two clocks disagreed on some cue
    with pytest.raises(SaemError, match="cue-only"):
        DetectorPair(twin)
