"""Per-cue stage profiles: how the stages that each cue opens route, from calibration traces.

The cue that opens a stage names what kind of stage it is ("Let me verify" opens a check,
"Therefore" a conclusion), and on the embedded model the kinds route to nearly disjoint experts
(docs/DEFAULT_MODEL.md), so the completed stage predicts the next one worse than the profile
of earlier stages opened by the same cue. ``saem-cue`` (saem.py) ranks by these profiles.

A stage opened by a cue runs from the token after the detector reported the cue to the next
boundary (or the end of the sequence); ``START`` keys a sequence's first decoded stage when no
cue opened it. Counts are token-level routing counts [L, E], like the calibration counts.
"""

from __future__ import annotations

import numpy as np

from saem_gguf.errors import SaemError
from saem_gguf.stage.coherence import stage_histograms, transition_coherence

START = "^"  # the first decoded stage of a sequence, when no cue opened it


def _stages(sq, ev: dict[int, str], n_expert: int):
    """(opening cue or START or "", routing counts [L, E]) of each decoded stage, in order."""
    p0, n = int(sq.prompt_len), int(sq.n_tokens)
    starts = sorted({t + 1 for t in ev if p0 < t + 1 < n})
    bounds = np.array([p0, *starts, n], np.int64)
    hists = stage_histograms(np.asarray(sq.experts[p0:n]), bounds - p0, n_expert).astype(np.float64)
    for a, b, h in zip(bounds[:-1], bounds[1:], hists):
        if b > a:
            yield ev.get(int(a) - 1, START if a == p0 else ""), h


def cue_stage_counts(sequences, events: list[dict[int, str]], n_expert: int) -> dict[str, np.ndarray]:
    """Sum, per opening cue, the routing counts of the decoded stages of ``sequences`` (trace
    SequenceTrace objects). ``events[i]`` maps token index -> cue text for sequence i: the
    detector reported that cue after that token, so its stage starts at the next token."""
    if len(events) != len(sequences):
        raise SaemError("cue_stage_counts needs one event map per sequence")
    out: dict[str, np.ndarray] = {}
    for sq, ev in zip(sequences, events):
        for key, h in _stages(sq, ev, n_expert):
            if key:
                out[key] = out.get(key, 0) + h
    return out


def profile_gain(sequences, events: list[dict[int, str]], n_expert: int, capacity: int,
                 min_stages: int = 5) -> dict[str, dict]:
    """Does a cue's profile predict the stages it opens better than the stage before them
    (SAEM's rule)? Per cue, token-weighted over those stages: the share of their routing on the
    top-``capacity`` experts of the cue's profile built from the *other* sequences, and of the
    preceding stage (``transition_coherence``, mean over layers). ``keep`` when the profile does
    at least as well over ``min_stages``."""
    per_seq = [list(_stages(sq, ev, n_expert)) for sq, ev in zip(sequences, events)]
    total: dict[str, np.ndarray] = {}
    for stages in per_seq:
        for key, h in stages:
            if key and key != START:
                total[key] = total.get(key, 0) + h
    acc: dict[str, list[float]] = {}  # cue -> [stages, tokens, profile hits, previous-stage hits]
    for stages in per_seq:
        own: dict[str, np.ndarray] = {}
        for key, h in stages:
            if key and key != START:
                own[key] = own.get(key, 0) + h
        for (_, prev), (key, h) in zip(stages[:-1], stages[1:]):
            if not key or key == START:
                continue
            loso = total[key] - own[key]
            if loso.sum() <= 0:
                continue
            tok = float(h.sum())
            a = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            a[0] += 1
            a[1] += tok
            a[2] += tok * float(np.nanmean(transition_coherence(loso, h, capacity)))
            a[3] += tok * float(np.nanmean(transition_coherence(prev, h, capacity)))
    out = {}
    for key, (n, tok, hp, hv) in sorted(acc.items()):
        hit_p, hit_v = hp / max(tok, 1.0), hv / max(tok, 1.0)
        out[key] = {"stages": int(n), "hit_profile": round(hit_p, 4), "hit_previous_stage": round(hit_v, 4),
                    "keep": bool(n >= min_stages and hit_p >= hit_v)}
    return out


def detected_events(sequences, make_detector) -> list[dict[int, str]]:
    """Per sequence, token index -> cue text ("" for a routing-shift event without a cue) of
    every event a fresh stage detector (``make_detector()``, one slot) reports when fed the
    sequence's decoded tokens causally, token by token, as the engine feeds it (the prompt is
    not fed: the engine's detector starts at the first decoded token)."""
    out = []
    slot = np.zeros(1, np.int64)
    for sq in sequences:
        det = make_detector()
        p0 = int(sq.prompt_len)
        det.reset(0, p0)
        ev: dict[int, str] = {}
        for t in range(p0, int(sq.n_tokens)):
            for e in det.feed(slot, sq.pieces[t:t + 1], np.asarray(sq.experts[t:t + 1])):
                if not ev.get(e.token):  # the first cue at a token names it
                    ev[e.token] = e.cue
        out.append(ev)
    return out


def detected_cues(sequences, make_detector) -> list[dict[int, str]]:
    """``detected_events`` restricted to the events a cue raised."""
    return [{t: c for t, c in ev.items() if c} for ev in detected_events(sequences, make_detector)]


def to_json(counts: dict[str, np.ndarray]) -> dict[str, list]:
    return {cue: np.asarray(c).astype(np.int64).tolist() for cue, c in sorted(counts.items())}


def from_json(obj, n_layer: int, n_expert: int, where: str = "profile") -> dict[str, np.ndarray]:
    """Inverse of ``to_json``, checked against the model's shape."""
    if not isinstance(obj, dict):
        raise SaemError(f"{where}: cue_expert_counts must be an object (cue -> [n_layer][n_expert] counts)")
    out = {}
    for cue, c in obj.items():
        a = np.asarray(c, np.float64)
        if a.shape != (n_layer, n_expert) or (a < 0).any():
            raise SaemError(f"{where}: cue_expert_counts[{cue!r}] must be [{n_layer}][{n_expert}] non-negative "
                            f"counts, got shape {a.shape}")
        out[str(cue)] = a
    return out
