"""bench/bench_layout.py: the chosen layout against a grid of whole-layer counts, on the real
simulator. With every count in the grid, the chosen layout is one of them: its tokens/s equal
that entry's, and no ratio exceeds 1."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench, rows_by_cost_flags, small_drawn_families

bl = load_bench("bench_layout")


@pytest.fixture
def small_draws(monkeypatch):
    """The drawn families with short stages (a few hundred tokens per sequence), in the
    bench_policies module bench_layout imported (a test may have loaded another since)."""
    where = bl.selected_families.__globals__
    monkeypatch.setitem(where, "drawn_families", small_drawn_families(where["drawn_families"]))


def test_the_chosen_layout_is_measured_against_every_count(tmp_path, small_draws, capsys):
    out = tmp_path / "rows.json"
    # ECR 6.25 % of 128 experts over 48 layers: 3 whole layers at most, so 4 points cover all
    assert bl.main(["--search", "1", "--seed", "2", "--ecr", "6.25%", "--batch", "1", "--points", "4",
                    "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert set(row["tok_s"]) == {"auto", "resident-0", "resident-1", "resident-2", "resident-3"}
    assert row["tok_s"]["auto"] == row["tok_s"][f"resident-{row['chosen_whole']}"]
    assert 0 < row["chosen_vs_best"] <= 1 and 0 < row["uniform_vs_best"] <= 1
    assert "chosen/best over 1 cells" in capsys.readouterr().out


def test_overlap_and_copy_barrier_price_as_a_profile_with_them(tmp_path, small_draws):
    """--hw / --overlap / --copy-barrier are bench_policies' (and simulate's): the flags give the
    rows of a profile file that sets them, and other rows than the preset's."""
    rows = rows_by_cost_flags(bl.main, ["--search", "1", "--seed", "2", "--ecr", "6.25%", "--batch", "1",
                                        "--points", "2"], tmp_path)
    assert rows["flags"] == rows["file"]
    assert rows["flags"][0]["hw"]["cpu_gpu_overlap"] and not rows["plain"][0]["hw"]["cpu_gpu_overlap"]
    assert rows["flags"][0]["tok_s"] != rows["plain"][0]["tok_s"]


@pytest.mark.parametrize("args", [["--points", "0"], ["--hw", "nosuch"], ["--hw", "/no/such/hw.json"],
                                  ["--batch", "a"], ["--batch", ""], ["--batch", "0"],
                                  ["--families", "nosuch"], ["--search", "-2"], ["--families", "model"],
                                  ["--json", "/no/such/dir/out.json"]])
def test_bad_arguments_get_one_line_and_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        bl.main(args)
    assert e.value.code == 2
    assert "error: " in capsys.readouterr().err.strip().splitlines()[-1]
