"""Residency and its inputs: the per-layer slot cache a policy keeps (``CacheState``), the
residency decisions it hands out (``ResidencyChange``, rows of ``OP_*``; ``ResidencyPlan`` is a
ranking's evictions and copies), the stage events it is told of after a step (``StepEvents``)
and the simulator's routing (``RoutingBlock``: decode steps of a batch in lockstep, with the
stage events known before each step).

Nothing here has a clock: what a decision costs is the simulator's business (pricing.py); the
engine puts decisions in force natively (placement.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError



@dataclass
class CacheState:
    """Per-layer slot cache: ``slot_of[l, e]`` is e's slot or -1 (host); ``owner[l, s]`` is the
    expert in slot s or -1; layer l has ``n_slots[l]`` usable slots."""

    slot_of: np.ndarray  # int32 [L, E]
    owner: np.ndarray  # int32 [L, max(1, max slots)]
    n_slots: np.ndarray  # int32 [L]

    @classmethod
    def empty(cls, n_expert: int, n_slots: np.ndarray) -> "CacheState":
        n_slots = np.asarray(n_slots, np.int32)
        L = n_slots.shape[0]
        if np.any(n_slots < 0) or np.any(n_slots > n_expert):
            raise SaemError(f"slots per layer must be in [0, {n_expert}]")
        smax = max(1, int(n_slots.max()) if L else 1)
        return cls(slot_of=np.full((L, n_expert), -1, np.int32), owner=np.full((L, smax), -1, np.int32),
                   n_slots=n_slots.copy())

    def copy(self) -> "CacheState":
        return CacheState(slot_of=self.slot_of.copy(), owner=self.owner.copy(), n_slots=self.n_slots.copy())

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
        apply_free(plan.evictions, plan.copies, self.slot_of, self.owner, self.n_slots)


@njit(cache=True)
def apply_free(evicts, copies, slot_of, owner, n_slots):
    """Evict the (layer, expert, slot) rows ``evicts``, then put the ``copies`` rows in their
    slots, checking both against the maps; no time passes (model load, shadow caches)."""
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
class RoutingBlock:
    """Decode steps of one batch of B sequences in lockstep.

    ``routing[s, b]`` is the [L, K] routing of sequence b's s-th decoded token, -1 where b has
    no token at step s. ``event_steps`` are the steps before which a stage event is known
    (detected from text already generated; S: after the block's last step), ``event_rows[i]``
    the batch rows that raised it.
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

    def __post_init__(self) -> None:
        if self.routing.ndim != 4 or self.routing.dtype != np.int16:
            raise SaemError("RoutingBlock.routing must be int16 [steps, batch, layers, top_k]")
        self.routing = np.ascontiguousarray(self.routing)
        self.event_steps = np.asarray(self.event_steps, np.int32)
        if self.implicit_event_steps is not None:
            self.implicit_event_steps = np.asarray(self.implicit_event_steps, np.int32)
        if self.event_cues is not None and len(self.event_cues) != self.event_steps.size:
            raise SaemError("RoutingBlock.event_cues needs one entry per event step")
        self._index_events()

    @property
    def n_steps(self) -> int:
        return int(self.routing.shape[0])

    def events_after(self, s: int) -> "StepEvents":
        """The events reported after step ``s`` (those known before step s + 1), as a policy's
        ``observe`` is told of them."""
        ev = self._events.get(s + 1)
        if ev is not None:
            return ev
        return self._quiet

    def _index_events(self) -> None:
        B = int(self.routing.shape[1])
        combined = None if self.implicit_event_steps is None else set(self.implicit_event_steps.tolist())
        self._quiet = StepEvents(n_rows=B, combined=None if combined is None else False)
        self._events: dict[int, StepEvents] = {}
        rows = self.event_rows if len(self.event_rows) == self.event_steps.size else None
        for i, step in enumerate(self.event_steps.tolist()):
            r = tuple(int(x) for x in rows[i]) if rows is not None else (0,)
            cues = tuple(self.event_cues[i]) if self.event_cues is not None else ("",) * len(r)
            self._events[step] = StepEvents(rows=r, cues=cues, n_rows=B,
                                            combined=None if combined is None else step in combined)
        for step in sorted(combined or ()):
            if step not in self._events:
                self._events[step] = StepEvents(n_rows=B, combined=True)


@dataclass(frozen=True)
class StepEvents:
    """What the stage detectors reported after one decode step (acted on before the next).

    ``rows``: the batch rows whose cue detector reported a boundary (a cue, or the routing
    shift when that detector tracks one); ``cues[i]``: the cue text row ``rows[i]`` matched, ""
    when none the detector could name; ``n_rows``: rows in the step (a share of them opened the
    stage); ``combined``: whether the combined cue + routing-shift detector reported one (None:
    it was not run)."""

    rows: tuple[int, ...] = ()
    cues: tuple[str, ...] = ()
    n_rows: int = 1
    combined: bool | None = None

    @property
    def cue_event(self) -> bool:
        return bool(self.rows)

    def named_cues(self) -> list[str]:
        return [c for c in self.cues if c]


# Kinds of residency decision (column 3 of ResidencyChange.ops); the values are the decision
# log's kinds (accounting.K_*), so a priced change logs as it was decided.
OP_DEMAND = 3  # copied before the observed step's layer used it, the layer waiting (wait-for-load caches)
OP_AFTER_USE = 4  # copied after the observed step's layer ran it on the CPU, for the next tokens
OP_EVICT = 5
OP_PREFETCH = 6  # copied though the observed step did not use it (a stage placement, a leader switch)


@dataclass
class ResidencyChange:
    """The residency decisions a policy made on observing one step, in issue order.

    ``ops`` rows are (layer, expert, slot, OP_*). The first ``n_in_step`` were made while the
    observed step ran, layer by layer in layer order: an ``OP_DEMAND`` copy (and the eviction
    before it) before the layer used the expert, the others after the layer ran. The rest were
    made after the step, before the next one (a placement at a stage boundary: evictions, then
    copies best first). ``target`` is the policy's expert->slot map after all of them (int32
    [L, E]; a view of the policy's books: read it before the next ``observe``). ``placements``:
    stage placements decided (counted even when one moved nothing)."""

    ops: np.ndarray  # int32 [n, 4]
    n_in_step: int
    target: np.ndarray
    placements: int = 0

    @property
    def n_ops(self) -> int:
        return int(self.ops.shape[0])

    @classmethod
    def placement(cls, plan: ResidencyPlan, target: np.ndarray, placements: int = 1) -> "ResidencyChange":
        """A stage placement before the next step: the plan's evictions, then its copies."""
        ne, nc = plan.evictions.shape[0], plan.copies.shape[0]
        ops = np.empty((ne + nc, 4), np.int32)
        ops[:ne, :3] = plan.evictions
        ops[:ne, 3] = OP_EVICT
        ops[ne:, :3] = plan.copies
        ops[ne:, 3] = OP_PREFETCH
        return cls(ops=ops, n_in_step=0, target=target, placements=placements)


# One decision of a policy as a driver (simulator.replay, placement.Placement) records it:
# ("group", global step of the group's first step, change) for begin_group, ("step", global
# step observed, change) for observe; the change is a copy (its ops view the policy's buffer).
Decision = tuple[str, int, ResidencyChange]


def record_decision(decisions: list[Decision] | None, when: str, step: int, change: ResidencyChange | None) -> None:
    """Append a copy of ``change`` to ``decisions`` (nothing when either is None)."""
    if decisions is not None and change is not None:
        decisions.append((when, step, ResidencyChange(ops=change.ops.copy(), n_in_step=change.n_in_step,
                                                      target=change.target.copy(), placements=change.placements)))


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


@njit(cache=True)
def gather(rows, l, cnt, uniq):
    """Unique experts of layer ``l`` in one step's ``rows`` int16 [B, L, K] (rows whose first
    id is -1 have no token) into ``uniq[:n]``, in order of first use, with their token counts
    in ``cnt[e]`` (an expert used by several tokens of the step runs once). Returns n; the
    caller zeroes ``cnt`` at ``uniq[:n]`` before the next layer."""
    n = 0
    for b in range(rows.shape[0]):
        if rows[b, 0, 0] < 0:
            continue
        for k in range(rows.shape[2]):
            e = rows[b, l, k]
            if cnt[e] == 0:
                uniq[n] = e
                n += 1
            cnt[e] += 1
    return n


@njit(cache=True)
def put_op(ops, n, layer, expert, slot, kind):
    """Write residency decision row ``n`` of ``ops`` int32 [m, 4]; returns n + 1."""
    ops[n, 0] = layer
    ops[n, 1] = expert
    ops[n, 2] = slot
    ops[n, 3] = kind
    return n + 1


def op_buffer(n_layer: int, n_expert: int) -> np.ndarray:
    """Room for the decisions of one step: at most an eviction and a copy per (layer, expert)."""
    return np.empty((2 * n_layer * n_expert, 4), np.int32)


# A decision kernel's scratch (``decide_caching``, ``decide_adaptive``) travels as one int32
# array of SCRATCH_PER_EXPERT * E entries, not five: after a decode each array argument of a
# kernel call costs about 0.8 us (docs/POLICIES_HISTORY.md, per-token cost). ``scratch_views`` names
# its parts: cnt [E] (zeros between steps: ``gather``'s counts), uniq / miss / entrants [E],
# admitted [E, 3] (``admit_after_use``'s rows).
SCRATCH_PER_EXPERT = 7


def scratch_buffer(n_expert: int) -> np.ndarray:
    """A decision kernel's scratch for ``n_expert`` experts per layer (cnt starts at zero)."""
    return np.zeros(SCRATCH_PER_EXPERT * n_expert, np.int32)


@njit(cache=True)
def scratch_views(scratch):
    """(cnt, uniq, miss, entrants, admitted): the parts of ``scratch`` (``scratch_buffer``)."""
    E = scratch.shape[0] // SCRATCH_PER_EXPERT
    return (scratch[:E], scratch[E:2 * E], scratch[2 * E:3 * E], scratch[3 * E:4 * E],
            scratch[4 * E:SCRATCH_PER_EXPERT * E].reshape((E, 3)))


@njit(cache=True)
def active_rows(rows):
    """Rows of one step's routing int16 [B, L, K] that have a token."""
    n = 0
    for b in range(rows.shape[0]):
        if rows[b, 0, 0] >= 0:
            n += 1
    return n


def used_experts(rows: np.ndarray, n_expert: int) -> np.ndarray:
    """bool [L, E]: the experts one step's ``rows`` int16 [B, L, K] route to (-1 rows: no token)."""
    live = rows[rows[:, 0, 0] >= 0]
    used = np.zeros((rows.shape[1], n_expert), bool)
    used[np.broadcast_to(np.arange(rows.shape[1])[None, :, None], live.shape), live] = True
    return used


@njit(cache=True)
def step_uses(rows, slot_of):
    """(hits, uses) of one step's ``rows`` int16 [B, L, K] (-1 rows: no token) under
    ``slot_of`` int32 [L, E]: the (row, layer, k) uses of resident experts, and all uses (the
    engine, the simulator and the RAM tier count both at every step: one pass)."""
    hits = 0
    n = 0
    for b in range(rows.shape[0]):
        if rows[b, 0, 0] < 0:
            continue
        n += 1
        for l in range(rows.shape[1]):
            for k in range(rows.shape[2]):
                if slot_of[l, rows[b, l, k]] >= 0:
                    hits += 1
    return hits, n * rows.shape[1] * rows.shape[2]
