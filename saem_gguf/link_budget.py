"""The link budget: how many bytes the host-to-device link can carry for a policy's decisions on
one decode step (``Policy.observe``'s ``link_budget``), from an estimated clock both drivers keep.

Each step, before the policy observes it, the step's duration is estimated from its routing and
the residency in force, with the cost model's formulas (docs/POLICIES.md): per layer the dense
part, ``t_gpu(c)`` for each resident expert used by ``c`` tokens and ``t_cpu(c)`` for each other
one (serial, or the larger of the two with ``cpu_gpu_overlap``), one sync when any ran on the
CPU, and the output head once. The budget is that duration less the time the copies already
queued keep the link busy beyond the step's start, times the link bandwidth; a copy takes
``costmodel.link_bytes_per_copy`` of it. After the policy decided, its copies join the queue
(from the step's start, FIFO) and the clock moves to the step's end.

The estimate leaves out what only the simulator's full pricing (pricing.py) models: waits for
slots still in flight, transfers-first, the CPU slowed while DMA runs, the copy barrier. That
pricing costs about 15 us a step at 48 layers x top-8 (measured), too much for the engine's
per-token budget; this one is a single pass over the step's routing. The simulator and the
engine (placement.py) run the same ``LinkMeter`` over the same routing, maps and decisions, so
they tell a policy the same budget (tests/test_parity.py). Measured times are not used: the
decisions stay reproducible and equal the simulator's on the same trace.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from saem_gguf.costmodel import C_DENSE_LAYER_S, C_H2D_BW, C_OVERLAP, C_STEP_S, C_SYNC, CostModel, t_cpu, t_gpu, t_xfer
from saem_gguf.kernel_books import Book, KernelBooks, entry_point, f64_1d, i32_1d
from saem_gguf.policies.state import OP_EVICT, ResidencyChange, gather

# The meter's clock (float64 array ``clock``)
M_NOW = 0  # estimated start of the step being observed (seconds)
M_LINK_FREE = 1  # when the link has carried every copy queued so far
M_STEP_S = 2  # the observed step's estimated duration
N_METER = 3


@njit(cache=True)
def estimate_step(rows, slot_of, cost, clock, cnt, uniq, advance):
    """Estimate the duration of one step with routing ``rows`` int16 [B, L, K] (-1 rows: no token)
    under the map in force ``slot_of`` int32 [L, E] into ``clock[M_STEP_S]``; returns the link
    budget in bytes (see the module docstring). ``cnt`` int32 [E] (zeros) / ``uniq`` int32 [E]:
    scratch. ``advance``: the previous step decided no copies and its end is not on the clock yet
    (``queue_copies`` with no ops, done here). A step with no token takes no time."""
    if advance:
        clock[M_NOW] += clock[M_STEP_S]
    L = slot_of.shape[0]
    step = 0.0
    live = False
    for b in range(rows.shape[0]):
        if rows[b, 0, 0] >= 0:
            live = True
    if live:
        step = cost[C_STEP_S]
        for l in range(L):
            n = gather(rows, l, cnt, uniq)
            gpu = 0.0
            cpu = 0.0
            for i in range(n):
                e = uniq[i]
                if slot_of[l, e] >= 0:
                    gpu += t_gpu(cnt[e], cost)
                else:
                    cpu += t_cpu(cnt[e], cost)
                cnt[e] = 0
            layer = max(gpu, cpu) if cost[C_OVERLAP] > 0 else gpu + cpu
            if cpu > 0.0:
                layer += cost[C_SYNC]
            step += cost[C_DENSE_LAYER_S] + layer
    clock[M_STEP_S] = step
    backlog = max(0.0, clock[M_LINK_FREE] - clock[M_NOW])
    return cost[C_H2D_BW] * max(0.0, step - backlog)


@njit(cache=True)
def queue_copies(ops, cost, clock):
    """The copies among decisions ``ops`` int32 [n, 4] (rows not OP_EVICT) join the link's queue
    from the observed step's start; the clock moves to that step's end."""
    n = 0
    for j in range(ops.shape[0]):
        if ops[j, 3] != OP_EVICT:
            n += 1
    if n > 0:
        clock[M_LINK_FREE] = max(clock[M_LINK_FREE], clock[M_NOW]) + n * t_xfer(cost)
    clock[M_NOW] += clock[M_STEP_S]


# The meter's books (kernel_books): ``estimate_step``'s arrays after the map in force, in its order
METER_BOOKS = (Book("cost", np.float64, 1), Book("clock", np.float64, 1), Book("cnt", np.int32, 1),
               Book("uniq", np.int32, 1))


@njit(cache=True)
def estimate_entry(rows, slot_of, advance, tab):
    """``estimate_step`` with its books from ``tab`` (``METER_BOOKS``' table)."""
    return estimate_step(rows, slot_of, f64_1d(tab, 0), f64_1d(tab, 1), i32_1d(tab, 2), i32_1d(tab, 3), advance)


class LinkMeter:
    """The estimated clock of one driver's decode steps (module docstring). Per step:
    ``budget(rows, slot_of)`` before the policy observes it, ``decided(change)`` after it when it
    decided something; a group's first placement (``Policy.begin_group``) is ``placed(change)``."""

    def __init__(self, cost: CostModel, n_expert: int) -> None:
        self.cost = cost.array
        self.clock = np.zeros(N_METER, np.float64)
        self._cnt = np.zeros(n_expert, np.int32)
        self._uniq = np.empty(n_expert, np.int32)
        self._books = KernelBooks(METER_BOOKS, {"cost": self.cost, "clock": self.clock, "cnt": self._cnt,
                                                "uniq": self._uniq})
        self._tab = self._books.table
        # the step last estimated decided no copies (yet) and the clock has not moved to its end:
        # the next estimate or placement moves it, so a quiet decode step makes one kernel call
        # and one method call, not two of each (after a decode each call costs a few us before
        # its work: docs/POLICIES_HISTORY.md, per-token cost)
        self._advance = False
        # bind_step's rows and map, and estimate_entry's compiled entry point for them
        self._bound_rows: np.ndarray | None = None
        self._bound_map: np.ndarray | None = None
        self._bound_entry = estimate_entry

    def bind_step(self, rows: np.ndarray, slot_of: np.ndarray) -> None:
        """Later ``budget`` calls with these very arrays (kept) call ``estimate_entry``'s compiled
        entry point, untyped (kernel_books.entry_point): the engine's decode step, whose rows are
        one view of the native routing sink and whose map is the one in force."""
        self._bound_entry = entry_point(estimate_entry, rows, slot_of, False, self._tab)
        self._bound_rows, self._bound_map = rows, slot_of

    def budget(self, rows: np.ndarray, slot_of: np.ndarray) -> float:
        """Bytes the link can carry for the decisions on the step ``rows`` int16 [B, L, K] that ran
        under ``slot_of`` int32 [L, E]. The step counts as deciding nothing unless ``decided`` is
        told otherwise before the next step."""
        advance, self._advance = self._advance, True
        # the entry point only for the bound arrays: it would read any other as their types
        kernel = self._bound_entry if rows is self._bound_rows and slot_of is self._bound_map else estimate_entry
        return float(kernel(rows, slot_of, advance, self._tab))

    def decided(self, change: ResidencyChange | None) -> None:
        """The policy's decisions on the step last estimated (None, or not calling this: none)."""
        if change is not None:
            self._advance = False
            queue_copies(change.ops, self.cost, self.clock)

    def placed(self, change: ResidencyChange) -> None:
        """A placement before the next step (no step runs): its copies join the queue now."""
        if self._advance:
            self._advance = False
            self.clock[M_NOW] += self.clock[M_STEP_S]
        self.clock[M_STEP_S] = 0.0
        queue_copies(change.ops, self.cost, self.clock)
