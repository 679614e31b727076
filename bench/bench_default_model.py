"""Placement on the default model's own traces: trace held-out questions, then simulate policies.

    python bench/bench_default_model.py [--model M.gguf] [-n 60] [--seed 777] [--out DIR] [--json OUT]

1. writes ``-n`` held-out single-turn questions (``eval.problems.question_lines``, every kind in
   turn, the evaluation's own phrasings) to ``DIR/questions.txt``;
2. ``python -m saem_gguf trace -m M --prompts DIR/questions.txt -n 1024 -o DIR/trace.npz``
   (greedy; the model stops itself long before 1024 tokens);
3. ``python -m saem_gguf simulate --trace DIR/trace.npz --cues qwen3 --policies POLICIES
   --ecr 6.25%,12.5%,25%,50% --batch 1,8 --json DIR/simulate.json`` (a quarter of the traces
   calibrates static-hot and saem-cue, the rest is replayed; qwen3 is the family cue set the
   engine's detector uses on a qwen3moe model);

and prints the hit rate (and the cost model's tokens/s) by policy and ECR, batch 1 and 8, with
the load average. Run it under the shared lock: ``flock /tmp/saem-heavy.lock nice -n 5 ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.defaultmodel.eval.problems import question_lines  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402

POLICIES = "saem,saem-strict,saem-cue,lfu-cpu,static-hot,temporal-cpu,n-cpu-moe,oracle"
ECRS = "6.25%,12.5%,25%,50%"
BATCHES = "1,8"
N_PREDICT = 1024


def saem_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "saem_gguf", *args], check=True)


def table(rows: list[dict], column: str, scale: float, fmt: str) -> str:
    ecrs = sorted({r["ecr"] for r in rows})
    lines = []
    for batch in sorted({r["batch"] for r in rows}):
        lines.append(f"batch {batch}: {column}")
        lines.append(f"  {'policy':<14}" + "".join(f"{f'ECR {e:g}%':>11}" for e in ecrs))
        for pol in dict.fromkeys(r["policy"] for r in rows):
            cells = {r["ecr"]: r[column] for r in rows if r["batch"] == batch and r["policy"] == pol}
            lines.append(f"  {pol:<14}" + "".join(f"{format(scale * cells[e], fmt):>11}" if e in cells
                                                   else f"{'-':>11}" for e in ecrs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded model)")
    p.add_argument("-n", type=int, default=60, help="held-out questions to trace (60)")
    p.add_argument("--seed", type=int, default=777, help="their seed (777)")
    p.add_argument("--out", type=Path, default=Path("out/bench_default_model"), help="working directory")
    p.add_argument("--json", type=output_file, default=None, help="write the simulate rows and the load average")
    a = p.parse_args(argv)
    if a.n < 8:
        print("error: -n must be at least 8 (a quarter calibrates, batch 8 replays the rest)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    questions, trace, sim = a.out / "questions.txt", a.out / "trace.npz", a.out / "simulate.json"
    write_text_atomic(questions, "\n".join(question_lines(a.seed, a.n)) + "\n")
    model = ["-m", str(a.model)] if a.model else []
    load_before = os.getloadavg()[0]
    saem_cli("trace", *model, "--prompts", str(questions), "-n", str(N_PREDICT), "--quiet", "-o", str(trace))
    saem_cli("simulate", "--trace", str(trace), "--cues", "qwen3", "--policies", POLICIES, "--ecr", ECRS,
             "--batch", BATCHES, "--quiet", "--json", str(sim))
    load_after = os.getloadavg()[0]
    rows = json.loads(sim.read_text())["rows"]
    print(table(rows, "hit_rate", 100.0, ".1f"))
    print(table(rows, "tok_s", 1.0, ".0f"))
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    if a.json:
        # atomic, as the other benches' results: an interrupted run leaves no half-written file
        write_text_atomic(a.json, json.dumps({"rows": rows, "loadavg": [load_before, load_after],
                                              "questions": a.n, "seed": a.seed}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
