"""One policy, two drivers: the simulator replaying a trace the engine recorded makes exactly the
residency decisions the engine made live (same policy class, same entry points ``begin_group``
and ``observe``, same stage detectors, cue and combined, the same link budget at every step),
policy by policy; the engine puts the decisions in force, the simulator prices them (both keep
the same estimated link clock, link_budget.LinkMeter, for the budget)."""

from __future__ import annotations

import numpy as np
import pytest

from saem_gguf import native_api as na
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.accounting import A_ACCESS, A_HIT, A_PLANS, Accounting
from saem_gguf.policies import make_policy
from saem_gguf.simulator import build_blocks, detector_events, replay
from saem_gguf.trace import TraceSet

# Every policy the engine runs as named (the wait-for-load caches run as their -cpu variant).
ENGINE_POLICIES = ["cpu-moe", "n-cpu-moe", "static-hot", "lru-cpu", "lfu-cpu", "temporal-cpu", "saem", "saem-stage",
                   "saem-strict", "saem-implicit", "saem-cue", "gpu-all"]
N_DECODE = 300
QUESTIONS = 3


@pytest.fixture(scope="module")
def questions():
    from saem_gguf.defaultmodel import corpus

    return [e.question for e in corpus.heldout_examples(QUESTIONS, seed=777)]


def same_decisions(live: list, replayed: list) -> None:
    """The two drivers' decision records (state.Decision) are equal, one by one."""
    assert len(live) == len(replayed), f"{len(live)} decisions live, {len(replayed)} replayed"
    for i, ((w0, g0, c0), (w1, g1, c1)) in enumerate(zip(live, replayed)):
        assert (w0, g0, c0.n_in_step, c0.placements) == (w1, g1, c1.n_in_step, c1.placements), f"decision {i}"
        assert np.array_equal(c0.ops, c1.ops), f"decision {i} at step {g0}: other copies/evictions"
        assert np.array_equal(c0.target, c1.target), f"decision {i} at step {g0}: other target map"


def count_native_hits(pl) -> list[int]:
    """Wrap ``pl.on_token`` to count, independently of the placement, the decoded token's routed
    experts that the native cache had resident (the slot maps read back from llama.cpp before
    the placement changes them), and to check the policy's books equal those maps.
    Returns the live [hits, accesses]."""
    inner = pl.on_token
    out = [0, 0]

    def on_token(piece: bytes):
        if na.saem_moe_cache_is_init(pl.ctx):
            maps = np.array([na.saem_moe_get_slot_map(pl.ctx, il) for il in pl.moe_layers], np.int32)
        else:  # no slot anywhere (cpu-moe): every expert runs on the host
            maps = np.full_like(pl.state.slot_of, -1)
        assert np.array_equal(maps, pl.state.slot_of), "the policy's books differ from the native cache"
        routing = na.saem_moe_get_last_routing(pl.ctx, len(pl.moe_layers) * pl.top_k)[0]
        out[0] += int((maps[np.arange(len(pl.moe_layers))[:, None], routing] >= 0).sum())
        out[1] += int(routing.size)
        return inner(piece)

    pl.on_token = on_token
    return out


# ECR 25 % for every policy; saem again at 12.5 %, where its layout decision (layout.py) keeps
# caches in every layer of the embedded model (at 25 % it makes one layer fully resident)
PARITY_CASES = [(p, 0.25) for p in ENGINE_POLICIES] + [("saem", 0.125)]


@pytest.mark.parametrize(("policy", "ecr"), PARITY_CASES)
def test_simulator_makes_the_engines_decisions(llama_cpp, questions, policy, ecr):
    """On the embedded model (real cues, its packaged profile's cue routing, the combined
    detector's routing-shift events), over several chat requests in one process (the cache
    carries over, as the simulator's batches do)."""
    eng = Engine(EngineConfig(policy=policy, ecr=ecr, n_threads=2, record=True, progress=False), log=lambda m: None)
    try:
        pl = eng.placement
        pl.decisions = live = []
        pl.link_budgets = live_budgets = []
        native_hits = count_native_hits(pl)
        seqs = []
        for q in questions:
            eng.generate(eng.chat_prompt([{"role": "user", "content": q}]), N_DECODE)
            seqs.append(eng.sequence_trace())
        live_hits, live_accesses = eng.stats()["hits"], eng.stats()["expert_accesses"]
        assert live_hits == native_hits[0] and live_accesses == native_hits[1]
        ctx, detector, sig = pl.policy.ctx, pl.detector, eng.signature()
        live_boundaries = list(getattr(pl.policy, "boundaries", []))
        live_layout = pl.state.n_slots.copy()
        live_prices = dict(getattr(pl.policy, "layout_prices", {}))
        n_expert = pl.n_expert
    finally:
        eng.close()
    ts = TraceSet(signature=sig, sequences=seqs, source="engine")
    events = detector_events(ts, template=detector)
    blocks = build_blocks(ts, 1, "detector", detected=events)
    assert [b.n_steps for b in blocks] == [s.decoded_tokens for s in seqs]
    sim = make_policy(policy)
    state = sim.start(ctx)
    assert np.array_equal(state.n_slots, live_layout), "the simulator chose another slot layout"
    if policy == "saem" and ecr == 0.25:
        # the packaged profile's calibration sample, replayed at both layouts the budget allows
        # (none or one of the 6 layers whole), priced alike by both drivers
        assert list(live_prices) == [0, 1] and sim.layout_prices == live_prices
    acct = Accounting()
    replayed, replayed_budgets = [], []
    replay(sim, blocks, acct, replayed, link_budgets=replayed_budgets)
    # a layout of whole layers (every layer fully resident or empty) has nothing to change
    whole_layers = bool(np.all((live_layout == 0) | (live_layout == n_expert)))
    if policy == "saem" and ecr == 0.125:
        assert not whole_layers, "the case meant to cover saem's caches got a whole-layer layout"
    # saem at 25 % starts on static (the calibrated set, its calibration replay's leader) and may
    # keep it throughout: its 12.5 % case is the one that covers its caches' decisions
    if policy not in ("cpu-moe", "n-cpu-moe", "static-hot", "gpu-all") and not whole_layers \
            and (policy, ecr) != ("saem", 0.25):
        assert sum(c.n_ops for _, _, c in live) > 0, "the run made no residency decision: the comparison would be empty"
    if policy.startswith("saem"):
        assert any(ev[0].size for ev in events), "no cue event: the stage path would be untested"
        assert list(sim.boundaries) == live_boundaries
    same_decisions(live, replayed)
    # both drivers told the policy the same link budget at every step (the same LinkMeter over the
    # same routing, maps and decisions); inf to a policy that does not read it
    assert len(live_budgets) == len(replayed_budgets) == sum(b.n_steps for b in blocks)
    assert live_budgets == replayed_budgets
    if sim.uses_link_budget:
        assert np.all(np.isfinite(live_budgets)) and max(live_budgets) > 0
    else:
        assert np.all(np.isinf(live_budgets))
    if policy.startswith("saem"):
        assert acct.counters[A_PLANS] > 0
    # the engine's hit count is the replay's: each decode ran under the map the simulator assumes
    assert (acct.counters[A_HIT], acct.counters[A_ACCESS]) == (live_hits, live_accesses)
