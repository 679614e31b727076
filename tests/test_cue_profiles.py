"""Per-cue stage profiles (saem_gguf.policies.cue_profiles): stage cutting, the predictiveness
test that selects cues for saem-cue, JSON round trip, and detection with the real matcher."""

from __future__ import annotations

import numpy as np
import pytest

from saem_gguf.errors import SaemError
from saem_gguf.policies.cue_profiles import (
    START, cue_stage_counts, detected_cues, from_json, profile_gain, to_json,
)
from saem_gguf.trace import SequenceTrace


def _seq(experts, prompt=0, pieces=None):
    ex = np.asarray(experts, np.int16).reshape(-1, 1, 1)
    T = ex.shape[0]
    return SequenceTrace(token_ids=np.arange(T, dtype=np.int32), pieces=pieces or [b"x"] * T, experts=ex,
                         stage_starts=np.array([0], np.int32), prompt_len=prompt)


def test_cue_stage_counts_hand_computed():
    # prompt of 2 tokens; the detector reported "Wait" after token 3 and "Therefore" after token 6
    sq = _seq([3, 3, 0, 0, 1, 1, 1, 2, 2], prompt=2)
    got = cue_stage_counts([sq], [{3: "Wait", 6: "Therefore"}], 4)
    assert {k: v[0].tolist() for k, v in got.items()} == {
        START: [2, 0, 0, 0], "Wait": [0, 3, 0, 0], "Therefore": [0, 0, 2, 0]}
    assert {k: v.tolist() for k, v in from_json(to_json(got), 1, 4).items()} == {k: v.tolist() for k, v in got.items()}
    with pytest.raises(SaemError, match="cue_expert_counts"):
        from_json({"Wait": [[1, 2]]}, 1, 4)
    with pytest.raises(SaemError, match="one event map per sequence"):
        cue_stage_counts([sq], [], 4)


def test_profile_gain_keeps_a_cue_whose_stages_route_alike():
    # "V" always opens a stage on expert 3; the stage before it is on expert 0 or 1 (it varies);
    # "X" opens stages on a different expert each time, so its profile predicts nothing
    rng = np.random.default_rng(0)
    seqs, events = [], []
    for i in range(8):
        before = [i % 2] * 4
        x_stage = [int(rng.integers(4, 8))] * 4
        seqs.append(_seq(before + [3] * 4 + x_stage))
        events.append({3: "V", 7: "X"})
    g = profile_gain(seqs, events, 8, capacity=1)
    assert g["V"] == {"stages": 8, "hit_profile": 1.0, "hit_previous_stage": 0.0, "keep": True}
    assert g["X"]["hit_profile"] < 0.5 and g["X"]["hit_previous_stage"] == 0.0
    few = profile_gain(seqs[:3], events[:3], 8, capacity=1)
    assert few["V"]["keep"] is False  # fewer than min_stages stages: not enough evidence


def test_detected_cues_with_the_real_matcher():
    from saem_gguf.stage.cues import CueSet
    from saem_gguf.stage.detector import DetectorConfig, StageDetector

    pieces = [b"First", b" add", b".", b" Wait", b",", b" check", b".", b" Therefore", b",", b" 5", b"."]
    sq = _seq([0] * len(pieces), pieces=pieces)
    cues = CueSet.load("general")
    got = detected_cues([sq], lambda: StageDetector(1, cues, DetectorConfig(min_stage_tokens=1), n_layer=1,
                                                    n_expert=8, top_k=1))
    # each cue is confirmed by the punctuation after it (right boundary): reported there
    assert got == [{4: "Wait", 8: "Therefore"}]
