"""Import a script of bench/ (they are scripts, not a package) for its tests."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py as module NAME (registered in sys.modules: a dataclass there looks its
    module up by name), loaded once: a second module of the same name would leave the first's
    functions unpicklable (multiprocessing finds them by name)."""
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "") == BENCH / f"{name}.py":
        return loaded
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def small_drawn_families(real: Callable) -> Callable:
    """bench_policies' ``drawn_families`` (``real``) with short stages, a few hundred tokens per
    sequence: a script's own loop over drawn families, fast."""
    def small(n, seed):
        return {k: dataclasses.replace(v, stage_len_scale=0.05, n_stage_median=2.0, n_stage_mean=3.0)
                for k, v in real(n, seed).items()}
    return small


def rows_by_cost_flags(main: Callable, args: list[str], tmp_path: Path) -> dict[str, list[dict]]:
    """A script's --json rows run three ways: ``flags`` with --overlap --copy-barrier, ``file``
    with --hw of a profile file that sets both, ``plain`` with neither."""
    from saem_gguf.costmodel import get_hw

    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps(dataclasses.asdict(get_hw("rtx4090-ddr5").replace(cpu_gpu_overlap=True,
                                                                                  copy_barrier=True))))
    rows = {}
    for name, flags in (("flags", ["--overlap", "--copy-barrier"]), ("file", ["--hw", str(prof)]), ("plain", [])):
        out = tmp_path / f"{name}.json"
        assert main([*args, *flags, "--json", str(out)]) == 0
        rows[name] = json.loads(out.read_text())
    return rows
