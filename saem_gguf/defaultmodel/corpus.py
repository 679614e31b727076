"""Generated chain-of-thought corpus for the default model (all text here is synthetic, seeded).

Each example is one ChatML conversation: a user question (2-digit addition / subtraction,
one-digit multiplication, or a small word problem) and an assistant turn

    <think>
    First, ...            compute: column arithmetic ("ones", "tens", "carry", "borrow")
    Wait, ...             pause: re-examine a step, sometimes fixing a planted slip (optional)
    Alternatively, ...    alternative: the same result another way ("split", "round") (optional)
    Let me verify ...     verify: the inverse operation ("adding back", "matches") (optional)
    Therefore, ...        conclude: "the answer is"
    </think>

    Answer: N<|im_end|>

Each stage type has its own vocabulary, as real reasoning traces do, and starts with one of the
cues that ``saem_gguf/data/cues/*.json`` know. The rates of the optional stages are the
``STAGE_RATES`` below. A fixed tenth of the operand tuples (by hash) never appears in training:
``heldout_examples`` draws from exactly those, so held-out problems are unseen but of the
training distribution.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIALS = ("<|endoftext|>", IM_START, IM_END, THINK_OPEN, THINK_CLOSE)

# problem kind -> share of the corpus
KIND_WEIGHTS = {"add": 0.27, "sub": 0.22, "mul": 0.07, "word_add": 0.11, "word_sub": 0.11,
                "word_mul": 0.05, "word_two": 0.10, "word_three": 0.07}
# optional stages: probability that a trace has one
STAGE_RATES = {"pause": 0.35, "slip": 0.08, "alternative": 0.30, "verify": 0.55,
               "verify_before_alternative": 0.3}
SYSTEM_RATE = 0.15
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful math tutor.",
                  "Think step by step.")

NAMES = (("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Sara", "She"), ("Leo", "He"),
         ("Mia", "She"), ("Sam", "He"), ("Lily", "She"), ("Max", "He"), ("Emma", "She"))
ITEMS = ("apples", "marbles", "books", "stickers", "cookies", "pencils", "coins", "cards",
         "shells", "stamps")
CONTAINERS = ("boxes", "bags", "rows", "packs", "baskets")

PAUSE_CUES = (("Wait, ", 0.55), ("Hmm, ", 0.2), ("Hold on, ", 0.15), ("But wait, ", 0.1))
ALT_CUES = (("Alternatively, ", 0.6), ("Another way: ", 0.25), ("Instead, ", 0.15))
VERIFY_CUES = (("Let me verify", 0.4), ("Let me check", 0.35), ("Let me double-check", 0.15),
               ("Let me recheck", 0.1))


@dataclass
class Example:
    kind: str
    question: str
    answer: int
    stages: list[tuple[str, str]]  # (stage type, text), in order, inside <think>
    system: str | None = None
    key: tuple = field(default=())  # the operand tuple (held-out split key)

    @property
    def prompt(self) -> str:
        return prompt_text(self.question, self.system)

    @property
    def completion(self) -> str:
        body = "\n".join(t for _, t in self.stages)
        return f"{THINK_OPEN}\n{body}\n{THINK_CLOSE}\n\nAnswer: {self.answer}{IM_END}"

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def prompt_text(question: str, system: str | None = None) -> str:
    """ChatML up to the assistant turn, exactly as the GGUF's chat template renders it."""
    sys_part = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return f"{sys_part}{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"


def is_heldout(kind: str, key: tuple) -> bool:
    """A fixed 10% of operand tuples, never used for training."""
    return zlib.crc32(repr((kind.removeprefix("word_"), key)).encode()) % 10 == 0


def _pick(rng: random.Random, weighted) -> str:
    r, acc = rng.random(), 0.0
    for item, w in weighted:
        acc += w
        if r < acc:
            return item
    return weighted[-1][0]


# --- column arithmetic -----------------------------------------------------------------------

def add_steps(a: int, b: int, slip: bool = False) -> tuple[str, int, bool]:
    """Text of a + b by columns, the result written, and whether it needed a carry."""
    a1, a10, b1, b10 = a % 10, a // 10, b % 10, b // 10
    s1 = a1 + b1
    carry = s1 >= 10
    if carry:
        t = a10 + b10 + 1
        out = f"The ones: {a1} + {b1} = {s1}, so I write {s1 - 10} and carry 1. "
        if slip:  # forget the carry
            t -= 1
            out += (f"The tens: {a10} + {b10} = {t}. " if b10 else f"The tens: {a10}. ")
        else:
            out += (f"The tens: {a10} + {b10} + 1 = {t}. " if b10 else f"The tens: {a10} + 1 = {t}. ")
    else:
        t = a10 + b10
        out = f"The ones: {a1} + {b1} = {s1}. "
        out += f"The tens: {a10} + {b10} = {t}. " if b10 else f"The tens stay {a10}. "
    c = 10 * t + s1 % 10
    return out + f"So {a} + {b} = {c}.", c, carry


def sub_steps(a: int, b: int, slip: bool = False) -> tuple[str, int, bool]:
    """Text of a - b (a >= b) by columns, the result written, and whether it borrowed."""
    a1, a10, b1, b10 = a % 10, a // 10, b % 10, b // 10
    borrow = a1 < b1
    if borrow:
        d1 = a1 + 10 - b1
        out = (f"The ones: {a1} is less than {b1}, so I borrow 1 from the tens: "
               f"{a1 + 10} - {b1} = {d1}. ")
        if slip:  # forget to take the borrowed ten away
            d10 = a10 - b10
            out += f"The tens: {a10} - {b10} = {d10}. "
        else:
            d10 = a10 - 1 - b10
            out += f"The tens: {a10} - 1 - {b10} = {d10}. "
    else:
        d1 = a1 - b1
        d10 = a10 - b10
        out = f"The ones: {a1} - {b1} = {d1}. "
        out += f"The tens: {a10} - {b10} = {d10}. " if b10 else f"The tens stay {a10}. "
    c = 10 * d10 + d1
    return out + f"So {a} - {b} = {c}.", c, borrow


# --- stages per operation --------------------------------------------------------------------

def _add_stages(rng, a, b, lead):
    slip = rng.random() < STAGE_RATES["slip"] / 0.45  # ~45% of sums carry
    steps, got, carry = add_steps(a, b, slip=slip)
    slip = slip and carry
    c = a + b
    stages = [("compute", lead + steps)]
    a1, a10, b1, b10 = a % 10, a // 10, b % 10, b // 10
    if slip:
        t = a10 + b10 + 1
        tens = f"{a10} + {b10} + 1" if b10 else f"{a10} + 1"
        stages.append(("pause", _pick(rng, PAUSE_CUES) + f"I forgot the carry. The tens are {tens} = {t}, "
                                                         f"so {a} + {b} = {c}."))
    elif rng.random() < STAGE_RATES["pause"]:
        cue = _pick(rng, PAUSE_CUES)
        if rng.random() < 0.6:
            s1 = a1 + b1
            why = "more than 9, so the carry is 1" if s1 >= 10 else "less than 10, so there is no carry"
            stages.append(("pause", cue + f"did I need a carry? {a1} + {b1} = {s1}, which is {why}. Good."))
        else:
            tens = f"{a10} + {b10}" if b10 else f"{a10}"
            tens += " + 1" if a1 + b1 >= 10 else ""
            stages.append(("pause", cue + f"let me look at the tens again: {tens} = {c // 10}. Yes."))
    alt = None
    if rng.random() < STAGE_RATES["alternative"]:
        cue = _pick(rng, ALT_CUES)
        r = rng.random()
        if b10 and b1 and r < 0.45:
            x = a + 10 * b10
            alt = cue + f"split {b} into {10 * b10} and {b1}. {a} + {10 * b10} = {x}, and {x} + {b1} = {c}."
        elif b1 >= 5 and r < 0.8:
            rr = 10 * (b10 + 1)
            y = a + rr
            alt = cue + f"round {b} up to {rr}. {a} + {rr} = {y}, and {y} - {rr - b} = {c}."
        else:
            alt = cue + f"start from {b} and add {a}: {b} + {a} = {c}, the same."
    ver = None
    if rng.random() < STAGE_RATES["verify"]:
        cue = _pick(rng, VERIFY_CUES)
        r = rng.random()
        if r < 0.5:
            ver = cue + f" by subtracting: {c} - {b} = {a}. That matches."
        elif r < 0.8:
            ver = cue + f": {c} - {a} = {b}. Yes, it is right."
        else:
            ver = cue + f" the ones digit: {a1} + {b1} ends in {(a1 + b1) % 10}, and {c} ends in {c % 10}. Good."
    return stages, alt, ver, c


def _sub_stages(rng, a, b, lead):
    slip = rng.random() < STAGE_RATES["slip"] / 0.45
    steps, got, borrow = sub_steps(a, b, slip=slip)
    slip = slip and borrow
    c = a - b
    stages = [("compute", lead + steps)]
    a1, a10, b1, b10 = a % 10, a // 10, b % 10, b // 10
    if slip:
        stages.append(("pause", _pick(rng, PAUSE_CUES) + f"I forgot the borrow. The tens are {a10} - 1 - {b10} = "
                                                         f"{a10 - 1 - b10}, so {a} - {b} = {c}."))
    elif rng.random() < STAGE_RATES["pause"]:
        cue = _pick(rng, PAUSE_CUES)
        if a1 < b1:
            stages.append(("pause", cue + f"did I need to borrow? {a1} is less than {b1}, so yes, I borrow 1. Good."))
        else:
            stages.append(("pause", cue + f"did I need to borrow? {a1} is not less than {b1}, so no borrow. Good."))
    alt = None
    if rng.random() < STAGE_RATES["alternative"]:
        cue = _pick(rng, ALT_CUES)
        if b10 and b1 and rng.random() < 0.6:
            x = a - 10 * b10
            alt = cue + f"take away the tens first: {a} - {10 * b10} = {x}, then {x} - {b1} = {c}."
        else:
            alt = cue + f"count up from {b} to {a}: {b} + {c} = {a}, so the difference is {c}."
    ver = None
    if rng.random() < STAGE_RATES["verify"]:
        cue = _pick(rng, VERIFY_CUES)
        if rng.random() < 0.6:
            ver = cue + f" by adding back: {c} + {b} = {a}. That matches."
        else:
            ver = cue + f": {a} - {c} = {b}. Correct."
    return stages, alt, ver, c


def _mul_stages(rng, n, m, lead):
    p = n * m
    stages = [("compute", lead + f"{n} times {m} is {p}. So {n} * {m} = {p}.")]
    if rng.random() < STAGE_RATES["pause"]:
        stages.append(("pause", _pick(rng, PAUSE_CUES) + f"is {n} times {m} really {p}? "
                                                         f"{m} times {n} is the same, {p}. Yes."))
    alt = None
    if rng.random() < STAGE_RATES["alternative"]:
        counts = ", ".join(str(m * i) for i in range(1, n + 1))
        alt = _pick(rng, ALT_CUES) + f"count by {m}s {n} times: {counts}. That gives {p}."
    ver = None
    if rng.random() < STAGE_RATES["verify"]:
        ver = _pick(rng, VERIFY_CUES) + f": {p} split into {n} equal groups is {m} each. Correct."
    return stages, alt, ver, p


def _assemble(rng, stages, alt, ver, conclude):
    extra = [("alternative", alt), ("verify", ver)]
    if rng.random() < STAGE_RATES["verify_before_alternative"]:
        extra.reverse()
    stages = stages + [(k, t) for k, t in extra if t]
    stages.append(("conclude", conclude))
    return stages


def _conclude(rng, c, sentence=None):
    if sentence and rng.random() < 0.6:
        return f"Therefore, {sentence}"
    return f"Therefore, the answer is {c}." if rng.random() < 0.65 else f"So the answer is {c}."


PART_CUES = (("But wait, ", 0.35), ("Okay, so ", 0.45), ("Hold on, ", 0.2))


def _multi_step(rng, name, item, steps):
    """A problem in parts; each later part opens with a pause cue, and its optional check
    follows it, so adjacent stages share the part's operation (stage-scale locality)."""
    stages: list[tuple[str, str]] = []
    total = None
    for i, (op, val) in enumerate(steps):
        if op == "has":
            total = val
            continue
        if op == "mul":
            n, m, box = val
            total = n * m
            stages.append(("compute", f"First, {n} {box} of {m} {item}: {n} times {m} is {total}. "
                                      f"So {name} starts with {total} {item}."))
            if rng.random() < STAGE_RATES["verify"]:
                stages.append(("verify", _pick(rng, VERIFY_CUES) + f": {total} split into {n} equal groups "
                                                                   f"is {m} each. Correct."))
            continue
        first = not stages
        lead = "First, " if first else _pick(rng, PART_CUES) + "then "
        if op in ("gives",):
            steps_txt, new, _ = sub_steps(total, val)
            text = lead + f"{name} gives away {val}, so I subtract {total} - {val}. " + steps_txt
            check = f" by adding back: {new} + {val} = {total}. That matches."
        else:
            steps_txt, new, _ = add_steps(total, val)
            text = lead + f"{name} {op} {val} more, so I add {total} + {val}. " + steps_txt
            check = f" by subtracting: {new} - {val} = {total}. That matches."
        stages.append(("compute", text))
        if rng.random() < STAGE_RATES["verify"]:
            stages.append(("verify", _pick(rng, VERIFY_CUES) + check))
        total = new
    stages.append(("conclude", _conclude(rng, total, f"{name} has {total} {item} now.")))
    return stages, total


# --- problems --------------------------------------------------------------------------------

def _operands(rng, kind):
    if kind in ("add", "word_add"):
        a = rng.randint(10, 99)
        b = rng.randint(10, 99) if rng.random() < 0.75 else rng.randint(1, 9)
        if rng.random() < 0.5:
            a, b = max(a, b), min(a, b)
        return (a, b)
    if kind in ("sub", "word_sub"):
        a = rng.randint(10, 99)
        b = rng.randint(10, a) if rng.random() < 0.75 else rng.randint(1, 9)
        return (a, b)
    if kind in ("mul", "word_mul"):
        return (rng.randint(2, 9), rng.randint(2, 9))
    if kind == "word_two":
        a = rng.randint(20, 99)
        b = rng.randint(1, a - 1)
        d = rng.randint(1, 60)
        return (a, b, d)
    if kind == "word_three":
        n, m = rng.randint(2, 9), rng.randint(3, 9)
        b = rng.randint(1, n * m - 1)
        d = rng.randint(1, 40)
        return (n, m, b, d)
    raise ValueError(kind)


def make_example(rng: random.Random, kind: str, key: tuple) -> Example:
    name, pron = rng.choice(NAMES)
    other = rng.choice([n for n, _ in NAMES if n != name])
    item = rng.choice(ITEMS)
    if kind == "add":
        a, b = key
        q = rng.choice((f"What is {a} + {b}?", f"Calculate {a} + {b}.", f"Compute {a} plus {b}.",
                        f"{a} + {b} = ?", f"Add {a} and {b}.", f"What is {a} plus {b}?"))
        lead = rng.choice((f"First, I need to add {a} and {b}. ", f"First, let me add {a} and {b} digit by digit. ",
                           f"First, I add {a} + {b} column by column. "))
        st, alt, ver, c = _add_stages(rng, a, b, lead)
        stages = _assemble(rng, st, alt, ver, _conclude(rng, c, f"{a} + {b} = {c}."))
    elif kind == "sub":
        a, b = key
        q = rng.choice((f"What is {a} - {b}?", f"Calculate {a} - {b}.", f"Subtract {b} from {a}.",
                        f"{a} - {b} = ?", f"What is {a} minus {b}?"))
        lead = rng.choice((f"First, I need to subtract {b} from {a}. ", f"First, let me subtract {a} - {b} digit by digit. ",
                           f"First, I subtract {b} from {a} column by column. "))
        st, alt, ver, c = _sub_stages(rng, a, b, lead)
        stages = _assemble(rng, st, alt, ver, _conclude(rng, c, f"{a} - {b} = {c}."))
    elif kind == "mul":
        n, m = key
        q = rng.choice((f"What is {n} * {m}?", f"What is {n} times {m}?", f"Calculate {n} * {m}.",
                        f"Multiply {n} by {m}."))
        lead = rng.choice(("First, I need to multiply. ", f"First, let me multiply {n} by {m}. "))
        st, alt, ver, c = _mul_stages(rng, n, m, lead)
        stages = _assemble(rng, st, alt, ver, _conclude(rng, c, f"{n} * {m} = {c}."))
    elif kind == "word_add":
        a, b = key
        verb = rng.choice(("gets", "finds", "buys"))
        q = f"{name} has {a} {item}. {pron} {verb} {b} more. How many {item} does {name} have now?"
        lead = f"First, {name} starts with {a} {item} and {verb} {b} more, so I add {a} + {b}. "
        st, alt, ver, c = _add_stages(rng, a, b, lead)
        stages = _assemble(rng, st, alt, ver, _conclude(rng, c, f"{name} has {c} {item} now."))
    elif kind == "word_sub":
        a, b = key
        q = rng.choice((f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?",
                        f"{name} has {a} {item}. {pron} loses {b} of them. How many {item} are left?"))
        lead = f"First, {name} has {a} {item} and {b} go away, so I subtract {a} - {b}. "
        st, alt, ver, c = _sub_stages(rng, a, b, lead)
        stages = _assemble(rng, st, alt, ver, _conclude(rng, c, f"{name} has {c} {item} left."))
    elif kind == "word_mul":
        n, m = key
        box = rng.choice(CONTAINERS)
        q = f"{name} has {n} {box} with {m} {item} in each. How many {item} are there in total?"
        lead = f"First, there are {n} {box} of {m} {item}, so I multiply {n} * {m}. "
        st, alt, ver, c = _mul_stages(rng, n, m, lead)
        stages = _assemble(rng, st, alt, ver, _conclude(rng, c, f"there are {c} {item} in total."))
    elif kind == "word_two":
        a, b, d = key
        q = (f"{name} has {a} {item}. {pron} gives {b} to {other} and then buys {d} more. "
             f"How many {item} does {name} have now?")
        stages, c = _multi_step(rng, name, item, [("has", a), ("gives", b), ("buys", d)])
    elif kind == "word_three":
        n, m, b, d = key
        box = rng.choice(CONTAINERS)
        q = (f"{name} buys {n} {box} of {m} {item}. {pron} gives {b} to {other} and then finds {d} more. "
             f"How many {item} does {name} have now?")
        stages, c = _multi_step(rng, name, item, [("mul", (n, m, box)), ("gives", b), ("finds", d)])
    else:
        raise ValueError(kind)
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < SYSTEM_RATE else None
    return Example(kind=kind, question=q, answer=c, stages=stages, system=system, key=key)


def _draw(rng: random.Random, heldout: bool) -> Example:
    kinds, weights = zip(*KIND_WEIGHTS.items())
    while True:
        kind = rng.choices(kinds, weights)[0]
        key = _operands(rng, kind)
        # one-digit multiplication facts are split by question wording, not by operands
        split_key = key if kind not in ("mul", "word_mul") else (key, rng.random())
        if is_heldout(kind, split_key) == heldout:
            return make_example(rng, kind, key)


def training_examples(n: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    return [_draw(rng, heldout=False) for _ in range(n)]


def heldout_examples(n: int, seed: int = 12345) -> list[Example]:
    """Problems of the training distribution whose operand tuples training never uses (for
    one-digit multiplication, whose 64 facts all occur in training, a fresh draw)."""
    rng = random.Random(seed)
    return [_draw(rng, heldout=True) for _ in range(n)]


if __name__ == "__main__":  # print a few examples
    import sys

    for ex in training_examples(int(sys.argv[1]) if len(sys.argv) > 1 else 5, seed=0):
        print(ex.text)
        print("-" * 60)
