"""Stages of generated replies: where the qwen3 cue set cuts them (no minimum stage length), and
their length statistics.

A reply's tokens are cut at every qwen3 cue the stage detector's matcher finds in their pieces, at
the token that completes the cue (where the live detector fires).
The *reasoning stages* are the segments before the ``</think>`` cut (the first opens with
``<think>``); the segment from ``</think>`` on (the answer line) is not a reasoning stage and is
left out of the length statistics, but it is a stage for TCseq, as in the detector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from saem_gguf.defaultmodel.eval.scoring import CUE_SET, THINK_CLOSE


@dataclass(frozen=True)
class ReplyStages:
    bounds: np.ndarray  # int64 [S + 1]: stage s is tokens [bounds[s], bounds[s+1]) of the reply
    openers: tuple[str, ...]  # the cue opening each stage ("" for the first)

    @property
    def reasoning_lengths(self) -> np.ndarray:
        """Token lengths of the stages before ``</think>`` (all of them without one)."""
        n = self.openers.index(THINK_CLOSE) if THINK_CLOSE in self.openers else len(self.openers)
        return np.diff(self.bounds)[:n]


def reply_stages(pieces: Sequence[bytes]) -> ReplyStages:
    """Cut a reply (its tokens' text pieces) at every qwen3 cue; the first cue found at a token
    names the stage it opens."""
    from saem_gguf.stage.cues import load_cues
    from saem_gguf.stage.matcher import find_cues

    cues = load_cues(CUE_SET)
    return cut_at_cues(find_cues(cues, list(pieces)), cues, len(pieces))


def cut_at_cues(cue_events, cues, n_tokens: int) -> ReplyStages:
    """The stages of ``n_tokens`` tokens cut where ``cue_events`` ((cue index into ``cues``,
    token) pairs, as ``find_cues`` returns them) fall inside; the first cue at a token opens it."""
    opener: dict[int, str] = {}
    for c, t in cue_events:
        if 0 < t < n_tokens:
            opener.setdefault(t, cues[c].text)
    cuts = sorted(opener)
    return ReplyStages(np.array([0, *cuts, n_tokens], np.int64), ("", *(opener[t] for t in cuts)))


def length_statistics(replies: Sequence[ReplyStages]) -> dict:
    """Reasoning-stage lengths in tokens (median, mean, 10th and 90th percentile) and reasoning
    stages per reply, over ``replies``."""
    lengths = np.concatenate([r.reasoning_lengths for r in replies]) if replies else np.zeros(0)
    counts = np.array([len(r.reasoning_lengths) for r in replies])
    if not lengths.size:
        return {"n_replies": len(replies), "n_stages": 0}

    def pct(x: np.ndarray, q: float) -> float:
        return round(float(np.percentile(x, q)), 1)

    return {"n_replies": len(replies), "n_stages": int(lengths.size),
            "length_median": pct(lengths, 50), "length_mean": round(float(lengths.mean()), 1),
            "length_p10": pct(lengths, 10), "length_p90": pct(lengths, 90),
            "stages_per_reply_mean": round(float(counts.mean()), 2),
            "stages_per_reply_median": pct(counts, 50),
            "stages_per_reply_min": int(counts.min()), "stages_per_reply_max": int(counts.max())}
