"""Residency and its inputs: the per-layer slot cache (``CacheState``, the mirror of the native
slot cache), residency changes (``ResidencyPlan``) and the routing a policy observes
(``RoutingBlock``: decode steps of a batch in lockstep, with the stage events known before
each step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError



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
    def engine_step(cls, routing: np.ndarray, step: int, event_after: bool = False, cues: list[str] | None = None,
                    combined_after: bool | None = None) -> "RoutingBlock":
        """The engine's block for one decoded token: step 0 is the token just decoded (``routing``
        int [n_tokens, L, K], global step ``step``); step 1 is the next decode, not yet run (no
        routing), carrying the events the detectors reported after this token: ``event_after``
        with its ``cues``, and ``combined_after`` from the combined cue + routing-shift detector
        (None when it is not run). Running both steps replays this token and then makes the
        decisions due before the next decode, so the native cache has them in force for it,
        exactly where the simulator places them."""
        r = np.full((2,) + np.shape(routing), -1, np.int16)
        r[0] = routing
        blk = cls(routing=r, event_steps=_NO_STEP, step0=step)
        blk.refill_engine_step(routing, step, event_after, cues, combined_after)
        return blk

    def refill_engine_step(self, routing: np.ndarray, step: int, event_after: bool = False,
                           cues: list[str] | None = None, combined_after: bool | None = None) -> None:
        """Reuse this ``engine_step`` block for the next token (same shape; no allocation: the
        engine calls this once per decoded token)."""
        self.routing[0] = routing
        self.step0 = step
        self.event_steps = _NEXT_STEP if event_after else _NO_STEP
        self.event_cues = [list(cues or [])] if event_after else None
        self.implicit_event_steps = None if combined_after is None else (_NEXT_STEP if combined_after else _NO_STEP)


# event-step arrays of engine_step blocks (never written to)
_NO_STEP = np.zeros(0, np.int32)
_NEXT_STEP = np.ones(1, np.int32)
_NO_STEP.flags.writeable = False
_NEXT_STEP.flags.writeable = False


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
