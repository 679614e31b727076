"""One policy, two drivers: the simulator replaying a trace the engine recorded makes exactly the
residency decisions the engine made live (same policy class, same entry point, same stage
detectors, cue and combined), policy by policy."""

from __future__ import annotations

import numpy as np
import pytest

from saem_gguf import native_api as na
from saem_gguf.engine import Engine, EngineConfig
from saem_gguf.policies import make_policy
from saem_gguf.policies.accounting import A_ACCESS, A_HIT, K_ASYNC, K_DEMAND, K_EVICT, K_PREFETCH, Accounting
from saem_gguf.simulator import build_blocks, detector_events
from saem_gguf.trace import TraceSet

# Every policy the engine runs as named (the wait-for-load caches run as their -cpu variant).
ENGINE_POLICIES = ["cpu-moe", "n-cpu-moe", "static-hot", "lru-cpu", "lfu-cpu", "temporal-cpu", "saem", "saem-stage",
                   "saem-strict", "saem-implicit", "saem-cue", "gpu-all"]
RESIDENCY_KINDS = (K_EVICT, K_DEMAND, K_ASYNC, K_PREFETCH)
N_DECODE = 300
QUESTIONS = 3


@pytest.fixture(scope="module")
def questions():
    from saem_gguf.defaultmodel import corpus

    return [e.question for e in corpus.heldout_examples(QUESTIONS, seed=777)]


def residency_decisions(acct: Accounting) -> np.ndarray:
    """(step, layer, expert, slot, kind) rows of the copies and evictions, in issue order."""
    rows = acct.logged()
    return rows[np.isin(rows[:, 4], RESIDENCY_KINDS)]


def count_native_hits(pl) -> list[int]:
    """Wrap ``pl.on_token`` to count, independently of the policy, the decoded token's routed
    experts that the native cache had resident (the slot maps read back from llama.cpp before
    the placement changes them), and to check the policy's mirror equals those maps.
    Returns the live [hits, accesses]."""
    inner = pl.on_token
    out = [0, 0]

    def on_token(piece: bytes):
        if na.saem_moe_cache_is_init(pl.ctx):
            maps = np.array([na.saem_moe_get_slot_map(pl.ctx, il) for il in pl.moe_layers], np.int32)
        else:  # no slot anywhere (cpu-moe): every expert runs on the host
            maps = np.full_like(pl.state.slot_of, -1)
        assert np.array_equal(maps, pl.state.slot_of), "the policy's mirror differs from the native cache"
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
        pl.acct = Accounting.with_log(1 << 20)
        native_hits = count_native_hits(pl)
        seqs = []
        for q in questions:
            eng.generate(eng.chat_prompt([{"role": "user", "content": q}]), N_DECODE)
            seqs.append(eng.sequence_trace())
        live = residency_decisions(pl.acct)
        live_hits, live_accesses = eng.stats()["hits"], eng.stats()["expert_accesses"]
        assert live_hits == native_hits[0] and live_accesses == native_hits[1]
        ctx, detector, sig = pl.policy.ctx, pl.detector, eng.signature()
        live_boundaries = list(getattr(pl.policy, "boundaries", []))
        live_layout = pl.state.n_slots.copy()
        n_expert = pl.n_expert
    finally:
        eng.close()
    ts = TraceSet(signature=sig, sequences=seqs, source="engine")
    events = detector_events(ts, template=detector)
    blocks = build_blocks(ts, 1, "detector", detected=events)
    assert [b.n_steps for b in blocks] == [s.n_tokens - s.prompt_len for s in seqs]
    sim = make_policy(policy)
    state = sim.start(ctx)
    assert np.array_equal(state.n_slots, live_layout), "the simulator chose another slot layout"
    acct = Accounting.with_log(1 << 20)
    for blk in blocks:
        sim.begin_group(blk, state, acct)
        sim.run_steps(blk, 0, blk.n_steps, state, acct)
    replayed = residency_decisions(acct)
    # a layout of whole layers (every layer fully resident or empty) has nothing to change
    whole_layers = bool(np.all((live_layout == 0) | (live_layout == n_expert)))
    if policy == "saem" and ecr == 0.125:
        assert not whole_layers, "the case meant to cover saem's caches got a whole-layer layout"
    if policy not in ("cpu-moe", "n-cpu-moe", "static-hot", "gpu-all") and not whole_layers:
        assert live.shape[0] > 0, "the run made no residency decision: the comparison would be empty"
    if policy.startswith("saem"):
        assert any(ev[0].size for ev in events), "no cue event: the stage path would be untested"
        assert list(sim.boundaries) == live_boundaries
    assert np.array_equal(live, replayed)
    # the engine's hit count is the replay's: each decode ran under the map the simulator assumes
    assert (acct.counters[A_HIT], acct.counters[A_ACCESS]) == (live_hits, live_accesses)
