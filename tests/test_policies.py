"""Policies: hand-computed decisions on tiny traces, and invariants under random routing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from saem_gguf.costmodel import HW_PRESETS, CostModel, t_cpu, t_gpu, t_xfer
from saem_gguf.policies import DEFAULT_POLICIES, POLICIES, make_policy
from saem_gguf.accounting import (
    A_ACCESS, A_ASYNC, A_BYTES, A_CPU_RUNS, A_DEMAND, A_EVICT, A_HIT, A_PLANS, A_PROACTIVE, A_TEMP, K_CPU, K_HIT,
    K_HIT_CPU, K_TEMP, Accounting,
)
from saem_gguf.errors import SaemError
from saem_gguf.policies.base import PolicyContext, budget_slots
from saem_gguf.policies.oracle import OraclePolicy
from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.saem import SaemConfig, SaemPolicy
from saem_gguf.policies.state import OP_DEMAND, OP_EVICT, CacheState, RoutingBlock, StepEvents
from saem_gguf.pricing import price_placement, price_steps
from saem_gguf.simulator import replay

HW = HW_PRESETS["rtx4090-ddr5"]
EB = 1_000_000


def _ctx(L, E, K, S, calib=None, batch=1):
    cost = CostModel.from_expert_bytes(EB, HW)
    return PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, S, np.int32), cost=cost,
                         calib_counts=None if calib is None else np.asarray(calib, float), batch=batch)


def _block(seq, events=(), B=1):
    """seq: per step, per batch row, per layer, the K experts (lists); -1 rows = no token."""
    r = np.asarray(seq, np.int16)
    if r.ndim == 1:  # steps of a single expert id, B=1, L=1, K=1
        r = r[:, None, None, None]
    return RoutingBlock(routing=r, event_steps=np.array(sorted(events), np.int32))


def _run(policy, ctx, block, log=10_000):
    state = policy.start(ctx)
    acct = Accounting.with_log(log)
    replay(policy, [block], acct)
    state.check()
    return state, acct


def _hit_steps(acct):
    rows = acct.logged()
    return sorted(set(rows[np.isin(rows[:, 4], (K_HIT, K_HIT_CPU)), 0].tolist()))


# ---------------------------------------------------------------------------------------------
# hand-computed


def test_lru_hand_computed():
    # 1 layer, 4 experts, 2 slots, empty start. 0 0 1 2 1 0:
    # load 0 | hit | load 1 | 2 evicts 0 (older) | hit 1 | 0 evicts 2 (older than 1)
    st, acct = _run(make_policy("lru"), _ctx(1, 4, 1, 2), _block([0, 0, 1, 2, 1, 0]))
    c = acct.counters
    assert (c[A_ACCESS], c[A_HIT], c[A_DEMAND], c[A_EVICT], c[A_BYTES]) == (6, 2, 4, 2, 4 * EB)
    assert _hit_steps(acct) == [1, 4]
    assert sorted(np.nonzero(st.slot_of[0] >= 0)[0].tolist()) == [0, 1]


def test_lfu_hand_computed():
    # same stream: 2 evicts 1 (count 1 < 2), 1 evicts 2 (1 < 2), so the last 0 hits
    st, acct = _run(make_policy("lfu"), _ctx(1, 4, 1, 2), _block([0, 0, 1, 2, 1, 0]))
    assert acct.counters[A_HIT] == 2 and acct.counters[A_DEMAND] == 4
    assert _hit_steps(acct) == [1, 5]


def test_lru_cpu_runs_misses_in_place_and_loads_after():
    st, acct = _run(make_policy("lru-cpu"), _ctx(1, 4, 1, 2), _block([0, 0, 1, 2, 1, 0]))
    c = acct.counters
    assert c[A_HIT] == 2 and c[A_CPU_RUNS] == 4 and c[A_ASYNC] == 4 and c[A_DEMAND] == 4
    rows = acct.logged()
    assert rows[rows[:, 4] == K_CPU, 0].tolist() == [0, 2, 3, 5]


def test_temporal_keeps_frequent_over_recent():
    # half-life 16 steps: expert 0 used 4 times outweighs a single recent use of 1
    stream = [0, 0, 0, 0, 1, 2, 0]
    _, acct = _run(make_policy("temporal"), _ctx(1, 4, 1, 2), _block(stream))
    assert _hit_steps(acct) == [1, 2, 3, 6]
    _, acct = _run(make_policy("lru"), _ctx(1, 4, 1, 2), _block(stream))
    assert _hit_steps(acct) == [1, 2, 3]  # LRU evicted 0 for 2


def test_static_policies():
    calib = [[5, 1, 3, 0]]
    blk = _block([[[[0, 1]]], [[[2, 3]]]])  # 2 steps, B=1, L=1, K=2
    _, acct = _run(make_policy("static-hot"), _ctx(1, 4, 2, 2, calib), blk)
    assert acct.counters[A_HIT] / acct.counters[A_ACCESS] == 0.5 and acct.counters[A_BYTES] == 0
    _, acct = _run(make_policy("gpu-all"), _ctx(1, 4, 2, 1, calib), blk)
    assert acct.counters[A_HIT] == acct.counters[A_ACCESS] == 4
    _, acct = _run(make_policy("cpu-moe"), _ctx(1, 4, 2, 2, calib), blk)
    assert acct.counters[A_HIT] == 0 and acct.counters[A_BYTES] == 0 and acct.counters[A_CPU_RUNS] == 4


def test_n_cpu_moe_whole_layers():
    ctx = _ctx(4, 8, 1, 4)  # 4 slots x 4 layers = 16 experts = 2 whole layers
    pol = make_policy("n-cpu-moe")
    st = pol.start(ctx)
    assert st.n_slots.tolist() == [0, 0, 8, 8] and st.resident_count().tolist() == [0, 0, 8, 8]


def test_step_times_hand_computed():
    ctx = _ctx(1, 4, 2, 2)
    c = ctx.cost
    a = c.array
    from saem_gguf.costmodel import C_DENSE_LAYER_S, C_STEP_S

    blk = _block([[[[0, 1]]]])
    _, acct = _run(make_policy("cpu-moe"), ctx, blk)
    assert acct.now == pytest.approx(a[C_DENSE_LAYER_S] + 2 * c.cpu_time(1) + HW.sync_s + a[C_STEP_S])
    _, acct = _run(make_policy("gpu-all"), ctx, blk)
    assert acct.now == pytest.approx(a[C_DENSE_LAYER_S] + 2 * c.gpu_time(1) + a[C_STEP_S])
    # overlap: the layer costs the longer of the two sides
    ctx2 = _ctx(1, 4, 2, 1, calib=[[1, 0, 0, 0]])
    ctx2.cost = CostModel.from_expert_bytes(EB, HW.replace(cpu_gpu_overlap=True))
    _, acct = _run(make_policy("static-hot"), ctx2, blk)
    cc = ctx2.cost
    assert acct.now == pytest.approx(cc.array[C_DENSE_LAYER_S] + max(cc.gpu_time(1), cc.cpu_time(1)) + HW.sync_s)


def test_copy_barrier_makes_the_next_step_wait():
    from saem_gguf.costmodel import C_DENSE_LAYER_S

    stream = [0, 0]  # step 0: miss on the CPU, loaded after; step 1: hit
    times = {}
    for barrier in (False, True):
        ctx = _ctx(1, 4, 1, 1)
        ctx.cost = CostModel.from_expert_bytes(EB, HW.replace(copy_barrier=barrier))
        _, acct = _run(make_policy("lru-cpu"), ctx, _block(stream))
        times[barrier] = acct.now
    c = ctx.cost
    step0 = c.array[C_DENSE_LAYER_S] + c.cpu_time(1) + HW.sync_s
    # per-slot readiness: step 1's dense part overlaps the copy; barrier: step 1 starts after it
    assert times[False] == pytest.approx(max(step0 + c.array[C_DENSE_LAYER_S], step0 + c.transfer_time()) + c.gpu_time(1))
    assert times[True] == pytest.approx(step0 + c.transfer_time() + c.array[C_DENSE_LAYER_S] + c.gpu_time(1))


def test_saem_hand_computed_and_oracle():
    # stage A uses {0,1}, stage B and C use {2,3}; cue events before steps 6 and 12
    stream = [0, 1] * 3 + [2, 3] * 3 + [2, 3] * 3
    cfg = SaemConfig(min_gap_steps=2, warmup_steps=0, refresh_steps=0)
    blk = _block(stream, events=(6, 12))
    pol = SaemPolicy(cfg)
    st, acct = _run(pol, _ctx(1, 6, 1, 2), blk)
    c = acct.counters
    # empty start; at 6 it places stage A's {0,1} (useless for B); at 12 stage B's {2,3}: C hits
    assert [r for _, r in pol.boundaries] == ["request", "cue", "cue"]
    assert c[A_HIT] == 6 and c[A_PROACTIVE] == 4 and c[A_DEMAND] == 0
    assert _hit_steps(acct) == list(range(12, 18))
    ora = OraclePolicy(cfg)
    _, acct_o = _run(ora, _ctx(1, 6, 1, 2), blk)
    assert acct_o.counters[A_HIT] == 18  # next stage's true profile at the same boundaries
    assert [s for s, _ in ora.boundaries] == [s for s, _ in pol.boundaries]


def test_saem_ignores_events_too_close():
    stream = [0, 1] * 10
    pol = SaemPolicy(SaemConfig(min_gap_steps=8, warmup_steps=0, refresh_steps=0))
    _run(pol, _ctx(1, 6, 1, 2), _block(stream, events=(3, 9, 12)))
    assert [s for s, r in pol.boundaries if r == "cue"] == [9]


def test_saem_warmup_and_refresh():
    stream = [0, 1] * 20
    pol = SaemPolicy(SaemConfig(warmup_steps=4, refresh_steps=10, use_events=False))
    st, acct = _run(pol, _ctx(1, 6, 1, 2), _block(stream))
    assert pol.boundaries == [(0, "request"), (4, "warmup"), (14, "refresh"), (24, "refresh"), (34, "refresh")]
    assert acct.counters[A_HIT] == 40 - 4


def test_cpu_versus_transfer_rule_in_replay():
    # expert 0 is not resident and used by n tokens of the step: CPU below the crossover, transfer above
    ctx = _ctx(1, 2, 1, 1, calib=[[0, 1]])
    n_cross = ctx.cost.crossover_tokens()
    for n in (1, n_cross - 1, n_cross, n_cross + 5):
        blk = RoutingBlock(routing=np.zeros((1, n, 1, 1), np.int16), event_steps=np.zeros(0, np.int32))
        pol = SaemPolicy(SaemConfig(warmup_steps=0, refresh_steps=0))
        st, acct = _run(pol, ctx, blk)
        kinds = acct.logged()[:, 4].tolist()
        a = ctx.cost.array
        if t_cpu(n, a) <= t_xfer(a) + t_gpu(n, a):  # the paper's rule, idle link: lower latency wins
            assert kinds == [K_CPU] and acct.counters[A_BYTES] == 0
        else:
            assert kinds == [K_TEMP] and acct.counters[A_TEMP] == 1 and acct.counters[A_BYTES] == EB
        assert st.slot_of[0].tolist() == [-1, 0]  # a transfer-first never changes residency


def test_rank_fill():
    st = CacheState.empty(4, np.array([2, 2, 3], np.int32))
    st.place(plan_from_scores(st, np.array([[5, 1, 3, 0], [0, 0, 0, 0], [1, 1, 1, 1]], float)))
    assert sorted(np.nonzero(st.slot_of[0] >= 0)[0].tolist()) == [0, 2]
    assert st.resident_count().tolist() == [2, 0, 3]  # zero evidence copies nothing; ties by id
    plan = plan_from_scores(st, np.array([[5, 4, 3, 0], [0, 0, 0, 0], [1, 1, 1, 2]], float))
    assert plan.evictions.tolist() == [[0, 2, st.slot_of[0, 2]], [2, 2, st.slot_of[2, 2]]]
    assert plan.copies.tolist() == [[0, 1, st.slot_of[0, 2]], [2, 3, st.slot_of[2, 2]]]
    assert plan.target[0].tolist() == [st.slot_of[0, 0], st.slot_of[0, 2], -1, -1]
    st.place(plan)
    st.check()
    # ties at the cut keep residents (no churn for equal evidence)
    plan = plan_from_scores(st, np.array([[5, 4, 4, 0], [0, 0, 0, 0], [1, 1, 1, 1]], float))
    assert plan.n_copies == 0 and plan.evictions.shape[0] == 0
    assert plan.by_layer() == {}


@pytest.mark.parametrize("name", ["lru-cpu", "lru", "saem", "saem-stage"])
def test_observed_changes_applied_in_order_give_the_policys_map(name):
    """The engine applies each change's rows in order to the maps in force (its copy of the
    native cache): that gives the map the policy holds, after every step."""
    ctx = _ctx(2, 5, 2, 2)
    pol = make_policy(name, **({"config": SaemConfig(min_gap_steps=2, warmup_steps=3, refresh_steps=9)}
                               if name.startswith("saem") else {}))
    state = pol.start(ctx)
    mirror = state.slot_of.copy()
    rng = np.random.default_rng(0)
    n_evict = 0
    for step in range(80):
        routing = np.argsort(rng.random((1, 2, 5)), axis=2)[:, :, :2].astype(np.int16)
        change = pol.observe(routing, StepEvents(rows=(0,) if step % 7 == 6 else ()))
        if change is None:
            continue
        assert change.target is state.slot_of
        for l, e, s, kind in change.ops.tolist():
            if kind == OP_EVICT:
                assert mirror[l, e] == s
                mirror[l, e] = -1
                n_evict += 1
            else:
                assert mirror[l, e] == -1 and s not in mirror[l]
                mirror[l, e] = s
        assert np.array_equal(mirror, state.slot_of)
        state.check()
    assert n_evict > 0


def test_lru_decides_demand_loads_within_the_step():
    """A wait-for-load cache's loads belong to the observed step (the pricing makes its layer
    wait for them); a -cpu cache's are loads after use."""
    pol = make_policy("lru")
    pol.start(_ctx(1, 4, 1, 1))
    change = pol.observe(np.array([[[2]]], np.int16), StepEvents())
    assert change.ops.tolist() == [[0, 2, 0, OP_DEMAND]] and change.n_in_step == 1


def test_registry_and_budget():
    assert set(DEFAULT_POLICIES) <= set(POLICIES)
    for name in ("cpu-moe", "n-cpu-moe", "gpu-all", "static-hot", "lru", "lfu", "temporal", "saem", "saem-implicit",
                 "oracle"):
        assert POLICIES[name].name == name
    with pytest.raises(SaemError, match="unknown policy"):
        make_policy("mru")
    assert [budget_slots(e, 128) for e in (3.125, 6.25, 12.5, 25, 50)] == [4, 8, 16, 32, 64]
    assert budget_slots(0.1, 128) == 1 and budget_slots(0, 128) == 0


# ---------------------------------------------------------------------------------------------
# invariants under random routing


@hst.composite
def _case(draw):
    L = draw(hst.integers(1, 2))
    E = draw(hst.integers(3, 8))
    K = draw(hst.integers(1, min(3, E)))
    B = draw(hst.integers(1, 3))
    S = draw(hst.integers(1, 24))
    slots = draw(hst.integers(0, E))
    seed = draw(hst.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    hot = rng.random(E) ** 3  # skewed, so caches have something to find
    r = np.empty((S, B, L, K), np.int16)
    for s in range(S):
        for b in range(B):
            for l in range(L):
                r[s, b, l] = rng.choice(E, K, replace=False, p=hot / hot.sum())
    n_fin = draw(hst.integers(0, B - 1))  # some rows finish early
    for b in range(n_fin):
        r[rng.integers(1, S + 1):, b] = -1
    events = sorted(set(draw(hst.lists(hst.integers(1, max(1, S - 1)), max_size=5))))
    calib = rng.random((L, E)) * draw(hst.sampled_from([0.0, 1.0]))
    return L, E, K, slots, RoutingBlock(routing=r, event_steps=np.array(events, np.int32)), calib


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case(), hst.sampled_from([0, 1, 3]), hst.sampled_from([0, 4]))
def test_invariants_random(case, gap, warm):
    L, E, K, slots, blk, calib = case
    ctx = _ctx(L, E, K, slots, calib, batch=blk.routing.shape[1])
    total = int((blk.routing >= 0).sum())
    hits = {}
    for name in POLICIES:
        kw = {}
        if name in ("saem", "saem-stage", "oracle"):
            kw = {"config": SaemConfig(min_gap_steps=gap, warmup_steps=warm, refresh_steps=7)}
        pol = make_policy(name, **kw)
        state = pol.start(ctx)
        state.check()
        acct = Accounting()
        # the pricing checks every decision against the residency in force, and the replay
        # that its copy of the residency equals the policy's at the end
        replay(pol, [blk], acct)
        state.check()  # never more resident experts than slots, maps consistent
        c = acct.counters
        assert c[A_ACCESS] == total
        assert 0 <= c[A_HIT] <= c[A_ACCESS]
        assert c[A_BYTES] == EB * (c[A_DEMAND] + c[A_PROACTIVE])
        hits[name] = c[A_HIT]
        if name == "gpu-all":
            assert c[A_HIT] == total and c[A_BYTES] == 0
        if name == "cpu-moe":
            assert c[A_HIT] == 0 and c[A_BYTES] == 0
        if name in ("static-hot", "n-cpu-moe", "cpu-moe", "gpu-all"):
            assert c[A_PROACTIVE] == 0 and c[A_DEMAND] == 0
    assert hits["oracle"] >= hits["saem-stage"]  # same boundaries, same budget, true next-stage profile


@settings(max_examples=25, deadline=None)
@given(_case())
def test_pricing_steps_together_equals_one_by_one(case):
    """The simulator prices the steps between two decisions in one kernel call: that gives the
    counters and clock of pricing every step on its own (the policy told the same link budgets)."""
    L, E, K, slots, blk, calib = case
    for name in ("lru", "lru-cpu", "lfu", "temporal-cpu", "saem", "saem-stage", "saem-implicit", "static-hot"):
        out = []
        budgets = []
        for together in (True, False):
            ctx = _ctx(L, E, K, slots, calib, batch=blk.routing.shape[1])
            pol = make_policy(name)
            pol.start(ctx)
            acct = Accounting()
            if together:
                replay(pol, [blk], acct, link_budgets=budgets)
            else:
                cache = pol.state.copy()
                ready = np.zeros(cache.owner.shape)
                a = ctx.cost.array
                ch = pol.begin_group(blk)
                if ch is not None:
                    acct.counters[A_PLANS] += ch.placements
                    price_placement(ch.ops, 0, 0, cache.slot_of, cache.owner, ready, a, acct.clock, acct.counters,
                                    acct.log, acct.log_n)
                for s in range(blk.n_steps):
                    ch = pol.observe(blk.routing[s], blk.events_after(s), budgets[s])
                    ops, n_in = (ch.ops, ch.n_in_step) if ch is not None else (np.zeros((0, 4), np.int32), 0)
                    acct.counters[A_PLANS] += ch.placements if ch is not None else 0
                    price_steps(blk.routing, s, s + 1, 0, cache.slot_of, cache.owner, ready, ops, n_in,
                                pol.miss_mode, a, acct.clock, acct.counters, acct.log, acct.log_n)
            out.append((acct.counters.copy(), acct.clock.copy(), pol.state.slot_of.copy()))
        np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-12)
        np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-12)
        assert np.array_equal(out[0][2], out[1][2])


def test_dma_contention_slows_cpu_experts():
    from saem_gguf.costmodel import cpu_phase

    cost = _ctx(1, 4, 1, 1).cost
    f = HW.cpu_mem_bw / (HW.cpu_mem_bw - HW.h2d_bw)
    a = cost.array
    assert cpu_phase(1e-3, 0.0, 0.0, a) == 1e-3  # idle link
    assert cpu_phase(1e-3, 0.0, 1.0, a) == pytest.approx(f * 1e-3)  # busy throughout
    # busy for 0.5 ms: that part does 0.5/f ms of work, the rest runs at full speed
    assert cpu_phase(1e-3, 0.0, 0.5e-3, a) == pytest.approx(0.5e-3 + (1e-3 - 0.5e-3 / f))
    off = CostModel.from_expert_bytes(EB, HW.replace(dma_slows_cpu=False)).array
    assert cpu_phase(1e-3, 0.0, 1.0, off) == 1e-3


# ---------------------------------------------------------------------------------------------
# saem-cue: per-cue stage profiles


def _two_kind_block(n=20, cue="Let me verify"):
    """1 layer, top-2: n steps on experts 0,1 (compute), then a cue, n steps on 6,7 (verify)."""
    r = np.array([[[[0, 1]]]] * n + [[[[6, 7]]]] * n, np.int16)
    return RoutingBlock(routing=r, event_steps=np.array([n], np.int32), event_rows=[np.array([0], np.int32)],
                        event_cues=[[cue]])


def test_saem_cue_ranks_a_cue_stage_by_its_calibrated_profile():
    E, n = 8, 20
    verify = np.zeros((1, E))
    verify[0, [6, 7]] = 40.0  # 40 calibration tokens of verify stages, on experts 6 and 7
    cfg = SaemConfig(min_gap_steps=8, warmup_steps=0, refresh_steps=0)
    hits = {}
    for name in ("saem-stage", "saem-cue"):
        ctx = _ctx(1, E, 2, 2)
        ctx.cue_counts = {"Let me verify": verify}
        pol = make_policy(name, config=cfg)
        _, acct = _run(pol, ctx, _two_kind_block(n))
        rows = acct.logged()
        after = rows[(rows[:, 0] >= n) & np.isin(rows[:, 4], (K_HIT, K_HIT_CPU))]
        hits[name] = len(after)
    # saem-stage places the completed stage's experts (0, 1): no verify access hits; saem-cue
    # places the verify profile (6, 7) at the cue: every verify access hits
    assert hits["saem-stage"] == 0
    assert hits["saem-cue"] == 2 * n


def test_saem_cue_falls_back_to_saem_without_a_usable_profile():
    cfg = SaemConfig(min_gap_steps=8, warmup_steps=0, refresh_steps=0)
    thin = np.zeros((1, 8))
    thin[0, [6, 7]] = 3.0  # 3 tokens: below cue_min_tokens
    for cue_counts, cue in ((None, "Let me verify"), ({"Let me verify": thin}, "Let me verify"),
                            ({"Therefore": np.ones((1, 8)) * 99}, "Let me verify")):
        out = []
        for name in ("saem-stage", "saem-cue"):
            ctx = _ctx(1, 8, 2, 2)
            ctx.cue_counts = cue_counts
            _, acct = _run(make_policy(name, config=cfg), ctx, _two_kind_block(cue=cue))
            out.append(acct.counters.copy())
        np.testing.assert_array_equal(out[0], out[1])


def test_routing_block_events_after():
    blk = _two_kind_block()
    ev = blk.events_after(19)  # the cue is known before step 20, so reported after step 19
    assert ev.cue_event and ev.named_cues() == ["Let me verify"] and ev.combined is None and ev.n_rows == 1
    assert not blk.events_after(20).cue_event and not blk.events_after(0).cue_event
    both = RoutingBlock(routing=np.zeros((5, 2, 1, 2), np.int16), event_steps=np.array([2], np.int32),
                        event_rows=[np.array([1], np.int32)], implicit_event_steps=np.array([2, 4], np.int32))
    assert both.events_after(1) == StepEvents(rows=(1,), cues=("",), n_rows=2, combined=True)
    assert both.events_after(3) == StepEvents(n_rows=2, combined=True)
    assert both.events_after(2) == StepEvents(n_rows=2, combined=False)
    with pytest.raises(SaemError, match="event_cues"):
        RoutingBlock(routing=np.zeros((3, 1, 1, 2), np.int16), event_steps=np.array([1], np.int32), event_cues=[])


def test_policy_context_checks_cue_counts_shape():
    with pytest.raises(SaemError, match="cue_counts"):
        PolicyContext(n_layer=2, n_expert=4, top_k=1, n_slots=np.ones(2, np.int32),
                      cost=CostModel.from_expert_bytes(EB, HW), cue_counts={"Wait": np.zeros((1, 4))})
