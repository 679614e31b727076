"""The simulator's books: the counters the pricing kernels (pricing.py) add to, the simulated
clock and the decision log.

``Accounting.counters`` is one float64 array indexed by the ``A_*`` constants below (counts and
seconds side by side, so a Numba kernel takes one array); ``Accounting.clock`` is
``[now, link free at]`` in simulated seconds; ``Accounting.log`` rows are
``(global step, layer, expert, slot, kind)`` with ``kind`` one of ``K_*`` (``KIND_NAMES``), slot
-1 for a CPU run or the temporary slot."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError
from saem_gguf.policies.state import OP_AFTER_USE, OP_DEMAND, OP_EVICT, OP_PREFETCH

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

# Log kinds: column 4 of a decision-log row (step, layer, expert, slot, kind)
K_HIT = 0
K_CPU = 1
K_TEMP = 2
K_DEMAND = OP_DEMAND  # the residency decisions log as the policy made them (state.OP_*)
K_ASYNC = OP_AFTER_USE
K_EVICT = OP_EVICT
K_PREFETCH = OP_PREFETCH
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
    """Append a decision row to ``log`` int32 [n, 5]; ``log_n`` int64 [1] counts rows, past the
    capacity too (Accounting.logged reports an overflow)."""
    i = log_n[0]
    if i < log.shape[0]:
        log[i, 0] = step
        log[i, 1] = layer
        log[i, 2] = expert
        log[i, 3] = slot
        log[i, 4] = kind
    log_n[0] = i + 1  # counts past capacity so overflow is detectable
