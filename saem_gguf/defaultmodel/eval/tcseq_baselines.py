"""TCseq of replies' own routing against shuffled baselines, with z-scores.

TCseq is ``saem_gguf.stage.coherence.tcseq`` (capacity 25 % by default, token-weighted). The
baselines keep every reply's stage bounds and permute its routing rows:

* ``rows``:   each reply's per-token routing rows permuted within the reply (order destroyed,
  every token keeps the routing of its real context): the order test proper;
* ``pooled``: the rows of all replies pooled, permuted, and dealt back in the replies' lengths.

For each baseline: mean, standard deviation (ddof 1) and maximum over ``n_perm`` permutations,
and z = (real - mean) / std.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Segments = list[tuple[np.ndarray, np.ndarray]]  # (experts [T, L, K], stage bounds [S + 1])


def rows_shuffled(routes: Sequence[np.ndarray], bounds: Sequence[np.ndarray], rng: np.random.Generator) -> Segments:
    return [(r[rng.permutation(len(r))], b) for r, b in zip(routes, bounds)]


def pooled_shuffled(routes: Sequence[np.ndarray], bounds: Sequence[np.ndarray], rng: np.random.Generator) -> Segments:
    pool = np.concatenate(routes)
    pool = pool[rng.permutation(len(pool))]
    ends = np.cumsum([len(r) for r in routes])
    return [(pool[end - len(r):end], b) for r, b, end in zip(routes, bounds, ends)]


def baseline_summary(real: float, values: Sequence[float]) -> dict:
    v = np.asarray(values, np.float64)
    sd = float(v.std(ddof=1)) if len(v) > 1 else float("nan")
    z = round((real - float(v.mean())) / sd, 2) if np.isfinite(sd) and sd > 0 else None
    return {"mean": round(float(v.mean()), 6), "std": round(sd, 6), "max": round(float(v.max()), 6),
            "n_perm": len(v), "z": z}


def tcseq_with_baselines(routes: Sequence[np.ndarray], bounds: Sequence[np.ndarray], n_expert: int,
                         capacity_ratio: float = 0.25, n_perm: int = 20, seed: int = 0) -> dict:
    """{"real": TCseq.to_dict(), "rows": summary, "pooled": summary, ...} over the sequences with
    at least one stage transition."""
    from saem_gguf.stage.coherence import tcseq

    keep = [i for i, b in enumerate(bounds) if len(b) > 2]
    routes = [routes[i] for i in keep]
    bounds = [bounds[i] for i in keep]
    rng = np.random.default_rng(seed)
    real = tcseq(list(zip(routes, bounds)), n_expert, capacity_ratio)
    out: dict = {"real": real.to_dict(), "n_sequences": len(routes), "capacity_ratio": capacity_ratio}
    for name, shuffle in (("rows", rows_shuffled), ("pooled", pooled_shuffled)):
        values = [tcseq(shuffle(routes, bounds, rng), n_expert, capacity_ratio).overall for _ in range(n_perm)]
        out[name] = baseline_summary(real.overall, values)
    return out
