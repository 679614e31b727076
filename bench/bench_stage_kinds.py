"""Which stage-granularity placement predicts a stage's experts best, on real traces?

    python -m saem_gguf trace --prompts QUESTIONS.txt -n 300 -o T.npz
    python bench/bench_stage_kinds.py T.npz [--ecr 0.25] [--calib 15] [--json OUT]

Hit rate only (no timing, batch 1): at every stage start the cache holds, per layer, the top-C
experts of

* ``static``:       the calibration sequences' overall histogram,
* ``prev-stage``:   the stage just completed (SAEM's rule; the first stage uses ``static``),
* ``kind``:         the calibration histogram of the stage *kind* the opening cue names
                    (``defaultmodel.evaluate.CUE_KIND``: pause, alternative, verify, conclude,
                    answer; the first stage is ``compute``),
* ``kind+prev``:    the two above, each normalised, summed,
* ``stage-oracle``: the stage's own histogram (the best any per-stage placement can do).

The first ``--calib`` sequences calibrate; the rest are scored. Stages are cut at the qwen3 cue
set's matches in the decoded part, as ``evaluate`` cuts them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.defaultmodel.evaluate import CUE_KIND, CUE_SET  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.stage.coherence import capacity_of, stage_histogram  # noqa: E402
from saem_gguf.stage.cues import load_cues  # noqa: E402
from saem_gguf.stage.matcher import find_cues  # noqa: E402
from saem_gguf.trace import load_traces  # noqa: E402

POLICIES = ("static", "prev-stage", "kind", "kind+prev", "stage-oracle")


def staged(seq, cues) -> tuple[np.ndarray, list[int], list[str]]:
    """Decoded experts [T, L, K], stage bounds and stage kinds of one sequence."""
    p = int(seq.prompt_len)
    ex = np.asarray(seq.experts)[p:]
    first: dict[int, str] = {}
    for c, t in find_cues(cues, seq.pieces[p:]):
        if 0 < t < len(ex):
            first.setdefault(t, CUE_KIND.get(cues[c].text, "other"))
    cuts = sorted(first)
    return ex, [0, *cuts, len(ex)], ["compute"] + [first[t] for t in cuts]


def histogram(ex: np.ndarray, n_expert: int) -> np.ndarray:
    return stage_histogram(ex, n_expert).astype(np.float64)


def share(h: np.ndarray) -> np.ndarray:
    return h / np.maximum(h.sum(axis=1, keepdims=True), 1.0)


def hits(ex: np.ndarray, score: np.ndarray, cap: int) -> int:
    """Accesses of ex [T, L, K] that fall on each layer's top-``cap`` experts by ``score``."""
    top = np.argsort(-score, axis=1, kind="stable")[:, :cap]
    cached = np.zeros(score.shape, bool)
    np.put_along_axis(cached, top, True, axis=1)
    return int(cached[np.arange(ex.shape[1])[None, :, None], ex].sum())


def evaluate(seqs, n_expert: int, cap: int, n_calib: int) -> dict:
    cal, test = seqs[:n_calib], seqs[n_calib:]
    glob = share(sum(histogram(ex, n_expert) for ex, _, _ in cal))
    kinds: dict[str, np.ndarray] = {}
    for ex, b, ks in cal:
        for k, a, z in zip(ks, b[:-1], b[1:]):
            kinds[k] = kinds.get(k, 0) + histogram(ex[a:z], n_expert)
    kinds = {k: share(h) for k, h in kinds.items()}
    got = dict.fromkeys(POLICIES, 0)
    total = 0
    for ex, b, ks in test:
        prev = glob
        for k, a, z in zip(ks, b[:-1], b[1:]):
            seg = ex[a:z]
            if not len(seg):
                continue
            kind = kinds.get(k, glob)
            own = histogram(seg, n_expert)
            for name, score in zip(POLICIES, (glob, prev, kind, kind + prev, own)):
                got[name] += hits(seg, score, cap)
            total += seg.size
            prev = share(own)
    return {"capacity": cap, "calib_sequences": len(cal), "scored_sequences": len(test), "accesses": total,
            "kinds_calibrated": sorted(kinds), "hit_pct": {k: round(100.0 * v / max(total, 1), 2) for k, v in got.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--ecr", type=float, default=0.25, help="cache share of each layer's experts")
    p.add_argument("--calib", type=int, default=15, help="calibration sequences (the first ones)")
    p.add_argument("--json", type=output_file, default=None)
    a = p.parse_args(argv)
    ts = load_traces(a.trace)
    cues = load_cues(CUE_SET)
    seqs = [staged(s, cues) for s in ts.sequences]
    n_expert = ts.signature.n_expert
    if not 0 < a.calib < len(seqs):
        p.error(f"--calib must leave sequences to score (trace has {len(seqs)})")
    res = evaluate(seqs, n_expert, capacity_of(n_expert, a.ecr), a.calib)
    print(f"{a.trace}: {res['scored_sequences']} sequences scored, {res['accesses']} expert accesses, "
          f"cache {res['capacity']} of {n_expert} per layer")
    for name, v in res["hit_pct"].items():
        print(f"  {name:13s} {v:6.2f} % hit")
    if a.json:
        write_text_atomic(a.json, json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
