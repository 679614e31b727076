"""The policy interface shared by the simulator and the engine.

A policy keeps books and decides; it prices nothing. It owns its ``CacheState`` (state.py: the
per-layer expert->slot maps it wants in force) and is driven through three calls, by the
simulator (simulator.replay) and by the engine (placement.py) alike, with the same events:

``start(ctx) -> CacheState``
    the placement at model load (free: nothing is on the critical path yet).
``begin_group(block) -> ResidencyChange | None``
    a new batch of requests starts (their prompts' routing known: ``block.prefill_counts``).
``observe(routing_rows, events, link_budget) -> ResidencyChange | None``
    one decode step ran with int16 [B, L, K] ``routing_rows`` (-1 rows: no token) under the
    residency in force; ``events`` (StepEvents) are what the stage detectors reported after
    it; ``link_budget`` is how many bytes the host-to-device link can carry before the next
    step (link_budget.LinkMeter; a copy takes ``costmodel.link_bytes_per_copy`` of them; inf
    for a policy that does not read it, ``uses_link_budget`` False). Returns the residency decisions made while the step ran (loads after a CPU
    run, demand loads) and those due before the next step (stage placements), or None.

    Which decisions respect the budget is each policy's rule (docs/POLICIES.md, "The link
    budget"): the adaptive ``saem``'s own copies (it follows a shadow cache: opportunistic) stay
    within it and the rest wait for a later step; the baselines and SAEM's stage rules keep their
    published behaviour (a miss loaded after its CPU run, a boundary's copies issued at once).

What a decision costs is the simulator's concern (pricing.py prices each change on one FIFO
host-to-device link with per-slot ready times and the CPU/GPU time of every layer); the engine
issues the copies natively. ``miss_mode`` says how the simulator serves this policy's misses
(the engine always runs a non-resident expert in place on the CPU).
"""

from __future__ import annotations

import math

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from saem_gguf.costmodel import CostModel
from saem_gguf.errors import SaemError
from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.state import CacheState, ResidencyChange, ResidencyPlan, RoutingBlock, StepEvents

# How the simulator serves a miss (Policy.miss_mode; pricing.py)
MISS_CPU = 0  # in place on the CPU (llama.cpp --cpu-moe style; what the engine does)
MISS_RULE = 1  # lower latency wins: CPU in place or transfer into the temporary slot (SAEM)
MISS_TRANSFER = 2  # always transfer into the temporary slot (the paper's "no CPU" ablation)


@dataclass
class PolicyContext:
    """What a policy may know before decoding: shapes, the slot budget, calibration counts
    (token-level routing counts [L, E] from a calibration set; per cue text, the counts of the
    stages that cue opened, see cue_profiles.py), the cost model and, where calibration routing
    is known, a way to price a policy on it (``replay_calibration``)."""

    n_layer: int
    n_expert: int
    top_k: int
    n_slots: np.ndarray  # int32 [L]: the budget (slots per layer)
    cost: CostModel
    calib_counts: np.ndarray | None = None  # float64 [L, E]
    batch: int = 1
    cue_counts: dict[str, np.ndarray] | None = None  # cue text -> float64 [L, E]
    # (tokens/s, the policies replayed) of fresh policies, made by the callable given, replayed
    # over a sample of the calibration routing on this context's budget, batch and cost model
    # (simulator.calibration_pricer); None where no calibration routing is known. What a policy
    # may price a set-up fixed at load with (the adaptive saem's slot layout: docs/POLICIES.md,
    # "Slot layout")
    replay_calibration: Callable[[Callable[[], Policy]], tuple[float, list[Policy]]] | None = None

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
    miss_mode: ClassVar[int] = MISS_CPU

    @property
    def uses_combined_events(self) -> bool:
        """Whether the policy acts on the combined cue + routing-shift detector's events
        (StepEvents.combined): the engine then runs that detector too."""
        return False

    @property
    def uses_link_budget(self) -> bool:
        """Whether ``observe`` reads its ``link_budget``: the drivers price the link to tell it
        only then (the engine otherwise prices nothing) and pass inf to the others."""
        return False

    def __init__(self) -> None:
        self.ctx: PolicyContext | None = None
        self.state: CacheState | None = None

    def slots_for(self, ctx: PolicyContext) -> np.ndarray:
        """Slots per layer this policy uses under ``ctx``'s budget (most use the budget)."""
        return ctx.n_slots

    def start(self, ctx: PolicyContext) -> CacheState:
        self.ctx = ctx
        state = CacheState.empty(ctx.n_expert, self.slots_for(ctx))
        plan = self.initial_plan(ctx, state)
        if plan is not None:
            state.place(plan)
        self.state = state
        return state

    def initial_plan(self, ctx: PolicyContext, state: CacheState) -> ResidencyPlan | None:
        """Load-time placement; default: the calibrated top experts of each layer, and every
        expert of a layer with a slot for each (a layout's whole layers, as n-cpu-moe's): ranking
        has nothing to decide there, and experts without calibration counts would otherwise be
        copied in while decoding, on the first use of each (without calibration, every one)."""
        scores = ctx.calib.copy()
        whole = state.n_slots >= ctx.n_expert
        scores[whole] += 1.0  # every expert above 0: rank_fill_kernel copies in only positive scores
        return plan_from_scores(state, scores, reason="load")

    def begin_group(self, block: RoutingBlock) -> ResidencyChange | None:
        """A new batch of requests starts decoding (default: nothing changes)."""
        return None

    def bind_step(self, routing_rows: np.ndarray) -> None:
        """After ``start``: most later ``observe`` calls will pass these very rows (the engine's
        view of the native routing sink, refilled by every decode). A policy whose step is one
        kernel call may then call its compiled entry point for them (kernel_books.entry_point);
        default: nothing."""

    @abstractmethod
    def observe(self, routing_rows: np.ndarray, events: StepEvents,
                link_budget: float = math.inf) -> ResidencyChange | None:
        """One decode step ran (see module docstring)."""

    def _apply_plan(self, plan: ResidencyPlan) -> ResidencyChange | None:
        """Put a ranking's plan in the books; the change that moves the cache there (None when
        it moves nothing)."""
        if plan.n_copies == 0 and plan.evictions.shape[0] == 0:
            return None
        self.state.place(plan)
        return ResidencyChange.placement(plan, self.state.slot_of)
