"""The policy interface shared by the simulator and the engine.

A policy owns no cache memory: the residency lives in a ``CacheState`` (state.py: per-layer
expert->slot maps, the mirror of the native slot cache) and every cost lands in an
``Accounting`` (accounting.py). A policy is driven through three calls, by the simulator over
whole blocks and by the engine (placement.py) over one-step blocks, with the same events:

``start(ctx) -> CacheState``
    placement at model load (free: nothing is on the critical path yet).
``begin_group(block, state, acct)``
    a new batch of requests starts (prompts known); may issue copies.
``run_steps(block, s0, s1, state, acct)``
    decode steps ``s0..s1`` of ``block``: per step and layer, which used experts are hits,
    which run in place on the CPU and which are transferred first, plus any residency changes
    (loads for the next tokens, prefetches at stage boundaries). The engine makes the native
    cache hold ``state.slot_of`` after each step.

Residency changes are priced through ``Policy.apply`` (accounting.apply_plan_kernel) or inside
the replay kernels, so every policy's copies share one FIFO host-to-device link with per-slot
ready times.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from saem_gguf.costmodel import CostModel
from saem_gguf.errors import SaemError
from saem_gguf.policies.accounting import A_PLANS, Accounting, apply_plan_kernel
from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.state import CacheState, ResidencyPlan, RoutingBlock


@dataclass
class PolicyContext:
    """What a policy may know before decoding: shapes, the slot budget, calibration counts
    (token-level routing counts [L, E] from a calibration set; per cue text, the counts of the
    stages that cue opened, see cue_profiles.py) and the cost model."""

    n_layer: int
    n_expert: int
    top_k: int
    n_slots: np.ndarray  # int32 [L]: the budget (slots per layer)
    cost: CostModel
    calib_counts: np.ndarray | None = None  # float64 [L, E]
    batch: int = 1
    cue_counts: dict[str, np.ndarray] | None = None  # cue text -> float64 [L, E]

    def __post_init__(self) -> None:
        self.n_slots = np.asarray(self.n_slots, np.int32)
        if self.n_slots.shape != (self.n_layer,):
            raise SaemError(f"n_slots must have one entry per layer ({self.n_layer})")
        if self.calib_counts is not None and self.calib_counts.shape != (self.n_layer, self.n_expert):
            raise SaemError("calib_counts must be [n_layer, n_expert]")
        for cue, c in (self.cue_counts or {}).items():
            if np.shape(c) != (self.n_layer, self.n_expert):
                raise SaemError(f"cue_counts[{cue!r}] must be [n_layer, n_expert]")

    @property
    def calib(self) -> np.ndarray:
        if self.calib_counts is None:
            return np.zeros((self.n_layer, self.n_expert))
        return self.calib_counts


def budget_slots(ecr_percent: float, n_expert: int) -> int:
    """Slots per layer for an Expert Cache Ratio given in percent of the layer's experts."""
    if not 0 <= ecr_percent <= 100:
        raise SaemError(f"ECR must be in [0, 100] %, got {ecr_percent}")
    s = int(round(ecr_percent / 100.0 * n_expert))
    return max(1, s) if ecr_percent > 0 else 0


class Policy(ABC):
    """Base class of every placement policy (see module docstring for the call protocol)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    @property
    def uses_combined_events(self) -> bool:
        """Whether the policy acts on the combined cue + routing-shift detector's events
        (RoutingBlock.implicit_event_steps): the engine then runs that detector too."""
        return False

    def __init__(self) -> None:
        self.ctx: PolicyContext | None = None

    def slots_for(self, ctx: PolicyContext) -> np.ndarray:
        """Slots per layer this policy uses under ``ctx``'s budget (most use the budget)."""
        return ctx.n_slots

    def start(self, ctx: PolicyContext) -> CacheState:
        self.ctx = ctx
        state = CacheState.empty(ctx.n_expert, self.slots_for(ctx))
        plan = self.initial_plan(ctx, state)
        if plan is not None:
            state.place(plan)
        return state

    def initial_plan(self, ctx: PolicyContext, state: CacheState) -> ResidencyPlan | None:
        """Load-time placement; default: the calibrated top experts of each layer."""
        return plan_from_scores(state, ctx.calib, reason="load")

    def begin_group(self, block: RoutingBlock, state: CacheState, acct: Accounting) -> None:
        """A new batch of requests starts decoding (default: nothing changes)."""

    @abstractmethod
    def run_steps(self, block: RoutingBlock, s0: int, s1: int, state: CacheState, acct: Accounting) -> None:
        """Replay steps [s0, s1) of ``block`` (see module docstring)."""

    def apply(self, plan: ResidencyPlan, state: CacheState, acct: Accounting, step: int) -> None:
        """Issue a plan's copies on the link and account for them."""
        if plan.n_copies == 0 and plan.evictions.shape[0] == 0:
            return
        acct.counters[A_PLANS] += 1
        apply_plan_kernel(plan.evictions, plan.copies, state.slot_of, state.owner, state.n_slots, state.ready_at,
                          self.ctx.cost.array, acct.clock, acct.counters, plan.proactive, step,
                          acct.log, acct.log_n)
