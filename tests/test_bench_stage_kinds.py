"""bench/bench_stage_kinds.py scores stage-granularity placements correctly on routing whose
answer is known: two stage kinds with disjoint experts, alternating."""

from __future__ import annotations

import numpy as np

from bench_scripts import load_bench


def _bench():
    return load_bench("bench_stage_kinds")


def _seq(rng, n_stages: int, stage_len: int = 10):
    """Stages alternate compute (experts 0-3) and verify (experts 4-7), 2 layers, top-2."""
    ex, kinds, bounds = [], [], [0]
    for s in range(n_stages):
        base = 0 if s % 2 == 0 else 4
        ex.append(base + rng.integers(0, 4, size=(stage_len, 2, 2)))
        kinds.append("compute" if s % 2 == 0 else "verify")
        bounds.append(bounds[-1] + stage_len)
    return np.concatenate(ex), bounds, kinds


def test_kind_placement_beats_previous_stage_on_alternating_kinds():
    b = _bench()
    rng = np.random.default_rng(0)
    seqs = [_seq(rng, 4) for _ in range(6)]
    res = b.evaluate(seqs, n_expert=16, cap=4, n_calib=2)
    hit = res["hit_pct"]
    assert res["accesses"] == 4 * 4 * 10 * 2 * 2
    assert hit["kind"] == 100.0 and hit["stage-oracle"] == 100.0
    # the completed stage is always of the other kind: only the first stage (static) can hit
    assert hit["prev-stage"] < 30.0
    assert hit["static"] < hit["kind"]
