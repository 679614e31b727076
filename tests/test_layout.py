"""Slot layout (policies/layout.py): the default saem splits its slot budget over the layers by
pricing layouts, from a cache in every layer to whole layers resident as n-cpu-moe."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from saem_gguf.costmodel import C_SYNC, HW_PRESETS, MODEL_PRESETS, CostModel, t_gpu
from saem_gguf.policies import make_policy
from saem_gguf.policies.adaptive import CTL_FIRST_SWITCH, CTL_SCORED, resident_layers
from saem_gguf.policies.base import PolicyContext
from saem_gguf.policies.cue_profiles import START
from saem_gguf.policies.layout import choose_layout, expert_use_probability, layer_time_table, whole_layer_grid
from saem_gguf import simulator
from saem_gguf.simulator import (
    MIN_REPLAY_TOKENS, CalibrationReplay, SimConfig, calibration_counts, calibration_pricer, calibration_replay,
    calibration_sample, detector_events, lockstep_lengths, sequence_cues, simulate, split_to_batch,
)
from saem_gguf.synthetic import SyntheticConfig, make_stage_traces

HW = HW_PRESETS["rtx4090-ddr5"]
# a tiny expert (the embedded test model's size class): per-layer fixed costs dominate
SMALL = CostModel.from_expert_bytes(50_000, HW)
# Qwen3-30B-A3B's experts: their weights dominate
LARGE = CostModel.from_shape(MODEL_PRESETS["qwen3-30b-a3b"], HW)


def _skewed_calib(L, E, K, tokens=1000, skew=1.5, seed=0):
    """Token-level counts: each token picks K experts by a Zipf-like preference."""
    rng = np.random.default_rng(seed)
    calib = np.zeros((L, E))
    for l in range(L):
        p = 1.0 / np.arange(1, E + 1) ** skew
        p = p[rng.permutation(E)]
        for _ in range(tokens):
            calib[l, rng.choice(E, K, replace=False, p=p / p.sum())] += 1
    return calib


def test_use_probability_reads_token_level_counts():
    calib = np.array([[30.0, 10.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # 20 tokens of top-2 in layer 0
    q = expert_use_probability(calib, 2)
    assert q[0].tolist() == [1.0, 0.5, 0.0, 0.0]  # 30 uses in 20 tokens clips at 1
    assert q[1].tolist() == [0.5] * 4  # no counts: uniform top_k / E


def test_a_fully_resident_layer_has_no_round_trip():
    q = expert_use_probability(_skewed_calib(2, 16, 2), 2)
    table = layer_time_table(q, 1, SMALL.array)
    gpu_all = q.sum(axis=1) * t_gpu(1, SMALL.array)  # batch 1: P(used) * one-token GPU time
    assert np.allclose(table[:, 16], gpu_all)
    assert np.all(table[:, 15] > table[:, 16])  # one expert on the CPU: its run and maybe a round trip
    assert np.all(table[:, 0] >= SMALL.array[C_SYNC] * 0.99)  # nothing resident: a round trip nearly surely


def test_small_experts_flat_routing_get_whole_layers_large_experts_skewed_routing_a_cache_everywhere():
    L, E, K = 4, 32, 4
    calib = _skewed_calib(L, E, K, skew=0.3)  # flat routing: a partial cache saves little
    budget = np.full(L, 16, np.int32)  # ECR 50 %: two layers' worth
    small, t_small, t_uniform = choose_layout(calib, K, budget, 1, SMALL.array)
    assert int((small == E).sum()) >= 1 and t_small < t_uniform
    assert small.sum() <= budget.sum() and small.min() >= 0 and small.max() <= E
    # skewed routing, expert weights dominating: a cache in every layer holds the hot experts
    large, t_large, t_uniform_large = choose_layout(_skewed_calib(L, E, K, skew=1.5), K, budget, 1, LARGE.array)
    assert large.tolist() == budget.tolist() and t_large == t_uniform_large


def test_resident_layers_must_save_the_margin():
    """A layout with resident layers is kept only when its estimate beats the uniform one by
    ``min_gain`` (the estimate is pessimistic for the uniform cache): just above its gain, the
    uniform layout; just below, the same layout as with no margin."""
    L, E, K = 4, 32, 4
    calib = _skewed_calib(L, E, K, skew=0.3)
    budget = np.full(L, 16, np.int32)
    free, t_free, t_uniform = choose_layout(calib, K, budget, 1, SMALL.array, min_gain=0.0)
    gain = 1.0 - t_free / t_uniform
    assert int((free == E).sum()) >= 1 and gain > 0
    kept, t_kept, _ = choose_layout(calib, K, budget, 1, SMALL.array, min_gain=gain * 0.99)
    assert kept.tolist() == free.tolist() and t_kept == t_free
    uniform, t_u, _ = choose_layout(calib, K, budget, 1, SMALL.array, min_gain=gain * 1.01)
    assert uniform.tolist() == budget.tolist() and t_u == t_uniform


@pytest.mark.parametrize("total", [0, 1, 7, 33, 64, 128])
def test_layouts_spend_at_most_the_budget(total):
    L, E, K = 4, 32, 4
    budget = np.full(L, total // L, np.int32)
    budget[0] += total - budget.sum()
    for cost in (SMALL, LARGE):
        slots, _, _ = choose_layout(_skewed_calib(L, E, K), K, budget, 8, cost.array)
        assert slots.sum() == budget.sum() and slots.min() >= 0 and slots.max() <= E


def test_saem_starts_with_the_chosen_layout_and_uniform_on_request():
    L, E, K = 4, 32, 4
    calib = _skewed_calib(L, E, K, skew=0.3)
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calib)
    chosen, _, _ = choose_layout(calib, K, ctx.n_slots, 1, SMALL.array)
    state = make_policy("saem").start(ctx)
    assert state.n_slots.tolist() == chosen.tolist()
    state.check()
    for l in np.flatnonzero(chosen == E):
        assert np.all(state.slot_of[l] >= 0)  # a fully resident layer holds every expert from load
    uniform = make_policy("saem", layout="uniform").start(ctx)
    assert uniform.n_slots.tolist() == [16] * L


def _flat_routing(rng, steps, L, E, K):
    r = np.empty((steps, 1, L, K), np.int16)
    for s in range(steps):
        for l in range(L):
            r[s, 0, l] = rng.choice(E, K, replace=False)
    return r


def test_where_whole_layers_pay_saem_is_not_behind_n_cpu_moe():
    """Tiny experts, flat routing: a partial cache in every layer pays the CPU round trip at every
    layer and step, whole resident layers do not. The uniform layout loses to n-cpu-moe there;
    the chosen layout must not (simulated tokens/s, same trace and budget)."""
    from saem_gguf.policies.state import RoutingBlock
    from saem_gguf.simulator import run_policy

    rng = np.random.default_rng(5)
    L, E, K, S = 4, 32, 4, 16
    calib = np.zeros((L, E))
    for step in _flat_routing(rng, 300, L, E, K)[:, 0]:
        for l in range(L):
            calib[l, step[l]] += 1
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, S, np.int32), cost=SMALL,
                        calib_counts=calib)
    blk = RoutingBlock(routing=_flat_routing(rng, 400, L, E, K), event_steps=np.zeros(0, np.int32))
    tok = {"saem": run_policy("saem", [blk], ctx)["tok_s"],
           "n-cpu-moe": run_policy("n-cpu-moe", [blk], ctx)["tok_s"],
           "uniform": run_policy("saem", [blk], ctx, {"layout": "uniform"})["tok_s"]}
    assert tok["uniform"] < tok["n-cpu-moe"], tok  # the case the layout decision exists for
    assert tok["saem"] >= tok["n-cpu-moe"] * (1 - 1e-9), tok  # same layout here: equal up to rounding


def test_a_named_count_of_resident_layers_is_kept_as_asked():
    """layout="resident-N" is auto's candidate with N whole layers (clamped to what the budget
    holds): what bench_layout.py measures auto's choice against."""
    L, E, K = 6, 32, 4
    calib = _skewed_calib(L, E, K, skew=0.3)
    budget = np.full(L, 16, np.int32)  # 96 slots: at most 3 whole layers
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=budget, cost=SMALL, calib_counts=calib)
    for n, whole in ((0, 0), (2, 2), (3, 3), (9, 3)):
        slots, _, _ = choose_layout(calib, K, budget, 1, SMALL.array, resident=n)
        assert int((slots == E).sum()) == whole and slots.sum() == budget.sum()
        state = make_policy("saem", layout=f"resident-{n}").start(ctx)
        assert state.n_slots.tolist() == slots.tolist()
    zero, _, _ = choose_layout(calib, K, budget, 1, SMALL.array, resident=0)
    assert zero.tolist() == [16] * L  # no whole layer: the uniform layout
    for bad in ("resident", "resident-x", "resident--1", "whole-2", "Auto"):
        with pytest.raises(ValueError, match="resident-N"):
            make_policy("saem", layout=bad)


@pytest.mark.parametrize("calibrated", [True, False])
def test_whole_layers_start_with_every_expert(calibrated):
    """A whole layer holds every expert from load, as n-cpu-moe's do, even the experts calibration
    never saw (without calibration, all of them): else each is copied in on its first use while
    decoding (the first device run's saem at ECR 50 % without a profile: 0.85x n-cpu-moe, the same
    layout, simulated on its costs)."""
    L, E, K = 6, 32, 4
    calib = _skewed_calib(L, E, K, skew=0.3) if calibrated else None
    if calib is not None:
        calib[:, E // 2:] = 0  # half the experts never routed to in calibration
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calib)
    state = make_policy("saem", layout="resident-2").start(ctx)
    whole = state.n_slots == E
    assert whole.sum() == 2
    assert (state.slot_of[whole] >= 0).all()
    # the cached layers: the calibrated top experts, as before; no evidence, no copy (the slots
    # wait for the routing)
    held = (state.slot_of[~whole] >= 0).sum(axis=1)
    expect = np.minimum(state.n_slots[~whole], (calib[~whole] > 0).sum(axis=1)) if calibrated else 0
    assert (held == expect).all()


def test_whole_layer_grid_spans_uniform_to_every_whole_layer():
    assert whole_layer_grid(24, 7) == [0, 4, 8, 12, 16, 20, 24]
    assert whole_layer_grid(3) == [0, 1, 2, 3]
    assert whole_layer_grid(0) == [0] and whole_layer_grid(12, 1) == [0]


def _calibration(L, E, K, n_sequences=3, seed=5):
    cfg = SyntheticConfig(n_layer=L, n_expert=E, top_k=K, n_sequences=n_sequences, stage_len_scale=0.1, seed=seed)
    return make_stage_traces(cfg)


def _fold_replays(sample, ctx, layout, batch=1):
    """(tokens/s, the policies) of plain replays of saem held to ``layout`` over each fold of
    ``sample`` (every other sequence; at least 4 sequences), each started on the other fold's
    counts: the pricer's recipe written out."""
    from saem_gguf.accounting import A_TOKENS, Accounting
    from saem_gguf.simulator import replay

    n = len(sample.sequences)
    assert n >= 4
    halves = [[sample.sequences[i] for i in range(h, n, 2)] for h in (0, 1)]
    tokens = seconds = 0.0
    policies = []
    for h in (0, 1):
        counts = np.zeros((ctx.n_layer, ctx.n_expert))
        for sq in halves[1 - h]:
            np.add.at(counts, (np.arange(ctx.n_layer)[None, :, None], sq.experts.astype(np.int64)), 1.0)
        pol = make_policy("saem", layout=layout)
        pol.start(PolicyContext(n_layer=ctx.n_layer, n_expert=ctx.n_expert, top_k=ctx.top_k, n_slots=ctx.n_slots,
                                cost=ctx.cost, calib_counts=counts, batch=batch))
        fold = dataclasses.replace(sample, sequences=halves[h], meta={})
        acct = Accounting()
        replay(pol, CalibrationReplay(fold).blocks(batch), acct)
        tokens, seconds = tokens + acct.counters[A_TOKENS], seconds + acct.clock[0]
        policies.append(pol)
    return tokens / seconds, policies


def test_a_calibration_replay_decodes_as_many_sequences_at_once_as_the_batch():
    """A sample of fewer sequences than the batch, that does not say how long its requests ran,
    is replayed with its longest sequences' decoded tokens cut in two until the batch is full: the
    same tokens (the same counts), every part a sequence of its own whose recorded cues still
    match its stage starts, one block as wide as the batch. A batch the sample fills, and a
    sequence of one decoded token, are left whole."""
    L, E, K = 6, 32, 4
    sample = _without_request_lengths(calibration_sample(_calibration(L, E, K), 1500))
    assert len(sample.sequences) == 3
    wide = split_to_batch(sample, 8)
    assert len(wide.sequences) == 8
    assert sum(sq.n_tokens for sq in wide.sequences) == sum(sq.n_tokens for sq in sample.sequences)
    np.testing.assert_array_equal(calibration_counts(wide, L, E), calibration_counts(sample, L, E))
    assert sorted(sq.prompt_len for sq in wide.sequences) == [0] * 5 + sorted(sq.prompt_len for sq in sample.sequences)
    decoded = sorted(sq.decoded_tokens for sq in wide.sequences)
    assert decoded[-1] - decoded[0] <= max(sq.n_tokens for sq in sample.sequences) // 2  # the longest were cut
    for sq, cues in zip(wide.sequences, sequence_cues(wide)):
        assert sq.stage_starts[0] == 0 and cues is not None and len(cues) == len(sq.stage_starts)
    blocks = CalibrationReplay(sample).blocks(8)
    assert len(blocks) == 1 and blocks[0].routing.shape[1] == 8
    assert split_to_batch(sample, 3) is sample and len(CalibrationReplay(sample).blocks(1)) == 3
    one = calibration_sample(_calibration(L, E, K, n_sequences=1), 1)  # one decoded token
    assert [sq.decoded_tokens for sq in one.sequences] == [1] and split_to_batch(one, 8) is one


def _without_request_lengths(ts):
    return dataclasses.replace(ts, meta={k: v for k, v in ts.meta.items() if k != "request_lengths"})


def _lockstep_lengths_by_enumeration(lengths, batch):
    """lockstep_lengths the slow, obvious way: every one of the len(lengths) ** batch equally
    likely batches drawn with replacement, its rows sorted longest first, averaged."""
    draws = np.array(list(itertools.product(lengths, repeat=batch)), np.float64)
    return np.sort(draws, axis=1)[:, ::-1].mean(axis=0)


@pytest.mark.parametrize("lengths,batch", [([5], 3), ([1, 2], 1), ([100, 30, 30, 7], 3), ([9, 400, 52], 5),
                                           ([3, 3, 3], 4), ([1000, 10, 250, 40, 1], 4)])
def test_lockstep_lengths_are_the_expected_rows_of_a_drawn_batch(lengths, batch):
    np.testing.assert_allclose(lockstep_lengths(lengths, batch), _lockstep_lengths_by_enumeration(lengths, batch),
                               rtol=1e-12)


def test_lockstep_lengths_against_enumeration_on_random_inputs():
    rng = np.random.default_rng(5)
    for _ in range(20):
        lengths = rng.integers(1, 3000, rng.integers(1, 6)).tolist()
        batch = int(rng.integers(1, 6))
        np.testing.assert_allclose(lockstep_lengths(lengths, batch), _lockstep_lengths_by_enumeration(lengths, batch),
                                   rtol=1e-12)


def test_a_calibration_replay_thins_out_as_a_lockstep_batch_of_its_requests_does():
    """A sample that says how long its requests ran (calibration_sample keeps every sequence's whole
    decoded length) is cut into as many parts as the batch, in proportion to the rows of a lockstep
    batch of such requests (lockstep_lengths): the same tokens, every part a sequence whose cues
    match its stage starts, every sequence's first part (with its prompt) first; one block as wide
    as the batch, whose rows end as the batch's would, not together. Each fold keeps every
    request's length."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4, seed=11)
    sample = calibration_sample(calib, 1500)
    assert sample.meta["request_lengths"] == [sq.decoded_tokens for sq in calib.sequences]
    for batch in (5, 8):
        wide = split_to_batch(sample, batch)
        assert len(wide.sequences) == batch
        np.testing.assert_array_equal(calibration_counts(wide, L, E), calibration_counts(sample, L, E))
        assert [sq.prompt_len for sq in wide.sequences[:4]] == [sq.prompt_len for sq in sample.sequences]
        assert all(sq.prompt_len == 0 for sq in wide.sequences[4:])
        for sq, cues in zip(wide.sequences, sequence_cues(wide)):
            assert sq.stage_starts[0] == 0 and cues is not None and len(cues) == len(sq.stage_starts)
        rows = np.sort([sq.decoded_tokens for sq in wide.sequences])[::-1]
        assert rows[-1] < 0.8 * rows[0]  # the batch thins out
        (block,) = CalibrationReplay(sample).blocks(batch)
        active = (block.routing[:, :, 0, 0] >= 0).sum(axis=1)
        assert active[0] == batch and active[-1] < batch
    for fold in CalibrationReplay(sample).folds():
        assert fold.replay.sample.meta["request_lengths"] == sample.meta["request_lengths"]
        assert len(fold.replay.blocks(8)[0].routing[0]) == 8
    # one sequence: its parts are the rows' lengths to the cut's rounding (several sequences are
    # cut each in proportion to the rows it got, so that no part crosses two requests)
    one = dataclasses.replace(sample, sequences=sample.sequences[:1], meta={"request_lengths": [40, 300, 90]})
    wide = split_to_batch(one, 6)
    want = lockstep_lengths([40, 300, 90], 6)
    want = want / want.sum() * one.decoded_tokens
    assert [sq.prompt_len for sq in wide.sequences] == [one.sequences[0].prompt_len] + [0] * 5
    assert np.abs(np.sort([sq.decoded_tokens for sq in wide.sequences])[::-1] - want).max() <= 1
    # a request that decoded nothing is a row as it is; lengths of nothing cut into halves
    head = sample.sequences[0]
    asked = dataclasses.replace(head, token_ids=head.token_ids[:head.prompt_len], pieces=head.pieces[:head.prompt_len],
                                experts=head.experts[:head.prompt_len], stage_starts=np.zeros(1, np.int32))
    for lengths in ([0, 120, 40], [0, 0]):
        some = dataclasses.replace(sample, sequences=[asked, *sample.sequences[1:]],
                                   meta={**sample.meta, "request_lengths": lengths})
        wide = split_to_batch(some, 8)
        assert len(wide.sequences) == 8 and wide.sequences[0] is asked
        np.testing.assert_array_equal(calibration_counts(wide, L, E), calibration_counts(some, L, E))


def test_the_calibration_replay_prices_each_fold_on_the_other_folds_counts():
    """What the calibration counts place (static, the caches' priors) is priced on routing it was
    not fitted to: the sample's sequences in two folds (every other one), each replayed by a fresh
    policy started on the other fold's counts, the price every fold's tokens over their time; a
    sample too small for two folds of two sequences is one fold on the context's counts."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4, seed=11)
    sample = calibration_sample(calib, 1500)
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calibration_counts(calib, L, E))
    folds = CalibrationReplay(sample).folds()
    assert [len(f.replay.sample.sequences) for f in folds] == [2, 2]
    for h, fold in enumerate(folds):
        other = dataclasses.replace(sample, sequences=sample.sequences[1 - h::2], meta={})
        np.testing.assert_array_equal(fold.calib_counts, calibration_counts(other, L, E))
    tok, replayed = calibration_pricer(CalibrationReplay(sample), ctx)(lambda: make_policy("saem", layout="resident-1"))
    want, held = _fold_replays(sample, ctx, "resident-1")
    assert tok == pytest.approx(want, rel=1e-12) and len(replayed) == 2
    assert [p.led_steps() for p in replayed] == [p.led_steps() for p in held]
    for n in (1, 3):
        small = dataclasses.replace(sample, sequences=sample.sequences[:n], meta={})
        (fold,) = CalibrationReplay(small).folds()
        assert fold.calib_counts is None and fold.cue_counts is None and fold.replay.sample is small
    tok, (one,) = calibration_pricer(CalibrationReplay(small), ctx)(lambda: make_policy("saem", layout="resident-1"))
    assert one.ctx.calib_counts is ctx.calib_counts


def _hand_cue_profiles(sample, which, n_expert, template=None):
    """Per cue text (START for a sequence's first stage), the routing counts [L, E] of the stages
    that cue opened in ``sample``'s sequences ``which``: a stage runs from the token after the
    detector (the default one, or the engine's ``template``) reported its cue to the next cue or
    the sequence's end (no prompt here)."""
    out = {}
    for i in which:
        sq = sample.sequences[i]
        assert sq.prompt_len == 0
        cued = detector_events(dataclasses.replace(sample, sequences=[sq], meta={}), template=template)[0][2]
        starts = [0, *sorted(t + 1 for t in cued if t + 1 < sq.n_tokens), sq.n_tokens]
        for a, b in zip(starts[:-1], starts[1:]):
            key = START if a == 0 else cued[a - 1]
            h = out.setdefault(key, np.zeros((sq.experts.shape[1], n_expert)))
            np.add.at(h, (np.arange(h.shape[0])[None, :, None], sq.experts[a:b].astype(np.int64)), 1.0)
    return out


def test_each_fold_of_the_calibration_replay_gets_the_other_folds_cue_profiles():
    """saem's stage candidate blends a cued stage's calibrated profile into its ranking (as
    saem-cue): profiles built on the replayed stages themselves foretell them, so each fold
    starts on the other fold's per-cue stage profiles, and only on the cues the context keeps a
    profile for (the engine keeps those that predict their stages); with none in the context,
    none. A sample of one fold replays on no profile: the context's hold the stages replayed."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4, seed=11)
    sample = calibration_sample(calib, 1500)
    everywhere = _hand_cue_profiles(sample, range(4), E)
    assert len(everywhere) >= 4, "too few cues in the sample for the test to mean anything"
    kept = sorted(everywhere)[1:]  # one cue without a profile in the context
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calibration_counts(calib, L, E), cue_counts={c: everywhere[c] for c in kept})
    tok, replayed = calibration_pricer(CalibrationReplay(sample), ctx)(lambda: make_policy("saem", layout="resident-1"))
    for h, pol in enumerate(replayed):
        want = _hand_cue_profiles(sample, range(1 - h, 4, 2), E)
        got = pol.ctx.cue_counts
        assert sorted(got) == sorted(c for c in want if c in kept)
        for c in got:
            np.testing.assert_array_equal(got[c], want[c])
    assert any(not np.array_equal(replayed[0].ctx.cue_counts.get(c, 0), everywhere[c]) for c in kept)
    bare = dataclasses.replace(ctx, cue_counts=None)
    _, replayed = calibration_pricer(CalibrationReplay(sample), bare)(lambda: make_policy("saem", layout="resident-1"))
    assert [p.ctx.cue_counts for p in replayed] == [None, None]
    small = dataclasses.replace(sample, sequences=sample.sequences[:3], meta={})
    _, (one,) = calibration_pricer(CalibrationReplay(small), ctx)(lambda: make_policy("saem", layout="resident-1"))
    assert one.ctx.cue_counts is None and one.ctx.calib_counts is ctx.calib_counts


def test_the_engines_replay_cuts_the_fold_profiles_with_the_engines_own_detector():
    """The engine replays its profile's sample under its own detector (placement.py: the
    CalibrationReplay's ``template``), whose cues and thresholds are the profile's: the other
    fold's cue profiles are cut by that detector's cue events, not the default cue set's; a
    detector that detects no cue leaves each fold the START profile (a sequence's first stage)."""
    from saem_gguf.stage import CueSet, DetectorConfig, StageDetector

    L, E, K = 6, 32, 4
    sample = calibration_sample(_calibration(L, E, K, n_sequences=4, seed=11), 1500)
    engine = StageDetector(1, CueSet.load("general").subset(["Wait", "Instead", "Hmm"]),
                           DetectorConfig(min_stage_tokens=40), n_layer=L, n_expert=E, top_k=K)
    default = _hand_cue_profiles(sample, range(4), E)
    everywhere = _hand_cue_profiles(sample, range(4), E, engine)
    assert sorted(everywhere) != sorted(default), "the engine's detector cuts as the default does: no test"
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calibration_counts(sample, L, E), cue_counts={**default, **everywhere})
    folds = CalibrationReplay(sample, template=engine).folds()
    for h, fold in enumerate(folds):
        want = _hand_cue_profiles(sample, range(1 - h, 4, 2), E, engine)
        got = fold.context(ctx).cue_counts
        assert sorted(got) == sorted(want)
        for c in got:
            np.testing.assert_array_equal(got[c], want[c])
    implicit_only = StageDetector(1, None, DetectorConfig(use_cues=False, use_implicit=True), n_layer=L, n_expert=E,
                                  top_k=K)
    for h, fold in enumerate(CalibrationReplay(sample, template=implicit_only).folds()):
        got = fold.context(ctx).cue_counts
        assert list(got) == [START]
        np.testing.assert_array_equal(got[START], calibration_counts(
            dataclasses.replace(sample, sequences=sample.sequences[1 - h::2], meta={}), L, E))


def test_auto_replays_itself_on_the_calibration_routing_and_keeps_the_fastest_layout():
    """With calibration routing in the context, saem's auto layout is the count of whole layers
    (of whole_layer_grid) under which the policy itself replays that routing fastest (the fewest
    within the short replay's margin: the tests below). Each price is what a plain replay of
    saem held to that count gives (nothing carries over from one replay to the next), and the
    layout is that count's."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4)
    sample = calibration_sample(calib, 1500)
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calibration_counts(calib, L, E))
    ctx.replay_calibration = calibration_pricer(CalibrationReplay(sample), ctx)
    pol = make_policy("saem")
    state = pol.start(ctx)
    prices = pol.layout_prices
    assert list(prices) == whole_layer_grid(3) == [0, 1, 2, 3]  # 96 slots: 3 whole layers at most
    assert len(set(prices.values())) > 1, "every layout priced alike: the replay measured nothing"
    assert 0 < pol.layout_margin_used < 0.01  # layout_warmup_steps over some hundred steps
    best = min(n for n, tok in prices.items() if tok >= max(prices.values()) * (1 - pol.layout_margin_used))
    assert int((state.n_slots == E).sum()) == best
    expect, _, _ = choose_layout(ctx.calib, K, ctx.n_slots, 1, SMALL.array, resident=best)
    assert state.n_slots.tolist() == expect.tolist()
    for n in reversed(list(prices)):  # in another order than the policy's
        assert _fold_replays(sample, ctx, f"resident-{n}")[0] == pytest.approx(prices[n], rel=1e-12)
    # a layout named or uniform replays nothing
    for layout in ("uniform", "resident-2"):
        named = make_policy("saem", layout=layout)
        named.start(ctx)
        assert named.layout_prices == {}


def _margin_replay(batch):
    """(context, calibration sample, its real pricer) of the layout-margin tests: 6 layers of 32
    experts, top-4, 16 slots a layer, a 4-sequence sample replayed at ``batch``."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4)
    sample = calibration_sample(calib, 1500)
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                        calib_counts=calibration_counts(calib, L, E), batch=batch)
    return ctx, sample, calibration_pricer(CalibrationReplay(sample), ctx)


@pytest.mark.parametrize("batch", [1, 2])
def test_at_a_batch_a_layout_needs_the_margin_over_fewer_whole_layers(batch):
    """Above batch 1 the count chosen is the fewest whole layers whose replay runs within
    layout_margin of the fastest; at batch 1 layout_margin does not count (the fastest; with
    layout_warmup_steps 0, the short replay's margin, below, is none). The replays are real;
    their prices are set here (a near-tie within the margin, 2 fastest) so that the rules differ."""
    ctx, _, real = _margin_replay(batch)
    E = ctx.n_expert
    set_price = {0: 99.0, 1: 99.85, 2: 100.0, 3: 99.95}

    def pricer(make):
        _, replayed = real(make)
        return set_price[resident_layers(replayed[0].adaptive.layout)], replayed

    ctx.replay_calibration = pricer
    pol = make_policy("saem", layout_warmup_steps=0.0)
    state = pol.start(ctx)
    assert pol.layout_prices == set_price and pol.adaptive.layout_margin == 0.002
    assert int((state.n_slots == E).sum()) == (2 if batch == 1 else 1)
    wide = make_policy("saem", layout_margin=0.02, layout_warmup_steps=0.0)
    assert int((wide.start(ctx).n_slots == E).sum()) == (2 if batch == 1 else 0)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_short_replay_widens_the_margin_by_its_steps(batch):
    """The margin is layout_warmup_steps over the replay's decode steps, and at a batch at least
    layout_margin: the same replay prices (a near-tie, 2 fastest, 1 within 0.4 %) choose 1 under
    a margin of 0.6 %, and 2 under 0.1 % (at a batch, layout_margin's 0.2 %). The replays are
    real, and their steps are the steps every fold decoded. Batch 1 too: a short replay
    undervalues a cache's slots there as well (drawn-6-10, ECR 25 %, docs/POLICIES.md)."""
    ctx, sample, real = _margin_replay(batch)
    E = ctx.n_expert
    steps = sum(blk.n_steps for fold in CalibrationReplay(sample).folds() for blk in fold.replay.blocks(batch))
    assert steps > 0
    set_price = {0: 99.0, 1: 99.6, 2: 100.0, 3: 99.95}

    def pricer(make):
        _, replayed = real(make)
        return set_price[resident_layers(replayed[0].adaptive.layout)], replayed

    ctx.replay_calibration = pricer
    for warmup, margin, whole in ((0.006 * steps, 0.006, 1), (0.001 * steps, 0.001 if batch == 1 else 0.002, 2)):
        pol = make_policy("saem", layout_warmup_steps=warmup)
        state = pol.start(ctx)
        assert pol.layout_margin_used == pytest.approx(margin, rel=1e-12)
        assert int((state.n_slots == E).sum()) == whole


def test_the_leader_at_start_is_the_rule_that_led_the_calibration_replay():
    """Under the copy barrier (the engine's), saem's real cache starts following the candidate
    that led the most steps when the policy replayed its calibration routing under the layout it
    chose (the steps each led are plain replays' of its folds, held to that layout), and each
    candidate's score starts at its mean over those replays' steps; a leader named in the options
    wins; without a replay (uniform layout) or without the barrier it is lrfu-16, temporal-cpu's
    rule. The scores start at the replay's means with or without the barrier, and at 0 without a
    replay; under the barrier the first_switch steps are the run's own, not the prior's."""
    L, E, K = 6, 32, 4
    # paper-length stages: here the replay's most-led rule is lrfu-32, not the default lrfu-16
    calib = make_stage_traces(SyntheticConfig(n_layer=L, n_expert=E, top_k=K, n_sequences=4, seed=11))
    sample = calibration_sample(calib, 1500)
    barrier = CostModel.from_expert_bytes(SMALL.expert_bytes, SMALL.hw.replace(copy_barrier=True))
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 8, np.int32), cost=barrier,
                        calib_counts=calibration_counts(calib, L, E))
    ctx.replay_calibration = calibration_pricer(CalibrationReplay(sample), ctx)
    pol = make_policy("saem")
    state = pol.start(ctx)
    n = int((state.n_slots == E).sum())
    _, held = _fold_replays(sample, ctx, f"resident-{n}")
    led = {c: sum(p.led_steps()[c] for p in held) for c in pol.adaptive.candidates}
    assert pol.replay_led == led and sum(led.values()) > 0
    # the scores start where those replays left them on average over all their steps, worth
    # prior_steps (16) steps
    mean = sum(p.mean_scores() * p.scored_steps() for p in held) / sum(p.scored_steps() for p in held)
    np.testing.assert_allclose(pol.replay_score, mean, rtol=1e-12)
    np.testing.assert_array_equal(pol._score, pol.replay_score)
    assert pol._ctl[CTL_SCORED] == pol.adaptive.prior_steps == 16
    # and the run's own first steps, not the prior's, must pass before it may switch away
    assert pol._ctl[CTL_FIRST_SWITCH] == pol.adaptive.first_switch + 16 == 24
    unprimed = make_policy("saem", prior_steps=0)
    unprimed.start(ctx)
    assert not unprimed._score.any() and unprimed._ctl[CTL_SCORED] == 0
    names = [c for c, _, _ in pol.candidates]
    assert pol.leader == max(names, key=lambda c: (led[c], -names.index(c))) == "lrfu-32"
    named = make_policy("saem", start_leader="lfu")
    named.start(ctx)
    assert named.leader == "lfu"
    uniform = make_policy("saem", layout="uniform")
    uniform.start(ctx)
    assert uniform.replay_led == {} and uniform.leader == "lrfu-16" and not uniform._score.any()
    plain = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 8, np.int32), cost=SMALL,
                          calib_counts=ctx.calib_counts)
    plain.replay_calibration = calibration_pricer(CalibrationReplay(sample), plain)
    no_barrier = make_policy("saem")
    no_barrier.start(plain)
    assert sum(no_barrier.replay_led.values()) > 0 and no_barrier.leader == "lrfu-16"
    # the prior is the replays', as under the barrier (held to the layout it chose there)
    _, held_plain = _fold_replays(sample, plain, f"resident-{int((no_barrier.state.n_slots == E).sum())}")
    mean = sum(p.mean_scores() * p.scored_steps() for p in held_plain) / sum(p.scored_steps() for p in held_plain)
    np.testing.assert_allclose(no_barrier._score, mean, rtol=1e-12)
    assert no_barrier._ctl[CTL_SCORED] == 16
    assert no_barrier._ctl[CTL_FIRST_SWITCH] == no_barrier.adaptive.first_switch  # the prior's steps count


def test_simulate_gives_saem_its_calibration_sample_to_replay():
    """simulate() prices saem's layouts on calibration_sample(calib), at each batch size, with the
    events of the detector the replayed traces get: the row's layout is that replay's choice."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4, seed=7)
    ts = _calibration(L, E, K, n_sequences=2, seed=8)
    cfg = SimConfig(policies=("saem",), ecrs=(50.0,), batches=(1, 2))
    res = simulate(ts, cfg, SMALL, calib=calib)
    sample = calibration_sample(calib)
    for B in (1, 2):
        ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, 16, np.int32), cost=SMALL,
                            calib_counts=calibration_counts(calib, L, E), batch=B)
        ctx.replay_calibration = calibration_pricer(CalibrationReplay(sample, "detector", cfg.cues), ctx)
        pol = make_policy("saem")
        state = pol.start(ctx)
        assert len(pol.layout_prices) == 4
        assert res.select(batch=B, ecr=50.0)[0]["whole_layers"] == int((state.n_slots == E).sum())


def test_a_sample_too_short_to_replay_is_not_replayed(monkeypatch):
    """calibration_replay gates the replay on the sample's decoded tokens: with fewer than
    MIN_REPLAY_TOKENS (or no sample) there is none, and simulate() gives saem no pricer, so it
    sets up as where no sample is known (the static estimate); with enough, one per cell. The
    engine's placement goes through the same gate."""
    L, E, K = 6, 32, 4
    calib = _calibration(L, E, K, n_sequences=4, seed=7)
    short = calibration_sample(calib, MIN_REPLAY_TOKENS - 1)
    enough = calibration_sample(calib, 2 * MIN_REPLAY_TOKENS)
    assert 0 < short.decoded_tokens < MIN_REPLAY_TOKENS <= enough.decoded_tokens
    assert calibration_replay(None) is None and calibration_replay(short) is None
    replay = calibration_replay(enough, "detector", "qwen3")
    assert isinstance(replay, CalibrationReplay) and replay.sample is enough and replay.cues == "qwen3"
    priced = []
    real = simulator.calibration_pricer
    monkeypatch.setattr(simulator, "calibration_pricer", lambda c, ctx: priced.append(c.sample) or real(c, ctx))
    ts = _calibration(L, E, K, n_sequences=2, seed=8)
    cfg = SimConfig(policies=("saem",), ecrs=(25.0, 50.0), batches=(1,))
    short_rows = simulate(ts, cfg, SMALL, calib=short).rows
    assert priced == []
    for row in short_rows:  # the static estimate's layout
        n_slots = np.full(L, row["slots"], np.int32)
        expect, _, _ = choose_layout(calibration_counts(short, L, E), K, n_slots, 1, SMALL.array)
        assert row["whole_layers"] == int((expect == E).sum())
    simulate(ts, cfg, SMALL, calib=enough)
    assert len(priced) == 2 and priced[0].decoded_tokens == enough.decoded_tokens
