"""VRAM budget <-> expert cache size (ECR = Expert Cache Ratio = slots per layer / n_expert)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import ModelInfo, compute_buffer_bytes, kv_cache_bytes

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
          "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40,
          "tb": 10**12}


def parse_size(text: str) -> int:
    """'8G', '8GiB' (binary), '7.5GB' (decimal), '512M', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SaemError(f"invalid size {text!r}: use e.g. 8G, 7.5GB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# the one --ecr unit of every command, said in every --help
ECR_HELP = ("expert cache ratio = cache slots per MoE layer / experts per layer, as a percentage "
            "(25%%) or a fraction (0.25); a bare number above 1 is refused")


def parse_ecr(text: str | float) -> float:
    """'25%' or '0.25' -> 0.25. A bare number is a fraction, so '25' is an error (it suggests '25%')."""
    s = str(text).strip()
    percent = s.endswith("%")
    try:
        v = float(s[:-1]) / 100 if percent else float(s)
    except ValueError:
        raise SaemError(f"invalid ECR {text!r}: give a percentage (25%) or a fraction (0.25)") from None
    if math.isnan(v) or v < 0.0:
        raise SaemError(f"ECR {text} is out of range: give a percentage in [0%, 100%] or a fraction in [0, 1]")
    if v > 1.0:
        hint = f"; for {v:g} percent write {v:g}%" if not percent and v <= 100 else ""
        raise SaemError(f"ECR {text} is out of range: above 100% (a bare number is a fraction){hint}")
    return v


def parse_ecr_list(text: str) -> list[float]:
    """'12.5%,25%,0.5' -> [0.125, 0.25, 0.5] (at least one value)."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise SaemError("--ecr: give at least one value")
    return [parse_ecr(x) for x in items]


@dataclass
class CachePlan:
    n_ctx: int
    slots_per_layer: int
    ecr: float
    vram_bytes: int  # total the plan needs on the device
    non_expert_bytes: int
    kv_bytes: int
    compute_bytes: int
    cache_bytes: int
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _fixed_bytes(info: ModelInfo, n_ctx: int, overhead: int | None) -> tuple[int, int, int]:
    kv = kv_cache_bytes(info, n_ctx)
    comp = compute_buffer_bytes(info) if overhead is None else overhead
    return info.non_expert_bytes, kv, comp


def plan_from_budget(info: ModelInfo, budget: int, n_ctx: int = 4096,
                     overhead: int | None = None) -> CachePlan:
    if not info.is_moe:
        raise SaemError(f"{info.architecture} model is dense: it has no experts to cache")
    ne, kv, comp = _fixed_bytes(info, n_ctx, overhead)
    fixed = ne + kv + comp
    per_slot = info.bytes_per_expert_all_layers
    if budget < fixed:
        raise SaemError(f"VRAM budget {format_size(budget)} is below what non-expert weights, KV cache "
                        f"and compute buffers need ({format_size(fixed)}); raise it or lower -c")
    slots = min(info.n_expert, (budget - fixed) // per_slot)
    note = "every expert fits: the budget is larger than needed" if slots == info.n_expert else ""
    return CachePlan(n_ctx, int(slots), slots / info.n_expert, fixed + slots * per_slot, ne, kv, comp,
                     slots * per_slot, note)


def plan_from_ecr(info: ModelInfo, ecr: float, n_ctx: int = 4096,
                  overhead: int | None = None) -> CachePlan:
    if not info.is_moe:
        raise SaemError(f"{info.architecture} model is dense: it has no experts to cache")
    ne, kv, comp = _fixed_bytes(info, n_ctx, overhead)
    slots = min(info.n_expert, int(round(ecr * info.n_expert)))
    cache = slots * info.bytes_per_expert_all_layers
    note = "" if abs(slots / info.n_expert - ecr) < 1e-9 else (
        f"ECR {ecr:g} rounded to {slots}/{info.n_expert} slots per layer")
    return CachePlan(n_ctx, slots, slots / info.n_expert, ne + kv + comp + cache, ne, kv, comp, cache,
                     note)


# --vram-budget auto: what is left free on the GPU. The reserved compute buffers cover a graph's
# tensors, but CUDA's memory pool also grows during decode (quantized activations, MUL_MAT_ID
# scratch) and the driver keeps some for itself: 1 GiB plus 2 % of the card.
AUTO = "auto"
AUTO_MARGIN_BYTES = 1 << 30
AUTO_MARGIN_FRACTION = 0.02


def parse_vram_budget(text: str) -> int | str:
    """--vram-budget's value: AUTO (free VRAM, sized after the load) or a size (parse_size)."""
    return AUTO if str(text).strip().lower() == AUTO else parse_size(text)


def auto_margin(total_bytes: int) -> int:
    return AUTO_MARGIN_BYTES + int(AUTO_MARGIN_FRACTION * total_bytes)


def plan_auto(info: ModelInfo, free_bytes: int, total_bytes: int, n_ctx: int = 4096) -> CachePlan:
    """Before loading: free VRAM minus the margin is the budget; the non-expert weights, KV cache
    and compute buffers are taken out of it as ``inspect`` estimates them (plan_from_budget)."""
    budget = free_bytes - auto_margin(total_bytes)
    try:
        return plan_from_budget(info, max(budget, 0), n_ctx)
    except SaemError as e:
        raise SaemError(f"--vram-budget auto: {format_size(free_bytes)} free on the GPU, "
                        f"{format_size(auto_margin(total_bytes))} kept as margin; {e}") from None


def slots_fitting(info: ModelInfo, free_bytes: int, total_bytes: int) -> int:
    """After loading: expert slots per layer that fit in what llama.cpp left free (its weights, KV
    cache and compute buffers are allocated by then), keeping the margin."""
    room = free_bytes - auto_margin(total_bytes)
    return int(max(0, min(info.n_expert, room // info.bytes_per_expert_all_layers)))
