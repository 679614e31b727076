"""The engine's placement loop: routing out of llama.cpp -> stage detector -> policy -> native cache.

One ``Placement`` per loaded model. The engine calls ``on_prompt`` after each prefill ubatch and
``on_token`` after each decoded token; the batch scheduler (saem_gguf.serving.batch) calls
``on_step`` after each decode step of several sequences, one row per sequence (``on_token`` is its
one-row case). Routing comes from the native counters (no eval callback). The policy is driven
through the entry points the simulator drives it through (``Policy.begin_group``,
``Policy.observe`` with the stage events reported after the step and its link budget) and only
decides. A policy that reads its link budget (``uses_link_budget``) gets it from the estimated
link clock the simulator keeps too (link_budget.LinkMeter: each step's duration estimated on
the cost model, the copies still queued), not from measured times, so the decisions are
reproducible and equal the simulator's on the same trace; the others are told inf. Its
decisions (``ResidencyChange``) become native copies, in decision order (async where the build
has a device), and slot-map updates, in force for the next decode. Hits are counted against the
slot maps in force for the step's decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from saem_gguf import native_api as na
from saem_gguf.errors import SaemError
from saem_gguf.link_budget import LinkMeter
from saem_gguf.policies import make_policy
from saem_gguf.policies.base import PolicyContext
from saem_gguf.policies.state import (
    OP_EVICT, CacheState, ResidencyChange, RoutingBlock, StepEvents, record_decision, step_uses,
)
from saem_gguf.simulator import calibration_pricer, calibration_replay
from saem_gguf.stage.detector import StageDetector, StageEvent
from saem_gguf.stage.pair import DetectorPair
from saem_gguf.trace import TraceSet


# Policies whose misses wait for a load mid-step: the native layer offers no such wait, so the
# engine runs the variant whose miss computes in place on the CPU and loads for the next tokens.
ENGINE_VARIANT = {"lru": "lru-cpu", "lfu": "lfu-cpu", "temporal": "temporal-cpu"}


@dataclass
class PlacementStats:
    tokens: int = 0  # decoded tokens observed
    prompt_tokens: int = 0
    accesses: int = 0  # (token, layer, k) expert uses while decoding
    hits: int = 0  # of those, served from a resident slot
    copies: int = 0
    bytes_moved: int = 0
    boundaries: int = 0
    plans: int = 0  # placement updates that changed residency
    events: list[StageEvent] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "expert_accesses": self.accesses, "hits": self.hits,
                "hit_rate": round(self.hit_rate, 6), "copies": self.copies,
                "bytes_moved": self.bytes_moved,
                "mb_moved_per_token": round(self.bytes_moved / 1e6 / max(self.tokens, 1), 6),
                "boundaries": self.boundaries, "plans": self.plans}


# on_token's detector slot (sequence 0), in the form the detectors take slots (read only)
_SEQ0 = np.zeros(1, np.int64)
_INF = math.inf  # a module global: one lookup, not two


class Placement:
    """Drives one policy over the native expert cache of one llama context: one sequence
    (``on_token``) or a batch of them decoding together (``on_step``)."""

    def __init__(self, ctx, policy_name: str, slots_per_layer: int, cost, detector: StageDetector,
                 calib_counts: np.ndarray | None = None, cue_counts: dict[str, np.ndarray] | None = None,
                 calib_routing: TraceSet | None = None, record: bool = False,
                 policy_args: dict | None = None,
                 check_slots: Callable[[np.ndarray], None] | None = None,
                 file_moe_layers: Sequence[int] | None = None) -> None:
        """``check_slots``: called with the slots per model layer the policy asks for, before the
        native cache allocates them (the engine's host-memory bound: it raises SaemError).
        ``file_moe_layers``: the MoE layers the engine read in the file (gguf_info), which must be
        the ones llama.cpp loaded: the engine placed the expert tensors by them."""
        self.ctx = ctx
        n_layers = na.saem_moe_n_layers(ctx)
        infos = [na.saem_moe_get_layer_info(ctx, il) for il in range(n_layers)]
        # what the host experts are (types, repacked layout), read once: the engine's notes use them
        self.moe_layer_infos = [i for i in infos if i.n_expert > 0]
        self.moe_layers = [i.il for i in self.moe_layer_infos]
        if not self.moe_layers:
            raise SaemError("the model has no MoE layers")
        if file_moe_layers is not None and list(file_moe_layers) != self.moe_layers:
            # the cache would trust expert tensors the engine did not place (a split model read
            # from its first part alone was such a case: SIGSEGV in llama.cpp)
            raise SaemError(f"llama.cpp loaded experts in layers {self.moe_layers}, the file was read as having "
                            f"them in layers {list(file_moe_layers)}: not starting the expert cache on that")
        first = infos[self.moe_layers[0]]
        self.n_expert, self.top_k = first.n_expert, first.n_expert_used
        # indexed by a decision's MoE layer index: the model layer, the bytes one copy moves
        self._moe_layer_ids = np.array(self.moe_layers, np.int32)
        self._expert_nbytes = np.array([infos[il].expert_nbytes for il in self.moe_layers], np.int64)
        L = len(self.moe_layers)
        self._uses_per_row = L * self.top_k  # (layer, k) uses of one token
        n_slots = np.zeros(n_layers, np.int32)
        n_slots[self.moe_layers] = slots_per_layer
        self.policy = make_policy(ENGINE_VARIANT.get(policy_name, policy_name), **(policy_args or {}))
        # batch stays 1 under `serve -np N` too: how many sequences will decode together is not
        # known at load, and a policy priced for batch 1 lost at most 0.18 % run at batch 4 or 8,
        # where one priced for batch 4 or 8 lost up to 1.8 % run at batch 1 (docs/POLICIES.md,
        # "The batch a policy is priced for")
        pctx = PolicyContext(n_layer=L, n_expert=self.n_expert, top_k=self.top_k,
                             n_slots=np.full(L, slots_per_layer, np.int32), cost=cost,
                             calib_counts=calib_counts, cue_counts=cue_counts)
        # the calibration sample replayed under this detector's events, as the simulator
        # replays it under its own (simulator.simulate): a policy prices its set-up on it
        calibration = calibration_replay(calib_routing, template=detector)
        if calibration is not None:
            pctx.replay_calibration = calibration_pricer(calibration, pctx)
        self.state: CacheState = self.policy.start(pctx)  # the policy's books (read only here)
        # the estimated link clock, for a policy that reads its link budget (the others are told
        # inf, as the simulator tells them)
        self.link = LinkMeter(cost, self.n_expert) if self.policy.uses_link_budget else None
        # the policy may use fewer/more slots than the budget (n-cpu-moe, gpu-all)
        n_slots[self.moe_layers] = self.state.n_slots
        if check_slots is not None:
            check_slots(n_slots)
        na.saem_moe_cache_init(ctx, n_slots.tolist())
        na.saem_moe_set_counting(ctx, na.SAEM_COUNT_IDS)
        self.detector = detector
        # the combined cue + routing-shift twin of the detector, for policies that act on both
        # (the simulator replays the same two detectors, simulator.detector_events): fed with the
        # cue detector in one pass (stage.pair) when that one detects cues only; a detector that
        # also detects routing shifts is its own twin
        wants_twin = self.policy.uses_combined_events and detector.tracks_routing
        self.pair = DetectorPair(detector) if wants_twin and not detector.needs_routing else None
        self.twin_is_detector = wants_twin and detector.needs_routing
        self._rows_to_detector = detector.needs_routing  # read once: a property call per step costs
        self.stats = PlacementStats()
        self._native = np.full((L, self.n_expert), -1, np.int32)  # expert -> slot in force natively
        self._put_initial(self.state.slot_of)
        self._step = 0
        self._quiet: dict[int, StepEvents] = {}  # per batch size, the events of a step that raised none
        # a test may set lists here to collect every decision (state.Decision records) and every
        # link budget told to the policy
        self.decisions: list | None = None
        self.link_budgets: list[float] | None = None
        self.record = record
        self.trace_experts: list[np.ndarray] = []  # [n_tokens, L, K] per ubatch, when recording
        # one native call reads a step of up to every detector slot's token (a prefill ubatch may take two)
        self._routing_reader = na.LastRoutingReader(ctx, len(self.moe_layers) * self.top_k * detector.n_seq)
        self._bound_rows: np.ndarray | None = None  # the rows the step's kernels are bound to (_bind_step)
        # lower tiers (ram_tier.RamTier), driven with the same prefill counts, rows and events after this policy
        self.tiers: list = []

    # --- routing in ------------------------------------------------------------------------
    def last_routing(self) -> np.ndarray:
        """int16 [n_tokens, L, K]: the last ubatch's top-k experts of every MoE layer (one native
        call reads up to a token per detector slot; a prefill ubatch may take a second).

        llama.cpp computes the last layer only for tokens whose logits are wanted (the prompt's
        last token), so a layer may report fewer tokens: its rows align to the ubatch's end and
        the rest stay -1."""
        return self._routing_reader.read()

    def on_prompt(self, n_tokens: int, routing: np.ndarray | None = None) -> None:
        """After a prefill ubatch: its routing seeds the first placement (``routing``: that
        ubatch's int16 [n_tokens, L, K] when the caller kept it, as a replay does; else read)."""
        if routing is None:
            routing = self.last_routing()
        if self.record:
            self.trace_experts.append(routing)
        self.stats.prompt_tokens += n_tokens
        counts = np.zeros((routing.shape[1], self.n_expert))
        for l in range(routing.shape[1]):
            ids = routing[:, l, :].ravel()
            counts[l] = np.bincount(ids[ids >= 0], minlength=self.n_expert)
        block = RoutingBlock(routing=np.zeros((0, 1, routing.shape[1], self.top_k), np.int16),
                             event_steps=np.zeros(0, np.int32), prefill_counts=counts,
                             prefill_tokens=n_tokens, step0=self._step)
        change = self.policy.begin_group(block)
        if change is not None and self.link is not None:
            self.link.placed(change)
        self._put_in_force("group", change)
        for tier in self.tiers:
            tier.begin_group(block)

    def on_token(self, piece: bytes) -> list[StageEvent]:
        """After decoding one token (sequence 0) whose text is ``piece``: ``on_step`` of one row,
        its hits as the native layer counted them when the decode ran."""
        reader = self._routing_reader
        # a view of the native buffer (no call, no copy: after a decode has emptied the caches
        # each costs tens of microseconds); nothing keeps it past this token
        token = reader.one_token()
        if token is None:  # not one token's row: on_step refuses it
            return self.on_step(reader.view(), [piece], _SEQ0)
        # one decoded token's row routes in every layer, and is int16 [1, L, K] by construction:
        # the detectors' checks are spared. It is one view of the native sink, the same object
        # every token: the step's kernels are bound to it (and to _SEQ0) once
        rows = token[0]
        if rows is not self._bound_rows:
            self._bind_step(rows)
        return self._observe_step(rows, [piece], _SEQ0, token[1], self._uses_per_row, checked=True)

    def _bind_step(self, rows: np.ndarray) -> None:
        """Bind the per-token kernels of the detectors, the link meter and the policy to a decode
        step's arguments: ``rows`` (the sink's one-token view), ``_SEQ0`` and the map in force.
        Calls with exactly these arrays then skip Numba's argument typing, about 7 us a kernel
        after a decode (kernel_books.entry_point); every other call is typed as before."""
        if self.pair is not None:
            self.pair.bind_step(_SEQ0, rows)
        else:
            self.detector.bind_step(_SEQ0)
        if self.link is not None:
            self.link.bind_step(rows, self._native)
        self.policy.bind_step(rows)
        self._bound_rows = rows

    def on_step(self, routing: np.ndarray, pieces: list[bytes], seqs: list[int]) -> list[StageEvent]:
        """After one decode step of ``len(seqs)`` sequences: ``routing`` int16 [B, L, K] holds one
        row per sequence (row b is the token of detector slot ``seqs[b]`` whose text is
        ``pieces[b]``). Hits are counted per row against the maps in force; the stage detector runs
        per sequence; the policy observes the step with the simulator's batch semantics
        (saem_gguf.simulator.build_blocks, RoutingBlock.events_after): an event of any row is a
        boundary, its cues are those of the rows that raised it (saem-cue blends them by their
        share of the B rows; B counts the sequences of this step, where the simulator's lockstep
        batch also counts rows whose sequence has ended). Its decisions are put in force natively."""
        B = len(seqs)
        if routing.shape[0] != B or len(pieces) != B:
            raise SaemError(f"on_step: {routing.shape[0]} routing rows, {len(pieces)} pieces, {B} sequences")
        # hits against the maps in force for this decode (the policy's books before it observes)
        hits, uses = step_uses(routing, self._native)
        slots = seqs if type(seqs) is np.ndarray else np.asarray(seqs, np.int64)  # once for both detectors
        return self._observe_step(routing, pieces, slots, hits, uses, checked=False)

    def _observe_step(self, routing: np.ndarray, pieces: list[bytes], slots: np.ndarray, hits: int, uses: int,
                      checked: bool) -> list[StageEvent]:
        """``on_step`` once its step's hits are counted (``on_token``: natively, as the decode ran).
        ``checked``: slots and rows are known to be what the detectors take (their checked entry
        points run)."""
        # each attribute is read once (after a decode every read and call costs: docs/POLICIES.md)
        B = len(pieces)
        if self.record:
            self.trace_experts.append(np.array(routing))  # on_token's routing is a view of the native buffer
        stats = self.stats
        stats.hits += hits
        stats.accesses += uses
        pair = self.pair
        if pair is not None:
            events, combined = (pair.feed_checked if checked else pair.feed)(slots, pieces, routing)
        else:
            det = self.detector
            events = (det.feed_checked if checked else det.feed)(slots, pieces,
                                                                 routing if self._rows_to_detector else None)
            combined = bool(events) if self.twin_is_detector else None
        if events or combined:
            stats.events.extend(events)
            stats.boundaries += len(events)
            # one cue per row that raised an event ("" when the row's events name none), as the
            # simulator's blocks carry them
            row_cue: dict[int, str] = {}
            for e in events:
                if not row_cue.get(e.seq):
                    row_cue[e.seq] = e.cue
            row_of = {s: b for b, s in enumerate(slots.tolist())}
            seen = StepEvents(rows=tuple(row_of[s] for s in row_cue), cues=tuple(row_cue.values()), n_rows=B,
                              combined=bool(combined) if self._has_twin else None)
        else:
            seen = self._quiet.get(B)
            if seen is None:
                seen = self._quiet[B] = StepEvents(n_rows=B, combined=False if self._has_twin else None)
        link = self.link
        budget = link.budget(routing, self._native) if link is not None else _INF
        if self.link_budgets is not None:
            self.link_budgets.append(budget)
        change = self.policy.observe(routing, seen, budget)
        if change is not None:
            if link is not None:
                link.decided(change)
            self._put_in_force("step", change)
        self._step += 1
        stats.tokens += B
        if self.tiers:
            for tier in self.tiers:
                tier.on_step(routing, seen)
        return events

    # --- residency out ---------------------------------------------------------------------
    def _put_in_force(self, when: str, change: ResidencyChange | None) -> None:
        """Issue a change's copies natively in decision order (those its target still holds),
        then set the slot map of every layer it touched."""
        if change is None:
            return
        record_decision(self.decisions, when, self._step, change)
        ops, target = change.ops, change.target
        if ops.shape[0] == 0:
            return
        l, e = ops[:, 0], ops[:, 1]
        copied = (ops[:, 3] != OP_EVICT) & (target[l, e] == ops[:, 2])
        lc = l[copied]
        self._send(lc, e[copied], ops[copied, 2], np.unique(l), target)
        self.stats.copies += int(lc.shape[0])
        self.stats.bytes_moved += int(self._expert_nbytes[lc].sum())
        self.stats.plans += 1

    def _put_initial(self, target: np.ndarray) -> None:
        """Load the policy's starting map ``target`` (int32 [L, E], expert -> slot or -1) into the
        empty native cache (not counted: no decode has run yet)."""
        l, e = np.nonzero(target >= 0)
        if l.shape[0]:
            self._send(l, e, target[l, e], np.unique(l), target)

    def _send(self, l: np.ndarray, e: np.ndarray, slot: np.ndarray, touched: np.ndarray,
              target: np.ndarray) -> None:
        """Copy expert ``e[i]`` of MoE layer ``l[i]`` into ``slot[i]``, in order, then put the
        ``touched`` layers' rows of ``target`` in force: one native call each (a burst is up to
        a few hundred copies; one call per copy cost about 4 us of ctypes work)."""
        if l.shape[0]:
            na.saem_moe_copy_experts_async(self.ctx, np.stack([self._moe_layer_ids[l], e, slot], 1))
        na.saem_moe_set_slot_maps(self.ctx, self._moe_layer_ids[touched], target[touched])
        self._native[touched] = target[touched]

    @property
    def _has_twin(self) -> bool:
        """Whether the combined detector runs (its verdict goes to the policy)."""
        return self.pair is not None or self.twin_is_detector

    def reset_stats(self) -> None:
        """Counts start again from zero; residency and the policy's state stay (a server's warm-up
        run is not the clients' figures)."""
        self.stats = PlacementStats()

    def reset_sequence(self, seq: int = 0) -> None:
        """A new conversation in detector slot ``seq``: its stage state restarts, residency stays
        (it is still a good guess)."""
        self.detector.reset(seq)
        if self.pair is not None:
            self.pair.reset(seq)
