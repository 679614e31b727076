"""bench/bench_server.py's summary over interleaved repetitions (ratios taken within a repetition,
mean +/- sd) and bench/bench_batch.py --decode-rows on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[1]


def _bench_server():
    return load_bench("bench_server")


def _run(bs, n: int, tok_s: float, failed: int = 0, load: float = 0.5):
    return bs.RunResult(n, 200, failed, 1.0, int(tok_s), tok_s, 0.01, 0.02, 0.1, 0.2, load, load + 0.1, None)


def test_summary_takes_each_ratio_within_its_repetition():
    bs = _bench_server()
    # the machine got slower in repetition 2: both -np drop, their ratio does not
    reps = [[_run(bs, 1, 1000.0), _run(bs, 4, 2000.0)], [_run(bs, 1, 500.0), _run(bs, 4, 1000.0, failed=1, load=1.5)]]
    one, four = bs.summarize(reps)
    assert (one.n_parallel, one.repetitions, one.requests, one.failed) == (1, 2, 400, 0)
    assert four.ratio == (2.0, 0.0)  # ratios of the means would be 2.0 too; each pair is exactly 2
    assert four.tokens_per_s[0] == 1500.0 and four.tokens_per_s[1] == pytest.approx(707.1068, rel=1e-6)
    assert four.failed == 1 and (four.load_min, four.load_max) == (0.5, 1.6)
    table = bs.table([one, four])
    assert "1500 +/- 707" in table and "2.00 +/- 0.00" in table and "0.50-1.60" in table
    # one repetition: no spread
    assert bs.summarize(reps[:1])[1].tokens_per_s == (2000.0, 0.0)


def test_decode_rows_times_llama_decode_per_batch_size(tmp_path, llama_cpp):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_batch.py"), "--decode-rows", "1,2",
                           "--steps", "20", "--ctx-per-seq", "256", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["rows"] for r in rows] == [1, 2] and all(r["steps"] == 20 and r["mean_ms"] > 0 for r in rows)
    assert "rows/s" in proc.stdout


def test_bench_prompt_cache_runs_conversations_three_ways(tmp_path):
    """bench/bench_prompt_cache.py on the embedded model, 2 conversations of 3 turns taking turns:
    the host-memory cache evaluates fewer prompt tokens than the slot's cells alone, which
    evaluate no more than no cache; the JSON keeps every request."""
    out = tmp_path / "pc.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_prompt_cache.py"), "--turns", "3", "--repeat", "1",
                        "--conversations", "2", "--max-tokens", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "off / ram" in r.stdout and "load average" in r.stdout
    runs = {run["way"]: run["requests"] for run in json.loads(out.read_text())["runs"]}
    evaluated = {way: sum(q["prompt_n"] for q in reqs) for way, reqs in runs.items()}
    assert len(runs["off"]) == 4 and all(q["cache_n"] == 0 for q in runs["off"])
    assert evaluated["ram"] < evaluated["slot"] <= evaluated["off"]
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "bench_prompt_cache.py"), "--json",
                          str(tmp_path / "no" / "x.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "does not exist" in bad.stderr.splitlines()[-1]
