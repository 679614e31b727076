"""bench/bench_policies.py's drawn families (``--search``): reproducible draws, each replayed on
its own seed, and a searched run's rows carry the setting they were drawn with."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench_scripts import load_bench, rows_by_cost_flags, small_drawn_families

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


@pytest.fixture
def small_draws(monkeypatch):
    """bench_policies' drawn families made small (short stages): the script's own loop, fast."""
    monkeypatch.setattr(bp, "drawn_families", small_drawn_families(bp.drawn_families))


def test_search_rows_carry_their_setting(tmp_path, small_draws, capsys):
    # one drawn family made small, one cell: the script's own loop, rows and JSON
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


def _row(fam: str, vs_best: float, vs_n_cpu: float, vs_oracle: float, best: str = "lfu-cpu") -> dict:
    return {"family": fam, "ecr": 25.0, "batch": 1, "best_other": best, "vs_best": vs_best,
            "vs_n_cpu_moe": vs_n_cpu, "vs_oracle": vs_oracle}


def test_summary_gives_item_4s_figures():
    rows = [_row("a", 1.2, 1.5, 0.9), _row("b", 1 - 1e-12, 1.0, 1.1),  # float noise counts as a tie
            _row("c", 0.9995, 1.2, 0.95, "temporal-cpu"), _row("d", 0.98, 0.9, 1.0, "n-cpu-moe")]
    s = bp.summary(rows)
    assert (s["cells"], s["at_least_best"], s["below_1"], s["below_0999"]) == (4, 2, 2, 1)
    assert s["worst"] == 0.98 and s["worst_cell"] == "d 25 % batch 1 (n-cpu-moe)"
    assert np.isclose(s["geomean_vs_best"], (1.2 * (1 - 1e-12) * 0.9995 * 0.98) ** 0.25)
    assert np.isclose(s["geomean_vs_n_cpu_moe"], (1.5 * 1.0 * 1.2 * 0.9) ** 0.25)
    assert s["min_vs_n_cpu_moe"] == 0.9
    assert np.isclose(s["geomean_vs_oracle"], (0.9 * 1.1 * 0.95 * 1.0) ** 0.25)


def test_jobs_give_the_same_rows_in_the_same_order(tmp_path, small_draws, capsys):
    outs = []
    for jobs in (1, 2):
        out = tmp_path / f"rows{jobs}.json"
        assert bp.main(["--search", "2", "--seed", "4", "--ecr", "25%", "--batch", "1",
                        "--jobs", str(jobs), "--json", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
        printed = capsys.readouterr().out
        assert "geometric means: saem/best other" in printed and "of 2 cells" in printed
    assert [r["family"] for r in outs[0]] == ["drawn-4-0", "drawn-4-1"]
    assert outs[0] == outs[1]


def test_reuse_resimulates_saem_alone_against_the_stored_others(tmp_path, small_draws, capsys):
    full, again, other = tmp_path / "full.json", tmp_path / "again.json", tmp_path / "other.json"
    args = ["--search", "1", "--seed", "6", "--ecr", "25%", "--batch", "1"]
    assert bp.main([*args, "--json", str(full)]) == 0
    assert bp.main([*args, "--reuse", str(full), "--json", str(again)]) == 0
    assert json.loads(again.read_text()) == json.loads(full.read_text())  # saem is deterministic
    # another saem against the same stored others: only its own figures move
    assert bp.main([*args, "--reuse", str(full), "--saem", '{"copy_price": 4.0, "layout": "uniform"}',
                    "--json", str(other)]) == 0
    a, b = json.loads(full.read_text())[0], json.loads(other.read_text())[0]
    assert {k: v for k, v in a["tok_s"].items() if k != "saem"} == {k: v for k, v in b["tok_s"].items() if k != "saem"}
    assert b["saem"] != a["saem"] and b["vs_best"] == b["saem"] / b["best_other_tok_s"]
    capsys.readouterr()


@pytest.mark.parametrize("extra, message", [
    (["--saem", "{nope"], "--saem: not JSON"),
    (["--saem", "[1]"], "--saem must be a JSON object"),
    (["--saem", '{"no_such_knob": 1}'], "--saem: "),
    (["--reuse", "MISSING"], "--reuse MISSING: not a bench_policies --json output"),
    (["--search", "-1"], "--search must be 0"),
    (["--calib-seqs", "0"], "--calib-seqs must be at least 1, not 0"),
    (["--families", "model"], "no family to run (the model family needs --trace)"),
    (["--families", "model", "--trace", "MISSING.npz"], "MISSING.npz: no such trace file"),
    (["--json", "no/such/dir/out.json"], "argument --json: file no/such/dir/out.json: directory no/such/dir does not exist"),
])
def test_bad_reuse_or_saem_options_are_one_line(extra, message, capsys, tmp_path, monkeypatch):
    """Each is refused before any simulation (the last two once came as tracebacks: --json's
    after every family had run)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        bp.main(["--families", "synthetic", "--ecr", "25%", *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_reuse_needs_every_cell(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"family": "synthetic", "ecr": 25.0, "batch": 1, "tok_s": {"lfu-cpu": 1.0}}]))
    with pytest.raises(SystemExit):
        bp.main(["--families", "synthetic", "--ecr", "25%", "--batch", "1,8", "--reuse", str(old)])
    assert "has no run of synthetic at ECR 25 %, batch 8" in capsys.readouterr().err


@pytest.mark.parametrize("stored, flags, message", [
    ({"hw": "overlap"}, [], "was priced on another cost model (rtx4090-ddr5 with overlap), not rtx4090-ddr5"),
    ({"hw": "plain"}, ["--copy-barrier"], "not rtx4090-ddr5 with copy barrier"),
    ({"hw": "plain"}, ["--hw", "rtx3060-ddr4"], "another cost model (rtx4090-ddr5), not rtx3060-ddr4"),
    ({"hw": "plain", "shape": "mixtral-8x7b"}, [], "was routed with --shape mixtral-8x7b, not the default"),
    ({"hw": "plain", "shape": None}, ["--shape", "gpt-oss-20b"], "--shape qwen3-30b-a3b (the default), not gpt-oss-20b"),
    ({"hw": "plain", "calib_sequences": 4}, ["--calib-seqs", "8"], "was calibrated on 4 sequences a family (--calib-seqs), not 8"),
    ({"hw": "plain", "calib_sequences": 8}, [], "was calibrated on 8 sequences a family (--calib-seqs), not 4"),
])
def test_reuse_refuses_runs_of_another_cost_model_or_shape(stored, flags, message, tmp_path, capsys):
    """Ratios against other policies' runs priced or routed otherwise would be silently wrong."""
    from saem_gguf.costmodel import get_hw

    hw = get_hw("rtx4090-ddr5")
    row = {"family": "synthetic", "ecr": 25.0, "batch": 1, "tok_s": {"lfu-cpu": 1.0},
           "hw": dataclasses.asdict(hw.replace(cpu_gpu_overlap=True) if stored["hw"] == "overlap" else hw)}
    row.update({k: v for k, v in stored.items() if k != "hw"})
    old = tmp_path / "old.json"
    old.write_text(json.dumps([row]))
    with pytest.raises(SystemExit) as e:
        bp.main(["--families", "synthetic", "--ecr", "25%", "--batch", "1", "--reuse", str(old), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_shape_routes_and_prices_a_family_with_another_models_shape():
    # --shape: the family's routing has the preset's layers, experts and top-k, and the cost model
    # (found from the routing shape, as simulate finds it) prices that model's expert size
    drawn = bp.drawn_families(1, 2)
    name = "drawn-2-0"
    small = {name: dataclasses.replace(drawn[name], stage_len_scale=0.05, n_stage_median=2.0, n_stage_mean=3.0)}
    ts, calib = bp.family_traces(name, None, 0, small, "mixtral-8x7b")
    for t in (ts, calib):
        assert (t.signature.n_layer, t.signature.n_expert, t.signature.n_expert_used) == (32, 8, 2)
        assert all(s.experts.shape[1:] == (32, 2) and s.experts.max() < 8 for s in t.sequences)
    assert bp.default_cost(ts).expert_bytes == bp.MODEL_PRESETS["mixtral-8x7b"].expert_bytes()
    plain, _ = bp.family_traces(name, None, 0, small)
    assert plain.signature.n_expert == 128


def test_calib_seqs_sets_a_synthetic_familys_calibration_sample(tmp_path, capsys):
    # --calib-seqs N: N calibration sequences (simulate --synthetic's --calib-seqs), the replayed 8
    # unchanged; each row records N, and 4 (the default) is what the rows said before
    drawn = bp.drawn_families(1, 2)
    name = "drawn-2-0"
    small = {name: dataclasses.replace(drawn[name], stage_len_scale=0.05, n_stage_median=2.0, n_stage_mean=3.0)}
    ts4, calib4 = bp.family_traces(name, None, 0, small)
    ts8, calib8 = bp.family_traces(name, None, 0, small, calib_sequences=8)
    assert (len(ts4.sequences), len(calib4.sequences), len(calib8.sequences)) == (8, 4, 8)
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(ts4.sequences, ts8.sequences))
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(calib4.sequences, calib8.sequences[:4]))
    out = tmp_path / "rows.json"
    assert bp.main(["--families", "shift-nocue", "--ecr", "25%", "--batch", "1", "--calib-seqs", "2",
                    "--json", str(out)]) == 0
    assert [r["calib_sequences"] for r in json.loads(out.read_text())] == [2]
    capsys.readouterr()


def test_ctrl_c_is_one_line_and_130_with_workers(tmp_path):
    """Ctrl-C reaches every process of the terminal's group: the parent says so in one line and
    exits 130, no worker prints a traceback, and no --json is written (it was a traceback from
    the parent and one from each worker)."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    p = subprocess.Popen([sys.executable, str(bp.__file__), "--families", "synthetic,stationary,kinds,drift-nocue",
                          "--ecr", "25%", "--batch", "1", "--jobs", "2", "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         # as a terminal's process: a background job (CI's) starts with SIGINT
                         # ignored, and an ignored signal stays so through exec
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        header = p.stdout.readline()
        first_row = p.stdout.readline()  # a worker has run a task: both are past their start
        assert header.startswith("family") and first_row.split()[0] in ("synthetic", "stationary")
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["bench_policies.py: interrupted"], err
    assert not out.exists()


def test_overlap_and_copy_barrier_price_as_a_profile_with_them(tmp_path, small_draws, capsys):
    """--overlap / --copy-barrier are simulate's: the rows equal those of --hw with a profile file
    that sets them, and differ from the preset's."""
    rows = rows_by_cost_flags(bp.main, ["--search", "1", "--seed", "5", "--ecr", "25%", "--batch", "1"], tmp_path)
    assert rows["flags"] == rows["file"]
    assert rows["flags"][0]["tok_s"] != rows["plain"][0]["tok_s"]
