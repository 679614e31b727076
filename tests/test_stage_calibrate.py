"""Calibration (Tmodel pruning), TCseq, stage histograms and the profile file."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from saem_gguf.errors import SaemError
from saem_gguf.stage import (
    CalibrationConfig,
    CueSet,
    Profile,
    StageDetector,
    aggregate_stage,
    calibrate,
    calibrate_traceset,
    stage_histogram,
    stage_histograms,
    tcseq,
    top_experts,
    transition_coherence,
)
from saem_gguf.synthetic import SyntheticConfig, make_stage_traces
from saem_gguf.trace import ModelSignature

PLANTED = ("Alternatively", "Wait", "Let me verify", "Instead", "On second thought")


@pytest.fixture(scope="module")
def planted_traces():
    # "Therefore" is written at many sentence starts inside stages (a noisy marker); "Instead"
    # opens unrelated stages (coherence 0 at its boundaries).
    cfg = SyntheticConfig(n_layer=24, n_sequences=12, seed=11, stage_cues=PLANTED, noise_cues=("Therefore",),
                          noise_cue_rate=0.3, reset_cues=("Instead",), stage_len_scale=0.5, prompt_len=8)
    return make_stage_traces(cfg)


def test_recovers_planted_cues_and_rejects_noisy_and_incoherent_ones(planted_traces):
    cands = CueSet.load("general")
    prof = calibrate_traceset(planted_traces, cands, CalibrationConfig(min_stage_tokens=24))
    st = prof.stats["candidates"]
    assert set(prof.cues.texts) == set(PLANTED) - {"Instead"}
    assert not st["Therefore"]["kept"] and st["Therefore"]["reason"].startswith(("(a) too frequent", "(b)"))
    assert st["Instead"]["reason"].startswith("(c)")
    assert st["Hold on"]["reason"].startswith("(a) rare")
    # Accepting the noisy marker's frequency leaves segmentation noise (b) to reject it.
    prof_b = calibrate_traceset(planted_traces, cands, CalibrationConfig(min_stage_tokens=48, max_rate_per_1k=100))
    assert prof_b.stats["candidates"]["Therefore"]["reason"].startswith("(b)")
    summary = prof.stats["summary"]
    assert summary["planted_boundaries"]["recall"] > 0.6  # Instead's boundaries are dropped on purpose
    assert summary["planted_boundaries"]["precision"] > 0.95
    tc = summary["tcseq"]
    assert len(tc["per_layer"]) == 24 and tc["baseline"] == 0.25
    assert tc["overall"] > tc["baseline"] + 0.15
    assert prof.thresholds["min_stage_tokens"] == 24
    assert prof.implicit is not None and prof.implicit.high >= prof.implicit.low


def test_optional_shift_rule_rejects_markers_inside_stages(planted_traces):
    # Sentence openers of the filler ("Now", "Next") are frequent but mark no routing change.
    cands = CueSet.load("general").merged(CueSet.from_texts(["Now", "Next"]))
    cfg = CalibrationConfig(min_stage_tokens=24, fit_implicit=False)
    plain = calibrate_traceset(planted_traces, cands, cfg)
    assert {"Now", "Next"} <= set(plain.cues.texts)  # (a)-(c) alone cannot tell
    cfg.min_shift = 0.05
    strict = calibrate_traceset(planted_traces, cands, cfg)
    assert set(strict.cues.texts) == set(PLANTED) - {"Instead"}
    assert strict.stats["candidates"]["Now"]["reason"].startswith("(d)")
    assert strict.stats["candidates"]["Wait"]["shift"] > 0.05


def test_profile_round_trip_and_validation(tmp_path, planted_traces):
    prof = calibrate_traceset(planted_traces, CueSet.load("general"), CalibrationConfig(min_stage_tokens=24))
    p = tmp_path / "profile.json"
    prof.save(p)
    back = Profile.load(p, expect=planted_traces.signature)
    assert back.cues.texts == prof.cues.texts
    assert back.implicit == prof.implicit
    assert back.thresholds["min_stage_tokens"] == 24
    det = StageDetector.from_profile(back, 2)
    assert det.matcher is not None and det.implicit is not None

    other = ModelSignature(arch="qwen3moe", n_layer=48, n_expert=128, n_expert_used=8)
    with pytest.raises(SaemError, match="another model"):
        Profile.load(p, expect=other)
    d = json.loads(p.read_text())
    for mutate in (
        lambda d: d.update(version=99),
        lambda d: d.update(format="x"),
        lambda d: d.pop("signature"),
        lambda d: d["signature"].update(n_layer="many"),
        lambda d: d["signature"].update(n_expert_used=1000),
        lambda d: d["cues"]["cues"].append({"text": "x", "boundary": "?"}),
        lambda d: d["thresholds"].update(min_stage_tokens=-1),
        lambda d: d.update(implicit={"high": 0.1, "low": 0.5}),
    ):
        bad = json.loads(json.dumps(d))
        mutate(bad)
        q = tmp_path / "bad.json"
        q.write_text(json.dumps(bad))
        with pytest.raises(SaemError):
            Profile.load(q)
    q.write_text("{not json")
    with pytest.raises(SaemError):
        Profile.load(q)
    with pytest.raises(SaemError):
        Profile.load(tmp_path / "missing.json")


def test_a_profile_carries_its_calibration_sample(tmp_path, planted_traces):
    """stats.calibration_routing (what the adaptive saem replays at load) reads back as the
    sample written, gate weights dropped; one made for another model shape is refused."""
    from saem_gguf.simulator import calibration_sample
    from saem_gguf.stage.calibrate import encode_routing

    prof = calibrate_traceset(planted_traces, CueSet.load("general"), CalibrationConfig(min_stage_tokens=24))
    assert prof.routing is None
    sample = calibration_sample(planted_traces, 600)
    prof.stats["calibration_routing"] = encode_routing(sample)
    p = tmp_path / "profile.json"
    prof.save(p)
    back = Profile.load(p, expect=planted_traces.signature).routing
    assert len(back.sequences) == len(sample.sequences) == len(planted_traces.sequences)
    for a, b in zip(back.sequences, sample.sequences):
        assert np.array_equal(a.experts, b.experts) and a.pieces == b.pieces and a.prompt_len == b.prompt_len
        assert a.weights is None and a.stage_starts.tolist() == b.stage_starts.tolist()
    assert back.meta["request_lengths"] == [sq.decoded_tokens for sq in planted_traces.sequences]
    # request lengths a hand edit broke are refused at load, not when a batched replay reads them
    d = json.loads(p.read_text())
    for bad in ([], [None] * len(sample.sequences), [True] * len(sample.sequences),
                [0] * len(sample.sequences), [10**6] * (len(sample.sequences) + 1), "many"):
        edited = dataclasses.replace(sample, meta={**sample.meta, "request_lengths": bad})
        d["stats"]["calibration_routing"] = encode_routing(edited)
        p.write_text(json.dumps(d))
        with pytest.raises(SaemError, match="calibration_routing: request_lengths"):
            Profile.load(p)
    other = make_stage_traces(SyntheticConfig(n_layer=12, n_sequences=1, stage_len_scale=0.05))
    d = json.loads(p.read_text())
    d["stats"]["calibration_routing"] = encode_routing(other)
    p.write_text(json.dumps(d))
    with pytest.raises(SaemError, match="calibration_routing: model mismatch"):
        Profile.load(p)


def test_calibration_input_checks(planted_traces):
    seqs = planted_traces.sequences
    with pytest.raises(SaemError):
        calibrate([], 128, CueSet.load("general"))
    with pytest.raises(SaemError, match="n_expert"):
        calibrate(seqs[:1], 16, CueSet.load("general"))
    bad_sig = ModelSignature(arch="x", n_layer=3, n_expert=128, n_expert_used=8)
    with pytest.raises(SaemError, match="signature"):
        calibrate(seqs[:1], 128, CueSet.load("general"), signature=bad_sig)
    with pytest.raises(SaemError):
        CalibrationConfig(max_short_share=2.0).validate()


# ---------------------------------------------------------------------------- TCseq


def test_tcseq_hand_example():
    # One layer, 4 experts, capacity 2 (ratio 0.5). Stage A uses {0, 1} mostly.
    a = np.array([[5, 3, 1, 0]])
    b = np.array([[2, 2, 4, 0]])  # top-2 of A = {0, 1} serve 4 of b's 8 activations
    assert transition_coherence(a, b, 2)[0] == pytest.approx(0.5)
    assert transition_coherence(b, a, 2)[0] == pytest.approx((5 + 1) / 9)  # top-2 of b = {2, 0} (tie -> lower id)
    ex = np.zeros((12, 1, 1), np.int16)
    ex[:4, 0, 0] = [0, 0, 1, 1]  # stage 0 (4 tokens)
    ex[4:12, 0, 0] = [2, 2, 2, 2, 0, 0, 3, 3]  # stage 1 (8 tokens)
    res = tcseq([(ex, np.array([0, 4, 12]))], n_expert=4, capacity_ratio=0.5)
    assert res.n_transitions == 1 and res.capacity == 2 and res.baseline == 0.5
    assert res.overall == pytest.approx(2 / 8)  # only the two uses of expert 0 are served
    np.testing.assert_allclose(res.per_layer, [0.25])


def test_tcseq_tracks_synthetic_coherence():
    vals = {}
    for coh in (0.0, 0.5, 0.9):
        ts = make_stage_traces(SyntheticConfig(n_layer=8, n_sequences=4, seed=1, with_text=False, coherence=coh,
                                               stage_len_scale=0.3))
        vals[coh] = tcseq([(s.experts, np.r_[s.stage_starts, s.n_tokens]) for s in ts.sequences], 128).overall
    assert vals[0.0] < vals[0.5] < vals[0.9]
    assert vals[0.0] < 0.25 + 0.15  # unrelated stages: close to a random cache's hit rate


def test_stage_histograms_and_aggregation():
    rng = np.random.default_rng(0)
    ex = rng.integers(0, 10, size=(50, 3, 2)).astype(np.int16)
    ex[7, 1, 0] = -1  # an unrouted slot is ignored
    ref = np.zeros((3, 10), np.int64)
    for t in range(10, 40):
        for layer in range(3):
            for e in ex[t, layer]:
                if e >= 0:
                    ref[layer, e] += 1
    np.testing.assert_array_equal(stage_histogram(ex, 10, 10, 40), ref)
    hs = stage_histograms(ex, np.array([0, 10, 40, 50]), 10)
    assert hs.shape == (3, 3, 10)
    np.testing.assert_array_equal(hs[1], ref)
    assert hs.sum() == 50 * 3 * 2 - 1
    np.testing.assert_array_equal(aggregate_stage(hs), hs.sum(axis=0))
    top = top_experts(ref, 3)
    assert top.shape == (3, 3) and all(ref[layer, top[layer, 0]] == ref[layer].max() for layer in range(3))
    with pytest.raises(SaemError):
        stage_histogram(ex, 10, 40, 10)
    with pytest.raises(SaemError):
        stage_histogram(ex[0], 10)


def test_profile_with_no_kept_cue_still_loads(tmp_path, planted_traces):
    # Candidates that never occur: Tmodel is empty, the implicit detector remains.
    cands = CueSet.from_texts(["Nonexistent marker"])
    prof = calibrate_traceset(planted_traces, cands, CalibrationConfig(min_stage_tokens=24))
    assert len(prof.cues) == 0 and prof.implicit is not None
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    det = StageDetector.from_profile(back, 1)
    assert det.matcher is None and det.implicit is not None
