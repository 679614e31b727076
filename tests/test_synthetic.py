"""The synthetic stage-structured trace generator (shared with the simulator)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from saem_gguf.errors import SaemError
from saem_gguf.synthetic import (
    SyntheticConfig,
    _drift_and_noise,
    draw_stage_counts,
    draw_stage_lengths,
    fit_clipped_lognormal,
    make_stage_traces,
    sample_routing,
    zipf_affinity,
)
from saem_gguf.trace import SequenceTrace, TraceSet

SMALL = dict(n_layer=4, n_expert=32, top_k=4)


def test_shapes_types_and_contract():
    cfg = SyntheticConfig(n_sequences=3, seed=1, stage_len_scale=0.2, prompt_len=5, **SMALL)
    ts = make_stage_traces(cfg)
    assert isinstance(ts, TraceSet) and ts.source == "synthetic" and ts.meta["synthetic"] is True
    sig = ts.signature
    assert (sig.n_layer, sig.n_expert, sig.n_expert_used) == (4, 32, 4)
    assert len(ts.sequences) == 3
    for s in ts.sequences:
        assert isinstance(s, SequenceTrace)
        T = s.n_tokens
        assert s.token_ids.dtype == np.int32 and s.token_ids.shape == (T,)
        assert s.experts.dtype == np.int16 and s.experts.shape == (T, 4, 4)
        assert s.weights.dtype == np.float32 and s.weights.shape == (T, 4, 4)
        assert s.stage_starts.dtype == np.int32 and s.stage_starts[0] == 0
        assert np.all(np.diff(s.stage_starts) > 0) and s.stage_starts[-1] < T
        assert len(s.pieces) == T and all(isinstance(p, bytes) for p in s.pieces)
        assert s.prompt_len == 5
        b"".join(s.pieces).decode("utf-8")  # pieces may split characters, the text may not
        # top-k: distinct experts in range, gate weights sorted and normalised
        ex = s.experts.astype(np.int64)
        assert ex.min() >= 0 and ex.max() < 32
        srt = np.sort(ex, axis=2)
        assert np.all(np.diff(srt, axis=2) > 0)
        assert np.allclose(s.weights.sum(axis=2), 1.0, atol=1e-5)
        assert np.all(np.diff(s.weights, axis=2) <= 0)


def test_deterministic_in_the_seed():
    cfg = SyntheticConfig(n_sequences=2, seed=9, stage_len_scale=0.2, **SMALL)
    a, b = make_stage_traces(cfg), make_stage_traces(cfg)
    c = make_stage_traces(dataclasses.replace(cfg, seed=10))
    for x, y in zip(a.sequences, b.sequences):
        np.testing.assert_array_equal(x.experts, y.experts)
        assert x.pieces == y.pieces
    assert not np.array_equal(a.sequences[0].experts[:50], c.sequences[0].experts[:50])


def test_stage_statistics_follow_the_paper():
    cfg = SyntheticConfig()
    rng = np.random.default_rng(0)
    n = draw_stage_counts(cfg, rng, 40000)
    assert n.min() >= 1 and n.max() <= 49
    assert np.median(n) == 5 and abs(n.mean() - 8) < 0.3
    lens = draw_stage_lengths(cfg, rng, 40000)
    assert lens.min() >= 55 and lens.max() <= 7129
    assert abs(np.median(lens) - 271) < 10 and abs(lens.mean() - 484) < 15
    mu, s = fit_clipped_lognormal(271, 484, 55, 7129)
    assert mu == pytest.approx(np.log(271))
    short = draw_stage_lengths(dataclasses.replace(cfg, stage_len_scale=0.1), rng, 1000)
    assert short.min() >= 5 and np.median(short) < 40


def test_boundaries_carry_cues_and_stationary_has_none():
    cfg = SyntheticConfig(n_sequences=4, seed=2, stage_len_scale=0.2, **SMALL)
    ts = make_stage_traces(cfg)
    for s, cues in zip(ts.sequences, ts.meta["boundary_cues"]):
        assert len(cues) == len(s.stage_starts) and cues[0] is None
        for start, cue in zip(s.stage_starts[1:], cues[1:]):
            text = b"".join(s.pieces[start:start + 6]).decode("utf-8", "replace")
            assert text.startswith(cue)
            assert s.pieces[start - 1].endswith(b"\n\n")  # cues sit at a line start
    still = make_stage_traces(dataclasses.replace(cfg, stationary=True))
    for s in still.sequences:
        assert s.stage_starts.tolist() == [0]
        assert s.n_tokens > 100
    none = make_stage_traces(dataclasses.replace(cfg, cue_prob=0.0, n_stages=4))
    assert all(c is None for cues in none.meta["boundary_cues"] for c in cues)


def test_routing_follows_stage_affinity_coherence_and_skew():
    # Usage overlap of adjacent stages grows with coherence.
    def overlap(coh: float, skew: float = 1.2) -> float:
        cfg = SyntheticConfig(n_layer=6, n_expert=64, top_k=4, n_sequences=3, seed=4, with_text=False,
                              coherence=coh, skew=skew, n_stages=4, stage_len_scale=0.5)
        vals = []
        for s in make_stage_traces(cfg).sequences:
            b = np.r_[s.stage_starts, s.n_tokens]
            for k in range(len(b) - 2):
                h0, h1 = (np.stack([np.bincount(s.experts[lo:hi, layer].ravel(), minlength=64) for layer in range(6)])
                          for lo, hi in ((b[k], b[k + 1]), (b[k + 1], b[k + 2])))
                p0, p1 = h0 / h0.sum(1, keepdims=True), h1 / h1.sum(1, keepdims=True)
                vals.append(np.minimum(p0, p1).sum(1).mean())
        return float(np.mean(vals))

    assert overlap(0.0) < overlap(0.5) < overlap(0.95)
    # Higher skew concentrates routing on fewer experts.
    def top_share(skew: float) -> float:
        rng = np.random.default_rng(0)
        aff = zipf_affinity(rng, 2, 64, skew)[None]
        ex, _ = sample_routing(aff, np.zeros(2000, np.int64), 4, seed=1)
        counts = np.bincount(ex[:, 0].ravel(), minlength=64)
        return np.sort(counts)[::-1][:8].sum() / counts.sum()

    assert top_share(0.5) < top_share(1.2) < top_share(2.5)


def test_sampling_matches_the_affinity():
    # With top_k=1 the draws are plain categorical samples of the affinity.
    aff = np.array([[[0.5, 0.25, 0.125, 0.125]]])
    ex, w = sample_routing(aff, np.zeros(40000, np.int64), 1, seed=3)
    freq = np.bincount(ex.ravel(), minlength=4) / 40000
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.125, 0.125], atol=0.01)
    assert np.all(w == 1.0)
    # Extremely skewed affinity: still k distinct experts (the exact fallback path).
    sharp = np.full((1, 1, 16), 1e-12)
    sharp[0, 0, 3] = 1.0
    ex, _ = sample_routing(sharp, np.zeros(50, np.int64), 8, seed=1)
    assert all(len(set(row)) == 8 and 3 in row for row in ex[:, 0].tolist())


def test_bad_configs():
    with pytest.raises(SaemError):
        make_stage_traces(SyntheticConfig(top_k=200))
    with pytest.raises(SaemError):
        make_stage_traces(SyntheticConfig(coherence=1.5))
    with pytest.raises(SaemError):
        make_stage_traces(SyntheticConfig(n_sequences=0))
    with pytest.raises(SaemError):
        fit_clipped_lognormal(10, 5, 1, 100)


def _layer_hist(experts, a, b, n_expert):
    return np.bincount(experts[a:b].reshape(-1).astype(np.int64), minlength=n_expert)


def test_drift_and_token_noise():
    """drift_every moves a stage's hot set without a recorded boundary; token_noise spreads a
    share of the tokens over every expert; both off draws nothing more (the text, boundaries and
    routing of every other family stay as they were)."""
    base = SyntheticConfig(n_sequences=1, seed=5, n_stages=1, stage_len_scale=4.0, **SMALL)
    plain = make_stage_traces(base).sequences[0]
    # both off: the rows and the tokens' rows come back as they were, and the generator's state
    # has not moved, so nothing drawn after them changes
    rng = np.random.default_rng(9)
    state = rng.bit_generator.state
    aff, token_stage, starts = np.ones((2, 4, 32)), np.array([0, 0, 1, 1]), np.array([0, 2], np.int32)
    out_aff, out_stage = _drift_and_noise(base, rng, aff, token_stage, starts, 1)
    assert out_aff is aff and out_stage is token_stage and rng.bit_generator.state == state
    drift = make_stage_traces(dataclasses.replace(base, drift_every=100, drift_keep=0.0)).sequences[0]
    assert drift.pieces == plain.pieces and np.array_equal(drift.stage_starts, plain.stage_starts)
    E = SMALL["n_expert"]
    T = plain.n_tokens
    assert T >= 400

    def overlap(s, a, b, c, d):  # share of layer 0's routing mass that two windows have in common
        h1 = _layer_hist(s.experts[:, :1], a, b, E) / (b - a)
        h2 = _layer_hist(s.experts[:, :1], c, d, E) / (d - c)
        return np.minimum(h1, h2).sum() / h1.sum()

    # within one stage: the plain routing is one distribution, the drifting one moves
    assert overlap(plain, 0, 100, 300, 400) > 0.8
    assert overlap(drift, 0, 100, 300, 400) < overlap(plain, 0, 100, 300, 400) - 0.2
    noisy = make_stage_traces(dataclasses.replace(base, token_noise=1.0)).sequences[0]
    counts = _layer_hist(noisy.experts, 0, T, E)
    assert counts.min() > 0.6 * counts.mean()  # uniform over the experts
    with pytest.raises(SaemError, match="token_noise"):
        make_stage_traces(dataclasses.replace(base, token_noise=1.5))
    with pytest.raises(SaemError, match="drift_every"):
        make_stage_traces(dataclasses.replace(base, drift_every=-1))
