"""bench/bench_placement_cost.py: its replay does the live run's placement work again (same
decisions, same hits and copies, same native slot maps), so the replayed timing is of the same
work without a decode between tokens."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from bench_scripts import load_bench
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.testmodels import ensure_model
from saem_gguf.testmodels.spec import ModelSpec


@pytest.mark.parametrize("policy", ["saem", "lru-cpu"])
def test_replay_repeats_the_live_runs_placement(policy):
    b = load_bench("bench_placement_cost")
    path = ensure_model(ModelSpec(n_layer=4, n_expert=16, n_expert_used=2))
    eng = Engine(EngineConfig(model=path, n_ctx=128, n_threads=1, ecr=0.25, progress=False), log=lambda m: None)
    # saem's caches in every layer: without a profile its layout here is one whole layer, full from
    # load, and nothing would be copied to compare
    args = {"layout": "uniform"} if policy == "saem" else None
    try:
        eng.set_placement(policy, 4, args)
        periods: list[float] = []
        wall, cpu, seen = b.timed_tokens(eng, "Wait, let me verify: what is 2 + 3?", 40, periods)
        live = eng.placement
        eng.set_placement(policy, 4, args)
        replay = b.replayed_tokens(eng, seen)
        again = eng.placement
        eng.set_placement(policy, 4, args)
        t0 = time.perf_counter()
        idle = b.replayed_tokens(eng, seen, 2000.0)
        idle_s = time.perf_counter() - t0
        after_idle = eng.placement
    finally:
        eng.close()
    assert len(wall) == len(cpu) == len(replay) == len(idle) >= 30 and len(seen) > len(wall)
    assert all(t > 0 for t in replay)
    # a token's period holds its own placement call; the idle replay waited before every token
    assert len(periods) == len(wall) - 1 and all(p > w for p, w in zip(periods, wall))
    assert idle_s >= len(idle) * 2000e-6
    assert live.stats.copies > 0  # the run placed something, so the comparison can fail
    for field in ("tokens", "prompt_tokens", "accesses", "hits", "copies", "bytes_moved", "boundaries", "plans"):
        assert getattr(again.stats, field) == getattr(live.stats, field), field
        assert getattr(after_idle.stats, field) == getattr(live.stats, field), field
    assert np.array_equal(again._native, live._native)
    assert np.array_equal(after_idle._native, live._native)


def test_part_times_clock_the_same_run_and_leave_the_placement_as_it_was():
    """--parts: the run with clock reads at the joints makes the same decisions as the timed run
    (the wrappers pass every call and its result through), clocks every part of every token, and
    takes its wrappers off afterwards."""
    b = load_bench("bench_placement_cost")
    path = ensure_model(ModelSpec(n_layer=4, n_expert=16, n_expert_used=2))
    eng = Engine(EngineConfig(model=path, n_ctx=128, n_threads=1, ecr=0.25, progress=False), log=lambda m: None)
    args = {"layout": "uniform"}  # caches in every layer, so the run copies (see above)
    try:
        eng.set_placement("saem", 4, args)
        wall, _, _ = b.timed_tokens(eng, b.PROMPT, 40)
        timed = eng.placement
        eng.set_placement("saem", 4, args)
        parts = b.part_times(eng, b.PROMPT, 40)
        clocked = eng.placement
    finally:
        eng.close()
    assert set(parts) == set(b.PART_NAMES)
    assert all(len(v) == len(wall) for v in parts.values())
    assert all(t > 0 for t in parts["detector"]) and all(t > 0 for t in parts["policy"])
    assert all(t > 0 for t in parts["link meter"])
    assert all(t >= -1e-6 for t in parts["rest"])
    assert timed.stats.copies > 0 and sum(t > 0 for t in parts["copies"]) > 0
    for field in ("tokens", "accesses", "hits", "copies", "bytes_moved", "boundaries", "plans"):
        assert getattr(clocked.stats, field) == getattr(timed.stats, field), field
    assert np.array_equal(clocked._native, timed._native)
    for obj in (clocked, clocked.policy, clocked.link, clocked.pair or clocked.detector):
        assert not {"on_token", "observe", "budget", "decided", "feed", "feed_checked", "_put_in_force"} & set(vars(obj))


def test_part_times_count_a_detector_call_once_on_the_on_step_path(monkeypatch):
    """A step that goes through Placement.on_step feeds the detector with ``feed``, which calls
    its own ``feed_checked``: both are clocked, and the detector part counts the call once. On a
    clock that moves one tick per read, once is one tick a token (counted twice, four)."""
    b = load_bench("bench_placement_cost")
    path = ensure_model(ModelSpec(n_layer=4, n_expert=16, n_expert_used=2))
    eng = Engine(EngineConfig(model=path, n_ctx=128, n_threads=1, ecr=0.25, progress=False), log=lambda m: None)
    try:
        eng.set_placement("saem", 4, None)
        pl = eng.placement
        pl.on_token = lambda piece: pl.on_step(pl.last_routing(), [piece], [0])  # part_times takes it off
        ticks = itertools.count()
        monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))
        parts = b.part_times(eng, b.PROMPT, 20)
    finally:
        monkeypatch.undo()
        eng.close()
    assert len(parts["detector"]) >= 15
    assert all(t == 1e6 for t in parts["detector"]), parts["detector"]
