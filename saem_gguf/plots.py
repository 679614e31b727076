"""Plots of simulator results: hit rate vs ECR and estimated tokens/s vs ECR, one line per
policy, one column per batch size."""

from __future__ import annotations

from pathlib import Path

from saem_gguf.errors import SaemError
from saem_gguf.fileio import atomic_output

_LABELS = {"hit_rate": "hit rate (%)", "adj_hit_rate": "adjusted hit rate (%)", "tok_s": "estimated tokens/s",
           "load_mb_per_token": "Load (MB/token)", "cpu_share": "CPU-executed share (%)"}
_PERCENT = {"hit_rate", "adj_hit_rate", "cpu_share"}


def _style(policy: str) -> dict:
    if policy == "saem":
        return {"linewidth": 2.6, "color": "tab:red", "marker": "o", "zorder": 5}
    if policy.startswith("saem"):
        c = {"saem-stage": "indianred", "saem-strict": "salmon", "saem-implicit": "darkred", "saem-nocpu": "sienna",
             "saem-cue": "orangered"}.get(policy, "tab:red")
        return {"linewidth": 1.6, "marker": "o", "markersize": 4, "linestyle": "-.", "color": c}
    if policy == "oracle":
        return {"linewidth": 1.4, "color": "black", "linestyle": ":", "marker": "^"}
    if policy == "gpu-all":
        return {"linewidth": 1.2, "color": "grey", "linestyle": "--"}
    if policy == "cpu-moe":
        return {"linewidth": 1.2, "color": "tab:brown", "linestyle": "--"}
    colors = {"n-cpu-moe": "tab:olive", "static-hot": "tab:orange", "lru": "tab:blue", "lru-cpu": "tab:cyan",
              "lfu": "tab:purple", "lfu-cpu": "tab:pink", "temporal": "tab:green", "temporal-cpu": "lime"}
    st = {"linewidth": 1.3, "marker": "s", "markersize": 4}
    if policy in colors:
        st["color"] = colors[policy]
    return st


def plot_results(result, path: str, metrics: tuple[str, ...] = ("hit_rate", "tok_s"), title: str = "") -> str:
    """Write a PNG of ``result`` (simulator.SimResult) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    if not rows:
        raise SaemError("nothing to plot: no simulation rows")
    batches = sorted({r["batch"] for r in rows})
    ecrs = sorted({r["ecr"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(len(metrics), len(batches), figsize=(5.2 * len(batches), 3.8 * len(metrics)),
                             squeeze=False)
    for j, B in enumerate(batches):
        for i, m in enumerate(metrics):
            ax = axes[i][j]
            for p in policies:
                pts = sorted((r["ecr"], r[m]) for r in rows if r["batch"] == B and r["policy"] == p)
                if not pts:
                    continue
                xs = [x for x, _ in pts]
                ys = [100 * y if m in _PERCENT else y for _, y in pts]
                ax.plot(xs, ys, label=p, **_style(p))
            ax.set_xscale("log", base=2)
            ax.set_xticks(ecrs)
            ax.set_xticklabels([f"{e:g}" for e in ecrs])
            ax.set_xlabel("expert cache ratio (% of experts per layer)")
            ax.set_ylabel(_LABELS.get(m, m))
            ax.set_title(f"batch {B}: {_LABELS.get(m, m)}")
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    # as many entries per legend row as fit the figure's width (~1.7 in each), below the axes;
    # the tight bounding box at save time grows the image to include it
    ncol = max(1, min(len(labels), int(5.2 * len(batches) // 1.7)))
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if title else 1))
    try:
        # the format named by the target's extension (simulate checked it), not matplotlib's guess
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight", format=Path(path).suffix.lstrip(".").lower() or "png")
    except (OSError, ValueError) as e:
        raise SaemError(f"{path}: cannot write plot ({getattr(e, 'strerror', None) or e})") from None
    finally:
        plt.close(fig)
    return path
