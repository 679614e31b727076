"""Placement policies behind one interface (base.Policy), by name.

``make_policy("saem")`` builds one; ``POLICIES`` maps every name to its class;
``DEFAULT_POLICIES`` is what ``simulate`` compares when not told otherwise."""

from __future__ import annotations

from saem_gguf.errors import SaemError
from saem_gguf.policies.adaptive import AdaptiveSaemPolicy
from saem_gguf.policies.base import Policy
from saem_gguf.policies.caching import (
    LfuCpuPolicy, LfuPolicy, LruCpuPolicy, LruPolicy, TemporalCpuPolicy, TemporalPolicy,
)
from saem_gguf.policies.oracle import OraclePolicy
from saem_gguf.policies.saem import (
    SaemCuePolicy, SaemImplicitPolicy, SaemNoCpuPolicy, SaemPolicy, SaemStrictPolicy,
)
from saem_gguf.policies.static import CpuMoePolicy, GpuAllPolicy, NCpuMoePolicy, StaticHotPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        CpuMoePolicy, NCpuMoePolicy, StaticHotPolicy, LruPolicy, LruCpuPolicy, LfuPolicy, LfuCpuPolicy,
        TemporalPolicy, TemporalCpuPolicy, AdaptiveSaemPolicy, SaemPolicy, SaemStrictPolicy, SaemImplicitPolicy, SaemCuePolicy,
        SaemNoCpuPolicy, OraclePolicy, GpuAllPolicy,
    )
}

DEFAULT_POLICIES: tuple[str, ...] = (
    "cpu-moe", "n-cpu-moe", "static-hot", "lru", "lru-cpu", "lfu", "lfu-cpu", "temporal", "temporal-cpu",
    "saem", "saem-stage", "saem-strict", "saem-implicit", "saem-cue", "oracle", "gpu-all",
)


def make_policy(name: str, **kwargs) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise SaemError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None
    return cls(**kwargs)


__all__ = ["POLICIES", "DEFAULT_POLICIES", "Policy", "make_policy"]
