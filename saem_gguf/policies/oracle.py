"""The oracle of the SAEM paper's prediction-efficiency analysis: the same boundaries, budget
and enforcement as ``saem-stage``, but each placement ranks the *next* stage's true routing
counts instead of the completed stage's. Within a stage residency is fixed, so per stage it
picks the set of slots that maximises hits: its hit rate bounds ``saem-stage``'s from above
under the same boundaries. Simulator only: ``begin_group`` must be given the whole block (its
future routing and events), which only a recorded trace has."""

from __future__ import annotations

import numpy as np

from saem_gguf.policies.saem import SaemConfig, SaemPolicy
from saem_gguf.policies.state import ResidencyChange, RoutingBlock, StepEvents, counts_between


class OraclePolicy(SaemPolicy):
    name = "oracle"
    summary = "SAEM's boundaries and budget ranking the next stage's true routing (prediction upper bound)"
    default_config = SaemConfig()

    def __init__(self, config: SaemConfig | None = None, **overrides) -> None:
        super().__init__(config, **overrides)
        if self.cfg.implicit:
            raise ValueError("the oracle uses explicit boundaries only")

    def begin_group(self, block: RoutingBlock) -> ResidencyChange | None:
        self._block = block
        self._block_step = 0  # index in ``block`` of the next step
        self._group_steps = 0
        self._warm_pending = self.cfg.warmup_steps > 0
        self._since_plan = 0
        return self._place(self._stage_counts(0), "request")

    def _book(self, routing_rows: np.ndarray, events: StepEvents) -> str:
        reason = super()._book(routing_rows, events)
        self._block_step += 1
        return reason

    def _boundary_scores(self, events: StepEvents, reason: str) -> np.ndarray:
        # _place runs after this and resets the schedule; mirror that state to find the stage end
        warm, since = self._warm_pending, self._since_plan
        self._since_plan = 0
        self._warm_pending = False
        scores = self._stage_counts(self._block_step)
        self._warm_pending, self._since_plan = warm, since
        return scores

    def _stage_counts(self, s: int) -> np.ndarray:
        """The true routing counts from step ``s`` of the block to the next placement."""
        return counts_between(self._block.routing, s, self._next_boundary(s), self.ctx.n_expert)

    def _next_boundary(self, s: int) -> int:
        """Step of the next placement if one is made before step ``s`` (no implicit fires)."""
        cfg, block = self.cfg, self._block
        nb = block.n_steps
        if cfg.use_events:
            ev = block.event_steps
            i = int(np.searchsorted(ev, s + max(1, cfg.min_gap_steps)))
            if i < ev.size:
                nb = min(nb, int(ev[i]))
        if self._warm_pending:
            nb = min(nb, s + max(1, cfg.warmup_steps - self._group_steps))
        if cfg.refresh_steps > 0:
            nb = min(nb, s + cfg.refresh_steps)
        return nb
