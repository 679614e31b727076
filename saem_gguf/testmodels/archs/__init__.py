"""Registry of test-model architectures: one module per architecture, each registering itself.

Add an architecture by adding a module here that defines an ``ArchDef`` subclass decorated with
``@register``; nothing else needs editing.
"""

from __future__ import annotations

import importlib
import pkgutil

from saem_gguf.testmodels.archs.base import ArchDef

ARCHS: dict[str, ArchDef] = {}


def register(cls: type[ArchDef]) -> type[ArchDef]:
    ARCHS[cls.name] = cls()
    return cls


def get_arch(name: str) -> ArchDef:
    if name not in ARCHS:
        raise ValueError(f"no test-model generator for architecture {name!r}; have: {sorted(ARCHS)}")
    return ARCHS[name]


for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")
