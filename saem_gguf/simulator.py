"""Trace-driven simulator: replays routing traces under each policy x ECR x batch size and
reports the cache metrics of the cache-aware router paper and an estimated decode throughput.

Replay model: sequences are served in batches of B that decode in lockstep (one step decodes
one token of every unfinished sequence of the batch; batches run one after another and the
cache carries over). Only decode tokens are replayed; a prompt's routing is known before
decoding (what SAEM ranks for a request's first placement). Stage events are causal: by
default the stage detector (saem_gguf.stage) runs over each sequence's text and routing and a
boundary it reports after token t is acted on before token t + 1 is decoded; alternatively the
trace's recorded stage starts are used, each known once its cue text has been generated.
Metrics are defined in docs/POLICIES.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from saem_gguf.accounting import (
    A_ACCESS, A_ASYNC, A_BYTES, A_CPU_RUNS, A_CPU_TOKENS, A_DEMAND, A_EVICT, A_GPU_RUNS, A_HIT, A_HIT_CPU,
    A_LAYER_STEPS, A_PLANS, A_PROACTIVE, A_STALL, A_STEPS, A_TEMP, A_TOKENS, Accounting,
)
from saem_gguf.budget import format_size
from saem_gguf.costmodel import CostModel, HardwareProfile, ModelShape, find_model_shape, get_hw
from saem_gguf.errors import SaemError
from saem_gguf.link_budget import LinkMeter
from saem_gguf.policies import DEFAULT_POLICIES, make_policy
from saem_gguf.policies.base import Policy, PolicyContext, budget_slots
from saem_gguf.policies.cue_profiles import cue_stage_counts, detected_cues, detected_events
from saem_gguf.policies.state import (
    Decision, RoutingBlock, record_decision, step_uses, used_experts,
)
from saem_gguf.pricing import price_placement, price_steps
from saem_gguf.stage.coherence import stage_histogram
from saem_gguf.trace import SequenceTrace, TraceSet, validate_traces

DEFAULT_ECRS: tuple[float, ...] = (3.125, 6.25, 12.5, 25.0, 50.0)
# Not comparable with a live placement (the engine cannot run them): an upper bound, the future,
# misses that wait for a load (into a cache slot, or into the temporary slot: saem-nocpu).
NOT_IMPLEMENTABLE: tuple[str, ...] = ("gpu-all", "oracle", "lru", "lfu", "temporal", "saem-nocpu")


# --------------------------------------------------------------------------------------------
# Traces -> blocks


def sequence_cues(ts: TraceSet) -> list[list | None]:
    """Per sequence, the cue text written at each stage start (None = implicit boundary), when
    the trace records it (synthetic traces do, in meta["boundary_cues"]); else None."""
    cues = ts.meta.get("boundary_cues") if isinstance(ts.meta, dict) else None
    if not isinstance(cues, list) or len(cues) != len(ts.sequences):
        return [None] * len(ts.sequences)
    return [c if isinstance(c, list) else None for c in cues]


def _event_delay(pieces: list[bytes], p: int, cue: str | None) -> int:
    """Tokens from a stage start until its cue has been generated (at least 1)."""
    if not cue:
        return 1
    need = len(cue.encode("utf-8"))
    got = 0
    j = p
    while j < len(pieces) and got < need:
        got += len(pieces[j])
        j += 1
    return max(1, j - p)


EVENT_MODES = ("detector", "cued", "all", "none")


def _detector_factory(ts: TraceSet, cues: str, implicit: bool):
    """A maker of fresh one-slot stage detectors for ``ts``'s model (cue set ``cues``; with the
    routing-shift detector too when ``implicit``)."""
    from saem_gguf.stage import CueSet, DetectorConfig, StageDetector

    sig = ts.signature
    cue_set = CueSet.load(cues)
    return lambda: StageDetector(1, cue_set, DetectorConfig(use_implicit=implicit), n_layer=sig.n_layer,
                                 n_expert=sig.n_expert, top_k=sig.n_expert_used)


def detector_events(ts: TraceSet, cues: str = "general", template=None) -> list[tuple[np.ndarray, np.ndarray, dict]]:
    """Per sequence, the tokens after which the stage detector (saem_gguf.stage) reports a
    boundary, run causally over the decoded text and routing as the engine runs it: (cue
    events only, cue + implicit routing-shift events in combined mode, {token: cue text} of the
    cue events). A boundary reported at token t is known before token t + 1 is decoded.
    ``template``: a StageDetector whose cues and thresholds to use (the engine's, for a trace the
    engine recorded) instead of the cue set ``cues`` with default thresholds."""
    cued = cue_events(ts, cues, template)
    if template is not None:
        combined_maker = lambda: template.fresh(n_seq=1, use_implicit=True)  # noqa: E731
    else:
        combined_maker = _detector_factory(ts, cues, implicit=True)
    combined = detected_events(ts.sequences, combined_maker)
    return [(np.array(sorted(c), np.int64), np.array(sorted(a), np.int64), c) for c, a in zip(cued, combined)]


def cue_events(ts: TraceSet, cues: str = "general", template=None) -> list[dict[int, str]]:
    """Per sequence, {token: cue text} of the cue events the stage detector of detector_events
    (the cue set ``cues``, or ``template``'s cues and thresholds) reports, routing shifts left out."""
    if template is not None and not template.config.use_cues:
        # a profile whose calibration kept no cue (implicit detection only): no cue event
        return [{} for _ in ts.sequences]
    if template is not None:
        cue_maker = lambda: template.fresh(n_seq=1, use_implicit=False)  # noqa: E731
    else:
        cue_maker = _detector_factory(ts, cues, implicit=False)
    return detected_cues(ts.sequences, cue_maker)


def trace_events(ts: TraceSet, mode: str, cues: list | None = None) -> list[np.ndarray]:
    """Per sequence, the tokens after which a recorded stage start is known (``cued``: those
    with a text cue when the trace says which, ``all``: every recorded one): a stage start at
    token p with a cue of n pieces is known after token p + n - 1."""
    cues = sequence_cues(ts) if cues is None else cues
    out = []
    for i, sq in enumerate(ts.sequences):
        toks = []
        for j, p in enumerate(np.asarray(sq.stage_starts).tolist()[1:], start=1):
            cue = None
            if cues[i] is not None and j < len(cues[i]):
                cue = cues[i][j]
                if mode == "cued" and cue is None:
                    continue  # no text cue: only an implicit detector can see this one
            toks.append(p + _event_delay(sq.pieces, p, cue) - 1)
        out.append(np.array(toks, np.int64))
    return out


def build_blocks(ts: TraceSet, batch: int, events: str = "cued", cues: list | None = None,
                 detected: list | None = None) -> list[RoutingBlock]:
    """Group ``ts``'s sequences into lockstep batches of ``batch`` (the last may be smaller).

    ``events``: ``detector`` (run the stage detector over the text; ``detected`` may pass
    ``detector_events(ts)`` precomputed), ``cued`` (recorded stage starts that carry a text cue,
    when the trace says which; all otherwise), ``all`` (every recorded stage start) or ``none``.
    With ``detector`` the blocks also carry the combined cue + implicit events."""
    if batch < 1:
        raise SaemError("batch size must be >= 1")
    if events not in EVENT_MODES:
        raise SaemError(f"events must be one of {', '.join(EVENT_MODES)}, got {events!r}")
    sig = ts.signature
    L, E, K = sig.n_layer, sig.n_expert, sig.n_expert_used
    implicit_toks = None
    texts: list[dict[int, str]] | None = None  # per sequence: token -> cue text of its event
    if events == "detector":
        detected = detected if detected is not None else detector_events(ts)
        known = [d[0] for d in detected]
        implicit_toks = [d[1] for d in detected]
        texts = [d[2] for d in detected]
    elif events == "none":
        known = [np.zeros(0, np.int64) for _ in ts.sequences]
    else:
        known = trace_events(ts, events, cues)
    blocks: list[RoutingBlock] = []
    step0 = 0
    seqs = ts.sequences

    def to_steps(group, n_dec, per_seq):
        ev: dict[int, list[int]] = {}
        cue: dict[int, list[str]] = {}
        for b, i in enumerate(group):
            p0 = seqs[i].prompt_len
            for tok in per_seq[i].tolist():
                step = tok + 1 - p0  # known after token tok -> before the decode step of tok + 1
                # an event after a sequence's last token counts too: the engine's policy is told
                # of it (and may act on it before the batch's next step, or the next request)
                if 0 < step <= n_dec[b]:
                    ev.setdefault(step, []).append(b)
                    cue.setdefault(step, []).append(texts[i].get(tok, "") if texts is not None else "")
        steps = sorted(ev)
        return np.array(steps, np.int32), [np.array(ev[s], np.int32) for s in steps], [cue[s] for s in steps]

    for g0 in range(0, len(seqs), batch):
        group = list(range(g0, min(len(seqs), g0 + batch)))
        n_dec = [seqs[i].decoded_tokens for i in group]
        S = max(n_dec) if n_dec else 0
        if S <= 0:
            continue
        routing = np.full((S, len(group), L, K), -1, np.int16)
        prefill = np.zeros((L, E))
        prefill_tokens = 0
        for b, i in enumerate(group):
            sq = seqs[i]
            p0 = sq.prompt_len
            routing[: n_dec[b], b] = sq.experts[p0:]
            if p0:
                prefill_tokens += p0
                pr = sq.experts[:p0].astype(np.int64)
                for l in range(L):
                    prefill[l] += np.bincount(pr[:, l, :].ravel(), minlength=E)
        ev_steps, ev_rows, ev_cues = to_steps(group, n_dec, known)
        imp_steps = to_steps(group, n_dec, implicit_toks)[0] if implicit_toks is not None else None
        blocks.append(RoutingBlock(routing=routing, event_steps=ev_steps, event_rows=ev_rows,
                                   prefill_counts=prefill if prefill_tokens else None,
                                   prefill_tokens=prefill_tokens, step0=step0, implicit_event_steps=imp_steps,
                                   event_cues=ev_cues if texts is not None else None))
        step0 += S
    return blocks


def calibration_counts(ts: TraceSet | None, n_layer: int, n_expert: int) -> np.ndarray:
    """Token-level routing counts [L, E] over every token of ``ts`` (zeros when None)."""
    out = np.zeros((n_layer, n_expert), np.int64)
    for sq in ts.sequences if ts is not None else ():
        stage_histogram(np.asarray(sq.experts), n_expert, out=out)
    return out.astype(np.float64)


def split_calibration(ts: TraceSet, frac: float) -> tuple[TraceSet, TraceSet | None]:
    """(replayed, calibration): the last ceil(frac * n) sequences calibrate, the rest replay
    (held out, like the paper's calibration set). frac 0 -> no calibration."""
    n = len(ts.sequences)
    k = int(np.ceil(frac * n)) if frac > 0 else 0
    if k == 0:
        return ts, None
    if k >= n:
        raise SaemError(f"calibration fraction {frac} leaves no sequence to replay ({n} sequences)")
    cues = sequence_cues(ts)
    meta_r = dict(ts.meta)
    meta_r["boundary_cues"] = cues[: n - k]
    rep = TraceSet(signature=ts.signature, sequences=ts.sequences[: n - k], source=ts.source, meta=meta_r)
    cal = TraceSet(signature=ts.signature, sequences=ts.sequences[n - k:], source=ts.source, meta={})
    return rep, cal


# the calibration tokens a policy is replayed over at load (calibration_sample): enough that the
# adaptive saem's layout choice measured no worse than on every calibration token
# (docs/POLICIES.md, "Is the chosen layout the best one?"), few enough to replay a 48-layer model
# at 7 layouts in seconds
CALIBRATION_REPLAY_TOKENS = 4096
# the fewest sequences a fold of the calibration replay holds (CalibrationReplay.folds): counts
# from one request price the other fold on that request's hot set alone (the device family's
# calibration holds 2 sequences; in folds of one its geometric mean fell 0.11 %, docs/POLICIES.md,
# "A cross-fitted replay as wide as the batch")
MIN_FOLD_SEQUENCES = 2
# the fewest decoded tokens a calibration sample needs to be replayed (calibration_replay): a
# shorter replay is mostly the caches' first steps, before they hold what the routing uses, which
# a run spreads over all its tokens; so it prices whole resident layers above caches the run
# warms (drawn-2-13: 119 tokens, 4 short sequences; at ECR 50 %, batch 8 the replay chose 16
# whole layers, 0.988x lfu-cpu, where the uniform layout ran 1.002x). Below it a policy sets up
# as where no sample is known (layout.choose_layout's static estimate; docs/POLICIES.md, "Too
# short a sample to replay")
MIN_REPLAY_TOKENS = 256


def calibration_sample(ts: TraceSet, max_tokens: int = CALIBRATION_REPLAY_TOKENS) -> TraceSet:
    """The calibration routing a policy is replayed over at load (PolicyContext.replay_calibration):
    every sequence of ``ts`` with its prompt and its first ``n`` decoded tokens (all of a shorter
    one), ``n`` the largest that keeps the decoded tokens within ``max_tokens``. Every
    sequence's opening rather than the first sequences whole: one long sequence would otherwise
    stand for the set (measured: docs/POLICIES.md, "Is the chosen layout the best one?"). Its
    meta keeps every sequence's whole decoded length (``request_lengths``: a replay at a batch
    above 1 decodes as a lockstep batch of such requests, split_to_batch). A calibration profile
    embeds it (stage.calibrate), so the engine replays what the simulator does."""
    decoded = np.array([sq.decoded_tokens for sq in ts.sequences], np.int64)
    lo, hi = 0, int(decoded.max(initial=0))
    while lo < hi:  # the largest per-sequence cut within the budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(np.minimum(decoded, mid).sum()) <= max_tokens else (lo, mid - 1)
    out = [_cut(sq, sq.prompt_len + lo) for sq in ts.sequences] if lo > 0 else []
    meta = {"boundary_cues": sequence_cues(ts)} if "boundary_cues" in ts.meta and out else {}
    if out:  # how long the requests ran, uncut: how a lockstep batch of them thins out (split_to_batch)
        meta["request_lengths"] = decoded.tolist()
    return TraceSet(signature=ts.signature, sequences=out, source=ts.source, meta=meta)


def split_to_batch(ts: TraceSet, batch: int) -> TraceSet:
    """``ts``'s decoded tokens cut into ``batch`` sequences where it has fewer: the same tokens,
    decoded ``batch`` at a time, in parts whose lengths are in proportion to what a lockstep batch
    of ``batch`` requests decodes in each row (``lockstep_lengths`` of ``ts.meta``'s
    ``request_lengths``), or, where ``ts`` does not say how long its requests ran, in near-equal
    parts (the longest sequence's decoded tokens split in two, the longest first, until there are
    ``batch`` or none has two left).

    Why split: a replay of fewer sequences than the batch decodes them at a fraction of the
    batch's concurrency, so it prices the experts a batch shares, and the layers a whole residency
    saves, as a smaller batch's (a batch-8 replay of bench_policies' 4 calibration sequences chose
    no whole layer where 8 ran faster: docs/POLICIES.md, "A cross-fitted replay as wide as the
    batch"). Why not equal parts: a lockstep batch thins out as its shorter requests end, so it
    decodes at less than its width for much of its time; equal parts priced every step at the
    full width and put whole layers first where the run, thinned out, is faster on caches
    (docs/POLICIES.md, "A replay that thins out as a lockstep batch does"). A part other than a
    sequence's first starts a stage of its own, uncued, and has no prompt."""
    seqs = list(ts.sequences)
    if len(seqs) >= batch:
        return ts
    lengths = ts.meta.get("request_lengths")
    empty = sum(sq.decoded_tokens == 0 for sq in seqs)  # a row each, as they are (nothing to cut)
    rows = lockstep_lengths(lengths, batch - empty) if lengths and batch > empty else None
    parts = _lockstep_parts(ts, rows) if rows is not None and rows.sum() > 0 else _halved_parts(ts, batch)
    if len(parts) == len(seqs):
        return ts
    cues = sequence_cues(ts)
    out, out_cues = [], []
    for i, lo, hi in parts:
        part, part_cues = _slice(seqs[i], cues[i], lo, hi)
        out.append(part)
        out_cues.append(part_cues)
    meta = {"boundary_cues": out_cues} if "boundary_cues" in ts.meta else {}
    return TraceSet(signature=ts.signature, sequences=out, source=ts.source, meta=meta)


def lockstep_lengths(request_lengths, batch: int) -> np.ndarray:
    """float64 [batch]: the expected decoded lengths of a lockstep batch's rows, longest first,
    when its ``batch`` requests' lengths are drawn (with replacement) from ``request_lengths``:
    the expected order statistics of the empirical distribution, exactly (``P(X_(k) <= x)`` is
    the chance that at least ``k`` of the ``batch`` draws are at most ``x``, a binomial tail).
    Row ``k`` decodes while at least ``k`` requests run, so these are how the batch thins out."""
    v = np.sort(np.asarray(request_lengths, np.float64))
    if v.size == 0:
        raise SaemError("lockstep_lengths: no request length")
    x = np.unique(v)
    F = np.searchsorted(v, x, side="right") / v.size  # P(length <= x)
    j = np.arange(batch + 1)
    binom = np.array([math.comb(batch, int(i)) for i in j], np.float64)
    # pmf[i, m] = P(exactly j[i] of the batch's draws are at most x[m])
    pmf = binom[:, None] * F[None, :] ** j[:, None] * (1.0 - F[None, :]) ** (batch - j)[:, None]
    out = np.empty(batch)
    for k in range(1, batch + 1):  # the k-th shortest
        cdf = pmf[k:].sum(axis=0)  # P(X_(k) <= x)
        out[batch - k] = float(np.diff(cdf, prepend=0.0) @ x)
    return out


def _lockstep_parts(ts: TraceSet, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """``ts``'s tokens as parts ``(sequence, first token, end)`` that come to ``len(rows)`` parts
    with decoded lengths in proportion to ``rows``: each row's share of the decoded tokens goes,
    longest first, to the sequence with the most tokens still unassigned, and a sequence's shares
    are then scaled to fill it exactly (no token left out, none repeated, no part empty). Every
    sequence's first part (its prompt and first decoded tokens) comes first, in ``ts``'s order."""
    decoded = np.array([sq.decoded_tokens for sq in ts.sequences], np.float64)
    shares = np.sort(rows)[::-1] / rows.sum() * decoded.sum()
    free, given = decoded.copy(), [[] for _ in ts.sequences]
    for share in shares:
        i = int(np.argmax(free))
        given[i].append(share)
        free[i] -= share
    heads, rest = [], []
    for i, (sq, d, g) in enumerate(zip(ts.sequences, decoded, given)):
        ends = np.round(np.cumsum(g) / max(sum(g), 1e-300) * d).astype(np.int64) + sq.prompt_len
        cuts = sorted({e for e in ends[:-1].tolist() if sq.prompt_len < e < sq.n_tokens})
        bounds = [0, *cuts, sq.n_tokens]  # a sequence given no share, or nothing decoded, stays whole
        for lo, hi in zip(bounds, bounds[1:]):
            (rest if lo else heads).append((i, lo, hi))
    return heads + rest


def _halved_parts(ts: TraceSet, batch: int) -> list[tuple[int, int, int]]:
    """``ts``'s tokens as parts ``(sequence, first token, end)``: the part with the most decoded
    tokens halved, the first such on a tie, until there are ``batch`` or none has two; a part
    keeps its place and its second half goes last."""
    parts = [(i, 0, sq.n_tokens) for i, sq in enumerate(ts.sequences)]

    def decoded(p: tuple[int, int, int]) -> int:
        return p[2] - max(p[1], ts.sequences[p[0]].prompt_len)

    while len(parts) < batch and parts:
        k = max(range(len(parts)), key=lambda q: (decoded(parts[q]), -q))
        n = decoded(parts[k])
        if n < 2:
            break
        i, lo, hi = parts[k]
        at = hi - n + n // 2
        parts[k] = (i, lo, at)
        parts.append((i, at, hi))
    return parts


def _slice(sq: SequenceTrace, cues: list | None, lo: int, hi: int) -> tuple[SequenceTrace, list | None]:
    """Tokens ``[lo, hi)`` of ``sq`` as a sequence, with its share of ``sq``'s recorded cues
    (``cues``, one per stage start, or None): the first part keeps the prompt; a later one has
    none and starts a stage of its own, uncued where no recorded stage starts at ``lo``."""
    starts = np.asarray(sq.stage_starts)
    if lo == 0:
        part = _cut(sq, hi)
    else:
        inside = (starts >= lo) & (starts < hi)
        part = SequenceTrace(token_ids=sq.token_ids[lo:hi], pieces=sq.pieces[lo:hi], experts=sq.experts[lo:hi],
                             weights=None if sq.weights is None else sq.weights[lo:hi],
                             stage_starts=np.unique(np.concatenate([[0], starts[inside] - lo])).astype(np.int32))
    if cues is None:
        return part, None
    # the first part's cues are those of the stages it keeps (a sequence's first stage starts at 0)
    part_cues = [c for s, c in zip(starts.tolist(), cues) if lo <= s < hi]
    return part, part_cues if starts[starts == lo].size else [None, *part_cues]


def _cut(sq: SequenceTrace, n: int) -> SequenceTrace:
    """``sq``'s first ``n`` tokens (``sq`` itself when it has no more)."""
    if sq.n_tokens <= n:
        return sq
    starts = np.asarray(sq.stage_starts)
    return dataclasses.replace(sq, token_ids=sq.token_ids[:n], pieces=sq.pieces[:n], experts=sq.experts[:n],
                               stage_starts=starts[starts < n], weights=None if sq.weights is None else sq.weights[:n])


def calibration_replay(sample: TraceSet | None, events: str = "detector", cues: str = "general",
                       template=None) -> "CalibrationReplay | None":
    """The replay of calibration ``sample`` a policy may price its set-up on, or None where it
    has fewer than MIN_REPLAY_TOKENS decoded tokens (or none is known). The one gate for the
    simulator and the engine, so both set up alike."""
    if sample is None or sample.decoded_tokens < MIN_REPLAY_TOKENS:
        return None
    return CalibrationReplay(sample, events, cues, template)


@dataclass
class ReplayFold:
    """One fold of a calibration replay (CalibrationReplay.folds): the routing replayed, and what
    its policy knows at start in place of the context's calibration: routing counts [L, E]
    (None: the context's own) and per-cue stage profiles (cue text -> [L, E], saem-cue's; None:
    none). Where the sample has two folds, both come from the other fold's routing."""

    replay: "CalibrationReplay"
    calib_counts: np.ndarray | None = None
    cue_counts: dict[str, np.ndarray] | None = None

    def context(self, ctx: PolicyContext) -> PolicyContext:
        """``ctx`` with this fold's calibration in place of its own; only the cues ``ctx`` has a
        profile for keep one (the engine's profile keeps only the cues that predict their stages:
        calibrate_cmd._cue_profiles)."""
        counts = ctx.calib_counts if self.calib_counts is None else self.calib_counts
        cue_counts = None if ctx.cue_counts is None or self.cue_counts is None else \
            {c: v for c, v in self.cue_counts.items() if c in ctx.cue_counts}
        return dataclasses.replace(ctx, calib_counts=counts, cue_counts=cue_counts)


class CalibrationReplay:
    """The calibration sample's routing as blocks to replay a policy over, built at first use,
    once per batch size, as ``simulate`` builds the replayed traces': the stage events of the
    detector the replayed sequences get (the cue set ``cues``, or the engine's own detector as
    ``template``); and its folds (``folds``). Most policies never ask, and pay nothing."""

    def __init__(self, sample: TraceSet, events: str = "detector", cues: str = "general", template=None) -> None:
        self.sample, self.events, self.cues, self.template = sample, events, cues, template
        self._blocks: dict[int, list[RoutingBlock]] = {}
        self._folds: list[ReplayFold] | None = None

    def blocks(self, batch: int) -> list[RoutingBlock]:
        """The sample split to ``batch`` sequences where it has fewer (split_to_batch), in
        lockstep batches of ``batch``, with the events of this replay's detector."""
        if batch not in self._blocks:
            sample = split_to_batch(self.sample, batch)
            detected = detector_events(sample, self.cues, self.template) if self.events == "detector" else None
            self._blocks[batch] = build_blocks(sample, batch, self.events, detected=detected)
        return self._blocks[batch]

    def folds(self) -> list[ReplayFold]:
        """The sample's sequences in two halves (every other one), each replayed on the other
        half's routing counts and per-cue stage profiles, so that what they place (``static``,
        the caches' priors, a cue's profile at a boundary) is priced on routing it was not fitted
        to, as the run's are. A sample too small for two folds of MIN_FOLD_SEQUENCES is one fold,
        the whole sample on the context's counts and on no cue profile (the context's hold the
        stages replayed). Why the cue profiles too: profiles that hold the replayed stages
        themselves foretell each cued stage's experts, which a run's profiles, made on other
        sequences, do not (drawn-1-17, ECR 50 %, batch 1: on the sample's own profiles the replay
        priced no whole layer at 71.6 tok/s, where the run gets 67.5, and chose 8 whole layers
        where 20 run fastest; docs/POLICIES.md, "The other fold's cue profiles too")."""
        if self._folds is None:
            seqs, sig = self.sample.sequences, self.sample.signature
            if len(seqs) < 2 * MIN_FOLD_SEQUENCES:
                self._folds = [ReplayFold(self)]
            else:
                cued = cue_events(self.sample, self.cues, self.template) if self.events == "detector" else None
                halves = [list(range(h, len(seqs), 2)) for h in (0, 1)]
                parts = [_subset(self.sample, ix) for ix in halves]
                # what each half's routing tells the policy that replays the other half
                counts = [calibration_counts(part, sig.n_layer, sig.n_expert) for part in parts]
                profiles = [None if cued is None else
                            cue_stage_counts(part.sequences, [cued[i] for i in ix], sig.n_expert)
                            for part, ix in zip(parts, halves)]
                self._folds = [ReplayFold(CalibrationReplay(parts[h], self.events, self.cues, self.template),
                                          counts[1 - h], profiles[1 - h]) for h in (0, 1)]
        return self._folds


def _subset(ts: TraceSet, which) -> TraceSet:
    """``ts``'s sequences ``which`` (with their recorded cues, and the request lengths of all)."""
    which = list(which)
    cues = sequence_cues(ts)
    meta = {"boundary_cues": [cues[i] for i in which]} if "boundary_cues" in ts.meta else {}
    if "request_lengths" in ts.meta:  # every request's, not the subset's: a fold's requests are few
        meta["request_lengths"] = ts.meta["request_lengths"]
    return TraceSet(signature=ts.signature, sequences=[ts.sequences[i] for i in which], source=ts.source, meta=meta)


def calibration_pricer(calibration: CalibrationReplay,
                       ctx: PolicyContext) -> Callable[[Callable[[], Policy]], tuple[float, list[Policy]]]:
    """PolicyContext.replay_calibration: (estimated tokens/s, the policies replayed) of fresh
    policies made by ``make`` replayed over the calibration sample's folds (CalibrationReplay.folds)
    at ``ctx``'s batch size, on its budget and cost model: every fold's tokens over their time.
    A policy starts on ``ctx`` without a pricer (what it prices is a set-up already fixed), on
    its fold's calibration (ReplayFold.context)."""
    bare = dataclasses.replace(ctx, replay_calibration=None)
    batch = max(int(bare.batch), 1)

    def price(make: Callable[[], Policy]) -> tuple[float, list[Policy]]:
        tokens = seconds = 0.0
        replayed = []
        for fold in calibration.folds():
            policy = make()
            policy.start(fold.context(bare))
            acct = Accounting()
            replay(policy, fold.replay.blocks(batch), acct)
            tokens += float(acct.counters[A_TOKENS])
            seconds += float(acct.clock[0])
            replayed.append(policy)
        return (tokens / seconds if seconds > 0 else 0.0), replayed

    return price


# --------------------------------------------------------------------------------------------
# Running


@dataclass
class SimConfig:
    policies: tuple[str, ...] = DEFAULT_POLICIES
    ecrs: tuple[float, ...] = DEFAULT_ECRS  # percent
    batches: tuple[int, ...] = (1,)
    events: str = "detector"
    cues: str = "general"  # cue set of the stage detector (events="detector")


def metrics(acc: np.ndarray, clock: np.ndarray, cost: CostModel) -> dict:
    """The reported metrics from a run's counters (definitions: docs/POLICIES.md)."""
    A = max(acc[A_ACCESS], 1.0)
    tok = max(acc[A_TOKENS], 1.0)
    t = float(clock[0])
    return {
        "hit_rate": acc[A_HIT] / A,
        "adj_hit_rate": (acc[A_HIT] - acc[A_PROACTIVE]) / A,
        "load_mb_per_token": acc[A_BYTES] / 1e6 / tok,
        "bytes": float(acc[A_BYTES]),
        "transfers": int(acc[A_DEMAND] + acc[A_PROACTIVE]),
        "demand_transfers": int(acc[A_DEMAND]),
        "proactive_transfers": int(acc[A_PROACTIVE]),
        "temp_transfers": int(acc[A_TEMP]),
        "async_loads": int(acc[A_ASYNC]),
        "evictions": int(acc[A_EVICT]),
        "cpu_expert_tokens": int(acc[A_CPU_TOKENS]),
        "cpu_expert_runs": int(acc[A_CPU_RUNS]),
        "gpu_expert_runs": int(acc[A_GPU_RUNS]),
        "hits_run_on_cpu": int(acc[A_HIT_CPU]),
        "cpu_share": acc[A_CPU_TOKENS] / A,
        "placements": int(acc[A_PLANS]),
        "accesses": int(acc[A_ACCESS]),
        "tokens": int(acc[A_TOKENS]),
        "steps": int(acc[A_STEPS]),
        "stall_s": float(acc[A_STALL]),
        "time_s": t,
        "tok_s": acc[A_TOKENS] / t if t > 0 else 0.0,
        "layer_steps": int(acc[A_LAYER_STEPS]),
    }


def replay(pol: Policy, blocks: list[RoutingBlock], acct: Accounting, decisions: list[Decision] | None = None,
           ram: "RamTierReplay | None" = None, link_budgets: list[float] | None = None) -> None:
    """Drive a started policy over ``blocks`` through its entry points (``begin_group`` per block,
    ``observe`` per step with the events reported after it and its link budget, as the engine
    does) and price what it decides into ``acct``: the simulator keeps its own copy of the
    residency in force and of when each slot's copy lands. Steps between decisions are priced in
    one kernel call. A policy that reads its link budget gets it from a LinkMeter (link_budget.py,
    the engine's too); the others are told inf. ``decisions`` collects every change and
    ``link_budgets`` every budget told (for comparing with the engine's). ``ram``: a RAM tier
    below this policy, driven with the same groups, rows and events (as Placement.tiers)."""
    cache = pol.state.copy()
    ready_at = np.zeros(cache.owner.shape, np.float64)
    cost = pol.ctx.cost.array
    no_ops = np.zeros((0, 4), np.int32)
    c = acct.counters
    meter = LinkMeter(pol.ctx.cost, pol.ctx.n_expert) if pol.uses_link_budget else None
    for blk in blocks:
        change = pol.begin_group(blk)
        if change is not None:
            record_decision(decisions, "group", blk.step0, change)
            if meter is not None:
                meter.placed(change)
            c[A_PLANS] += change.placements
            price_placement(change.ops, change.n_in_step, blk.step0, cache.slot_of, cache.owner, ready_at, cost,
                            acct.clock, c, acct.log, acct.log_n)
        if ram is not None:
            ram.begin_group(blk)
        priced = 0  # steps before this one are priced
        for s in range(blk.n_steps):
            if ram is not None:  # the VRAM map in force for step s: the policy's books before it observes
                ram.on_step(blk.routing[s], blk.events_after(s), pol.state.slot_of)
            budget = meter.budget(blk.routing[s], pol.state.slot_of) if meter is not None else math.inf
            if link_budgets is not None:
                link_budgets.append(budget)
            change = pol.observe(blk.routing[s], blk.events_after(s), budget)
            if meter is not None:
                meter.decided(change)
            if change is None:
                continue
            record_decision(decisions, "step", blk.step0 + s, change)
            c[A_PLANS] += change.placements
            price_steps(blk.routing, priced, s + 1, blk.step0, cache.slot_of, cache.owner, ready_at, change.ops,
                        change.n_in_step, pol.miss_mode, cost, acct.clock, c, acct.log, acct.log_n)
            priced = s + 1
        if priced < blk.n_steps:
            price_steps(blk.routing, priced, blk.n_steps, blk.step0, cache.slot_of, cache.owner, ready_at, no_ops, 0,
                        pol.miss_mode, cost, acct.clock, c, acct.log, acct.log_n)
        if not np.array_equal(cache.slot_of, pol.state.slot_of):
            raise AssertionError(f"{pol.name}: its changes do not lead to the residency it holds")


@dataclass(frozen=True)
class RamProjection:
    """``simulate --ram-budget``: a RAM tier of ``budget_bytes`` of experts under the VRAM cache,
    its policy ``policy`` (None: ram_tier.ram_policy_for's default for each VRAM policy)."""

    budget_bytes: int
    policy: str | None = None


def ram_slots(budget_bytes: int, n_layer: int, n_expert: int, expert_bytes: int) -> int:
    """Experts per layer that ``budget_bytes`` holds, as ram_tier.plan_ram_budget sizes them (one
    expert of every MoE layer per slot)."""
    per = n_layer * expert_bytes
    if budget_bytes < per:
        raise SaemError(f"--ram-budget {format_size(budget_bytes)} holds no expert: one expert of every "
                        f"MoE layer takes {format_size(per)}")
    return int(min(n_expert, budget_bytes // per))


class RamTierReplay:
    """The RAM tier's policy instance in a replay, driven as ram_tier.RamTier.on_step drives it:
    ``begin_group`` per block, then per step its hits counted against its map before it observes
    the step's rows and the VRAM policy's events.

    Disk model (priced with the hardware profile's ``ssd_read_bw`` and ``ssd_latency_s``):
    * a step reads from disk each distinct (layer, expert) its rows use that is neither in the VRAM
      map in force nor in the RAM tier's (one read for the whole batch, as the engine's in-graph
      read-ahead issues one per routed expert); such an expert is read again at its next use (the
      engine marks it cold; whether the page cache still holds it depends on the memory limit's
      slack, which the projection does not model, so this is its pessimistic side);
    * each expert the tier's policy makes resident (a read-ahead) is one disk read too, unless the
      step it was admitted after has just read it on demand (its pages are cached); the initial
      placement is not counted (loading the model, as the engine's stats leave it out);
    * every read costs ``ssd_latency_s + expert_bytes / ssd_read_bw`` and reads are serialised on
      the decode's critical path, not overlapped with compute or with each other: the projected
      time is the two-tier replay's time plus the disk time (an upper bound on what overlap saves).
    """

    def __init__(self, name: str, ctx: PolicyContext, slots: int, cost: CostModel) -> None:
        import dataclasses

        from saem_gguf.placement import ENGINE_VARIANT

        self.policy = make_policy(ENGINE_VARIANT.get(name, name))
        # the tier's copies are disk reads: copy-cost-aware policies price them so (as attach_ram_tier)
        self.state = self.policy.start(dataclasses.replace(
            ctx, n_slots=np.full(ctx.n_layer, slots, np.int32), cost=cost.ram_tier()))
        self.read_s = cost.hw.ssd_latency_s + cost.expert_bytes / cost.hw.ssd_read_bw
        self.expert_bytes = cost.expert_bytes
        self.accesses = self.hits = self.demand_reads = self.prefetch_reads = 0

    def begin_group(self, block: RoutingBlock) -> None:
        self._count_loads(lambda: self.policy.begin_group(block))

    def on_step(self, rows: np.ndarray, events, vram_slot_of: np.ndarray) -> None:
        ram_slot_of = self.state.slot_of
        hits, uses = step_uses(rows, ram_slot_of)
        self.hits += hits
        self.accesses += uses
        used = used_experts(rows, ram_slot_of.shape[1])
        read = used & (vram_slot_of < 0) & (ram_slot_of < 0)
        self.demand_reads += int(np.count_nonzero(read))
        self._count_loads(lambda: self.policy.observe(rows, events), already_read=read)

    def _count_loads(self, decide, already_read: np.ndarray | None = None) -> None:
        """Disk reads of the experts ``decide`` makes resident, but for those the step has just
        read (``already_read``: their pages are in the page cache; the engine's read-ahead of them
        reads nothing)."""
        before = self.state.slot_of >= 0
        decide()
        loaded = (self.state.slot_of >= 0) & ~before
        if already_read is not None:
            loaded &= ~already_read
        self.prefetch_reads += int(np.count_nonzero(loaded))

    def metrics(self, tokens: int, time_s: float) -> dict:
        reads = self.demand_reads + self.prefetch_reads
        disk_s = reads * self.read_s
        tok = max(tokens, 1)
        return {
            "ram_slots": int(self.state.n_slots[0]), "ram_policy": self.policy.name,
            "ram_hit_rate": self.hits / max(self.accesses, 1), "disk_demand_reads": self.demand_reads,
            "disk_prefetch_reads": self.prefetch_reads, "disk_bytes": float(reads * self.expert_bytes),
            "disk_mb_per_token": reads * self.expert_bytes / 1e6 / tok, "disk_s": disk_s,
            "tok_s_with_ram": tokens / (time_s + disk_s) if time_s + disk_s > 0 else 0.0,
        }


def run_policy(name: str, blocks: list[RoutingBlock], ctx: PolicyContext, policy_kwargs: dict | None = None,
               ram: RamProjection | None = None) -> dict:
    """Replay every block under one policy (and a RAM tier below it, with ``ram``); returns
    metrics plus wall time."""
    pol = make_policy(name, **(policy_kwargs or {}))
    state = pol.start(ctx)
    tier = None
    if ram is not None:
        from saem_gguf.ram_tier import ram_policy_for

        slots = ram_slots(ram.budget_bytes, ctx.n_layer, ctx.n_expert, ctx.cost.expert_bytes)
        tier = RamTierReplay(ram_policy_for(name, ram.policy), ctx, slots, ctx.cost)
    acct = Accounting()
    t0 = time.perf_counter()
    replay(pol, blocks, acct, ram=tier)
    wall = time.perf_counter() - t0
    m = metrics(acct.counters, acct.clock, ctx.cost)
    m["wall_s"] = wall
    m["slots_per_layer_used"] = float(state.n_slots.mean())
    m["whole_layers"] = int(np.count_nonzero(state.n_slots >= ctx.n_expert))  # fully resident (the layout)
    if tier is not None:
        m.update(tier.metrics(m["tokens"], m["time_s"]))
    return m


@dataclass
class SimResult:
    rows: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def select(self, **kw) -> list[dict]:
        return [r for r in self.rows if all(r.get(k) == v for k, v in kw.items())]

    def to_json(self) -> dict:
        return {"info": self.info, "rows": self.rows}

    def table(self, columns: tuple[str, ...] = ("hit_rate", "adj_hit_rate", "load_mb_per_token", "cpu_share",
                                                 "tok_s")) -> str:
        """Readable table: one block per batch size, one row per policy, ECRs across."""
        out = []
        heads = {"hit_rate": "hit %", "adj_hit_rate": "adj hit %", "load_mb_per_token": "MB/tok",
                 "cpu_share": "CPU %", "tok_s": "tok/s", "ram_hit_rate": "RAM hit %",
                 "disk_mb_per_token": "disk MB/tok", "tok_s_with_ram": "tok/s +disk"}
        batches = sorted({r["batch"] for r in self.rows})
        ecrs = sorted({r["ecr"] for r in self.rows})
        pols = list(dict.fromkeys(r["policy"] for r in self.rows))
        # the label column: policies indented under their metric, as wide as the longest label
        w = max([12, *(len(p) for p in pols), *(len(heads.get(c, c)) - 2 for c in columns), len("saem/best tok/s") - 2])
        for B in batches:
            out.append(f"batch {B}")
            for col in columns:
                h = f"  {heads.get(col, col):<{w + 2}}" + "".join(f"{f'ECR {e:g}%':>11}" for e in ecrs)
                out.append(h)
                for p in pols:
                    cells = []
                    for e in ecrs:
                        rr = self.select(batch=B, ecr=e, policy=p)
                        if not rr:
                            cells.append(f"{'-':>11}")
                            continue
                        v = rr[0][col]
                        if col in ("hit_rate", "adj_hit_rate", "cpu_share", "ram_hit_rate"):
                            cells.append(f"{100 * v:>11.2f}")
                        else:
                            cells.append(f"{v:>11.1f}")
                    out.append(f"    {p:<{w}}" + "".join(cells))
            # saem against the best other policy the engine can run, at each ECR
            base = [p for p in pols if p != "saem" and p not in NOT_IMPLEMENTABLE]
            if "saem" in pols and base:
                cells = []
                for e in ecrs:
                    s = self.select(batch=B, ecr=e, policy="saem")
                    bs = [r for p in base for r in self.select(batch=B, ecr=e, policy=p)]
                    if not s or not bs:
                        cells.append(f"{'-':>11}")
                        continue
                    best = max(bs, key=lambda r: r["tok_s"])
                    cells.append(f"{s[0]['tok_s'] / best['tok_s']:>10.2f}x")
                out.append(f"  {'saem/best tok/s':<{w + 2}}" + "".join(cells))
            out.append("")
        return "\n".join(out)


def default_cost(ts: TraceSet, hw: HardwareProfile | str = "rtx4090-ddr5", model: str | ModelShape | None = None,
                 quant: str | None = None) -> CostModel:
    """A cost model for ``ts``: an explicit model preset/shape, else the preset whose routing
    shape matches the trace, else the signature's expert size."""
    if isinstance(hw, str):
        hw = get_hw(hw)
    sig = ts.signature
    shape: ModelShape | None
    if isinstance(model, ModelShape):
        shape = model
    elif model:
        from saem_gguf.costmodel import MODEL_PRESETS

        if model not in MODEL_PRESETS:
            raise SaemError(f"unknown model preset {model!r} (known: {', '.join(MODEL_PRESETS)})")
        shape = MODEL_PRESETS[model]
    else:
        shape = find_model_shape(sig.n_layer, sig.n_expert, sig.n_expert_used)
    if shape is not None:
        if quant:
            import dataclasses

            shape = dataclasses.replace(shape, qtype=quant, qtype_down=None)
        return CostModel.from_shape(shape, hw)
    if sig.expert_bytes > 0:
        return CostModel.from_expert_bytes(sig.expert_bytes, hw)
    raise SaemError(f"no model shape for routing {sig.n_layer}x{sig.n_expert} top-{sig.n_expert_used}: "
                    "pass --model PRESET or record expert_bytes in the trace signature")


def simulate(ts: TraceSet, cfg: SimConfig, cost: CostModel, calib: TraceSet | None = None,
             progress=None, policy_kwargs: dict | None = None, ram: RamProjection | None = None) -> SimResult:
    """Replay ``ts`` under every policy x ECR x batch of ``cfg``. ``calib`` gives the
    calibration counts (static-hot, initial placements, priors) and the sample a policy may
    replay itself over at load (calibration_sample; saem's slot layout). ``progress(n)`` is called
    after each run. ``ram``: project a RAM tier below each VRAM cache (RamTierReplay)."""
    validate_traces(ts)
    sig = ts.signature
    L, E, K = sig.n_layer, sig.n_expert, sig.n_expert_used
    calib_counts = calibration_counts(calib, L, E)
    cue_counts = None  # per-cue stage profiles (saem-cue), from the detector run over the calibration set
    if calib is not None and calib.sequences and cfg.events == "detector":
        cal_events = detected_cues(calib.sequences, _detector_factory(calib, cfg.cues, implicit=False))
        cue_counts = cue_stage_counts(calib.sequences, cal_events, E)
    res = SimResult(info={
        "signature": {"arch": sig.arch, "n_layer": L, "n_expert": E, "n_expert_used": K, "name": sig.name},
        "sequences": len(ts.sequences), "calibration_sequences": len(calib.sequences) if calib else 0,
        "cost": cost.describe(), "events": cfg.events, "source": ts.source,
        # calibration tokens behind each cue's stage profile (saem-cue)
        "cue_profiles": {c: int(v[0].sum() // K) for c, v in sorted((cue_counts or {}).items())},
    })
    cues = sequence_cues(ts)
    detected = detector_events(ts, cfg.cues) if cfg.events == "detector" else None
    calibration = calibration_replay(calibration_sample(calib) if calib is not None else None, cfg.events, cfg.cues)
    for B in cfg.batches:
        blocks = build_blocks(ts, B, cfg.events, cues, detected)
        n_events = int(sum(b.event_steps.size for b in blocks))
        for ecr in cfg.ecrs:
            S = budget_slots(ecr, E)
            for name in cfg.policies:
                ctx = PolicyContext(n_layer=L, n_expert=E, top_k=K, n_slots=np.full(L, S, np.int32), cost=cost,
                                    calib_counts=calib_counts, batch=B, cue_counts=cue_counts)
                if calibration is not None:
                    ctx.replay_calibration = calibration_pricer(calibration, ctx)
                m = run_policy(name, blocks, ctx, (policy_kwargs or {}).get(name), ram)
                res.rows.append({"policy": name, "ecr": float(ecr), "batch": int(B), "slots": S,
                                 "events": n_events, **m})
                if progress is not None:
                    progress(1)
    return res
