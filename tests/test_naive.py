"""The Numba placement kernels against the slow references of naive.py, on random inputs."""

from __future__ import annotations

import numpy as np
import pytest

import naive
from saem_gguf.costmodel import HW_PRESETS, CostModel
from saem_gguf.policies import make_policy
from saem_gguf.accounting import A_ACCESS, A_ASYNC, A_HIT, A_STALL, A_TEMP, Accounting
from saem_gguf.policies.base import MISS_CPU, MISS_RULE, PolicyContext
from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.adaptive import (
    CAND_NET_SUM, CTL_ALPHA, CTL_COPY_COST, CTL_LEAD_KEEP, AdaptiveSaemPolicy, estimated_step_s, lead_forecast,
    warm_step_lines,
)
from saem_gguf.policies.state import CacheState, RoutingBlock, StepEvents, step_uses
from saem_gguf.pricing import price_steps
from saem_gguf.simulator import replay

HW = HW_PRESETS["rtx4090-ddr5"]


def _routing(rng, S, B, L, E, K, hot_power=3.0):
    hot = rng.random((L, E)) ** hot_power + 1e-3
    r = np.empty((S, B, L, K), np.int16)
    for s in range(S):
        for b in range(B):
            for l in range(L):
                r[s, b, l] = rng.choice(E, K, replace=False, p=hot[l] / hot[l].sum())
    for b in range(1, B):  # later rows finish early
        r[rng.integers(1, S + 1):, b] = -1
    return r


def _random_state(rng, L, E):
    n_slots = rng.integers(0, E + 1, L).astype(np.int32)
    st = CacheState.empty(E, n_slots)
    for l in range(L):
        k = int(rng.integers(0, n_slots[l] + 1))
        slots = rng.choice(n_slots[l], k, replace=False) if k else []
        for e, s in zip(rng.choice(E, k, replace=False), slots):
            st.slot_of[l, e] = s
            st.owner[l, s] = e
    st.check()
    return st


@pytest.mark.parametrize("seed", range(20))
def test_step_uses_equals_naive(seed):
    rng = np.random.default_rng(seed)
    L, E, K, B = int(rng.integers(1, 5)), int(rng.integers(4, 16)), 2, int(rng.integers(1, 5))
    st = _random_state(rng, L, E)
    rows = _routing(rng, 3, B, L, E, K)[int(rng.integers(0, 3))]
    assert step_uses(rows, st.slot_of) == naive.step_uses(rows, st.slot_of)


@pytest.mark.parametrize("seed", range(20))
def test_warm_step_lines_equals_naive(seed):
    """The adaptive step's warm pass reads the books of the step's uses in cached layers."""
    rng = np.random.default_rng(seed)
    L, E, K, B, C = int(rng.integers(1, 6)), int(rng.integers(4, 16)), 2, int(rng.integers(1, 5)), int(rng.integers(1, 8))
    n_slots = rng.integers(0, 3, L).astype(np.int32)  # some layers with no cache
    rows = _routing(rng, 3, B, L, E, K)[int(rng.integers(0, 3))]
    rows[rng.random(rows.shape) < 0.1] = -1  # entries that name no expert
    c_slot = rng.integers(-1, 4, (L, E, C)).astype(np.int32)
    c_key = rng.normal(size=(L, E, C))
    stamp = rng.integers(-1, 1000, (L, E))
    got = warm_step_lines(rows, n_slots, c_slot, c_key, stamp)
    assert got == naive.warm_step_lines(rows, n_slots, c_slot, c_key, stamp)


@pytest.mark.parametrize("seed", range(40))
def test_rank_fill_equals_naive(seed):
    rng = np.random.default_rng(seed)
    L, E = int(rng.integers(1, 4)), int(rng.integers(1, 12))
    st = _random_state(rng, L, E)
    # integer scores give ties at the cut; zeros and negatives test "no evidence, no copy"
    scores = rng.integers(-1, 4, (L, E)).astype(np.float64)
    plan = plan_from_scores(st, scores)
    copies, evictions = naive.rank_fill(scores, st.n_slots, st.slot_of, st.owner)
    assert plan.copies.tolist() == [list(x) for x in copies]
    assert plan.evictions.tolist() == [list(x) for x in evictions]


@pytest.mark.parametrize("seed", range(30))
def test_pricing_of_fixed_residency_equals_naive(seed):
    rng = np.random.default_rng(seed)
    L, E, K, B, S = int(rng.integers(1, 4)), int(rng.integers(4, 10)), 0, int(rng.integers(1, 20)), 12
    K = int(rng.integers(1, min(4, E) + 1))
    hw = HW.replace(cpu_gpu_overlap=bool(seed % 2), copy_barrier=bool(seed % 3 == 0))
    cost = CostModel.from_expert_bytes(2_000_000, hw).array
    st = _random_state(rng, L, E)
    ready_at = rng.random(st.owner.shape) * 2e-3  # some copies still in flight
    routing = _routing(rng, S, B, L, E, K)
    for mode in (MISS_CPU, MISS_RULE):
        acct = Accounting()
        acct.clock[1] = 1e-3  # the link is busy for a while
        price_steps(routing, 0, S, 0, st.slot_of, st.owner, ready_at, np.zeros((0, 4), np.int32), 0, mode, cost,
                    acct.clock, acct.counters, acct.log, acct.log_n)
        clock = [0.0, 1e-3]
        ref = naive.replay_fixed(routing, st.slot_of, ready_at, cost, mode == MISS_RULE, clock)
        c = acct.counters
        assert (c[A_ACCESS], c[A_HIT], c[A_TEMP]) == (ref["accesses"], ref["hits"], ref["temp"])
        assert c[A_STALL] == pytest.approx(ref["stall"], rel=1e-12, abs=1e-15)
        assert acct.clock.tolist() == pytest.approx(clock, rel=1e-12)


@pytest.mark.parametrize("name,kind", [("lru-cpu", "lru"), ("lfu-cpu", "lfu"), ("temporal-cpu", "lrfu")])
@pytest.mark.parametrize("seed", range(12))
def test_cpu_caches_equal_naive(name, kind, seed):
    rng = np.random.default_rng(seed)
    L, E, K, B, S = int(rng.integers(1, 3)), int(rng.integers(4, 12)), 2, int(rng.integers(1, 4)), 40
    slots = int(rng.integers(0, E))
    calib = rng.random((L, E)) * 10
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, slots, np.int32),
                        cost=CostModel.from_expert_bytes(2_000_000, HW), calib_counts=calib)
    pol = make_policy(name)
    state = pol.start(ctx)
    resident = [[int(state.owner[l, s]) for s in range(slots)] for l in range(L)]
    blk = RoutingBlock(routing=_routing(rng, S, B, L, E, K), event_steps=np.zeros(0, np.int32))
    acct = Accounting()
    replay(pol, [blk], acct)
    freq = calib / calib.sum(axis=1, keepdims=True) * K
    hits, loads, sets = naive.replay_cache_cpu(blk.routing, slots, resident, kind, freq, pol.prior_tokens,
                                               pol.half_life)
    assert acct.counters[A_HIT] == hits
    assert acct.counters[A_ASYNC] == loads
    assert [set(np.flatnonzero(state.slot_of[l] >= 0).tolist()) for l in range(L)] == sets


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("load_slope,barrier,clock,overlap", [(0.0, False, False, False), (0.5, False, False, False),
                                                              (0.5, True, False, False), (0.5, True, True, False),
                                                              (0.5, True, True, True), (0.5, False, True, False),
                                                              (0.5, False, True, True), (0.5, False, True, "gpu")])
def test_adaptive_scores_equal_naive(seed, batch, load_slope, barrier, clock, overlap):
    """Adaptive saem's candidate scores (decide_adaptive) equal naive.adaptive_step_gain averaged
    as documented: plain means over the first horizon, then weight 1 / horizon, on random
    routing with rows that finish early and layers of every cache size; each candidate's copies
    priced by its own link load (naive.adaptive_copy_price, its copy rate averaged with weight
    1 / horizon from 0); under the copy barrier with the step clock off each step's copies charged
    by naive.adaptive_barrier_charge instead (a link clock: idle or queued copies, and the time it
    runs past the step at the whole transfer); with the step clock by what they slow the
    candidate's CPU experts on its own step clock (naive.adaptive_clock_loss, its link's backlog
    carried from step to step, or under the barrier a stall at the step's end), the layers
    without a cache included, and with CPU and
    GPU experts overlapping (layer_end's other branch); ``overlap="gpu"`` slows the GPU tenfold,
    so that some layers' GPU part outlasts their slowed CPU part: the slow-down costs those
    nothing (a copy once charged the CPU part's whole slow-down there)."""
    rng = np.random.default_rng(100 + seed)
    L, E, K, steps = 4, 16, 3, 90
    calib = rng.random((L, E)) * 40
    n_slots = np.array([0, 3, 6, E], np.int32)
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=n_slots, batch=batch,
                        # a slower link, so that some steps' copies outrun them (the barrier's
                        # stall, the step clock's backlog)
                        cost=CostModel.from_expert_bytes(2_654_208, HW.replace(
                            copy_barrier=barrier, h2d_bw=HW.h2d_bw / 4, cpu_gpu_overlap=bool(overlap),
                            gpu_mem_bw=HW.gpu_mem_bw / (10 if overlap == "gpu" else 1)) if barrier or clock else HW),
                        calib_counts=calib)
    pol = AdaptiveSaemPolicy(layout="uniform", horizon_steps=32.0, load_slope=load_slope, step_clock=clock)
    pol.start(ctx)
    cost = ctx.cost.array
    step_s = estimated_step_s(ctx, n_slots)
    C = len(pol.candidates)
    expect = np.zeros(C)
    total = np.zeros(C)  # the net gains summed: mean_scores(), a replay's prior
    rate = np.zeros(C)
    routing = _routing(rng, steps, batch, L, E, K)
    scored = 0
    priced_above_idle = False
    stalled = False  # under the barrier, a step's copies outran its time
    queued = False  # under the barrier, a copy waited for another within the step's time
    backlog = np.zeros(C)  # the step clock: each candidate's link busy past the last step's end
    slowed = carried = False  # the step clock's loss and backlog were exercised
    seen: dict[str, int] = {}  # layers the step clock found GPU-bound on a busy link
    # cue events re-rank the stage candidate (candidate 0, a fixed set) after the kernel scored the
    # step; its entrants are charged as its copies at the next scored step
    cue_steps = {20, 45, 70}
    placed = 0
    for s in range(steps):
        before = pol._c_slot >= 0
        events = StepEvents(rows=(0,), cues=("x",), n_rows=batch) if s in cue_steps else StepEvents(n_rows=batch)
        pol.observe(routing[s], events)
        after = pol._c_slot >= 0
        if not (routing[s, :, 0, 0] >= 0).any():
            placed += int(np.count_nonzero(after[:, :, 0] & ~before[:, :, 0]))
            continue
        scored += 1
        alpha = pol._ctl[CTL_ALPHA]
        w = max(alpha, 1.0 / scored)
        for c in range(C):
            entrants = after[:, :, c] & ~before[:, :, c] & (n_slots > 0)[:, None]
            layer_copies = [0] * L
            if c == 0:  # the re-rank after this step is charged at the next one
                copies, placed = placed, int(np.count_nonzero(entrants))
                after_scoring = before[:, :, 0]
                ranked = copies
            else:
                copies, after_scoring = int(np.count_nonzero(entrants)), after[:, :, c]
                layer_copies, ranked = entrants.sum(axis=1).tolist(), 0
            rate[c] += alpha * (copies - rate[c])
            if barrier and not clock:
                charge, stall = naive.adaptive_barrier_charge(pol._ctl[CTL_COPY_COST], pol.adaptive.copy_price,
                                                              cost, layer_copies, ranked, step_s)
                stalled |= stall > 0
                queued |= stall == 0 and charge > copies * pol._ctl[CTL_COPY_COST] * (1 + 1e-6)
                gain = naive.adaptive_step_gain(routing[s], before[:, :, c], after_scoring, n_slots, cost, 0.0) - charge
            elif clock:
                carried |= backlog[c] > 0
                loss, backlog[c] = naive.adaptive_clock_loss(routing[s], before[:, :, c], layer_copies, ranked,
                                                             backlog[c], cost, seen, barrier)
                slowed |= loss > 0
                if barrier:  # the run past the step was a stall, not a backlog the next step carries
                    stalled |= backlog[c] > 0
                    backlog[c] = 0.0
                gain = naive.adaptive_step_gain(routing[s], before[:, :, c], after_scoring, n_slots, cost, 0.0) - loss
            else:
                price = naive.adaptive_copy_price(pol._ctl[CTL_COPY_COST], cost, rate[c], step_s, load_slope)
                priced_above_idle |= price > pol._ctl[CTL_COPY_COST] * (1 + 1e-6)
                gain = naive.adaptive_step_gain(routing[s], before[:, :, c], after_scoring, n_slots, cost, price)
                gain -= price * copies if c == 0 else 0.0
            expect[c] += w * (gain - expect[c])
            total[c] += gain
        np.testing.assert_allclose(pol._score, expect, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(pol.mean_scores(), total / scored, rtol=1e-9, atol=1e-9)
    assert priced_above_idle == (load_slope > 0 and not barrier and not clock)  # the load term was exercised
    assert slowed == clock and carried == (clock and not barrier)  # and the step clock's slow-down and backlog
    assert (seen.get("gpu_bound", 0) > 0) == (overlap == "gpu")  # and GPU-bound layers
    assert stalled == barrier and queued == (barrier and not clock)  # and the barrier's stall and queue
    assert sum(r == "cue" for _, r in pol.boundaries) >= 2  # and the stage candidate's re-ranks


@pytest.mark.parametrize("seed", range(3))
def test_lead_forecast_equals_naive(seed):
    """The leader switch's lead forecast (the books decide_adaptive keeps, read by lead_forecast)
    equals naive.lead_line's weighted least squares (the smaller of its line and bound), for
    every ordered pair of candidates and random score leads, after every step of random routing
    under the copy barrier: before the first observation, while the prior weighs most, and
    after; where the line's value is within its bound and where the bound holds it."""
    rng = np.random.default_rng(200 + seed)
    L, E, K, steps, horizon, memory, prior = 4, 16, 3, 70, 8, 20.0, 3.0
    calib = rng.random((L, E)) * 40
    n_slots = np.array([0, 3, 6, E], np.int32)
    ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=n_slots,
                        cost=CostModel.from_expert_bytes(2_654_208, HW.replace(copy_barrier=True)), calib_counts=calib)
    pol = AdaptiveSaemPolicy(layout="uniform", horizon_steps=float(horizon), lead_memory_steps=memory,
                             lead_prior_steps=prior)
    pol.start(ctx)
    assert pol._ctl[CTL_LEAD_KEEP] == pytest.approx(1.0 - 1.0 / memory)
    C = len(pol.candidates)
    routing = _routing(rng, steps, 1, L, E, K)
    scores, net_sums = [], []  # as each step found them: what the kernel records before deciding
    moved = 0.0
    bounded = 0
    for s in range(steps):
        scores.append(pol._score.copy())
        net_sums.append(pol._cand[:, CAND_NET_SUM].copy())
        pol.observe(routing[s], StepEvents(n_rows=1))
        for i in range(C):
            for j in range(C):
                if i == j:
                    continue
                x = float(rng.normal(0.0, 5.0))
                got = lead_forecast(pol._lead_books, C, horizon, i, j, x, prior)
                line, bound = naive.lead_line(scores, net_sums, horizon, memory, prior, i, j, x)
                assert got == pytest.approx(min(line, bound), rel=1e-7, abs=1e-7), (s, i, j)
                moved = max(moved, abs(got - x))
                bounded += line > bound + 1e-6
    assert moved > 1.0  # the forecast is not the lead itself: the books were exercised
    assert bounded > 0  # and the bound held the line somewhere


def test_estimated_step_equals_naive():
    """estimated_step_s (layout.layer_time_table, vectorised) equals naive.expected_step_s's loop
    at one token, for layers with no, some and all experts resident, with and without counts."""
    rng = np.random.default_rng(7)
    L, E, K = 4, 16, 3
    for calib in (rng.random((L, E)) * 40, np.zeros((L, E))):
        n_slots = np.array([0, 3, 6, E], np.int32)
        ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=n_slots, batch=1,
                            cost=CostModel.from_expert_bytes(2_654_208, HW), calib_counts=calib)
        assert estimated_step_s(ctx, n_slots) == pytest.approx(
            naive.expected_step_s(ctx.calib, K, n_slots, ctx.cost.array), rel=1e-9)
