"""Placements that never change while decoding: llama.cpp's offload modes and KTransformers-style
static hot experts. Non-resident experts always run in place on the CPU, as those systems do."""

from __future__ import annotations

import math

import numpy as np

from saem_gguf.policies.base import Policy, PolicyContext
from saem_gguf.policies.layout import max_whole_layers
from saem_gguf.policies.state import ResidencyChange, StepEvents


class StaticPolicy(Policy):
    """Residency fixed at load; misses run on the CPU."""

    def observe(self, routing_rows: np.ndarray, events: StepEvents,
                link_budget: float = math.inf) -> ResidencyChange | None:
        return None


class CpuMoePolicy(StaticPolicy):
    name = "cpu-moe"
    summary = "llama.cpp --cpu-moe: no expert on the GPU, every expert runs on the CPU"

    def slots_for(self, ctx: PolicyContext) -> np.ndarray:
        return np.zeros(ctx.n_layer, np.int32)

    def initial_plan(self, ctx, state):
        return None


class GpuAllPolicy(StaticPolicy):
    name = "gpu-all"
    summary = "every expert resident (upper bound; ignores the budget)"

    def slots_for(self, ctx: PolicyContext) -> np.ndarray:
        return np.full(ctx.n_layer, ctx.n_expert, np.int32)
    # initial_plan: Policy's default, which fills every whole layer


class NCpuMoePolicy(StaticPolicy):
    name = "n-cpu-moe"
    summary = ("llama.cpp --n-cpu-moe N: the experts of the first N layers stay on the CPU, later layers "
               "are fully resident; N given (-ncmoe N) or chosen so the resident bytes fit the budget")

    def __init__(self, n_cpu_layers: int | None = None) -> None:
        super().__init__()
        self.n_cpu_layers = n_cpu_layers  # MoE layers whose experts stay on the CPU; None: from the budget

    def slots_for(self, ctx: PolicyContext) -> np.ndarray:
        if self.n_cpu_layers is None:
            n_cpu = ctx.n_layer - max_whole_layers(ctx.n_slots, ctx.n_expert)  # whole layers in the same bytes
        else:
            n_cpu = min(self.n_cpu_layers, ctx.n_layer)
        out = np.zeros(ctx.n_layer, np.int32)
        out[n_cpu:] = ctx.n_expert
        return out
    # initial_plan: Policy's default, which fills every whole layer


class StaticHotPolicy(StaticPolicy):
    name = "static-hot"
    summary = "per-layer top experts by calibrated frequency, placed once (KTransformers hot experts)"
    # initial_plan: Policy's default (calibrated top experts of each layer)
