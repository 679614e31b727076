"""Scoring one reply against the model contract (docs/DEFAULT_MODEL.md, "Evaluation").

An in-domain reply is ``<think>`` reasoning ``</think>`` then exactly one ``Answer: N`` line. It is
*well formed* when it opens with ``<think>``, closes the think block once, has at least one stage
opened by a qwen3 cue inside the think block, and exactly one ``Answer:`` after it, holding an
integer; it is *correct* when that one answer line holds the expected N. An out-of-domain reply
is *well formed* with a think block and no ``Answer:`` after it, and is a *refusal* when it is
well formed and its visible text says what the model does: it contains "arithmetic".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_MARK = "Answer:"
ANSWER_LINE = re.compile(r"^[ \t]*Answer:[ \t]*(-?\d+)[ \t]*\.?[ \t]*$", re.MULTILINE)
REFUSAL_WORD = "arithmetic"
CUE_SET = "qwen3"
THINK_MARKERS = (THINK_OPEN, THINK_CLOSE)  # cues that delimit the think block, not open a stage in it


@lru_cache(maxsize=1)
def _cues():
    from saem_gguf.stage.cues import load_cues

    return load_cues(CUE_SET)


def cues_in(text: str) -> list[str]:
    """The qwen3 cue texts found in ``text``, in order (the stage detector's matcher, fed one
    character per piece)."""
    from saem_gguf.stage.matcher import find_cues

    cues = _cues()
    return [cues[c].text for c, _ in find_cues(cues, [ch.encode() for ch in text])]


@dataclass(frozen=True)
class Score:
    has_think: bool  # opens with <think> and closes it exactly once
    stage_cues: int  # cues inside the think block that open a stage (not <think>/</think>)
    answer_marks: int  # "Answer:" occurrences after </think>
    answer: int | None  # N of the single well-formed answer line, if there is exactly one
    mentions_arithmetic: bool  # the visible text (after </think>) says "arithmetic"

    def well_formed(self, in_domain: bool) -> bool:
        if in_domain:
            return self.has_think and self.stage_cues >= 1 and self.answer_marks == 1 and self.answer is not None
        return self.has_think and self.answer_marks == 0

    def correct(self, expected: int | None) -> bool:
        """In domain: the one answer line holds ``expected``. Out of domain (``expected`` None):
        a well-formed refusal."""
        if expected is None:
            return self.well_formed(False) and self.mentions_arithmetic
        return self.answer_marks == 1 and self.answer == expected


def score_reply(text: str) -> Score:
    has_think = text.startswith(THINK_OPEN) and text.count(THINK_CLOSE) == 1 and text.count(THINK_OPEN) == 1
    think, _, visible = text.partition(THINK_CLOSE) if THINK_CLOSE in text else (text, "", "")
    stage_cues = sum(c not in THINK_MARKERS for c in cues_in(think))
    lines = ANSWER_LINE.findall(visible)
    marks = visible.count(ANSWER_MARK)
    answer = int(lines[0]) if marks == 1 and len(lines) == 1 else None
    return Score(has_think, stage_cues, marks, answer, REFUSAL_WORD in visible.lower())
