"""Held-out evaluation sets of the default model, generated from a seed.

Every in-domain turn is built so that its first (or only) computation is a held-out triple
(``split.is_heldout``): no training reply ever computes it. Follow-up turns compute
``previous answer op x``; ``x`` is chosen so that this triple is held out too whenever one exists
in range (``Turn.heldout`` says whether it is). The wording comes from ``phrasings`` (written apart
from the training templates). The domain is the model contract's: addition and subtraction of
0-999 (never a negative result), a one-digit factor (2-9) times 2-99, word problems of one to
three steps, follow-ups, and out-of-domain turns that should be declined.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from saem_gguf.defaultmodel.eval import phrasings as P
from saem_gguf.defaultmodel.split import is_heldout

SINGLE_KINDS = ("add", "sub", "mul", "word_add", "word_sub", "word_mul", "word_distance", "two_step",
                "three_step")
OUT_OF_DOMAIN = "out_of_domain"
# the role of a turn in its conversation
SINGLE, FIRST, FOLLOW_UP, INDEPENDENT = "single", "first", "follow-up", "independent"
MAX_OPERAND = 999  # add/sub operands are 1 to 3 digits
DRAWS = 5000  # attempts to find a held-out triple before giving up (about 1 in 10 is held out)
Step = tuple[str, int, int]  # one computation: (operation, a, b)


@dataclass(frozen=True)
class Turn:
    question: str
    kind: str  # a SINGLE_KINDS entry, "follow_add" / "follow_sub" / "follow_mul", or OUT_OF_DOMAIN
    role: str  # SINGLE, FIRST, FOLLOW_UP, INDEPENDENT
    answer: int | None  # None for an out-of-domain turn
    # the computations that lead to the answer, in order: (operation, a, b); a later step's a is
    # the result before it (a follow-up's first a is the previous turn's answer)
    steps: tuple[Step, ...] = ()
    pronoun: str | None = None  # the story's subject, for a follow-up in the story's words

    @property
    def in_domain(self) -> bool:
        return self.answer is not None

    @property
    def heldout(self) -> bool:
        """The turn's first computation is a held-out triple."""
        return bool(self.steps) and is_heldout(*self.steps[0])


@dataclass(frozen=True)
class Conversation:
    structure: str  # how its turns are composed (see STRUCTURES)
    turns: tuple[Turn, ...]


def apply(op: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b}[op]


def result_of(steps: tuple[Step, ...]) -> int:
    return apply(*steps[-1])


def _operand(rng: random.Random, low: int = 0) -> int:
    """1 to 3 digits, each digit count equally likely."""
    digits = rng.randint(1, 3)
    return rng.randint(max(low, 10 ** (digits - 1) if digits > 1 else 0), 10 ** digits - 1)


class ProblemMaker:
    """Draws held-out problems and follow-ups from one seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # --- operands ----------------------------------------------------------------------------
    def heldout_operands(self, op: str, max_result: int | None = None, low: int = 0,
                         one_digit_second: bool = False) -> tuple[int, int]:
        """(a, b) with ``a op b`` held out and in the domain (a result <= ``max_result``, add and
        sub operands >= ``low``). Multiplication: a one-digit and a two-digit factor, in either
        order, or the one-digit one second (a speed times hours)."""
        rng = self.rng
        for _ in range(DRAWS):
            if op == "add":
                a, b = _operand(rng, low), _operand(rng, low)
            elif op == "sub":
                a, b = sorted((_operand(rng, low), _operand(rng, low)), reverse=True)
            else:
                a, b = rng.randint(10, 99), rng.randint(2, 9)
                if not one_digit_second and rng.random() < 0.5:
                    a, b = b, a
            if is_heldout(op, a, b) and (max_result is None or apply(op, a, b) <= max_result):
                return a, b
        raise AssertionError(f"no held-out {op} triple found in {DRAWS} draws")

    def follow_operand(self, op: str, prev: int) -> int | None:
        """An operand x for ``prev op x`` in the domain, held out when one can be found; None
        when ``op`` cannot follow ``prev``."""
        if op == "mul":
            if not 2 <= prev <= 99:
                return None
            pool = list(range(2, 10))
        elif op == "add":
            if prev > MAX_OPERAND:
                return None
            pool = list(range(1, MAX_OPERAND + 1))
        else:
            if not 1 <= prev <= MAX_OPERAND:
                return None
            pool = list(range(1, prev + 1))
        held = [x for x in pool if is_heldout(op, prev, x)]
        return self.rng.choice(held or pool)

    # --- wording -----------------------------------------------------------------------------
    def vary_case(self, text: str) -> str:
        r = self.rng.random()
        if r < 0.3:
            return text.lower()
        if r < 0.4:
            return text.upper()
        if r < 0.7:
            return text[:1].upper() + text[1:]
        return text

    def bare(self, template: str, **values: int) -> str:
        q = template.format(**values)
        if any(w in template.lower() for w in P.REQUEST_WORDS):
            return self.vary_case(q)
        fillers = P.FILLER + (P.EXPRESSION_FILLER if template.startswith("{") else ())
        before, after = self.rng.choice(fillers)
        if before and not q[:1].isdigit():
            q = q[:1].lower() + q[1:]
        if after:
            q = q.rstrip("?.")
        return self.vary_case(before + q + after)

    def story(self, template: str, **values: int) -> tuple[str, str | None]:
        """The story's text and its subject pronoun when it is about a named person counting
        items (a follow-up may then use the story's words)."""
        name, they, their = self.rng.choice(P.NAMES)
        text = template.format(name=name, they=they, their=their, items=self.rng.choice(P.ITEMS), **values)
        return text, they if "{name}" in template and "{items}" in template else None

    # --- turns -------------------------------------------------------------------------------
    def question(self, kind: str, role: str, max_result: int | None = None) -> Turn:
        """A held-out in-domain turn of ``kind`` (a SINGLE_KINDS entry)."""
        rng = self.rng
        pronoun = None
        if kind in ("add", "sub", "mul"):
            a, b = self.heldout_operands(kind, max_result)
            text = self.bare(rng.choice({"add": P.ADD, "sub": P.SUB, "mul": P.MUL}[kind]), a=a, b=b)
            steps = ((kind, a, b),)
        elif kind in ("word_add", "word_sub", "word_mul"):
            op = kind[len("word_"):]
            a, b = self.heldout_operands(op, max_result, low=1)
            text, pronoun = self.story(rng.choice({"add": P.WORD_ADD, "sub": P.WORD_SUB, "mul": P.WORD_MUL}[op]),
                                       a=a, b=b)
            steps = ((op, a, b),)
        elif kind == "word_distance":  # speed (two digits) x hours (one digit)
            a, b = self.heldout_operands("mul", one_digit_second=True)
            text, _ = self.story(rng.choice(P.WORD_DISTANCE), a=a, b=b)
            steps = (("mul", a, b),)
        elif kind in ("two_step", "three_step"):
            text, steps = self._multi_step(P.TWO_STEP if kind == "two_step" else P.THREE_STEP, max_result)
        else:
            raise ValueError(f"unknown problem kind {kind!r}")
        return Turn(text, kind, role, result_of(steps), steps, pronoun)

    def _multi_step(self, templates, max_result: int | None) -> tuple[str, tuple[Step, ...]]:
        """A story whose first step is a held-out triple and whose later steps stay in the domain
        (every intermediate result 0-999)."""
        rng = self.rng
        template, *ops = rng.choice(templates)
        limit = MAX_OPERAND if max_result is None else min(MAX_OPERAND, max_result)
        speed = "per hour" in template
        for _ in range(DRAWS):
            a, b = self.heldout_operands(ops[0], MAX_OPERAND, low=1, one_digit_second=speed)
            steps = [(ops[0], a, b)]
            result = apply(ops[0], a, b)
            for op in ops[1:]:
                if op == "sub" and result < 1:
                    break
                x = rng.randint(1, result) if op == "sub" else _operand(rng, low=1)
                steps.append((op, result, x))
                result = apply(op, result, x)
            if len(steps) == len(ops) and 0 <= result <= limit:
                values = dict(zip("cd", (x for _, _, x in steps[1:])))
                text, _ = self.story(template, a=a, b=b, **values)
                return text, tuple(steps)
        raise AssertionError(f"no in-domain story found for {template!r}")

    def follow_up(self, prev: Turn) -> Turn | None:
        """A turn that refers to ``prev``'s answer, or None when no operation can follow it."""
        rng = self.rng
        ops = ["add", "sub", "mul"]
        rng.shuffle(ops)
        for op in ops:
            got = self.follow_operand(op, prev.answer)
            if got is None:
                continue
            x = got
            if prev.pronoun is not None and op in ("add", "sub") and rng.random() < 0.5:
                template = rng.choice(P.FOLLOW_STORY_ADD if op == "add" else P.FOLLOW_STORY_SUB)
                text = template.format(x=x, they=prev.pronoun)
                pronoun = prev.pronoun
            else:
                template = rng.choice({"add": P.FOLLOW_ADD, "sub": P.FOLLOW_SUB, "mul": P.FOLLOW_MUL}[op])
                text, pronoun = self.vary_case(template.format(x=x)), None
            return Turn(text, f"follow_{op}", FOLLOW_UP, apply(op, prev.answer, x), ((op, prev.answer, x),), pronoun)
        return None

    def out_of_domain(self, role: str) -> Turn:
        return Turn(self.rng.choice(P.OUT_OF_DOMAIN), OUT_OF_DOMAIN, role, None)

    def any_question(self, role: str, followed: bool) -> Turn:
        """An in-domain turn of a random kind; its answer leaves room for a follow-up when one
        comes next."""
        return self.question(self.rng.choice(SINGLE_KINDS), role, MAX_OPERAND if followed else None)


# Conversation structures: each builds its turns with a ProblemMaker. "F" = a follow-up of the
# turn before, "I" = an independent in-domain question, "O" = out of domain, "Q" = the first
# in-domain question.
STRUCTURES = ("QFF", "QIF", "QFI", "OQF", "QOI")


def _build(maker: ProblemMaker, structure: str) -> tuple[Turn, ...] | None:
    turns: list[Turn] = []
    for i, code in enumerate(structure):
        followed = i + 1 < len(structure) and structure[i + 1] == "F"
        role = FIRST if i == 0 else INDEPENDENT
        if code == "O":
            turns.append(maker.out_of_domain(role))
        elif code in "QI":
            turns.append(maker.any_question(role, followed))
        else:
            turn = maker.follow_up(turns[-1])
            if turn is None:
                return None
            turns.append(turn)
    return tuple(turns)


@dataclass(frozen=True)
class EvalSets:
    single: tuple[Turn, ...]  # one question per conversation
    conversations: tuple[Conversation, ...]  # multi-turn
    out_of_domain: tuple[Turn, ...]  # one out-of-domain first turn per conversation


def make_sets(seed: int, per_kind: int, n_conversations: int, n_out_of_domain: int) -> EvalSets:
    """The evaluation sets for ``seed``: ``per_kind`` single-turn problems of every kind,
    ``n_conversations`` three-turn conversations (the STRUCTURES in turn), ``n_out_of_domain``
    single out-of-domain turns."""
    maker = ProblemMaker(seed)
    single = tuple(maker.question(kind, SINGLE) for _ in range(per_kind) for kind in SINGLE_KINDS)
    convs: list[Conversation] = []
    while len(convs) < n_conversations:
        structure = STRUCTURES[len(convs) % len(STRUCTURES)]
        turns = _build(maker, structure)
        if turns is not None:
            convs.append(Conversation(structure, turns))
    ood = tuple(maker.out_of_domain(SINGLE) for _ in range(n_out_of_domain))
    return EvalSets(single, tuple(convs), ood)


def question_lines(seed: int, n: int, kinds: tuple[str, ...] = SINGLE_KINDS) -> list[str]:
    """``n`` held-out single-turn questions (kinds in turn), one per line: a ``--prompts`` file for
    ``trace``."""
    maker = ProblemMaker(seed)
    return [maker.question(kinds[i % len(kinds)], SINGLE).question for i in range(n)]

