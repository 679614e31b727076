"""Every benchmark that writes a file refuses a path it cannot write as it parses its flags:
one line and exit 2, not a traceback after minutes of measuring (``cli.arg_types.output_file``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OUTPUT_FLAG = re.compile(r'add_argument\("(--json|--out)", type=_?output_file\b')
# each script that writes a file, and the flag that names it (a benchmark's --out that names a
# working directory, not a file, is not one)
WRITERS = sorted([*((p, m.group(1)) for p in [*REPO.glob("bench/*.py"), *REPO.glob("bench/device/*.py")]
                    for m in OUTPUT_FLAG.finditer(p.read_text(encoding="utf-8"))),
                  (REPO / "bench" / "bench_layout.py", "--json")])  # bench_policies' workload options


def test_every_json_flag_of_a_benchmark_is_checked():
    """A new benchmark's --json without the type is caught here, not by a user."""
    plain = [p.name for p in REPO.glob("bench/**/*.py")
             if re.search(r'add_argument\("--json"(?!, type=_?output_file\b)', p.read_text(encoding="utf-8"))]
    assert not plain, plain
    assert len(WRITERS) >= 15


@pytest.mark.parametrize("script, flag", WRITERS, ids=[f"{p.name}:{f}" for p, f in WRITERS])
def test_an_unwritable_output_is_refused_before_any_work(script, flag, tmp_path):
    target = tmp_path / "no" / "such" / "out.json"
    r = subprocess.run([sys.executable, str(script), flag, str(target)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"error: argument {flag}: file {target}: directory {target.parent} does not exist" in last
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "no").exists()
