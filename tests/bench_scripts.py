"""Import a script of bench/ (they are scripts, not a package) for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
