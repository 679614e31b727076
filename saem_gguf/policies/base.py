"""The policy interface shared by the simulator and (later) the engine.

A policy owns no cache memory: the residency lives in a ``CacheState`` (per-layer expert->slot
maps, the mirror of the native slot cache) and every cost lands in an ``Accounting``. A policy
is driven through four calls:

``start(ctx) -> CacheState``
    placement at model load (free: nothing is on the critical path yet).
``begin_group(block, state, acct)``
    a new batch of requests starts (prompts known); may issue copies.
``run_steps(block, s0, s1, state, acct)``
    decode steps ``s0..s1`` of ``block``: per step and layer, which used experts are hits,
    which run in place on the CPU and which are transferred first, plus any residency changes
    (demand loads, loads for the next tokens, prefetches at stage boundaries). The simulator
    calls it on long blocks (Numba hot loops); the engine calls ``step`` which wraps it.
``step(routing, state, acct, events) -> StepDecision``
    one decode step with concrete output: copies (layer, expert, slot), evictions, CPU runs,
    transfers-first, and the target map. This is what the engine applies through
    ``set_slot_map(layer, expert_to_slot)`` / ``copy_expert(layer, expert, slot, async)``.

Residency changes are applied through ``apply_plan`` so that every policy's copies are priced
the same way (FIFO host-to-device link, per-slot ready times).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from numba import njit

from saem_gguf.costmodel import C_EXPERT_BYTES, CostModel, t_xfer
from saem_gguf.errors import SaemError

# --------------------------------------------------------------------------------------------
# Accounting: counters the kernels add to (float64, so one array carries counts and seconds)

A_ACCESS = 0  # routed (token, layer, k) accesses
A_HIT = 1  # accesses whose expert was resident at access time
A_DEMAND = 2  # copies caused by an access (transfer-first, demand load, load-after-use)
A_PROACTIVE = 3  # copies not caused by an access (prefetch at a stage boundary)
A_BYTES = 4  # host-to-device bytes of all copies
A_CPU_TOKENS = 5  # (token, expert) pairs executed on the CPU
A_CPU_RUNS = 6  # expert executions on the CPU (one per expert, layer and step)
A_GPU_RUNS = 7
A_TEMP = 8  # transfers into the temporary slot (used once, not kept)
A_ASYNC = 9  # loads issued after an in-place CPU run, for the next tokens
A_STALL = 10  # seconds the GPU waited for copies
A_TOKENS = 11  # decoded tokens
A_STEPS = 12  # decode steps (a step decodes one token of every active sequence)
A_EVICT = 13
A_LAYER_STEPS = 14  # token-layer steps replayed (simulator throughput unit)
A_HIT_CPU = 15  # hits whose copy was still in flight and ran on the CPU instead of waiting
A_PLANS = 16  # placement updates (stage boundaries acted on)
N_ACC = 17

# Log kinds (one row per decision; see StepDecision)
K_HIT = 0
K_CPU = 1
K_TEMP = 2
K_DEMAND = 3
K_ASYNC = 4
K_EVICT = 5
K_PREFETCH = 6
K_HIT_CPU = 7
KIND_NAMES = ("hit", "cpu", "transfer_first", "demand_load", "load_after_cpu", "evict", "prefetch", "hit_on_cpu")


@dataclass
class Accounting:
    """Counters, the simulated clock and an optional decision log."""

    counters: np.ndarray = field(default_factory=lambda: np.zeros(N_ACC, np.float64))
    clock: np.ndarray = field(default_factory=lambda: np.zeros(2, np.float64))  # [now, link free at]
    log: np.ndarray = field(default_factory=lambda: np.zeros((0, 5), np.int32))  # (step, layer, expert, slot, kind)
    log_n: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    @classmethod
    def with_log(cls, capacity: int) -> "Accounting":
        return cls(log=np.zeros((int(capacity), 5), np.int32))

    def logged(self) -> np.ndarray:
        n = int(self.log_n[0])
        if n > self.log.shape[0]:
            raise SaemError(f"decision log overflow: {n} rows for capacity {self.log.shape[0]}")
        return self.log[:n]

    @property
    def now(self) -> float:
        return float(self.clock[0])


@njit(cache=True)
def log_put(log, log_n, step, layer, expert, slot, kind):
    i = log_n[0]
    if i < log.shape[0]:
        log[i, 0] = step
        log[i, 1] = layer
        log[i, 2] = expert
        log[i, 3] = slot
        log[i, 4] = kind
    log_n[0] = i + 1  # counts past capacity so overflow is detectable


# --------------------------------------------------------------------------------------------
# Cache state


@dataclass
class CacheState:
    """Per-layer slot cache: ``slot_of[l, e]`` is e's slot or -1 (host); ``owner[l, s]`` is the
    expert in slot s or -1; layer l has ``n_slots[l]`` usable slots; ``ready_at[l, s]`` is the
    simulated time the last copy into s completes."""

    slot_of: np.ndarray  # int32 [L, E]
    owner: np.ndarray  # int32 [L, max(1, max slots)]
    n_slots: np.ndarray  # int32 [L]
    ready_at: np.ndarray  # float64 [L, max(1, max slots)]

    @classmethod
    def empty(cls, n_expert: int, n_slots: np.ndarray) -> "CacheState":
        n_slots = np.asarray(n_slots, np.int32)
        L = n_slots.shape[0]
        if np.any(n_slots < 0) or np.any(n_slots > n_expert):
            raise SaemError(f"slots per layer must be in [0, {n_expert}]")
        smax = max(1, int(n_slots.max()) if L else 1)
        return cls(slot_of=np.full((L, n_expert), -1, np.int32), owner=np.full((L, smax), -1, np.int32),
                   n_slots=n_slots.copy(), ready_at=np.zeros((L, smax), np.float64))

    @property
    def n_layer(self) -> int:
        return int(self.slot_of.shape[0])

    @property
    def n_expert(self) -> int:
        return int(self.slot_of.shape[1])

    def resident_count(self) -> np.ndarray:
        return (self.slot_of >= 0).sum(axis=1)

    def check(self) -> None:
        """Raise AssertionError if the maps disagree or a layer holds more experts than slots."""
        L, E = self.slot_of.shape
        for l in range(L):
            res = np.nonzero(self.slot_of[l] >= 0)[0]
            assert res.size <= self.n_slots[l], f"layer {l}: {res.size} resident > {self.n_slots[l]} slots"
            for e in res:
                s = self.slot_of[l, e]
                assert s < self.n_slots[l], f"layer {l}: expert {e} in slot {s} >= n_slots"
                assert self.owner[l, s] == e, f"layer {l}: slot {s} owner {self.owner[l, s]} != {e}"
            owned = self.owner[l, : self.n_slots[l]]
            assert np.count_nonzero(owned >= 0) == res.size, f"layer {l}: owner/slot_of mismatch"
            assert np.all(self.owner[l, self.n_slots[l]:] == -1), f"layer {l}: owner beyond n_slots"

    def place(self, plan: "ResidencyPlan") -> None:
        """Apply a plan at no cost (model load time)."""
        _apply_free(plan.evictions, plan.copies, self.slot_of, self.owner, self.n_slots)


@njit(cache=True)
def _apply_free(evicts, copies, slot_of, owner, n_slots):
    for i in range(evicts.shape[0]):
        l, e, s = evicts[i, 0], evicts[i, 1], evicts[i, 2]
        if slot_of[l, e] != s or owner[l, s] != e:
            raise ValueError("eviction of an expert that is not in that slot")
        slot_of[l, e] = -1
        owner[l, s] = -1
    for i in range(copies.shape[0]):
        l, e, s = copies[i, 0], copies[i, 1], copies[i, 2]
        if s < 0 or s >= n_slots[l] or owner[l, s] != -1 or slot_of[l, e] != -1:
            raise ValueError("copy into an occupied or invalid slot, or of a resident expert")
        slot_of[l, e] = s
        owner[l, s] = e


@njit(cache=True)
def apply_plan_kernel(evicts, copies, slot_of, owner, n_slots, ready_at, cost, clock, acc, proactive,
                      step, log, log_n):
    """Evict, then issue the copies on the host-to-device link in order (FIFO behind whatever
    is already queued); each slot becomes usable when its copy completes."""
    _apply_free(evicts, copies, slot_of, owner, n_slots)
    tx = t_xfer(cost)
    now = clock[0]
    for i in range(evicts.shape[0]):
        acc[A_EVICT] += 1
        log_put(log, log_n, step, evicts[i, 0], evicts[i, 1], evicts[i, 2], K_EVICT)
    for i in range(copies.shape[0]):
        l, e, s = copies[i, 0], copies[i, 1], copies[i, 2]
        start = max(now, clock[1])
        clock[1] = start + tx
        ready_at[l, s] = clock[1]
        acc[A_BYTES] += cost[C_EXPERT_BYTES]
        if proactive:
            acc[A_PROACTIVE] += 1
        else:
            acc[A_DEMAND] += 1
        log_put(log, log_n, step, l, e, s, K_PREFETCH if proactive else K_DEMAND)


# --------------------------------------------------------------------------------------------
# Plans, decisions, inputs


def _rows(a, n: int = 3) -> np.ndarray:
    a = np.asarray(a, np.int32)
    return a.reshape(-1, n) if a.size else np.zeros((0, n), np.int32)


@dataclass
class ResidencyPlan:
    """Residency changes, concrete enough for the native cache: evict these (layer, expert,
    slot), then copy these (layer, expert, slot) in this order. ``target`` is the expert->slot
    map of every layer after the plan (-1 = runs on the host)."""

    copies: np.ndarray  # int32 [n, 3]
    evictions: np.ndarray  # int32 [m, 3]
    proactive: bool = True
    target: np.ndarray | None = None  # int32 [L, E]
    reason: str = ""

    @classmethod
    def empty(cls) -> "ResidencyPlan":
        return cls(copies=_rows([]), evictions=_rows([]))

    @property
    def n_copies(self) -> int:
        return int(self.copies.shape[0])

    def by_layer(self) -> dict[int, dict[str, list[tuple[int, int]]]]:
        """{layer: {"copies": [(expert, slot)], "evictions": [(expert, slot)]}}."""
        out: dict[int, dict[str, list[tuple[int, int]]]] = {}
        for key, rows in (("copies", self.copies), ("evictions", self.evictions)):
            for l, e, s in rows.tolist():
                out.setdefault(l, {"copies": [], "evictions": []})[key].append((e, s))
        return out


@dataclass
class StepDecision:
    """What one decode step did, per (layer, expert) used, plus residency changes in issue order.

    ``transfer_first`` slot -1 means the reserved temporary slot (not kept after the step).
    ``copies`` are loads into cache slots with ``copy_kinds`` (KIND_NAMES: demand_load before
    use, load_after_cpu for the next tokens, prefetch at a stage boundary)."""

    gpu: np.ndarray  # int32 [n, 2] (layer, expert) run from the cache
    cpu: np.ndarray  # int32 [n, 2] run in place on the CPU
    transfer_first: np.ndarray  # int32 [n, 3] (layer, expert, slot)
    copies: np.ndarray  # int32 [n, 3]
    copy_kinds: list[str]
    evictions: np.ndarray  # int32 [n, 3]
    target: np.ndarray  # int32 [L, E] expert->slot after the step

    @classmethod
    def from_log(cls, rows: np.ndarray, state: CacheState) -> "StepDecision":
        k = rows[:, 4]
        pick = lambda *kinds, cols=(1, 2, 3): rows[np.isin(k, kinds)][:, list(cols)].astype(np.int32)  # noqa: E731
        cp = rows[np.isin(k, (K_DEMAND, K_ASYNC, K_PREFETCH))]
        return cls(gpu=pick(K_HIT, cols=(1, 2)), cpu=pick(K_CPU, K_HIT_CPU, cols=(1, 2)),
                   transfer_first=pick(K_TEMP), copies=cp[:, 1:4].astype(np.int32),
                   copy_kinds=[KIND_NAMES[int(x)] for x in cp[:, 4]], evictions=pick(K_EVICT),
                   target=state.slot_of.copy())


@dataclass
class RoutingBlock:
    """Decode steps of one batch of B sequences in lockstep.

    ``routing[s, b]`` is the [L, K] routing of sequence b's s-th decoded token, -1 where b has
    no token at step s. ``event_steps`` are the steps before which a stage event is known
    (detected from text already generated), ``event_rows[i]`` the batch rows that raised it.
    ``step0`` is the global index of step 0 (so time-based policies see one clock).
    ``implicit_event_steps`` (optional) are the stage detector's cue + routing-shift events.
    ``event_cues[i]`` (optional) is the cue text each row of ``event_rows[i]`` matched, or ""
    when the row's event had none the detector could name."""

    routing: np.ndarray  # int16 [S, B, L, K]
    event_steps: np.ndarray  # int32 [n_ev], sorted, unique
    event_rows: list[np.ndarray] = field(default_factory=list)
    prefill_counts: np.ndarray | None = None  # float64 [L, E]: routing counts of the prompts
    prefill_tokens: int = 0
    step0: int = 0
    # Cue + implicit (routing-shift) events from the stage detector, when it was run; None otherwise.
    implicit_event_steps: np.ndarray | None = None
    event_cues: list[list[str]] | None = None
    n_tok: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.routing.ndim != 4 or self.routing.dtype != np.int16:
            raise SaemError("RoutingBlock.routing must be int16 [steps, batch, layers, top_k]")
        self.routing = np.ascontiguousarray(self.routing)
        self.n_tok = (self.routing[:, :, 0, 0] >= 0).sum(axis=1).astype(np.int32)
        self.event_steps = np.asarray(self.event_steps, np.int32)
        if self.implicit_event_steps is not None:
            self.implicit_event_steps = np.asarray(self.implicit_event_steps, np.int32)
        if self.event_cues is not None and len(self.event_cues) != self.event_steps.size:
            raise SaemError("RoutingBlock.event_cues needs one entry per event step")

    def cues_at(self, s: int) -> list[str]:
        """The cue texts of the event at step ``s`` ([] when there is none or none is known)."""
        if self.event_cues is None:
            return []
        i = int(np.searchsorted(self.event_steps, s))
        if i < self.event_steps.size and int(self.event_steps[i]) == s:
            return [c for c in self.event_cues[i] if c]
        return []

    @property
    def n_steps(self) -> int:
        return int(self.routing.shape[0])

    @classmethod
    def single(cls, routing: np.ndarray, event: bool, step: int, cues: list[str] | None = None,
               combined_event: bool | None = None) -> "RoutingBlock":
        """One engine step: ``routing`` int [n_tokens, L, K]; ``cues``: the event's cue texts;
        ``combined_event``: whether the combined cue + routing-shift detector reported a
        boundary before this step (None when it is not run)."""
        r = np.asarray(routing, np.int16)[None]
        imp = None if combined_event is None else np.array([0] if combined_event else [], np.int32)
        return cls(routing=r, event_steps=np.array([0] if event else [], np.int32), step0=step,
                   event_cues=[list(cues or [])] if event else None, implicit_event_steps=imp)


@njit(cache=True)
def counts_between(routing, s0, s1, n_expert):
    """float64 [L, E]: token-level routing counts over steps [s0, s1)."""
    S, B, L, K = routing.shape
    out = np.zeros((L, n_expert), np.float64)
    for s in range(max(0, s0), min(S, s1)):
        for b in range(B):
            if routing[s, b, 0, 0] < 0:
                continue
            for l in range(L):
                for k in range(K):
                    out[l, routing[s, b, l, k]] += 1.0
    return out


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


# --------------------------------------------------------------------------------------------


class Policy(ABC):
    """Base class of every placement policy (see module docstring for the call protocol)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # How the engine realises this policy's misses: "cpu" (in place, the native host branch)
    # or "n/a" when the engine cannot (oracle, wait-for-load).
    engine_miss: ClassVar[str] = "cpu"

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
        from saem_gguf.planner import plan_from_scores

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

    def step(self, routing: np.ndarray, state: CacheState, acct: Accounting, event: bool = False,
             step_index: int = 0) -> StepDecision:
        """One decode step with concrete decisions (the engine's entry point).

        ``routing`` int [n_tokens, L, K] is the step's routing; ``event`` says a stage event was
        detected before this step. Decisions that the engine cannot realise (wait-for-load,
        transfer-first) are still reported; the engine maps them to in-place CPU runs."""
        block = RoutingBlock.single(routing, event, step_index)
        saved = (acct.log, acct.log_n)
        acct.log = np.zeros((8 * routing.size + 4 * state.slot_of.size + 64, 5), np.int32)
        acct.log_n = np.zeros(1, np.int64)
        try:
            self.run_steps(block, 0, 1, state, acct)
            rows = acct.logged().copy()
        finally:
            acct.log, acct.log_n = saved
        return StepDecision.from_log(rows, state)
