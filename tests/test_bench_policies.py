"""bench/bench_policies.py's drawn families (``--search``): reproducible draws, each replayed on
its own seed, and a searched run's rows carry the setting they were drawn with."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from bench_scripts import load_bench

bp = load_bench("bench_policies")


def test_drawn_families_are_reproducible_and_differ_between_seeds():
    a, b, c = bp.drawn_families(6, 0), bp.drawn_families(6, 0), bp.drawn_families(6, 1)
    assert list(a) == [f"drawn-0-{i}" for i in range(6)]
    assert a == b
    assert [dataclasses.astuple(x) for x in a.values()] != [dataclasses.astuple(x) for x in c.values()]
    assert len({x.seed for x in (*a.values(), *c.values())}) == 12  # every family its own traces


def test_a_drawn_family_replays_on_its_own_seed():
    drawn = bp.drawn_families(2, 3)
    name = "drawn-3-1"
    small = {name: dataclasses.replace(drawn[name], stage_len_scale=0.05, n_stage_median=2.0, n_stage_mean=3.0)}
    ts, calib = bp.family_traces(name, None, 0, small)
    again, _ = bp.family_traces(name, None, 7, small)  # --seed seeds the draw, not a drawn family's traces
    assert len(ts.sequences) == 8 and len(calib.sequences) == 4
    assert all(np.array_equal(x.experts, y.experts) for x, y in zip(ts.sequences, again.sequences))


def test_search_rows_carry_their_setting(tmp_path, monkeypatch, capsys):
    # one drawn family made small, one cell: the script's own loop, rows and JSON
    real = bp.drawn_families

    def small(n, seed):
        return {k: dataclasses.replace(v, stage_len_scale=0.05, n_stage_median=2.0, n_stage_mean=3.0)
                for k, v in real(n, seed).items()}

    monkeypatch.setattr(bp, "drawn_families", small)
    out = tmp_path / "rows.json"
    assert bp.main(["--search", "1", "--seed", "5", "--ecr", "25%", "--batch", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["family"] for r in rows] == ["drawn-5-0"]
    assert rows[0]["config"]["stage_len_scale"] == 0.05 and "skew" in rows[0]["config"]
    assert rows[0]["best_other"] in bp.OTHERS and rows[0]["vs_best"] > 0
    assert "drawn-5-0: {" in capsys.readouterr().out


def test_a_settings_inert_drift_keep_is_not_printed():
    still = bp.SyntheticConfig(skew=1.57, drift_every=0, drift_keep=0.5)
    moving = dataclasses.replace(still, drift_every=4)
    assert bp._changed_fields(still) == {"skew": 1.57}
    assert bp._changed_fields(moving) == {"skew": 1.57, "drift_every": 4, "drift_keep": 0.5}
