"""The oracle of the SAEM paper's prediction-efficiency analysis: the same boundaries, budget
and enforcement as ``saem``, but each placement ranks the *next* stage's true routing counts
instead of the completed stage's. Within a stage residency is fixed, so per stage it picks the
set of slots that maximises hits: its hit rate bounds ``saem``'s from above under the same
boundaries. Simulator only (it reads the future)."""

from __future__ import annotations

import numpy as np

from saem_gguf.policies.accounting import Accounting
from saem_gguf.policies.state import CacheState, RoutingBlock, counts_between
from saem_gguf.policies.saem import SaemConfig, SaemPolicy


class OraclePolicy(SaemPolicy):
    name = "oracle"
    summary = "SAEM's boundaries and budget ranking the next stage's true routing (prediction upper bound)"
    default_config = SaemConfig()

    def __init__(self, config: SaemConfig | None = None, **overrides) -> None:
        super().__init__(config, **overrides)
        if self.cfg.implicit:
            raise ValueError("the oracle uses explicit boundaries only")

    def begin_group(self, block: RoutingBlock, state: CacheState, acct: Accounting) -> None:
        self._group_steps = 0
        self._warm_pending = self.cfg.warmup_steps > 0
        self._since_plan = 0
        nb = self.next_boundary(block, 0)
        self._place(counts_between(block.routing, 0, nb, self.ctx.n_expert), block, 0, state, acct, "request")

    def _boundary_scores(self, block: RoutingBlock, s: int, reason: str) -> np.ndarray:
        # _place runs after this and resets the schedule; mirror that state to find the stage end
        warm = self._warm_pending
        self._since_plan = 0
        self._warm_pending = False
        nb = self.next_boundary(block, s)
        self._warm_pending = warm
        return counts_between(block.routing, s, nb, self.ctx.n_expert)
