"""Adaptive SAEM, the default ``saem``: several placement rules run in shadow on the routing as
it arrives, and the real cache follows the one that would have served best lately.

Why: SAEM's stage rule (rank the completed stage at a boundary, hold residency until the next)
wins where stages are long and coherent; frequency and recency caches that load a miss after
running it on the CPU win where hot sets drift inside a stage or no cue marks the shifts. No
single rule leads on every workload, but which one leads is visible from the routing itself.

Candidates, each a full shadow cache (sets only; no pricing):

* ``static``: the calibrated placement, never changed (KTransformers' hot experts);
* ``lru`` / ``lfu`` / ``lrfu-16`` / ``lrfu-32`` / ``lrfu-64`` / ``lrfu-256``: the ``-cpu`` caches'
  rule (caching.py ``admit_after_use``): a miss runs on the CPU and is loaded for the next tokens
  when its priority beats the coldest resident (LRFU at half-lives of 16, 32, 64 and 256 steps;
  ``lru``, a default since the step clock priced its many copies as they cost, leads only where
  its rule is fast; ``lrfu-32``, a default since the forty-ninth session, leads where neither
  neighbour fits and where the two trade the lead);
* ``stage``: SAEM's rule at every stage boundary (cue events, the stage detector's
  routing-shift events when the block carries them, SAEM's warm-up and long-stage refresh): the
  completed stage's counts, blended with the cue's calibrated stage profile when there is one
  (``saem-cue``'s blend).

Each step, each candidate earns what its set (before its own update) would have saved in
expert time on the cost model, in one-token hits (``hit_gains``: ``t_cpu(c) - t_gpu(c)`` for an
expert used by ``c`` of the step's tokens, plus the CPU round trip a layer skips when every
expert it used was held), less the price of the copies it made (the stage candidate's re-ranks
count as its copies, ``charge_placements``, as a cache's loads do); the score is an exponential
average over ``horizon_steps``. Counting token hits instead would favour the rule that hits
most, which is not the fastest where one CPU expert in a layer costs the whole round trip (the
embedded model: a hit saves 1.4 us, the round trip 30 us) or where a batch shares an expert's
weight read. The real cache follows the leader's set: after each layer runs, the leader's
new residents are copied in best first, each replacing a resident that left the leader's set,
as far as the step's link budget allows (``observe``'s ``link_budget``; the rest follow at later
steps); a cache leader's new residents only once a step uses them (its own loads come at once:
they are what the step used), a fixed set's (stage, static) at once. The leader at start is
``lrfu-16`` (``DEFAULT_START_LEADER``); under the copy barrier, where a wrong cache start's
loads hold up the decode, the candidate that led the most steps when the policy replayed its
calibration routing at load (the replay that chooses the layout), when there was one. Where
there was one, each candidate's score starts at its mean in that replay, worth ``prior_steps``
(16) steps, with or without the barrier. The leader changes when another candidate's score
beats it by more than the copies a switch costs, spread over the horizon, and not in the first
``first_switch`` steps (under the barrier a switch to a fixed set copies it in a burst, each
copy at its whole transfer; a switch to a cache leader copies its entrants as they are used,
each at an idle link's price). Under the barrier the lead
a switch counts on is forecast, not taken as it stands: per pair of candidates, a line fitted
to how the mean net-gain lead over the horizon after each past step followed the score lead at
it (``record_leads``, ``lead_forecast``) says how much of a lead lasts, never more than the
larger of the lead now and the pair's mean lead. Scores of a few hits a
step apart swing by tens between steps; a lead that such swings make and undo switched the
cache back and forth, each switch back a burst of copies the next decode waits for.
Copies are priced in hits, as the simulator prices the real cache's: on each candidate's own
step clock (``step_clock``, ``_clock_layer``): every layer starts after its dense part, the
candidate's held experts run on the GPU and the rest on the CPU, slowed ``f`` times (C_DMA_SLOW:
host-to-device DMA reads host memory) while its link is busy, and its copies queue on its link
when their layer ends (a stage re-rank's at the step's start); the link's backlog carries into
the next step. Under the copy barrier (the engine's native layer: each decode waits for every
copy queued before it) the link's run past the step and a re-rank's copies are instead a stall
of the next decode. What the slow-down and the stall cost, over what one hit saves
(``t_cpu(1) - t_gpu(1)``), is the price. Why: a copy costs what CPU work it overlaps, and that
depends on the candidate. At ECR 50 % a cache that hits 87 % of the time runs few CPU
experts and its copies mostly overlap none; a price per copy charged ``lrfu-16``'s extra copies
more than its extra hits earned, and the cache followed ``lrfu-64``, 1.5 % slower
(``drawn-2-14``, ECR 50 %, batch 1; docs/POLICIES.md, "Copies priced on a step clock").
``copy_cost`` is a copy's price on an idle link: ``copy_price`` (0.5) times the CPU time its DMA
takes from CPU experts (the part of ``t_xfer`` not hidden behind the next layer's dense part,
times ``1 - 1/f``) over what one hit saves. It prices a switch's copies, and, with the step clock
off (or a fixed ``copy_cost``), every copy: a candidate that copies much keeps the link busy, its
copies queue and their whole transfer slows CPU experts, so each candidate's copies are priced by
its own link load (its copy rate times ``t_xfer`` over an estimated step, ``copy_charge``), from
``copy_cost`` on an idle link towards the busy-link price. Under the copy barrier with the step
clock off a step's copies are priced as that step pays them instead, on a link clock of the
candidate's own in copy times (``barrier_stalls``): a copy issued after layer
``l`` of ``L`` starts at ``(l + 1) / L`` of the estimated step (``CTL_HIDDEN_COPIES`` copy times)
or when the link frees; one that finds the link idle costs ``copy_cost``, one queued behind
another the busy-link price (``CTL_QUEUED_COST``: its whole transfer slows CPU experts), and the
time the clock runs past the step is a stall the next decode waits for (the whole transfer). A
rate averaged over the horizon hid the bursts (a token whose experts all miss loads one per
layer at once), and a count of copies hid when they came (a copy after the last layer has none
of the step to hide behind).

Because the baselines' own rules are candidates, the real cache trails the best of them only by
the switching copies and the lag of the average: robust by construction, not by tuning.

The budget's split over the layers (``layout``, decided at load): where the context can replay
the calibration routing (``PolicyContext.replay_calibration``), the count of whole resident
layers under which this policy itself replays it fastest (the fewest within a margin of the
fastest: for a short replay ``layout_warmup_steps`` over its steps, and at a batch above 1 at
least ``layout_margin``); else layout.py's static estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
from numba import njit

from saem_gguf.costmodel import (
    C_BARRIER, C_DENSE_LAYER_S, C_DMA_SLOW, C_OVERLAP, C_STEP_S, C_SYNC, layer_end, link_bytes_per_copy, t_cpu, t_gpu,
    t_xfer,
)
from saem_gguf.kernel_books import (
    Book, KernelBooks, entry_point, f64_1d, f64_2d, f64_3d, i32_1d, i32_2d, i32_3d, i64_2d, u8_1d,
)
from saem_gguf.policies.base import PolicyContext
from saem_gguf.policies.caching import (
    KIND_LFU, KIND_LRU, _touch, admit_after_use, initial_keys, lrfu_lambda, resident_floor,
)
from saem_gguf.policies.layout import (
    choose_layout, expert_use_probability, layer_time_table, max_whole_layers, whole_layer_grid,
)
from saem_gguf.policies.ranking import plan_from_scores
from saem_gguf.policies.saem import SaemConfig, SaemCuePolicy, stage_books
from saem_gguf.policies.state import (
    OP_AFTER_USE, OP_EVICT, OP_PREFETCH, CacheState, ResidencyChange, StepEvents, active_rows, gather, op_buffer,
    put_op, scratch_buffer, scratch_views,
)

# Candidate kinds beyond the caching kinds (KIND_LRU, KIND_LFU): sets that change only when the
# policy says so (at load, or at stage boundaries), and LRFU kept as a scaled linear sum.
KIND_FIXED = 10
# LRFU with the key w = v * exp(lam * (g - ref)): an access at step g adds c * exp(lam * (g - ref)),
# one exp per candidate and step instead of an exp and a log per access (caching.py's log form);
# the order of keys, which is all admission compares, is the same. ``ref`` moves forward (and the
# keys shrink) before the factor overflows.
KIND_DECAY = 11
RESCALE_AT = 1e150
# copies one step may make when the link budget is unbounded (more than any cache holds)
MAX_COPIES = 1 << 40

# Per-candidate parameters (float64 array ``cand`` [C, N_CAND])
CAND_KIND = 0  # KIND_*
CAND_LAM = 1  # LRFU decay per step (KIND_DECAY), else 0
CAND_REF = 2  # KIND_DECAY: the step the keys are scaled to
CAND_RATE = 3  # copies per step, averaged like the score: how busy the candidate keeps the link
CAND_PLACED = 4  # copies a fixed set's re-rank made since the last step (the stage rule's placements)
CAND_NET_SUM = 5  # its step gains net of copies, summed over every step scored (a replay's mean: the prior)
CAND_BACKLOG = 6  # the step clock without the barrier: seconds its link stays busy past the end of the last step
N_CAND = 7

# Control block of the kernel (float64 array ``ctl``)
CTL_LEADER = 0  # index of the candidate the real cache follows
CTL_ALPHA = 1  # weight of the newest step in the score averages (1 / horizon)
CTL_COPY_COST = 2  # a copy's cost in hits
CTL_HORIZON = 3  # steps a switch's gain is expected to last
CTL_SWITCHES = 4  # leader changes so far
CTL_SWITCH_COST = 5  # what one copy of a leader switch must be outweighed by, in hits
CTL_SCORED = 6  # steps scored so far: the first horizon's averages are plain means (no lag from 0)
CTL_WARM = 7  # 1: the first steps are averaged as plain means; 0: all with weight 1 / horizon
CTL_SYNC_GAIN = 8  # a layer step with every used expert held skips the CPU round trip: its gain, in hits
CTL_FIRST_SWITCH = 9  # steps scored before the leader may change
CTL_COPY_COST_FULL = 10  # a copy's cost in hits when its whole transfer slows CPU experts (a busy link)
CTL_LINK_SHARE = 11  # share of an estimated step the link needs for one copy (t_xfer / step time)
CTL_LOAD_SLOPE = 12  # how much of the busy-link price a copy pays per unit of load (copy_charge)
CTL_HIDDEN_COPIES = 13  # barrier, step clock off: an estimated step in copy times, where the link clock ends (0: off)
CTL_CACHE_SWITCH_COST = 14  # under the barrier, CTL_SWITCH_COST of a switch to a cache leader (0: the same)
CTL_QUEUED_COST = 15  # under the barrier, a copy queued behind another's price in hits (no dense part hides it)
CTL_LEAD_KEEP = 16  # under the barrier, the weight a past lead's observation keeps per step (0: no forecast)
CTL_LEAD_PRIOR = 17  # steps the lead forecast's prior (slope 1, intercept 0) is worth
CTL_CLOCK = 18  # copies priced on each candidate's step clock: 1 its link's backlog carries, 2 (barrier) a stall
CTL_WARMED = 19  # what warm_step_lines loaded, summed: read by nothing, kept so that the compiler keeps its loads
N_CTL = 20


# lrfu-32 between lrfu-16 and lrfu-64 (forty-ninth session): the geometric mean of saem / best
# other rose 0.14-0.23 % on each of the ten sets measured on Qwen3-30B-A3B's shape (+0.01 % on
# Mixtral's), and 4 cells of 1,100 fell by more than 0.1 %, at most 0.41 % (docs/POLICIES.md,
# "lrfu-32 a candidate")
DEFAULT_CANDIDATES: tuple[str, ...] = ("stage", "static", "lfu", "lrfu-16", "lrfu-32", "lrfu-64", "lrfu-256", "lru")
# The leader at start when no calibration replay names one (``_start_leader``), when a
# candidate (else the stage rule). Until the stage rule's first boundary (SAEM's warm-up) its
# set is the calibrated one, static's; a cache that loads the misses it ran on the CPU is the
# better start wherever routing moves, and where it does not the stage rule takes over at its
# first placement. Starting from the stage rule, traces whose best rule is temporal-cpu's lost
# up to 0.14 % to it (the follower re-missing what the cache loaded while it did not lead;
# docs/POLICIES.md).
DEFAULT_START_LEADER = "lrfu-16"


def candidate_kind(name: str) -> tuple[int, float]:
    """(kind, LRFU decay per step) of a candidate name: stage, static, lru, lfu or lrfu-H (H =
    half-life in steps)."""
    if name in ("stage", "static"):
        return KIND_FIXED, 0.0
    if name == "lru":
        return KIND_LRU, 0.0
    if name == "lfu":
        return KIND_LFU, 0.0
    if name.startswith("lrfu-"):
        try:
            h = float(name[5:])
        except ValueError:
            h = 0.0
        if h > 0:
            return KIND_DECAY, lrfu_lambda(h)
    raise ValueError(f"unknown adaptive saem candidate {name!r}")


@dataclass
class AdaptiveConfig:
    """Adaptive SAEM's knobs. ``stage`` holds the stage candidate's boundary schedule (SAEM's)."""

    stage: SaemConfig
    horizon_steps: float = 64.0
    # a switch must gain this many times its copies' cost over the horizon (the scores are noisy)
    switch_margin: float = 1.0
    # average the first horizon's steps as plain means, so the scores are not pulled to 0 at start
    warm_start: bool = True
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    prior_tokens: float = 64.0  # LFU/LRFU calibration prior, as in caching.py
    # a copy's cost in hits, one price whatever the link does; None: the step clock's (below), and
    # copy_price * copy_cost_in_hits(cost model) for a switch's copies
    copy_cost: float | None = None
    # the share of copy_cost_in_hits a copy is priced at: that estimate charges every copy the
    # DMA slow-down of the transfer time the next dense part does not hide; the simulated price
    # varies with the workload (0.27-0.77 one-token runs measured), and half of it served every
    # measured family best (docs/POLICIES.md, "Measured: does saem lead?"). With the step clock it
    # prices a switch's copies, and under the barrier a copy's DMA slow-down
    copy_price: float = 0.5
    # "auto": split the slot budget over the layers, from uniform to whole layers resident as
    # n-cpu-moe, as the policy replays its calibration routing fastest where the context can
    # replay it, else as layout.py prices it; "uniform": the budget's slots in every layer;
    # "resident-N": auto's candidate with N whole layers resident (at most what the budget
    # holds), to measure auto's choice against the others (bench/bench_layout.py)
    layout: str = "auto"
    # the candidate the real cache follows at start; None: under the copy barrier the one that
    # led the most steps when the policy replayed its calibration routing under the chosen layout
    # (slots_for), else DEFAULT_START_LEADER when it is a candidate, else the stage rule
    start_leader: str | None = None
    # steps scored before the leader may change: the first steps' scores are means of a few
    # noisy steps, and a cache's copies are charged when made, before the hits they buy (under
    # the barrier, with the replay's prior, steps of the run itself: the prior does not count)
    first_switch: int = 8
    # with the step clock off, copies are priced by how busy the candidate keeps the link
    # (copy_charge): the mean price of its copies rises from copy_cost to the busy-link price by
    # this share of its load; 0: one price per copy whatever the load
    load_slope: float = 0.5
    # the stage candidate pays for its re-ranks as a cache pays for its loads: the copies a
    # placement of its set would make, priced like any copy at the next step (copy_charge). Free
    # re-ranks made the stage rule look best in the steps after each request's placement, on the
    # prompt's routing, and the cache followed it with a burst of copies (fitted device costs,
    # ECR 50 %: a second request at 174.5 tok/s against static-hot's 233.5; charged, 233.5)
    charge_placements: bool = True
    # under the copy barrier with the step clock off, a step's copies are priced on the
    # candidate's own link clock in copy times: the idle price for one that finds the link free,
    # the busy-link price for one queued behind another, the whole transfer for the time the clock
    # runs past the step (the next decode waits for it); off: by the averaged link load
    # (copy_charge). The step clock prices the same three things in seconds, as the simulator
    # does (below)
    barrier_stalls: bool = True
    # where the calibration replay chose the layout: each candidate's score starts at its mean
    # net gain per step in that replay, worth this many steps (0: none), instead of 0 and plain
    # means of the first noisy steps, whose swings switched the real cache away from what the
    # calibration routing showed (under the copy barrier each switch a burst of copies the next
    # decode waits for; without it, switches away from the rule that then led the whole run and
    # back); worth a quarter horizon it led more cells than worth one (docs/POLICIES.md, "A prior
    # from the calibration replay")
    prior_steps: float = 16.0
    # under the copy barrier, a switch to a cache leader (lfu, lrfu-*) prices each expert the real
    # cache lacks at this many copies on an idle link (copy_cost_in_hits), not at its whole
    # transfer as a fixed set's burst is: the cache's entrants come in as steps use them, as its
    # own loads do, and each step's time carries them. At the whole transfer a switch from the
    # calibrated set to a cache ahead of it by 16 hits a step never paid at ECR 50 % (1,340
    # experts apart at the end: drawn-1-9, batch 8, held the calibrated set for all 1,083 steps,
    # 0.959x lfu-cpu); 0: the whole transfer, as before (docs/POLICIES.md, "A switch to a cache
    # under the barrier")
    cache_switch_price: float = 1.0
    # under the copy barrier, a switch counts on the part of a challenger's score lead that past
    # leads of the pair kept: per pair of candidates, a line fitted to how the mean net-gain lead
    # over the horizon after each past step followed the score lead at it (observations weighted
    # exp(-age / lead_memory_steps)) forecasts the lead a switch buys (lead_forecast); 0: the
    # score lead as it stands. Why: on the device family (ECR 50 %, batch 1) lfu's score led
    # static's for stretches it did not keep, and the cache switched between them 25 times in
    # 2,999 steps (0.977x static-hot; docs/POLICIES.md, "A lead forecast for a switch")
    lead_memory_steps: float = 1024.0
    # the fitted line starts as the score lead itself (slope 1, intercept 0), worth this many steps
    lead_prior_steps: float = 512.0
    # each candidate's copies are priced on its own step clock, as the simulator prices the real
    # cache's: the seconds they slow the CPU experts that run while its link is busy, and under
    # the copy barrier the seconds its link runs past the step, which the next decode waits for;
    # off: copy_charge's price per copy by the averaged link load, or under the barrier the link
    # clock in copy times (barrier_stalls). On, every set's geometric mean saem / best other rose
    # by 0.03-0.14 % without the barrier; under it five of six sets' rose by 0.01-0.05 % (the
    # copy-time clock charged a queued copy its whole transfer's slow-down where few CPU experts
    # ran: drawn-2-14, ECR 50 %, batch 1, 0.988x -> 0.998x temporal-cpu) and the device family's
    # fell by 0.11 % (docs/POLICIES.md, "Copies priced on a step clock", "... under the barrier")
    step_clock: bool = True
    # at a batch above 1, a layout with more whole resident layers is chosen only where its
    # calibration replay runs more than this share faster than every layout with fewer (the
    # fewest within the margin of the fastest). Why: split to the batch (simulator.split_to_batch)
    # and cross-fitted, bench_policies' 4 calibration sequences replay as two folds of 57-127
    # steps, mostly the caches' first steps, which undervalue a cache's slots; given 8 and 16
    # sequences the same replay chose 6 and 2 whole layers where 4 chose 10 (drawn-3-19, ECR 25 %,
    # batch 8). At batch 1 the folds replay the sequences whole and the margin lost (0 -> 0.002:
    # the batch-1 cells of the seed-1 and seed-3 draws 0.02 % slower, down to -0.6 %;
    # docs/POLICIES.md, "A margin for whole layers at a batch")
    layout_margin: float = 0.002
    # ... and at least this many steps over the decode steps the replay ran (its folds' summed:
    # 1.2 / 164 = 0.73 % for drawn-4-2's), so the margin widens as the replay shortens; at batch 1
    # this alone, without layout_margin (a short replay undervalues a cache's slots at any batch:
    # drawn-6-10, ECR 25 %, batch 1, replayed 315 steps and chose 10 whole layers where the run is
    # fastest on 6, 0.9932x lfu-cpu; with the margin 6, 1.0014x). Why: the
    # caches' first steps, before they hold what the routing uses, cost about a fixed time, which
    # a replay of few steps weighs as a large share where the run, longer, spreads it thin; whole
    # resident layers pay no such cost. Fitted on the seed-4 draw (docs/POLICIES.md). A fixed wider
    # margin (0.005) lifted the short replays' worst cells but put the long ones further below
    # n-cpu-moe (drawn-2-15, ECR 12.5 %, and Mixtral's fastdrift-nocue, 763-912 replayed steps,
    # where whole layers do win); this one leaves a replay of 600 or more steps at layout_margin
    # (docs/POLICIES.md, "A margin that widens as the replay shortens")
    layout_warmup_steps: float = 1.2

    def __post_init__(self) -> None:
        # knobs come from JSON (bench --saem) and Python callers as any number type: each is held
        # as its default's type, so a policy copied from them (_replayed_layout) is the same one
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(f.default, bool):
                setattr(self, f.name, bool(v))
            elif isinstance(f.default, (int, float)):
                setattr(self, f.name, type(f.default)(v))
        if self.copy_cost is not None:
            self.copy_cost = float(self.copy_cost)
        self.candidates = tuple(self.candidates)
        # a zero horizon divides by zero; a memory under one step keeps nothing (the forecast off,
        # silently, where 0 is the way to say so); the rest are prices, margins and counts
        if not self.horizon_steps > 0:
            raise ValueError(f"horizon_steps must be above 0, not {self.horizon_steps}")
        if not (self.lead_memory_steps == 0 or self.lead_memory_steps >= 1):
            raise ValueError(f"lead_memory_steps must be 0 (no forecast) or at least 1 step, "
                             f"not {self.lead_memory_steps}")
        for name in ("switch_margin", "prior_tokens", "copy_price", "first_switch", "load_slope", "prior_steps",
                     "cache_switch_price", "lead_prior_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be 0 or more, not {getattr(self, name)}")
        if not 0 <= self.layout_margin < 1:
            raise ValueError(f"layout_margin must be at least 0 and below 1, not {self.layout_margin}")
        if not self.layout_warmup_steps >= 0:
            raise ValueError(f"layout_warmup_steps must be 0 or more, not {self.layout_warmup_steps}")
        if self.copy_cost is not None and not self.copy_cost >= 0:
            raise ValueError(f"copy_cost must be 0 or more (or None: from the cost model), not {self.copy_cost}")


# AdaptiveSaemPolicy's own keywords: every AdaptiveConfig field but the stage rule's config
ADAPTIVE_KNOBS = frozenset(f.name for f in fields(AdaptiveConfig)) - {"stage"}


@njit(cache=True)
def _set_diff(c_slot, slot_of, c):
    """Experts candidate ``c`` holds that the real cache does not (copies a switch costs)."""
    L, E = slot_of.shape
    n = 0
    for l in range(L):
        for e in range(E):
            if c_slot[l, e, c] >= 0 and slot_of[l, e] < 0:
                n += 1
    return n


@njit(cache=True)
def warm_step_lines(rows, n_slots, c_slot, c_key, stamp):
    """Load the books ``decide_adaptive`` reads for each expert the step ``rows`` int16 [B, L, K]
    (-1: no token) used in a cached layer (``n_slots`` int32 [L] > 0): its entries of ``c_slot``
    int32 [L, E, C] and ``c_key`` float64 [L, E, C] (the first and the last candidate's: one
    expert's entries may straddle two cache lines) and of ``stamp`` int64 [L, E]. Returns a
    count made of them (slots and stamps summed, positive keys counted); it means nothing.

    Why: after a decode these lines are cache misses, and in the step's loops each one's value
    decides a branch (held or missed, above the floor or not), so the misses come one after
    another. Loaded here first, with nothing waiting on them, they overlap: in the live engine
    the uniform layout's step took about 20 us less (docs/POLICIES_HISTORY.md, per-token cost)."""
    B, L, K = rows.shape
    C = c_key.shape[2]
    n = 0
    for l in range(L):
        if n_slots[l] == 0:  # the step reads no shadow books there
            continue
        for b in range(B):
            for k in range(K):
                e = rows[b, l, k]
                if e >= 0:
                    n += c_slot[l, e, 0] + c_slot[l, e, C - 1] + stamp[l, e] + (c_key[l, e, 0] > 0.0) \
                        + (c_key[l, e, C - 1] > 0.0)
    return n


@njit(cache=True)
def decide_adaptive(rows, g, slot_of, owner, n_slots, cand, c_slot, c_owner, c_key, c_floor, stamp, score, led, ctl,
                    behind, budget, gain_of, scratch, ops, lead_books, cost):
    """One decode step: pick the leader, update every candidate's shadow cache with the step's
    routing layer by layer, and bring each real layer to the leader's set after the layer ran.
    Returns how many ``ops`` rows it wrote.

    rows int16 [B, L, K]: the step's routing (-1 rows: no token); g: global step;
    slot_of/owner/n_slots: the real CacheState, updated in place; cand float64 [C, N_CAND]:
    each candidate's CAND_* parameters (CAND_RATE: its copies per step, averaged with weight
    1 / horizon from 0, updated here; CAND_PLACED: copies its re-ranks made since the last step,
    charged and cleared here; CAND_NET_SUM: its net gains summed, updated here); c_slot int32
    [L, E, C] / c_owner int32 [C, L, Smax]: each candidate's expert->slot and slot->expert maps;
    c_key float64 [L, E, C]: their priority keys (caching.py; an expert's entries of all
    candidates share a cache line, as a step reads them together: after a decode each line is a
    cache miss); c_floor float64 [C, L]:
    for a cache candidate, a lower bound of its layer's resident keys (-inf: none known; see
    below); stamp int64 [L, E]: last step each expert was used; score float64 [C]: averaged net
    gain per step, in one-token hits; led float64 [C]: steps each candidate led; ctl: CTL_*;
    behind uint8 [L]: 1 where the real layer may differ from the leader's (a switch, the
    leader's own loads, a stage re-rank, copies the budget deferred, a cache leader's entrants
    not used yet: only those layers are compared); budget: copies the link budget allows this
    step for a fixed set's entrants (a cache leader's loads are not held to it; shadow caches
    copy nothing); gain_of float64 [3 R], R >= B + 1 (``clock_tables``): what a held expert
    used by c tokens of the step earns (``hit_gains``) at ``c``, its CPU and GPU seconds (the step
    clock's) at ``R + c`` and ``2 R + c``; scratch int32:
    ``state.scratch_buffer``; ops int32 [>= 2 L E, 4]:
    (layer, expert, slot, OP_*) rows in issue order, per layer each entrant (best first) after
    the eviction that frees its slot (OP_AFTER_USE for one the step used,
    OP_PREFETCH otherwise); lead_books float64: the lead forecast's books (``record_leads``,
    kept here when CTL_LEAD_KEEP is set); cost float64: CostModel.array (the step clock's
    costs)."""
    cnt, uniq, miss, entrants, admitted = scratch_views(scratch)
    L = slot_of.shape[0]
    C = cand.shape[0]
    if active_rows(rows) == 0:
        return 0
    # the lines the step's loops read, loaded first so that their misses overlap
    ctl[CTL_WARMED] = warm_step_lines(rows, n_slots, c_slot, c_key, stamp)
    kappa = ctl[CTL_COPY_COST]
    # follow a better candidate when its lead pays for the copies of the switch: the lead as it
    # stands, or under the barrier the part of it that past leads of the pair kept
    lead = int(ctl[CTL_LEADER])
    best = lead
    if ctl[CTL_LEAD_KEEP] > 0:
        H = lead_window(ctl[CTL_HORIZON])
        record_leads(lead_books, score, cand, H, ctl[CTL_LEAD_KEEP])
        top = -np.inf
        for c in range(C):
            if c != lead:
                f = lead_forecast(lead_books, C, H, c, lead, score[c] - score[lead], ctl[CTL_LEAD_PRIOR])
                if f > top:
                    best = c
                    top = f
        gain = top * ctl[CTL_HORIZON]
    else:
        for c in range(C):
            if score[c] > score[best]:
                best = c
        gain = (score[best] - score[lead]) * ctl[CTL_HORIZON]
    sw = ctl[CTL_SWITCH_COST]
    if ctl[CTL_CACHE_SWITCH_COST] > 0 and int(cand[best, CAND_KIND]) != KIND_FIXED:
        sw = ctl[CTL_CACHE_SWITCH_COST]  # its entrants come as its loads do, when used: no burst
    if best != lead and ctl[CTL_SCORED] >= ctl[CTL_FIRST_SWITCH] and gain > sw \
            and gain > sw * _set_diff(c_slot, slot_of, best):
        lead = best
        ctl[CTL_LEADER] = best
        ctl[CTL_SWITCHES] += 1
        behind[:] = 1
    led[lead] += 1
    scale = np.ones(C, np.float64)  # KIND_DECAY: exp(lam * (g - ref)) at this step
    for c in range(C):
        if int(cand[c, CAND_KIND]) == KIND_DECAY:
            scale[c] = np.exp(cand[c, CAND_LAM] * (g - cand[c, CAND_REF]))
            if scale[c] > RESCALE_AT:
                for l in range(L):
                    c_floor[c, l] /= scale[c]
                    for e in range(c_key.shape[1]):
                        c_key[l, e, c] /= scale[c]
                cand[c, CAND_REF] = g
                scale[c] = 1.0
    net = np.zeros(C, np.float64)  # this step's gains minus priced copies, per candidate
    made = np.zeros(C, np.float64)  # copies each candidate made this step
    # under the barrier with the step clock off, each candidate's link clock (in copy times from
    # the step's start) and the DMA price of its copies so far: a stage re-rank's placement
    # (CAND_PLACED, made between steps) is queued at the start; on its step clock, the seconds
    # its copies slowed the step by (and under the barrier, stalled the next)
    hidden = ctl[CTL_HIDDEN_COPIES]
    queued = ctl[CTL_QUEUED_COST]
    link = np.zeros(C, np.float64)
    dma = np.zeros(C, np.float64)
    clock = ctl[CTL_CLOCK] > 0
    stalls = ctl[CTL_CLOCK] > 1
    R = gain_of.shape[0] // 3
    now = np.zeros(C, np.float64)
    for c in range(C):
        if stalls:  # a placement's copies are issued between steps: the next decode waits for them
            dma[c] = cand[c, CAND_PLACED] * t_xfer(cost)
        elif clock:
            link[c] = cand[c, CAND_BACKLOG] + cand[c, CAND_PLACED] * t_xfer(cost)
    if hidden > 0:
        for c in range(C):
            link[c] = cand[c, CAND_PLACED]
            dma[c] = cand[c, CAND_PLACED] * queued
    n_ops = 0
    for l in range(L):
        if n_slots[l] == 0:  # no cache here, in any candidate: nothing to score, keep or follow
            if clock:  # but its CPU experts run slower while a candidate's copies are in flight
                n = gather(rows, l, cnt, uniq)
                work = 0.0
                for i in range(n):
                    work += gain_of[R + cnt[uniq[i]]]
                    cnt[uniq[i]] = 0
                for c in range(C):
                    dma[c] += _clock_layer(now, link, c, 0.0, work, 1, 0, cost)
            continue
        n = gather(rows, l, cnt, uniq)
        for c in range(C):
            n_miss = 0
            gpu_s = 0.0
            cpu_s = 0.0
            for i in range(n):
                e = uniq[i]
                if c_slot[l, e, c] >= 0:
                    net[c] += gain_of[cnt[e]]
                    if clock:
                        gpu_s += gain_of[2 * R + cnt[e]]
                else:
                    miss[n_miss] = e
                    n_miss += 1
                    if clock:
                        cpu_s += gain_of[R + cnt[e]]
            if n_miss == 0:
                net[c] += ctl[CTL_SYNC_GAIN]
            kind = int(cand[c, CAND_KIND])
            if kind == KIND_FIXED:
                if clock:
                    dma[c] += _clock_layer(now, link, c, gpu_s, cpu_s, n_miss, 0, cost)
                continue
            key = c_key[:, :, c]
            for i in range(n):
                e = uniq[i]
                if kind == KIND_DECAY:
                    key[l, e] += cnt[e] * scale[c]
                else:
                    _touch(kind, key, l, e, cnt[e], g, 0.0)
            for i in range(n):
                stamp[l, uniq[i]] = g
            # The floor (caching.resident_floor; a decay key's floor is rescaled with it): a miss
            # whose key is not above it beats no resident, and its slot search is skipped (the
            # same decisions, most steps' work at a full cache). The check stays here, not in
            # admit_after_use: calling it for every layer and candidate cost more than the
            # search it skips.
            top = -np.inf
            for i in range(n_miss):
                top = max(top, key[l, miss[i]])
            n_in = 0
            if n_miss > 0 and top > c_floor[c, l]:
                n_in = admit_after_use(key, l, g, c_owner[c], c_slot[:, :, c], n_slots, stamp, miss, n_miss, admitted)
                c_floor[c, l] = resident_floor(key, l, c_owner[c], n_slots)
            made[c] += n_in
            if clock:
                dma[c] += _clock_layer(now, link, c, gpu_s, cpu_s, n_miss, n_in, cost)
            if hidden > 0 and n_in > 0:
                # issued after this layer: the first finds the link idle unless earlier copies
                # still run; each after it queues behind another
                start = (l + 1) * hidden / L
                if link[c] <= start:
                    dma[c] += kappa + (n_in - 1) * queued
                    link[c] = start + n_in
                else:
                    dma[c] += n_in * queued
                    link[c] += n_in
            if n_in > 0 and c == lead:
                behind[l] = 1
        for i in range(n):
            stamp[l, uniq[i]] = g
        if behind[l] == 0:
            for i in range(n):
                cnt[uniq[i]] = 0
            continue
        # the real layer moves to the leader's set: the entrants best first by the leader's
        # priority (a cache leader's own load order, the ranking's order for a fixed set), each
        # into a free slot or the slot of the leaver the leader values least. A cache leader's
        # entrants come in when a step uses one (as the cache loads its own misses): copying its
        # whole set at a switch would slow the CPU experts for experts that may never be used
        # before the cache drops them. A fixed set (a stage placement, the calibrated one) is
        # copied at once, as SAEM places a stage, as far as the link budget allows; the rest wait
        # for a later step (the layer stays behind). A cache leader's loads are not held to the
        # budget, as the -cpu caches' own are not: a load deferred under fast drift missed the
        # uses that came while it waited (up to 0.4 % slower than temporal-cpu; docs/POLICIES.md)
        n_new = 0
        waiting = 0
        lazy = int(cand[lead, CAND_KIND]) != KIND_FIXED
        for cs in range(n_slots[l]):
            e = c_owner[lead, l, cs]
            if e < 0 or slot_of[l, e] >= 0:
                continue
            if lazy and cnt[e] == 0:
                waiting += 1
                continue
            j = n_new
            while j > 0 and c_key[l, entrants[j - 1], lead] < c_key[l, e, lead]:
                entrants[j] = entrants[j - 1]
                j -= 1
            entrants[j] = e
            n_new += 1
        if lazy:
            take = n_new
        else:
            take = min(n_new, budget)
            budget -= take
        behind[l] = 1 if take < n_new or waiting > 0 else 0
        for i in range(take):
            e = entrants[i]
            free = -1
            for sl in range(n_slots[l]):
                o = owner[l, sl]
                if o < 0:
                    free = sl
                    break
                if c_slot[l, o, lead] < 0 and (free < 0 or c_key[l, o, lead] < c_key[l, owner[l, free], lead]):
                    free = sl
            o = owner[l, free]
            if o >= 0:
                slot_of[l, o] = -1
                owner[l, free] = -1
                n_ops = put_op(ops, n_ops, l, o, free, OP_EVICT)
            owner[l, free] = e
            slot_of[l, e] = free
            # used at this step: a load after its CPU run; else a prefetch (stage boundary or switch)
            n_ops = put_op(ops, n_ops, l, e, free, OP_AFTER_USE if cnt[e] > 0 else OP_PREFETCH)
        for i in range(n):
            cnt[uniq[i]] = 0
    ctl[CTL_SCORED] += 1
    alpha = ctl[CTL_ALPHA]
    w = max(alpha, 1.0 / ctl[CTL_SCORED]) if ctl[CTL_WARM] > 0 else alpha
    for c in range(C):
        made[c] += cand[c, CAND_PLACED]
        cand[c, CAND_PLACED] = 0.0
        cand[c, CAND_RATE] += alpha * (made[c] - cand[c, CAND_RATE])
        if hidden > 0:  # the barrier's copy-time clock: its run past the step holds up the next one, whole
            # (what a copy in it was charged for slowing CPU experts is taken back: none run then)
            net[c] -= dma[c] + max(link[c] - hidden, 0.0) * (ctl[CTL_COPY_COST_FULL] - queued)
        elif clock:  # the seconds its copies slowed the step by, over what one hit saves
            now[c] += cost[C_STEP_S]
            if stalls:  # the barrier: the next decode waits for the link, whole
                dma[c] += max(link[c] - now[c], 0.0)
            else:
                cand[c, CAND_BACKLOG] = max(link[c] - now[c], 0.0)
            net[c] -= dma[c] / (gain_of[R + 1] - gain_of[2 * R + 1])
        else:
            net[c] -= made[c] * copy_charge(kappa, ctl[CTL_COPY_COST_FULL], cand[c, CAND_RATE] * ctl[CTL_LINK_SHARE],
                                            ctl[CTL_LOAD_SLOPE])
        score[c] += w * (net[c] - score[c])
        cand[c, CAND_NET_SUM] += net[c]
    return n_ops


@njit(cache=True)
def _clock_layer(now, link, c, gpu_s, cpu_s, n_cpu, n_in, cost):
    """Candidate ``c``'s step clock through one layer that starts at ``now[c]``: its dense part,
    then GPU experts ``gpu_s`` seconds and ``n_cpu`` CPU runs of ``cpu_s`` seconds, slowed while
    its link is busy (until ``link[c]``), ended as the simulator ends a layer (``layer_end``);
    then ``n_in`` copies issued at the layer's end. Advances ``now[c]`` and ``link[c]``; returns
    the seconds the link added to the layer (its end less its end on an idle link)."""
    t = now[c] + cost[C_DENSE_LAYER_S]
    idle = layer_end(t, t + gpu_s, cpu_s, n_cpu, cost, -np.inf)
    # a link free when the layer starts slows none of it (most layers: the copies come in bursts)
    end = idle if link[c] <= t else layer_end(t, t + gpu_s, cpu_s, n_cpu, cost, link[c])
    now[c] = end
    if n_in > 0:
        link[c] = max(end, link[c]) + n_in * t_xfer(cost)
    return end - idle


@njit(cache=True)
def lead_window(horizon):
    """Steps a lead is followed over to see how much of it lasted: the horizon, whole."""
    return max(int(horizon + 0.5), 1)


@njit(cache=True)
def lead_sums_at(C, H):
    """Where the pairs' sums start in ``record_leads``' books (after the count and the two rings)."""
    return 1 + 2 * H * C


@njit(cache=True)
def record_leads(books, score, cand, H, keep):
    """Keep the lead forecast's books at the start of a scored step, before the leader is chosen.

    books float64 [1 + 2 H C + 5 C C] (``lead_books_size``): [0] steps recorded; then a ring of
    the last H steps' score vectors [H, C]; a ring of their net-gain sums (CAND_NET_SUM) [H, C];
    then five [C, C] matrices of sums over past steps, each observation weighted ``keep`` per step
    since: weights, x, y, x * x and x * y, where for the ordered pair (i, j) x is the score lead
    of i over j at a step and y the mean lead of their net gains over the H steps after it.
    score float64 [C]: the scores as this step finds them; cand float64 [C, N_CAND]: read for
    CAND_NET_SUM, each candidate's net gains summed to the step before; H: lead_window(horizon);
    keep: 1 - 1 / lead_memory_steps.
    The observation of the step H steps back is complete now: it is added, the older ones decay."""
    C = score.shape[0]
    n = int(books[0])
    at = n % H
    rs = 1 + at * C  # the ring's entry of the step H back (its slot is reused for this step)
    rn = 1 + H * C + at * C
    st = lead_sums_at(C, H)
    CC = C * C
    if n >= H:
        for k in range(5 * CC):
            books[st + k] *= keep
        for i in range(C):
            for j in range(C):
                if i == j:
                    continue
                x = books[rs + i] - books[rs + j]
                y = ((cand[i, CAND_NET_SUM] - books[rn + i]) - (cand[j, CAND_NET_SUM] - books[rn + j])) / H
                q = st + i * C + j
                books[q] += 1.0
                books[q + CC] += x
                books[q + 2 * CC] += y
                books[q + 3 * CC] += x * x
                books[q + 4 * CC] += x * y
    for i in range(C):
        books[rs + i] = score[i]
        books[rn + i] = cand[i, CAND_NET_SUM]
    books[0] = n + 1


def lead_books_size(n_candidates: int, horizon: float) -> int:
    """Length of ``record_leads``' books."""
    return lead_sums_at(n_candidates, lead_window(horizon)) + 5 * n_candidates * n_candidates


@njit(cache=True)
def lead_forecast(books, C, H, i, j, x, prior):
    """The mean net-gain lead of candidate i over j in the next H steps, forecast from their
    score lead ``x`` now: a weighted least-squares line through the pair's past observations
    (``record_leads``' books), its slope shrunk towards 1 and its intercept towards 0 as if
    ``prior`` steps had said so, the slope kept within [0, 1], and the value at most the larger
    of ``x`` and the pair's mean lead (shrunk alike); ``x`` itself before the first observation.
    A lead that past leads of the pair kept (slope 1) counts whole; one that past leads did not
    keep (noise in the scores: slope 0) counts for the pair's mean lead only. Why the bound: the
    line may discount a lead, or credit the pair's record, but not extrapolate one. A cache that
    starts far behind and closes the gap as it warms leaves a line steeper than 1 (its realized
    leads ran 180 hits a step above its score leads, and more the further behind it was); at a
    score lead of -386 the line forecast +4, and under the barrier the cache followed ``lru`` for
    the last 930 of 1,322 steps at 0.960x temporal-cpu (drawn-1-2, ECR 50 %, batch 8;
    docs/POLICIES.md, "No lead the line extrapolates")."""
    st = lead_sums_at(C, H)
    CC = C * C
    q = st + i * C + j
    w = books[q]
    if w <= 0:
        return x
    mx = books[q + CC] / w
    my = books[q + 2 * CC] / w
    vxx = books[q + 3 * CC] / w - mx * mx
    cxy = books[q + 4 * CC] / w - mx * my
    slope = cxy / vxx if vxx > 1e-12 else 1.0
    intercept = my - slope * mx
    slope = (w * slope + prior) / (w + prior)
    intercept = w * intercept / (w + prior)
    return min(min(max(slope, 0.0), 1.0) * x + intercept, max(x, w * my / (w + prior)))


@njit(cache=True)
def copy_charge(idle, full, load, slope):
    """What one copy costs, in hits, for a candidate whose copies keep the link busy ``load`` of
    a step (its copy rate times ``t_xfer`` over the step's time; capped at 1). On an idle link a
    copy issued after a layer overlaps the next dense part and costs ``idle``; on a busy one it
    waits in the queue and its whole transfer overlaps CPU experts (``full``). The cost of the
    marginal copy grows linearly with the load between the two; a candidate's copies are
    charged ``idle + (full - idle) * load * slope``, their mean at ``slope`` 0.5 (the default;
    0: one price whatever the load). Why: one price per copy made the
    churning rules look cheap. Between temporal-cpu's half-lives the simulated price of an extra
    copy rose from 0.42 hits (15 -> 37 copies a token) to 0.89 (37 -> 144), against 0.21 charged
    (fastdrift-skewed, ECR 12.5 %, batch 1; docs/POLICIES.md). Under the copy barrier
    decide_adaptive charges a step's copies by what that step carries instead (CTL_HIDDEN_COPIES)."""
    return idle + (full - idle) * min(load, 1.0) * slope


@njit(cache=True)
def adaptive_step(rows, g, slot_of, owner, n_slots, cand, c_slot, c_owner, c_key, c_floor, stamp, score, led, ctl,
                  behind, budget, gain_of, scratch, ops, counts, on, det, ring, pos, lead_books, cost):
    """One decode step of the adaptive policy in one kernel call: ``decide_adaptive`` (its
    arguments, same order, but ``lead_books`` and ``cost`` last), then the stage candidate's books,
    ``saem.stage_books(rows, slot_of, counts, on, det, ring, pos)`` (its arguments after ``ops``).
    Returns (ops rows written, decoded, fired). One call, not two: after a decode each kernel call
    costs a few us before its arguments, about 0.8 us for each array (docs/POLICIES_HISTORY.md,
    per-token cost)."""
    n = decide_adaptive(rows, g, slot_of, owner, n_slots, cand, c_slot, c_owner, c_key, c_floor, stamp, score, led,
                        ctl, behind, budget, gain_of, scratch, ops, lead_books, cost)
    decoded, fired = stage_books(rows, slot_of, counts, on, det, ring, pos)
    return n, decoded, fired


# The books of ``adaptive_step`` (kernel_books): its array arguments, in its order, reached
# through one table (after a decode each array argument costs about 0.6 us; docs/POLICIES.md)
ADAPTIVE_BOOKS = (
    Book("slot_of", np.int32, 2), Book("owner", np.int32, 2), Book("n_slots", np.int32, 1),
    Book("cand", np.float64, 2), Book("c_slot", np.int32, 3), Book("c_owner", np.int32, 3),
    Book("c_key", np.float64, 3), Book("c_floor", np.float64, 2), Book("stamp", np.int64, 2),
    Book("score", np.float64, 1), Book("led", np.float64, 1), Book("ctl", np.float64, 1),
    Book("behind", np.uint8, 1), Book("gain_of", np.float64, 1), Book("scratch", np.int32, 1),
    Book("ops", np.int32, 2), Book("counts", np.float64, 2), Book("det", np.float64, 1),
    Book("ring", np.float64, 3), Book("lead_books", np.float64, 1), Book("cost", np.float64, 1),
)


@njit(cache=True)
def adaptive_entry(rows, g, budget, on, pos, tab):
    """``adaptive_step`` with its books from ``tab`` (``ADAPTIVE_BOOKS``' table): the step's
    routing ``rows``, global step ``g``, copy ``budget``, built-in detector ``on`` and its ring
    position ``pos`` are the only arguments that change per step."""
    return adaptive_step(rows, g, i32_2d(tab, 0), i32_2d(tab, 1), i32_1d(tab, 2), f64_2d(tab, 3), i32_3d(tab, 4),
                         i32_3d(tab, 5), f64_3d(tab, 6), f64_2d(tab, 7), i64_2d(tab, 8), f64_1d(tab, 9),
                         f64_1d(tab, 10), f64_1d(tab, 11), u8_1d(tab, 12), budget, f64_1d(tab, 13), i32_1d(tab, 14),
                         i32_2d(tab, 15), f64_2d(tab, 16), on, f64_1d(tab, 17), f64_3d(tab, 18), pos,
                         f64_1d(tab, 19), f64_1d(tab, 20))


def hit_gains(cost: np.ndarray, batch: int) -> tuple[np.ndarray, float]:
    """(gain_of float64 [batch + 1], sync gain): what a candidate earns, in one-token hits, for a
    resident expert used by c tokens of a step, and for a layer step whose used experts are all
    resident: the cost model's saving, ``t_cpu(c) - t_gpu(c)`` (an expert's CPU run reads its
    weights once however many tokens use it) and the CPU round trip (``C_SYNC``) that a layer
    without CPU work skips, over what a one-token hit saves. So a candidate's score is the expert
    time it would have saved, as the simulator prices it."""
    c = np.arange(batch + 1, dtype=np.float64)
    one = t_cpu(1, cost) - t_gpu(1, cost)
    if one <= 0:
        return c, 0.0
    gain = np.array([0.0, *((t_cpu(int(n), cost) - t_gpu(int(n), cost)) / one for n in c[1:])])
    return gain, float(cost[C_SYNC] / one)


def clock_tables(cost: np.ndarray, batch: int) -> tuple[np.ndarray, float]:
    """``hit_gains``' (gain_of, sync gain) with the step clock's expert times after the gains:
    gain_of float64 [3 (batch + 1)]: the gains, then t_cpu(c), then t_gpu(c) (seconds)."""
    gain, sync = hit_gains(cost, batch)
    c = range(batch + 1)
    return np.concatenate([gain, [t_cpu(n, cost) for n in c], [t_gpu(n, cost) for n in c]]), sync


def copy_cost_in_hits(cost: np.ndarray, busy_link: bool = False) -> float:
    """What one copy costs, in hits. Host-to-device DMA reads host memory, so CPU experts run
    ``f`` times slower while it lasts (C_DMA_SLOW). A copy issued after a layer first overlaps the
    next layer's dense part, when no CPU expert runs (unless CPU and GPU overlap): only the rest
    of its ``t_xfer`` slows CPU experts. That loss, over the time a hit saves against a one-token
    CPU run (``t_cpu(1) - t_gpu(1)``), is the copy's price. ``busy_link``: the copy waits in the
    queue while CPU experts run, so none of it hides behind a dense part (``copy_charge``'s
    busy-link price); with the copy barrier (C_BARRIER: the engine's native layer makes the next
    step wait for every copy queued before it) a queued copy holds up the next step for its whole
    transfer, so its busy-link price is ``t_xfer`` itself (the first device run's tokens/s are fitted
    better with that barrier than without: bench/device/fit_device_run.py)."""
    if busy_link and cost[C_BARRIER] > 0:
        saved = t_cpu(1, cost) - t_gpu(1, cost)
        return float(t_xfer(cost) / saved) if saved > 0 else 0.0
    hidden = 0.0 if busy_link or cost[C_OVERLAP] > 0 else float(cost[C_DENSE_LAYER_S])
    return dma_loss_in_hits(cost, max(0.0, t_xfer(cost) - hidden))


def dma_loss_in_hits(cost: np.ndarray, busy_s: float) -> float:
    """What ``busy_s`` seconds of host-to-device DMA cost CPU experts, in hits: they run ``f``
    times slower while it lasts (C_DMA_SLOW), ``busy_s * (1 - 1/f)``, over what one hit saves
    (``t_cpu(1) - t_gpu(1)``). The price of a copy's part that no dense part hides: after its
    first ``t_dense`` for one on an idle link (copy_cost_in_hits), all of ``t_xfer`` for one
    queued behind another (the barrier's link clock, CTL_QUEUED_COST)."""
    saved = t_cpu(1, cost) - t_gpu(1, cost)
    if saved <= 0:
        return 0.0
    f = max(float(cost[C_DMA_SLOW]), 1.0)
    return float(busy_s * (1.0 - 1.0 / f) / saved)


def mean_over_replays(replayed: list) -> np.ndarray | None:
    """Each candidate's net gain per step over every step the ``replayed`` policies (one per
    fold of a calibration replay) scored, or None where none scored a step."""
    steps = sum(p.scored_steps() for p in replayed)
    if steps <= 0:
        return None
    return sum(p.mean_scores() * p.scored_steps() for p in replayed if p.scored_steps() > 0) / steps


def resident_layers(layout: str) -> int | None:
    """The resident layers a ``layout`` option names ("resident-N" -> N; "auto" and "uniform"
    -> None); ValueError for anything else."""
    if layout in ("auto", "uniform"):
        return None
    head, _, n = layout.partition("-")
    if head == "resident" and n.isdigit():
        return int(n)
    raise ValueError(f"layout must be 'auto', 'uniform' or 'resident-N' (N whole layers resident), not {layout!r}")


def estimated_step_s(ctx: PolicyContext, n_slots: np.ndarray) -> float:
    """A decode step's expected time on the cost model with ``n_slots`` per layer holding the
    calibrated hot experts (layout.layer_time_table), plus the dense parts and the step's fixed
    part: the scale of a candidate's link load (``copy_charge``)."""
    cost = ctx.cost.array
    table = layer_time_table(expert_use_probability(ctx.calib, ctx.top_k), max(int(ctx.batch), 1), cost)
    L = table.shape[0]
    experts = float(table[np.arange(L), np.minimum(n_slots, table.shape[1] - 1)].sum())
    return max(experts + L * float(cost[C_DENSE_LAYER_S]) + float(cost[C_STEP_S]), 1e-12)


class AdaptiveSaemPolicy(SaemCuePolicy):
    name = "saem"
    summary = ("adaptive SAEM: the stage rule, cue profiles and the frequency/recency caches run in shadow; "
               "the cache follows whichever served best lately")
    default_config = SaemConfig()

    def __init__(self, config: SaemConfig | None = None, **knobs) -> None:
        """``knobs``: AdaptiveConfig's fields by name (its defaults where not given); any other
        keyword overrides a field of the stage rule's SaemConfig, as for SaemCuePolicy."""
        super().__init__(config, **{k: v for k, v in knobs.items() if k not in ADAPTIVE_KNOBS})
        self.adaptive = AdaptiveConfig(stage=self.cfg, **{k: v for k, v in knobs.items() if k in ADAPTIVE_KNOBS})
        # what a copy of this policy under another layout is built from (_replayed_layout)
        self._args = dict(config=config, **{k: v for k, v in knobs.items() if k != "layout"})
        # tokens/s of each whole-layer count replayed on the calibration routing, when the layout
        # was chosen so (read by reports and tests)
        self.layout_prices: dict[int, float] = {}
        # the margin those prices were read within (_replayed_layout)
        self.layout_margin_used = 0.0
        # the steps each candidate led in the replay of the chosen layout, its folds' summed
        # (start's leader)
        self.replay_led: dict[str, int] = {}
        # each candidate's mean net gain per step over that replay's steps (the scores' prior), when
        # there was one
        self.replay_score: np.ndarray | None = None
        self._resident = resident_layers(self.adaptive.layout)
        candidates, start_leader = self.adaptive.candidates, self.adaptive.start_leader
        if not candidates or candidates[0] != "stage":
            raise ValueError("the stage rule must be the first candidate (its shadow cache is candidate 0)")
        self.candidates = [(c, *candidate_kind(c)) for c in candidates]
        if start_leader is not None and start_leader not in candidates:
            raise ValueError(f"the leader at start ({start_leader!r}) must be a candidate")

    def slots_for(self, ctx: PolicyContext) -> np.ndarray:
        """The budget's bytes split over the layers: under ``auto``, as this policy ran fastest
        on the calibration routing where the context can replay it, else as the cost model
        prices the calibrated hot experts (layout.py)."""
        if self.adaptive.layout == "uniform":
            return ctx.n_slots
        resident = self._resident
        if self.replays_its_layout and ctx.replay_calibration is not None:
            resident = self._replayed_layout(ctx)
        slots, _, _ = choose_layout(ctx.calib, ctx.top_k, ctx.n_slots, ctx.batch, ctx.cost.array,
                                    resident=resident)
        return slots

    @property
    def replays_its_layout(self) -> bool:
        """Whether this policy chooses its slot layout by replaying the calibration sample where
        the context can (``layout="auto"``)."""
        return self._resident is None and self.adaptive.layout == "auto"

    def _replayed_layout(self, ctx: PolicyContext) -> int:
        """The count of whole resident layers (of layout.whole_layer_grid) under which this policy
        replays the calibration routing fastest; the fewest within a margin of the fastest:
        ``layout_warmup_steps`` over the replay's decode steps, and at a batch above 1 at least
        ``layout_margin`` (AdaptiveConfig).

        Why not the static estimate alone: it prices the calibrated hot experts as if they stayed
        hot, so it cannot tell routing a cache follows (whole layers waste the bytes) from routing
        it only chases (whole layers win); replaying the policy itself, its candidates, switches and
        copies at each layout, can (docs/POLICIES.md, "Is the chosen layout the best one?")."""
        whole_max = max_whole_layers(ctx.n_slots, ctx.n_expert)
        self.layout_prices = {}
        if whole_max == 0:  # no whole layer fits: the uniform layout is the only one
            return 0
        led, means = {}, {}
        for n in whole_layer_grid(whole_max):
            self.layout_prices[n], replayed = ctx.replay_calibration(
                lambda n=n: type(self)(**self._args, layout=f"resident-{n}"))
            led[n] = {c: sum(p.led_steps()[c] for p in replayed) for c in self.adaptive.candidates}
            means[n] = mean_over_replays(replayed)
        # the replay's decode steps, the same at every layout, so read off the last one's (a
        # replayed copy has no prior, so the steps it scored are the steps it decoded)
        steps = sum(p.scored_steps() for p in replayed)
        best = max(self.layout_prices.values())
        margin = self.adaptive.layout_warmup_steps / max(steps, 1.0)
        if ctx.batch > 1:
            margin = max(self.adaptive.layout_margin, margin)
        self.layout_margin_used = margin
        n = min(n for n, tok in self.layout_prices.items() if tok >= best * (1.0 - margin))
        self.replay_led = led[n]
        self.replay_score = means[n]
        return n

    def _start_leader(self, barrier: bool) -> str:
        """The candidate the real cache follows at start: the configured one; else, under the
        copy barrier, the one that led the most steps in the calibration replay of the chosen
        layout (the first candidate on a tie); else DEFAULT_START_LEADER (the stage rule when it
        is not a candidate). Why the barrier decides: a cache leader loads the first steps'
        misses before any score says whether it is the right rule. Without the barrier those
        loads hide behind the decode and a wrong cache start costs little, while starting on
        another rule where the cache was right costs the hits it would have loaded (the replay's
        choice measured 0.9880x temporal-cpu at drawn-1-19, ECR 50 %, batch 8, against 1.0002x
        from lrfu-16). Under the barrier the next decode waits for them: on the device-fitted
        costs the device bench's first request ran at 0.89x static-hot (ECR 50 %) starting on
        lrfu-16, at static-hot's tokens/s starting on the replay's choice (static)."""
        names = self.adaptive.candidates
        if self.adaptive.start_leader is not None:
            return self.adaptive.start_leader
        if barrier and self.replay_led:
            return max(names, key=lambda c: (self.replay_led.get(c, 0), -names.index(c)))
        return DEFAULT_START_LEADER if DEFAULT_START_LEADER in names else "stage"

    def start(self, ctx: PolicyContext) -> CacheState:
        state = super().start(ctx)
        C = len(self.candidates)
        self._cand = np.zeros((C, N_CAND))
        self._c_slot = np.repeat(state.slot_of[:, :, None], C, axis=2)
        self._c_owner = np.repeat(state.owner[None], C, axis=0)
        self._c_key = np.zeros(state.slot_of.shape + (C,))
        for c, (_, kind, lam) in enumerate(self.candidates):
            self._cand[c, CAND_KIND] = kind
            self._cand[c, CAND_LAM] = lam
            if kind != KIND_FIXED:  # KIND_DECAY starts from the prior as evidence at step 0, unscaled
                self._c_key[:, :, c] = initial_keys(KIND_LFU if kind == KIND_DECAY else kind, ctx.calib,
                                                    ctx.top_k, self.adaptive.prior_tokens, state.slot_of)
            else:  # a fixed set's key is the score it was ranked by: the real cache copies its best first
                self._c_key[:, :, c] = ctx.calib
        self._c_floor = np.full((C, ctx.n_layer), -np.inf)  # nothing known: the first miss searches
        self._stamp = np.full(state.slot_of.shape, -1, np.int64)
        self._score = np.zeros(C)
        self._led = np.zeros(C)
        self._ctl = np.zeros(N_CTL)
        # under the copy barrier (the engine's native layer) queued copies hold up the next decode
        barrier = ctx.cost.array[C_BARRIER] > 0 and self.adaptive.copy_cost is None
        # the leader at start, until the routing says otherwise
        self._ctl[CTL_LEADER] = self.adaptive.candidates.index(self._start_leader(barrier))
        self._ctl[CTL_FIRST_SWITCH] = self.adaptive.first_switch
        self._ctl[CTL_ALPHA] = 1.0 / self.adaptive.horizon_steps
        self._ctl[CTL_COPY_COST] = self.adaptive.copy_price * copy_cost_in_hits(ctx.cost.array) \
            if self.adaptive.copy_cost is None else self.adaptive.copy_cost
        self._ctl[CTL_HORIZON] = self.adaptive.horizon_steps
        # a switch's copies come in a burst, which the copy barrier makes the next steps wait for:
        # there each is priced at its whole transfer (on the device-fitted costs the idle price let
        # the cache switch 100-133 times in 4,285 steps and move 4.1-5.4x lfu-cpu's bytes for its hits)
        self._ctl[CTL_SWITCH_COST] = self.adaptive.switch_margin * (
            copy_cost_in_hits(ctx.cost.array, busy_link=True) if barrier else self._ctl[CTL_COPY_COST])
        # ... but a cache leader's entrants come one by one, when used, as its own loads do
        if barrier:
            self._ctl[CTL_CACHE_SWITCH_COST] = self.adaptive.switch_margin * self.adaptive.cache_switch_price * \
                copy_cost_in_hits(ctx.cost.array)
        # a fixed copy_cost is one price whatever the load
        self._ctl[CTL_COPY_COST_FULL] = copy_cost_in_hits(ctx.cost.array, busy_link=True) \
            if self.adaptive.copy_cost is None else self.adaptive.copy_cost
        self._ctl[CTL_LINK_SHARE] = t_xfer(ctx.cost.array) / estimated_step_s(ctx, state.n_slots)
        self._ctl[CTL_LOAD_SLOPE] = self.adaptive.load_slope
        # copies are priced on each candidate's step clock (a fixed copy_cost is one price per
        # copy, as it says); under the barrier the link's run past the step is a stall
        clock = self.adaptive.step_clock and self.adaptive.copy_cost is None and \
            t_cpu(1, ctx.cost.array) > t_gpu(1, ctx.cost.array)
        if clock:
            self._ctl[CTL_CLOCK] = 2.0 if barrier else 1.0
        elif barrier and self.adaptive.barrier_stalls:
            self._ctl[CTL_HIDDEN_COPIES] = 1.0 / self._ctl[CTL_LINK_SHARE]
            # a queued copy hides behind no dense part: its whole transfer slows CPU experts, at
            # copy_price as the idle price is (without the barrier, copy_charge's busy-link price)
            self._ctl[CTL_QUEUED_COST] = self.adaptive.copy_price * dma_loss_in_hits(ctx.cost.array,
                                                                                     t_xfer(ctx.cost.array))
        self._ctl[CTL_WARM] = 1.0 if self.adaptive.warm_start else 0.0
        if barrier and self.adaptive.lead_memory_steps > 0:
            self._ctl[CTL_LEAD_KEEP] = 1.0 - 1.0 / self.adaptive.lead_memory_steps  # >= 1: AdaptiveConfig
            self._ctl[CTL_LEAD_PRIOR] = self.adaptive.lead_prior_steps
        self._lead_books = np.zeros(lead_books_size(C, self.adaptive.horizon_steps))
        if self.adaptive.prior_steps > 0 and self.replay_score is not None:
            # the scores start as the calibration replay left them on average, as if that many
            # steps had been scored (the warm start averages the next ones in from there)
            self._score[:] = self.replay_score
            self._ctl[CTL_SCORED] = self.adaptive.prior_steps
            self._cand[:, CAND_NET_SUM] = self.replay_score * self.adaptive.prior_steps
            if barrier:
                # the leader at start is the replay's most-led, which the means may put a hair
                # behind another: the run's own first steps, not the prior, decide a switch away
                self._ctl[CTL_FIRST_SWITCH] += self.adaptive.prior_steps
        self._gain_of, self._ctl[CTL_SYNC_GAIN] = clock_tables(ctx.cost.array, max(int(ctx.batch), 1))
        self._gain_rows = len(self._gain_of) // 3  # a plain int: no NumPy attribute read per step
        cost = ctx.cost.array
        self._behind = np.ones(ctx.n_layer, np.uint8)
        E = ctx.n_expert
        self._scratch = scratch_buffer(E)
        self._ops = op_buffer(ctx.n_layer, E)
        self._copy_bytes = link_bytes_per_copy(ctx.cost.array)
        # the stage candidate's shadow cache, ranked like SAEM's cache at a boundary
        self._stage_shadow = CacheState(slot_of=self._c_slot[:, :, 0], owner=self._c_owner[0], n_slots=state.n_slots)
        self._books = KernelBooks(ADAPTIVE_BOOKS, {
            "slot_of": state.slot_of, "owner": state.owner, "n_slots": state.n_slots, "cand": self._cand,
            "c_slot": self._c_slot, "c_owner": self._c_owner, "c_key": self._c_key, "c_floor": self._c_floor,
            "stamp": self._stamp, "score": self._score, "led": self._led, "ctl": self._ctl, "behind": self._behind,
            "gain_of": self._gain_of, "scratch": self._scratch, "ops": self._ops, "counts": self._counts,
            "det": self._det, "ring": self._ring, "lead_books": self._lead_books,
            "cost": cost})
        self._tab = self._books.table
        self._bound_entry = adaptive_entry  # the kernel for bind_step's rows (SaemPolicy.start set them to None)
        return state

    def bind_step(self, routing_rows: np.ndarray) -> None:
        self._bound_entry = entry_point(adaptive_entry, routing_rows, self._step, 0, False, self._ring_pos, self._tab)
        self._bound_rows = routing_rows

    @property
    def uses_combined_events(self) -> bool:
        """The stage detector's cue + routing-shift events when it ran (a boundary costs the
        stage candidate nothing but a re-rank), else the cue events."""
        return True

    @property
    def uses_link_budget(self) -> bool:
        """The real cache's copies of a fixed set (following the stage rule or the calibrated
        placement) stay within the link budget; a cache leader's loads are made as it makes them."""
        return True

    @property
    def leader(self) -> str:
        return self.candidates[int(self._ctl[CTL_LEADER])][0]

    @property
    def switches(self) -> int:
        return int(self._ctl[CTL_SWITCHES])

    def mean_scores(self) -> np.ndarray | None:
        """Each candidate's net gain per step (in hits) averaged over every step scored (a prior
        from the replay counting as its ``prior_steps`` steps), or None before the first."""
        n = self._ctl[CTL_SCORED]
        return self._cand[:, CAND_NET_SUM] / n if n > 0 else None

    def scored_steps(self) -> float:
        """Steps scored so far (a prior counting as its ``prior_steps``)."""
        return float(self._ctl[CTL_SCORED])

    def led_steps(self) -> dict[str, int]:
        """Decode steps each candidate led so far."""
        return {name: int(n) for (name, _, _), n in zip(self.candidates, self._led)}

    def _place(self, scores: np.ndarray, reason: str) -> ResidencyChange | None:
        """A stage boundary re-ranks the stage candidate only; the real cache follows it at the
        next step's layers if it leads."""
        shadow = self._stage_shadow
        plan = plan_from_scores(shadow, scores, reason=reason)
        shadow.place(plan)
        if self.adaptive.charge_placements:
            self._cand[0, CAND_PLACED] += len(plan.copies)
        self._c_key[:, :, 0] = scores
        self._behind[plan.copies[:, 0]] = 1
        self._behind[plan.evictions[:, 0]] = 1
        self._placed(reason)
        return ResidencyChange(ops=self._ops[:0], n_in_step=0, target=self.state.slot_of, placements=1)

    def observe(self, routing_rows: np.ndarray, events: StepEvents,
                link_budget: float = math.inf) -> ResidencyChange | None:
        # copies the link can carry before the next step (math.inf: as many as the leader needs)
        copies = int(min(link_budget / self._copy_bytes, MAX_COPIES))
        if len(routing_rows) >= self._gain_rows:  # a larger batch than the context said
            self._gain_of, _ = clock_tables(self.ctx.cost.array, len(routing_rows))
            self._gain_rows = len(self._gain_of) // 3
            self._books.set("gain_of", self._gain_of)
        builtin = self._implicit and events.combined is None  # _builtin_detector, without the call
        # the entry point only for the bound rows: it would read any other array as their type
        kernel = self._bound_entry if routing_rows is self._bound_rows else adaptive_entry
        n, decoded, fired = kernel(routing_rows, self._step, copies, builtin, self._ring_pos, self._tab)
        reason = self._boundary_after_step(builtin, decoded, fired, events)
        placements = 0
        if reason:
            self._place(self._boundary_scores(events, reason), reason)
            placements = 1
        if n == 0 and placements == 0:
            return None
        return ResidencyChange(ops=self._ops[:n], n_in_step=n, target=self.state.slot_of, placements=placements)
