"""Simulator: batching and events from traces, metrics equal to hand-computed values, the
paper-level invariants on synthetic traces, and the `simulate` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from saem_gguf.accounting import Accounting
from saem_gguf.cli.main import main
from saem_gguf.costmodel import HW_PRESETS, CostModel
from saem_gguf.policies.base import PolicyContext
from saem_gguf.simulator import (
    SimConfig, build_blocks, calibration_counts, calibration_sample, default_cost, detector_events, replay, run_policy,
    simulate, split_calibration,
)
from saem_gguf.trace import ModelSignature, SequenceTrace, TraceSet, save_traces, validate_traces

EB = 1_000_000
SIG = ModelSignature(arch="qwen3moe", n_layer=1, n_expert=4, n_expert_used=1, expert_bytes=EB, name="tiny")


def _seq(experts, starts=(0,), prompt=0, pieces=None):
    ex = np.asarray(experts, np.int16).reshape(-1, 1, 1)
    T = ex.shape[0]
    return SequenceTrace(token_ids=np.arange(T, dtype=np.int32), pieces=pieces or [b"x"] * T, experts=ex,
                         stage_starts=np.array(starts, np.int32), prompt_len=prompt)


def _cost():
    return CostModel.from_expert_bytes(EB, HW_PRESETS["rtx4090-ddr5"])


def test_build_blocks_lockstep_events_prefill():
    pieces = [b"p", b"p", b"Wa", b"it", b",", b"x", b"x", b"x"]
    a = _seq([1, 1, 2, 2, 2, 3, 3, 3], starts=(0, 2, 5), prompt=2, pieces=pieces)
    b = _seq([0, 0, 0], starts=(0, 1), pieces=[b"x", b"Hmm,", b"x"])
    ts = TraceSet(signature=SIG, sequences=[a, b], meta={"boundary_cues": [[None, "Wait", None], [None, "Hmm"]]})
    (blk,) = build_blocks(ts, 2, "all")
    assert blk.routing.shape == (6, 2, 1, 1)  # a has 6 decode tokens, b 3
    assert blk.routing[:, 1, 0, 0].tolist() == [0, 0, 0, -1, -1, -1]
    assert (blk.routing[:, :, 0, 0] >= 0).sum(axis=1).tolist() == [2, 2, 2, 1, 1, 1]
    # a: "Wait" spans 2 pieces from token 2 -> known before decode step 2-2+2=2; the implicit one
    # at token 5 fires one token later (step 4); b: "Hmm," is one piece -> step 2
    assert blk.event_steps.tolist() == [2, 4]
    assert [r.tolist() for r in blk.event_rows] == [[0, 1], [0]]
    assert blk.prefill_tokens == 2 and blk.prefill_counts[0].tolist() == [0, 2, 0, 0]
    (blk,) = build_blocks(ts, 2, "cued")
    assert blk.event_steps.tolist() == [2]
    (blk,) = build_blocks(ts, 2, "none")
    assert blk.event_steps.size == 0
    blocks = build_blocks(ts, 1)
    assert [x.step0 for x in blocks] == [0, 6] and [x.n_steps for x in blocks] == [6, 3]


def test_build_blocks_keeps_an_event_after_the_last_token():
    """The engine's policy is told of an event its detector reports after a sequence's last
    token (it may act on it before the next request, or the batch's next step): so is the
    simulator's, through the block's last step."""
    a = _seq([1, 1, 2, 2], starts=(0, 3))  # a stage starts at the last token: known after it
    b = _seq([0, 0, 0, 0, 0, 0], starts=(0,))
    (blk,) = build_blocks(TraceSet(signature=SIG, sequences=[a]), 1, "all")
    assert blk.event_steps.tolist() == [4] and blk.events_after(3).cue_event
    (blk,) = build_blocks(TraceSet(signature=SIG, sequences=[a, b]), 2, "all")
    assert blk.event_steps.tolist() == [4] and blk.events_after(3).rows == (0,)  # b still decodes


def test_metrics_hand_computed():
    # two sequences, batch 2: steps route {0,1}, {0,2}, {0} (second row finished)
    ts = TraceSet(signature=SIG, sequences=[_seq([0, 0, 0]), _seq([1, 2])])
    blocks = build_blocks(ts, 2)
    cost = _cost()
    calib = np.array([[3.0, 1.0, 0.0, 0.0]])
    ctx = PolicyContext(n_layer=1, n_expert=4, top_k=1, n_slots=np.array([1]), cost=cost, calib_counts=calib, batch=2)
    m = run_policy("static-hot", blocks, ctx)  # expert 0 resident: 3 of 5 accesses hit
    assert m["hit_rate"] == pytest.approx(3 / 5) and m["adj_hit_rate"] == pytest.approx(3 / 5)
    assert m["load_mb_per_token"] == 0 and m["transfers"] == 0 and m["cpu_expert_tokens"] == 2
    assert m["tokens"] == 5 and m["steps"] == 3
    assert m["tok_s"] == pytest.approx(5 / m["time_s"])
    m = run_policy("lru", blocks, ctx)  # 1 slot: 0 hit, 1 load (evicts 0), 0 load, 2 load, 0 load
    # step 0: 0 hit; 1 miss -> loads over 0. step 1: 0 miss -> load, 2 miss -> load. step 2: 0 miss -> load
    assert m["hit_rate"] == pytest.approx(1 / 5)
    assert m["transfers"] == 4 and m["bytes"] == 4 * EB
    assert m["load_mb_per_token"] == pytest.approx(4 * EB / 1e6 / 5)
    # SAEM: one proactive copy at a boundary is charged against hits in the adjusted hit rate
    seq = _seq([1, 1, 1, 1, 2, 2, 2, 2], starts=(0, 4), pieces=[b"x"] * 4 + [b"Wait"] + [b"x"] * 3)
    ts2 = TraceSet(signature=SIG, sequences=[seq], meta={"boundary_cues": [[None, "Wait"]]})
    blocks2 = build_blocks(ts2, 1)
    ctx2 = PolicyContext(n_layer=1, n_expert=4, top_k=1, n_slots=np.array([1]), cost=cost, calib_counts=calib)
    from saem_gguf.policies.saem import SaemConfig

    m = run_policy("saem-stage", blocks2, ctx2, {"config": SaemConfig(min_gap_steps=2, warmup_steps=0, refresh_steps=0)})
    # calib places 0; the cue is known before step 5 and places 1 (stage A) -> steps 5..7 use 2: no hit
    assert m["hit_rate"] == 0 and m["proactive_transfers"] == 1 and m["adj_hit_rate"] == pytest.approx(-1 / 8)
    assert m["load_mb_per_token"] == pytest.approx(EB / 1e6 / 8)


def test_calibration_split_and_counts():
    ts = TraceSet(signature=SIG, sequences=[_seq([0, 1]), _seq([2, 2]), _seq([3])],
                  meta={"boundary_cues": [[None], [None], [None]]})
    rep, cal = split_calibration(ts, 0.34)
    assert len(rep.sequences) == 1 and len(cal.sequences) == 2
    assert rep.meta["boundary_cues"] == [[None]]
    assert calibration_counts(cal, 1, 4)[0].tolist() == [0, 0, 2, 1]
    assert split_calibration(ts, 0)[1] is None


@pytest.fixture(scope="module")
def synth():
    synthetic = pytest.importorskip("saem_gguf.synthetic")
    cfg = synthetic.SyntheticConfig(n_layer=4, n_expert=16, top_k=2, n_sequences=4, stage_len_scale=0.25, seed=5)
    ts = synthetic.make_stage_traces(cfg)
    import dataclasses

    cal = synthetic.make_stage_traces(dataclasses.replace(cfg, n_sequences=2, seed=99))
    return ts, cal, synthetic


def test_simulate_synthetic_invariants(synth, tmp_path):
    ts, cal, _ = synth
    cost = default_cost(ts, "rtx4090-ddr5", "qwen3-30b-a3b")
    from saem_gguf.policies import POLICIES

    res = simulate(ts, SimConfig(policies=tuple(POLICIES), ecrs=(12.5, 50.0), batches=(1, 3)), cost, calib=cal)
    assert len(res.rows) == len(POLICIES) * 4
    for B in (1, 3):
        for e in (12.5, 50.0):
            row = {r["policy"]: r for r in res.select(batch=B, ecr=e)}
            assert row["gpu-all"]["hit_rate"] == 1.0 and row["gpu-all"]["bytes"] == 0
            assert row["cpu-moe"]["bytes"] == 0 and row["cpu-moe"]["hit_rate"] == 0
            assert row["cpu-moe"]["cpu_expert_tokens"] == row["cpu-moe"]["accesses"]
            assert row["oracle"]["hit_rate"] >= row["saem-stage"]["hit_rate"]
            assert row["gpu-all"]["tok_s"] >= max(r["tok_s"] for r in row.values())
            for r in row.values():
                assert r["adj_hit_rate"] <= r["hit_rate"] <= 1.0
                assert r["tokens"] == row["gpu-all"]["tokens"]
    json.dumps(res.to_json())
    text = res.table()
    assert "saem/best" in text and "oracle" in text
    # every row's ECR columns line up with its block's head (saem-implicit is wider than the
    # label column was; the last line of each block is saem/best)
    ends = {len(line) for line in text.splitlines() if line.startswith("  ")}
    assert len(ends) == 1, sorted(ends)
    from saem_gguf.plots import plot_results

    png = tmp_path / "p.png"
    plot_results(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_implicit_boundaries_fire_without_cues(synth):
    _, _, synthetic = synth
    import dataclasses

    cfg = synthetic.SyntheticConfig(n_layer=4, n_expert=16, top_k=2, n_sequences=2, stage_len_scale=0.5, seed=7,
                                    cue_prob=0.0, n_stages=6, coherence=0.0, skew=1.5)
    ts = synthetic.make_stage_traces(cfg)
    assert all(c is None for cues in ts.meta["boundary_cues"] for c in cues)
    blocks = build_blocks(ts, 1)
    assert all(b.event_steps.size == 0 for b in blocks)  # no cue: no explicit event
    from saem_gguf.policies import make_policy

    ctx = PolicyContext(n_layer=4, n_expert=16, top_k=2, n_slots=np.full(4, 4), cost=default_cost(ts, model="qwen3-30b-a3b"),
                        calib_counts=None)
    pol = make_policy("saem-implicit")
    pol.start(ctx)
    acct = Accounting()
    replay(pol, blocks, acct)
    assert sum(r == "implicit" for _, r in pol.boundaries) >= 2
    del dataclasses


def test_detector_events(synth):
    _, _, synthetic = synth
    cfg = synthetic.SyntheticConfig(n_layer=48, n_expert=128, top_k=8, n_sequences=2, stage_len_scale=0.6, seed=3,
                                    cue_prob=0.5, n_stages=6)
    ts = synthetic.make_stage_traces(cfg)
    blocks = build_blocks(ts, 1, "detector")
    cued = build_blocks(ts, 1, "cued")
    n_cue = sum(b.event_steps.size for b in blocks)
    n_all = sum(b.implicit_event_steps.size for b in blocks)
    assert n_cue >= 1 and n_all > n_cue  # the routing-shift detector finds cue-less boundaries too
    for b, c in zip(blocks, cued):
        assert set(b.event_steps.tolist()) <= set(b.implicit_event_steps.tolist())
        # every cue event carries the text the detector matched
        assert len(b.event_cues) == b.event_steps.size
        assert all(len(cs) == len(rows) and all(cs) for cs, rows in zip(b.event_cues, b.event_rows))
        # the matcher fires on the token that completes the cue, as the recorded starts say
        assert set(b.event_steps.tolist()) == set(c.event_steps.tolist())
    from saem_gguf.policies import make_policy

    ctx = PolicyContext(n_layer=48, n_expert=128, top_k=8, n_slots=np.full(48, 16), cost=default_cost(ts),
                        calib_counts=None)
    pol = make_policy("saem-implicit")
    pol.start(ctx)
    acct = Accounting()
    replay(pol, blocks, acct)
    reasons = [r for _, r in pol.boundaries]
    assert "implicit" in reasons and "cue" in reasons


def test_detector_events_of_a_profile_that_kept_no_cue(synth):
    """A calibration that kept no cue makes an implicit-only detector (StageDetector.from_profile);
    replaying under it as a template (the engine's saem pricing its layout on the calibration
    routing) has no cue event, only routing-shift ones. It raised on making the cue twin."""
    from saem_gguf.stage.detector import DetectorConfig, StageDetector

    _, _, synthetic = synth
    ts = synthetic.make_stage_traces(synthetic.SyntheticConfig(n_layer=8, n_expert=32, top_k=4, n_sequences=2,
                                                               seed=3, n_stages=6))
    implicit_only = StageDetector(1, None, DetectorConfig(use_cues=False, use_implicit=True), n_layer=8,
                                  n_expert=32, top_k=4)
    events = detector_events(ts, template=implicit_only)
    assert all(cue.size == 0 and not texts for cue, _, texts in events)
    assert sum(both.size for _, both, _ in events) > 0


def test_cli_simulate_synthetic(tmp_path, capsys):
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    rc = main(["simulate", "--synthetic", "--layers", "4", "--experts", "16", "--top-k", "2", "--seqs", "2",
               "--calib-seqs", "1", "--stage-scale", "0.2", "--ecr", "12.5%,50%", "--batch", "1,2", "--model",
               "qwen3-30b-a3b", "--policies", "cpu-moe,lru,saem,oracle,gpu-all", "--json", str(out), "--plot",
               str(png), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 5 * 2 * 2 and png.exists()
    assert capsys.readouterr().out == ""  # --quiet


def test_cli_simulate_trace_file_and_errors(tmp_path, capsys):
    synthetic = pytest.importorskip("saem_gguf.synthetic")
    ts = synthetic.make_stage_traces(synthetic.SyntheticConfig(n_layer=2, n_expert=8, top_k=2, n_sequences=3,
                                                               stage_len_scale=0.15, seed=1))
    p = tmp_path / "t.npz"
    save_traces(ts, str(p))
    rc = main(["simulate", "--trace", str(p), "--model", "qwen3-30b-a3b", "--ecr", "25%", "--policies",
               "static-hot,saem", "--hw", "h200-server"])
    out = capsys.readouterr().out
    assert rc == 0 and "static-hot" in out and "h200-server" in out and "1 calibration sequences" in out
    other = tmp_path / "o.npz"
    ts2 = synthetic.make_stage_traces(synthetic.SyntheticConfig(n_layer=3, n_expert=8, top_k=2, n_sequences=1,
                                                                stage_len_scale=0.15, seed=1))
    save_traces(ts2, str(other))
    rc = main(["simulate", "--trace", str(p), "--calib-trace", str(other), "--model", "qwen3-30b-a3b", "--quiet"])
    assert rc == 1 and "model mismatch" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"garbage")
    assert main(["simulate", "--trace", str(bad), "--quiet"]) == 1
    assert "not a saem trace" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(p), "--policies", "mru", "--quiet"]) == 1
    assert "unknown policy" in capsys.readouterr().err
    # no model shape known for a 2x8 top-2 trace without expert_bytes
    assert main(["simulate", "--trace", str(p), "--quiet"]) == 1
    assert "--model" in capsys.readouterr().err


def test_simulate_calibrates_cue_profiles(synth):
    _, _, synthetic = synth
    cfg = synthetic.SyntheticConfig(n_layer=4, n_expert=16, top_k=2, n_sequences=4, stage_len_scale=0.3, seed=5,
                                    cue_prob=0.8, n_stages=6)
    ts = synthetic.make_stage_traces(cfg)
    rep, cal = split_calibration(ts, 0.5)
    res = simulate(rep, SimConfig(policies=("saem", "saem-cue"), ecrs=(25.0,), batches=(1,)), _cost(), cal)
    assert res.info["cue_profiles"] and all(n > 0 for n in res.info["cue_profiles"].values())
    rows = {r["policy"]: r for r in res.rows}
    assert set(rows) == {"saem", "saem-cue"}
    assert 0.0 <= rows["saem-cue"]["hit_rate"] <= 1.0



def test_ram_tier_projection_budget_sweep():
    """simulate --ram-budget: a budget holding every expert reads nothing from disk and leaves
    tok/s as without the tier; the other figures are untouched by the tier; smaller budgets read
    more (monotone on this stage-structured trace, for every policy the engine's tier runs)."""
    import dataclasses

    from saem_gguf import synthetic
    from saem_gguf.simulator import RamProjection

    cfg = synthetic.SyntheticConfig(n_layer=4, n_expert=16, top_k=2, n_sequences=4, stage_len_scale=0.25, seed=5)
    ts = synthetic.make_stage_traces(cfg)
    cal = synthetic.make_stage_traces(dataclasses.replace(cfg, n_sequences=2, seed=99))
    cost = _cost()
    sim = SimConfig(policies=("lru-cpu", "lfu-cpu", "static-hot", "saem"), ecrs=(12.5,), events="cued")
    base = simulate(ts, sim, cost, calib=cal)
    per_slot = cfg.n_layer * EB  # one expert of every layer
    disk: dict[str, list[float]] = {}
    for slots in (1, 2, 4, 8, 16):
        res = simulate(ts, sim, cost, calib=cal, ram=RamProjection(per_slot * slots + per_slot // 2))
        for row, ref in zip(res.rows, base.rows):
            assert row["ram_slots"] == slots and row["ram_policy"] == row["policy"]
            assert {k: v for k, v in row.items() if k in ref and k != "wall_s"} == \
                {k: v for k, v in ref.items() if k != "wall_s"}
            reads = row["disk_demand_reads"] + row["disk_prefetch_reads"]
            assert row["disk_bytes"] == reads * EB
            assert row["disk_mb_per_token"] == pytest.approx(reads * EB / 1e6 / row["tokens"])
            read_s = cost.hw.ssd_latency_s + EB / cost.hw.ssd_read_bw
            assert row["tok_s_with_ram"] == pytest.approx(row["tokens"] / (row["time_s"] + reads * read_s))
            disk.setdefault(row["policy"], []).append(row["disk_bytes"])
            if slots == 16:  # every expert in RAM
                assert reads == 0 and row["ram_hit_rate"] == 1.0
                assert row["tok_s_with_ram"] == row["tok_s"]
            else:
                assert row["disk_demand_reads"] > 0 and row["tok_s_with_ram"] < row["tok_s"]
    for name, seq in disk.items():
        assert all(a >= b for a, b in zip(seq, seq[1:])), (name, seq)
        assert seq[0] > seq[-2] > 0, (name, seq)


def test_ram_tier_projection_vram_hits_read_nothing():
    """An expert resident in VRAM is not read from disk: with every expert in VRAM (gpu-all) the
    RAM tier's misses cost nothing, whatever its budget."""
    import dataclasses

    from saem_gguf import synthetic
    from saem_gguf.simulator import RamProjection

    cfg = synthetic.SyntheticConfig(n_layer=2, n_expert=8, top_k=2, n_sequences=2, stage_len_scale=0.25, seed=3)
    ts = synthetic.make_stage_traces(cfg)
    cal = synthetic.make_stage_traces(dataclasses.replace(cfg, n_sequences=1, seed=98))
    res = simulate(ts, SimConfig(policies=("gpu-all",), ecrs=(12.5,), events="cued"), _cost(), calib=cal,
                   ram=RamProjection(cfg.n_layer * EB))
    (row,) = res.rows
    assert row["ram_policy"] == "saem" and row["ram_slots"] == 1  # gpu-all places all: the tier runs saem
    assert row["disk_demand_reads"] == 0 and row["ram_hit_rate"] < 1.0


def test_simulate_cli_ram_budget(capsys):
    rc = main(["simulate", "--synthetic", "--seqs", "2", "--calib-seqs", "1", "--policies", "lru-cpu,saem",
               "--ecr", "12.5%", "--quiet", "--ram-budget", "1G", "--ram-policy", "lfu-cpu", "--json", "-"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["ram_policy"] for r in rows] == ["lfu-cpu", "lfu-cpu"]
    assert all(0 < r["tok_s_with_ram"] < r["tok_s"] and r["disk_mb_per_token"] > 0 for r in rows)


def test_calibration_sample_keeps_every_sequences_opening():
    """What a policy is replayed over at load: every sequence's prompt and first n decoded tokens
    (a shorter sequence whole), n the largest that keeps the decoded tokens within the cap; its
    routing, text and stage starts cut alike; a valid trace set; all of it under a larger cap."""
    synthetic = pytest.importorskip("saem_gguf.synthetic")
    cfg = synthetic.SyntheticConfig(n_layer=4, n_expert=16, top_k=2, n_sequences=3, stage_len_scale=0.25,
                                    prompt_len=5, seed=9)
    ts = synthetic.make_stage_traces(cfg)
    decoded = [s.n_tokens - 5 for s in ts.sequences]
    short = min(decoded)
    n = max(decoded) // 3 + short // 2  # above the shortest for some caps, below it for others
    for cap in (short * 3 - 1, 2 * n + short, 10):
        smp = calibration_sample(ts, cap)
        validate_traces(smp)
        cut = max(k for k in range(max(decoded) + 1) if sum(min(d, k) for d in decoded) <= cap)
        assert [s.decoded_tokens for s in smp.sequences] == [min(d, cut) for d in decoded]
        for part, whole in zip(smp.sequences, ts.sequences):
            k = part.n_tokens
            assert part.prompt_len == 5 and np.array_equal(part.experts, whole.experts[:k])
            assert part.pieces == whole.pieces[:k] and np.array_equal(part.token_ids, whole.token_ids[:k])
            starts = np.asarray(whole.stage_starts)
            assert part.stage_starts.tolist() == starts[starts < k].tolist()
    everything = calibration_sample(ts, 10**9)
    assert all(a is b for a, b in zip(everything.sequences, ts.sequences))
    assert calibration_sample(ts, 0).sequences == []
