"""Generated chat corpus for the default model, version 2 (all text here is synthetic, seeded).

A training conversation has 1 to 6 user turns. Each assistant reply is

    <think>
    First, ...            plan + compute: restate, then column arithmetic ("ones column", "carry")
    Okay, so / But wait   the next step of a multi-step problem (compute again)
    Wait, / Hmm, ...      pause: go back over the hardest column (optional)
    Alternatively, ...    the same result another way (optional)
    Let me verify ...     verify: the inverse operation, column by column (optional)
    Therefore, ...        conclude: the steps put together
    </think>

    Answer: N<|im_end|>

Out-of-domain turns (greetings, "who are you?", general knowledge, code, jokes) get a short think
block and a visible reply without an ``Answer:`` line that says the model only does arithmetic.
Later turns either ask an independent question or refer to the previous answer ("and if she buys
5 more?", "multiply that by 3").

Rendering follows the GGUF's chat template (``CHAT_TEMPLATE``): ChatML, with every EARLIER
assistant message reduced to its text after the last ``</think>`` (as Qwen3's template does), so
the model only ever sees its own earlier answers as ``Answer: N``. One training sequence is one
(conversation, turn) pair: the history rendered that way, then the turn's full reply; the loss
counts the reply only.

Held-out split: every ``a op b`` a reply writes out (main steps, verification, alternatives,
multi-digit carries) is recorded, and no training reply contains a triple that
``split.is_heldout`` holds out. One-digit facts are never held out, and the column text is
written so that its digit steps are one-digit facts (a borrow is worked out by counting up:
"6 + 8 = 14"), so a held-out problem needs no fact the model has not seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from saem_gguf.defaultmodel.split import is_heldout

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIALS = ("<|endoftext|>", IM_START, IM_END, THINK_OPEN, THINK_CLOSE)

# ChatML; an assistant message is rendered as its text after the last </think>, leading newlines
# stripped (Qwen3's rule for earlier turns). The generation prompt ends at "assistant\n": the
# model writes <think> itself. `render_prompt` below is the same function in Python.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# first-turn (and independent later-turn) problem kind -> weight
KIND_WEIGHTS = {"add": 0.15, "sub": 0.14, "mul": 0.11, "word_add": 0.09, "word_sub": 0.09,
                "word_mul": 0.09, "word_two": 0.09, "word_three": 0.07, "ood": 0.07}
N_TURNS_WEIGHTS = {1: 0.3, 2: 0.2, 3: 0.18, 4: 0.13, 5: 0.1, 6: 0.09}
FOLLOW_UP_RATE = 0.55  # a later turn refers to the previous answer (when that answer allows it)
# optional stages: probability that a reply has one
STAGE_RATES = {"pause": 0.45, "alternative": 0.3, "verify": 0.75}
SYSTEM_RATE = 0.12
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful math tutor.", "Think step by step.",
                  "You are a friendly assistant that shows its work.")

NAMES = (("Tom", "he", "his"), ("Anna", "she", "her"), ("Ben", "he", "his"), ("Sara", "she", "her"),
         ("Leo", "he", "his"), ("Mia", "she", "her"), ("Omar", "he", "his"), ("Lily", "she", "her"),
         ("Max", "he", "his"), ("Emma", "she", "her"), ("Ravi", "he", "his"), ("Zoe", "she", "her"),
         ("a farmer", "he", "his"), ("the teacher", "she", "her"), ("Carlos", "he", "his"), ("Yuki", "she", "her"))
ITEMS = ("apples", "marbles", "books", "stickers", "cookies", "pencils", "coins", "cards", "shells",
         "stamps", "cows", "sheep", "eggs", "flowers", "toy cars", "balloons", "tickets", "chairs")
CONTAINERS = ("boxes", "bags", "rows", "packs", "baskets", "crates", "shelves", "trays")
GAIN_VERBS = (("buys", "buy"), ("gets", "get"), ("finds", "find"), ("receives", "receive"), ("picks up", "pick up"),
              ("is given", "be given"), ("collects", "collect"), ("wins", "win"), ("earns", "earn"),
              ("adds", "add"), ("is handed", "be handed"))
LOSS_VERBS = (("gives away", "give away"), ("loses", "lose"), ("sells", "sell"), ("uses", "use"),
              ("eats", "eat"), ("gives", "give"), ("drops", "drop"), ("throws away", "throw away"),
              ("donates", "donate"), ("hands out", "hand out"), ("trades away", "trade away"))
UNITS = (("km", "km per hour", "hours"), ("miles", "miles per hour", "hours"), ("km", "km an hour", "hours"),
         ("meters", "meters per minute", "minutes"), ("miles", "mph", "hours"))
VEHICLES = ("a train", "a car", "a bus", "a cyclist", "a truck", "a boat", "a runner", "a plane")

PAUSE_CUES = ("Wait, ", "Hmm, ", "Hold on, ", "But wait, ")
NEXT_STEP_CUES = ("Okay, so ", "But wait, ", "Hold on, ")
ALT_CUES = ("Alternatively, ", "Another way: ", "Instead, ")
VERIFY_CUES = ("Let me verify", "Let me check", "Let me double-check", "Let me recheck")
PLACES = ("ones", "tens", "hundreds", "thousands")
ORDINALS = ("first", "second", "third", "fourth")


class HeldOutTriple(Exception):
    """A draft reply computed a held-out triple: the draft is discarded and redrawn."""


@dataclass
class Work:
    """The ``a op b`` computations a reply writes out, checked against the held-out split as they
    are written (``strict``: raise, so training text never contains one)."""

    strict: bool = True
    triples: list[tuple[str, int, int]] = field(default_factory=list)

    def note(self, op: str, a: int, b: int) -> None:
        if self.strict and is_heldout(op, a, b):
            raise HeldOutTriple((op, a, b))
        self.triples.append((op, a, b))

    def fork(self) -> Work:
        return Work(strict=self.strict)

    def join(self, other: Work) -> None:
        self.triples.extend(other.triples)


def digits(n: int) -> list[int]:
    """Digits of n, ones first."""
    out = []
    while True:
        out.append(n % 10)
        n //= 10
        if n == 0:
            return out


# --- column arithmetic, written out ----------------------------------------------------------

def add_columns(w: Work, a: int, b: int) -> str:
    """a + b by columns; every digit step is a one-digit fact (plus a carried 1)."""
    w.note("add", a, b)
    da, db = digits(a), digits(b)
    parts = [f"I line up {a} and {b} by place value and add column by column, starting from the ones."]
    carry = 0
    for i in range(max(len(da), len(db))):
        x = da[i] if i < len(da) else None
        y = db[i] if i < len(db) else None
        col = f"In the {PLACES[i]} column"
        if x is None or y is None:
            only = x if y is None else y
            s = only + carry
            if carry:
                parts.append(f"{col} only one number has a digit, {only}, and with the carried 1 that makes {s}.")
            else:
                parts.append(f"{col} only one number has a digit, so I bring down {only}.")
        else:
            s = x + y + carry
            expr = f"{x} + {y} + 1" if carry else f"{x} + {y}"
            parts.append(f"{col}, {expr} = {s}.")
        if s >= 10:
            parts.append(f"That is 10 or more, so I write {s - 10} and carry 1 to the {PLACES[i + 1]}.")
            carry = 1
        else:
            if x is not None and y is not None:
                parts.append(f"That is less than 10, so I write {s} and carry nothing.")
            carry = 0
    if carry:
        parts.append(f"The last carry becomes a new {PLACES[max(len(da), len(db))]} digit, 1.")
    parts.append(f"Reading the digits from left to right, {a} + {b} = {a + b}.")
    return " ".join(parts)


def sub_columns(w: Work, a: int, b: int) -> str:
    """a - b (a >= b) by columns; a borrow is worked out by counting up (one-digit facts)."""
    w.note("sub", a, b)
    da, db = digits(a), digits(b)
    parts = [f"I line up {a} and {b} by place value and subtract column by column, starting from the ones."]
    owe = 0  # this column gave 1 to the column on its right
    for i in range(len(da)):
        x = da[i]
        y = db[i] if i < len(db) else 0
        col = f"In the {PLACES[i]} column"
        if i >= len(db) and not owe:
            parts.append(f"{col} there is nothing to subtract, so I bring down {x}.")
            continue
        if owe and x == 0:
            parts.append(f"{col} the digit is 0 and it still owes the borrowed 1, so it borrows from the "
                         f"{PLACES[i + 1]} and becomes 9.")
            top, owe = 9, 1
        else:
            if owe:
                parts.append(f"{col} the {x} gave 1 away, so it is now {x - 1}.")
                x -= 1
            else:
                parts.append(f"{col} I have {x} on top and {y} below.")
            top, owe = x, 0
        if top >= y:
            parts.append(f"{top} - {y} = {top - y}, so this digit is {top - y}.")
        else:
            parts.append(f"{top} is smaller than {y}, so I borrow 1 from the {PLACES[i + 1]} and work with "
                         f"1{top}. Counting up, {y} + {10 + top - y} = 1{top}, so this digit is {10 + top - y}.")
            owe = 1
    parts.append(f"Reading the digits from left to right, {a} - {b} = {a - b}.")
    return " ".join(parts)


def mul_columns(w: Work, a: int, b: int) -> str:
    """a x b where one factor is a single digit 2-9 and the other has one or two digits."""
    w.note("mul", a, b)
    n, m = (a, b) if a < 10 else (b, a)
    if m < 10:
        return f"This is a times-table fact: {a} × {b} = {a * b}."
    m1, m10 = m % 10, m // 10
    p1 = n * m1
    parts = [f"I multiply {m} by {n} one digit at a time, starting from the ones."]
    parts.append(f"In the ones column, {n} × {m1} = {p1}.")
    carry = p1 // 10
    if carry:
        parts.append(f"I write {p1 % 10} and carry {carry} to the tens.")
    else:
        parts.append(f"That is less than 10, so I write {p1} and carry nothing.")
    p2 = n * m10
    if carry:
        if p2 >= 10:
            w.note("add", p2, carry)
        parts.append(f"In the tens column, {n} × {m10} = {p2}, and adding the carried {carry} gives {p2 + carry}.")
    else:
        parts.append(f"In the tens column, {n} × {m10} = {p2}, with no carry to add.")
    parts.append(f"Writing {p2 + carry} in front of {p1 % 10}, {a} × {b} = {a * b}.")
    return " ".join(parts)


OPS = {"add": ("+", add_columns, lambda a, b: a + b), "sub": ("-", sub_columns, lambda a, b: a - b),
       "mul": ("×", mul_columns, lambda a, b: a * b)}


def columns(w: Work, op: str, a: int, b: int) -> str:
    return OPS[op][1](w, a, b)


def value(op: str, a: int, b: int) -> int:
    return OPS[op][2](a, b)


def expr(op: str, a: int, b: int) -> str:
    return f"{a} {OPS[op][0]} {b}"


# --- optional stages: each built on a fork of the Work, dropped if it would need a held-out fact

def pause_stage(rng: random.Random, w: Work, op: str, a: int, b: int) -> str:
    """Go back over the hardest column (carry, borrow or the tens product)."""
    c = value(op, a, b)
    cue = rng.choice(PAUSE_CUES)
    da, db = digits(a), digits(b)
    if op == "add":
        s1 = da[0] + db[0]
        why = ("that is 10 or more, so there really is a carry into the tens" if s1 >= 10
               else "that is less than 10, so there is no carry into the tens")
        return (f"{cue}let me look at the ones column again, because a carry is easy to miss. The ones digits are "
                f"{da[0]} and {db[0]}, and {da[0]} + {db[0]} = {s1}; {why}. The ones digit of the result is "
                f"{s1 % 10}, and {c} does end in {c % 10}. That part is fine, so {expr(op, a, b)} = {c} stands.")
    if op == "sub":
        if da[0] < db[0]:
            how = (f"{da[0]} is smaller than {db[0]}, so I did have to borrow, and counting up, {db[0]} + "
                   f"{10 + da[0] - db[0]} = 1{da[0]}")
        else:
            how = f"{da[0]} is not smaller than {db[0]}, so no borrow was needed there, and {da[0]} - {db[0]} = {da[0] - db[0]}"
        return (f"{cue}a borrow is the step people most often get wrong, so let me look at the ones column again. "
                f"On top there is {da[0]} and below there is {db[0]}. {cap(how)}. The result {c} ends in "
                f"{c % 10}, which agrees. So {expr(op, a, b)} = {c} stands.")
    n, m = (a, b) if a < 10 else (b, a)
    size = ""
    if m >= 10:
        size = (f" The size is right too: {m} is between {m // 10 * 10} and {m // 10 * 10 + 10}, and the product "
                f"lies between {n} × {m // 10 * 10} and {n} × {m // 10 * 10 + 10}.")
    return (f"{cue}the times-table step is where a slip would hide, so let me look at it again. The factor "
            f"{n} times the ones digit {m % 10} is {n * (m % 10)}, so the product must end in {n * (m % 10) % 10}, "
            f"and {c} ends in {c % 10}.{size} So {expr(op, a, b)} = {c} stands.")


def verify_stage(rng: random.Random, w: Work, op: str, a: int, b: int) -> str:
    """The inverse operation, column by column."""
    c = value(op, a, b)
    cue = rng.choice(VERIFY_CUES)
    if op == "add":
        return (f"{cue} by going backwards: if {a} + {b} = {c}, then {c} - {b} must give back {a}. "
                f"{sub_columns(w, c, b)} That is {a} again, so the sum is right.")
    if op == "sub":
        return (f"{cue} by adding back: if {a} - {b} = {c}, then {c} + {b} must give back {a}. "
                f"{add_columns(w, c, b)} That is {a} again, so the difference is right.")
    n, m = (a, b) if a < 10 else (b, a)
    if m < 10:
        return (f"{cue} by counting in steps of {m}: " + ", ".join(str(m * i) for i in range(1, n + 1))
                + f". That is {n} steps and it ends at {c}, so the product is right.")
    m10 = 10 * (m // 10)
    t1, t2 = n * m10, n * (m % 10)
    if m % 10 == 0:
        return (f"{cue} another way: {m} is {m // 10} tens, and {n} × {m // 10} = {n * (m // 10)}, so "
                f"{n} × {m} is {n * (m // 10)} tens, which is {c}. That matches.")
    w.note("mul", n, m10)
    w.note("add", t1, t2)
    return (f"{cue} by splitting {m} into {m10} and {m % 10}: {n} × {m10} = {t1}, and {n} × {m % 10} = {t2}. "
            f"Then {t1} + {t2} = {c}. That matches, so the product is right.")


def alternative_stage(rng: random.Random, w: Work, op: str, a: int, b: int) -> str:
    """The same result by another route (split the second number, or count up)."""
    c = value(op, a, b)
    cue = rng.choice(ALT_CUES)
    if op in ("add", "sub") and b >= 10 and b % 10:
        big, small = b - b % 10, b % 10
        mid = value(op, a, big)
        if op == "sub" and mid < small:
            raise HeldOutTriple("no split route")  # not a held-out case: this route does not apply
        w.note(op, a, big)
        w.note(op, mid, small)
        word = "add them" if op == "add" else "take them away"
        return (f"{cue}I can split {b} into {big} and {small} and {word} one at a time. "
                f"{expr(op, a, big)} = {mid}, and then {expr(op, mid, small)} = {c}. "
                f"The same result, {c}.")
    if op == "sub":
        w.note("add", b, c)
        return (f"{cue}I can count up from {b} to {a}. The gap is what I need, and {b} + {c} = {a}, "
                f"so the gap is {c}. The same result, {c}.")
    if op == "add":
        w.note("add", b, a)
        return (f"{cue}I can add in the other order, starting from {b}: {b} + {a} = {c}, because the order "
                f"of an addition does not change the sum. The same result, {c}.")
    n, m = (a, b) if a < 10 else (b, a)
    if n == 2:
        w.note("add", m, m)
        return f"{cue}two times a number is the number doubled: {m} + {m} = {c}. The same result, {c}."
    w.note("mul", m, n)
    w.note("mul", n, m)
    return (f"{cue}I can swap the factors, since the order of a product does not matter: "
            f"{m} × {n} is the same as {n} × {m}, which is {c}. The same result, {c}.")


def optional(rng: random.Random, w: Work, build, *args) -> str | None:
    """Build an optional stage on a fork of ``w``; None if it needs a held-out triple."""
    fork = w.fork()
    try:
        text = build(rng, fork, *args)
    except HeldOutTriple:
        return None
    w.join(fork)
    return text


# --- replies ---------------------------------------------------------------------------------

@dataclass
class Step:
    op: str
    a: int
    b: int
    intro: str  # what the step means in the story ("Tom buys 19 more, so I add 42 + 19.")
    reading: str = ""  # the step as the plan of a multi-step reply lists it ("he buys 19 more, so plus 19")

    @property
    def result(self) -> int:
        return value(self.op, self.a, self.b)


def reasoning(rng: random.Random, w: Work, restate: str, steps: list[Step], conclusion: str
              ) -> tuple[list[tuple[str, str]], str]:
    """The think stages of an in-domain reply: plan + first step, later steps (each opened by a
    cue), optional pause / alternative / verify on the last step, conclusion. Also returns the
    *reading*: the first stage's opening, where the reply restates the question (and, for several
    steps, lists every step before doing any); the rest is worked out from it."""
    plan = ""
    if len(steps) > 1:
        plan = (f" There are {len(steps)} steps: " + "; then ".join(s.reading for s in steps)
                + ". I will do them one at a time.")
    reading = " ".join(p for p in (f"First, {restate}{plan}", steps[0].intro) if p)
    stages = [("compute", f"{reading} {columns(w, steps[0].op, steps[0].a, steps[0].b)}")]
    for i, st in enumerate(steps[1:], 1):
        cue = rng.choice(NEXT_STEP_CUES)
        stages.append(("compute", f"{cue}that was the {ORDINALS[i - 1]} step, and the running total is "
                                  f"{steps[i - 1].result}. Now the {ORDINALS[i]} step. {st.intro} "
                                  f"{columns(w, st.op, st.a, st.b)}"))
    key = max(steps, key=lambda s: (s.a >= 10) + (s.b >= 10))  # the step most worth a second look
    extra = []
    if rng.random() < STAGE_RATES["pause"]:
        extra.append(("pause", optional(rng, w, pause_stage, key.op, key.a, key.b)))
    if rng.random() < STAGE_RATES["alternative"]:
        extra.append(("alternative", optional(rng, w, alternative_stage, key.op, key.a, key.b)))
    if rng.random() < STAGE_RATES["verify"]:
        extra.append(("verify", optional(rng, w, verify_stage, key.op, key.a, key.b)))
    if len(extra) > 1 and rng.random() < 0.3:
        extra[-1], extra[-2] = extra[-2], extra[-1]
    stages += [(k, t) for k, t in extra if t]
    summary = "; ".join(f"{expr(s.op, s.a, s.b)} = {s.result}" for s in steps)
    head = rng.choice(("Therefore, ", "Therefore, ", "So the answer is clear: "))
    stages.append(("conclude", f"{head}putting it together: {summary}. {conclusion} "
                               f"The final answer is {steps[-1].result}."))
    return stages, reading


@dataclass
class Turn:
    """One user question and the assistant's reply to it."""

    kind: str
    question: str
    stages: list[tuple[str, str]]  # (stage type, text), in order, inside <think>
    visible: str  # what follows </think>: "Answer: N", or the out-of-domain reply
    answer: int | None  # None for out-of-domain turns
    triples: list[tuple[str, int, int]] = field(default_factory=list)
    context: dict = field(default_factory=dict)  # for follow-ups: story subject, item, unit
    reading: str = ""  # the opening of stages[0] that reads the question (``reasoning``)

    @property
    def reply(self) -> str:
        body = "\n".join(t for _, t in self.stages)
        return f"{THINK_OPEN}\n{body}\n{THINK_CLOSE}\n\n{self.visible}"

    @property
    def reading_reply(self) -> str:
        """The reply up to the end of its reading (train.py weighs these tokens' loss)."""
        assert self.stages[0][1].startswith(self.reading)
        return f"{THINK_OPEN}\n{self.reading}"


def render_prompt(messages: list[dict]) -> str:
    """``CHAT_TEMPLATE`` applied with add_generation_prompt (earlier replies after </think> only)."""
    out = []
    for m in messages:
        content = m["content"]
        if m["role"] == "assistant" and THINK_CLOSE in content:
            content = content.split(THINK_CLOSE)[-1].lstrip("\n")
        out.append(f"{IM_START}{m['role']}\n{content}{IM_END}\n")
    return "".join(out) + f"{IM_START}assistant\n"


@dataclass
class Example:
    """One training sequence: a conversation's turns up to ``turns[-1]``, whose reply is the
    completion (earlier replies appear as the template renders them)."""

    turns: list[Turn]
    system: str | None = None

    @property
    def last(self) -> Turn:
        return self.turns[-1]

    @property
    def kind(self) -> str:
        return self.last.kind

    @property
    def question(self) -> str:
        return self.last.question

    @property
    def answer(self) -> int | None:
        return self.last.answer

    @property
    def stages(self) -> list[tuple[str, str]]:
        return self.last.stages

    @property
    def turn_index(self) -> int:
        return len(self.turns) - 1

    def messages(self) -> list[dict]:
        """The chat messages before the completion (full earlier replies, as `chat` keeps them)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[:-1]:
            msgs += [{"role": "user", "content": t.question}, {"role": "assistant", "content": t.reply}]
        return msgs + [{"role": "user", "content": self.last.question}]

    @property
    def prompt(self) -> str:
        return render_prompt(self.messages())

    @property
    def completion(self) -> str:
        return self.last.reply + IM_END

    @property
    def reading_completion(self) -> str:
        """The last reply up to where its reading ends (a prefix of ``completion``)."""
        return self.last.reading_reply

    @property
    def text(self) -> str:
        return self.prompt + self.completion


# --- phrasings -------------------------------------------------------------------------------

OP_WORDS = {
    "add": ("{x} + {y}", "{x}+{y}", "{x} plus {y}", "{x} + {y}", "{x} plus {y}"),
    "sub": ("{x} - {y}", "{x}-{y}", "{x} minus {y}", "{x} - {y}", "{x} minus {y}"),
    "mul": ("{x} * {y}", "{x} x {y}", "{x} × {y}", "{x} times {y}", "{x} multiplied by {y}", "{x}*{y}"),
}
BARE_FORMS = ("What is {e}?", "what is {e}", "What's {e}?", "Compute {e}.", "Calculate {e}.", "{e} = ?",
              "{e}", "{e}?", "How much is {e}?", "Work out {e}.", "Solve {e}.", "Find {e}.", "{e} =",
              "Evaluate {e}.", "What does {e} equal?", "What do you get for {e}?", "Tell me {e}.",
              "{e} is what?", "Can you compute {e}?", "Please solve: {e}", "I want to know {e}.",
              "Figure out {e}.", "What would {e} be?", "Give me {e}.", "What is the value of {e}?",
              "what's {e}", "{e}, please.")
WORDY = {
    "add": ("Add {x} and {y}.", "Add {y} to {x}.", "What is the sum of {x} and {y}?", "Find the sum of {x} and {y}.",
            "What do you get if you add {y} to {x}?", "What is {y} added to {x}?", "Sum {x} and {y}.",
            "What is the total of {x} and {y}?", "If I add {x} and {y}, what do I get?",
            "Add together {x} and {y}.", "What is {x} and {y} added together?", "Increase {x} by {y}.",
            "Put {x} and {y} together. What do you get?", "What number is {y} more than {x}?"),
    "sub": ("Subtract {y} from {x}.", "What is {x} take away {y}?", "Take {y} away from {x}.",
            "What is the difference between {x} and {y}?", "Find the difference of {x} and {y}.",
            "What do you get if you subtract {y} from {x}?", "How much is left if you take {y} from {x}?",
            "What is {y} less than {x}?", "Decrease {x} by {y}.", "What is {x} reduced by {y}?",
            "Remove {y} from {x}. What is left?", "What number is {y} less than {x}?",
            "If you subtract {y} from {x}, what is the result?"),
    "mul": ("Multiply {x} by {y}.", "Multiply {x} and {y}.", "What is the product of {x} and {y}?",
            "Find the product of {x} and {y}.", "What is {x} multiplied by {y}?", "What do you get if you multiply {x} by {y}?",
            "What is {x} groups of {y}?", "What are {x} lots of {y}?", "Times {x} by {y}.",
            "If you multiply {x} and {y} together, what do you get?"),
}
PREFIXES = ("", "", "", "", "Please ", "please ", "Can you tell me ", "Could you tell me ", "Quick question: ",
            "quick question: ", "Hi! ", "Hey, ", "I need help. ", "Help me with this: ", "Question: ",
            "Can you help? ", "Math question: ", "Hello. ", "Could you work this out? ")
SUFFIXES = ("", "", "", "", " Please.", " Thanks!", " Thank you.", " Show your work.", " Thanks.")


def styled(rng: random.Random, text: str, prefixed: bool = True) -> str:
    """Filler, punctuation and case variations of a question."""
    if prefixed:
        pre = rng.choice(PREFIXES)
        if pre and text[:1].isupper() and not pre.endswith((". ", "! ", ": ", "? ")):
            text = text[0].lower() + text[1:]
        text = pre + text + rng.choice(SUFFIXES)
    r = rng.random()
    if r < 0.15:
        text = text.lower()
    elif r < 0.2:
        text = text.rstrip("?.!")
    elif r < 0.24:
        text = text.upper()
    return text


def bare_question(rng: random.Random, op: str, x: int, y: int) -> str:
    if rng.random() < 0.3:
        return styled(rng, rng.choice(WORDY[op]).format(x=x, y=y))
    e = rng.choice(OP_WORDS[op]).format(x=x, y=y)
    return styled(rng, rng.choice(BARE_FORMS).format(e=e))


# --- problems --------------------------------------------------------------------------------

def operand(rng: random.Random, lo: int = 0) -> int:
    """1 to 3 digits, mostly 2 or 3."""
    n = rng.choices((1, 2, 3), (0.15, 0.4, 0.45))[0]
    return rng.randint(max(lo, 0 if n == 1 else 10 ** (n - 1)), 10 ** n - 1)


def add_pair(rng: random.Random) -> tuple[int, int]:
    return operand(rng), operand(rng)


def sub_pair(rng: random.Random) -> tuple[int, int]:
    a, b = operand(rng), operand(rng)
    return (a, b) if a >= b else (b, a)


def mul_pair(rng: random.Random) -> tuple[int, int]:
    n = rng.randint(2, 9)
    m = rng.randint(10, 99) if rng.random() < 0.8 else rng.randint(2, 9)
    return (n, m) if rng.random() < 0.5 else (m, n)


def person(rng: random.Random) -> tuple[str, str, str]:
    return rng.choice(NAMES)


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def bare_turn(rng: random.Random, w: Work, op: str) -> Turn:
    a, b = {"add": add_pair, "sub": sub_pair, "mul": mul_pair}[op](rng)
    q = bare_question(rng, op, a, b)
    verb = {"add": "add", "sub": "subtract", "mul": "multiply"}[op]
    what = {"add": f"to add {a} and {b}", "sub": f"to subtract {b} from {a}", "mul": f"to multiply {a} by {b}"}[op]
    restate = rng.choice((f"I need {what}, that is {expr(op, a, b)}.",
                          f"the question asks me {what}, which is {expr(op, a, b)}.",
                          f"this is a plain {verb} problem: {expr(op, a, b)}."))
    st = Step(op, a, b, "")
    noun = {"add": "sum", "sub": "difference", "mul": "product"}[op]
    stages, reading = reasoning(rng, w, restate, [st], f"That is the {noun} the question asks for.")
    return Turn(op, q, stages, f"Answer: {st.result}", st.result, context={"kind": "bare"}, reading=reading)


@dataclass(frozen=True)
class StoryForms:
    """The one-step story phrasings of one operation: money stories and item stories."""

    op: str
    verbs: tuple[tuple[str, str], ...]
    money: tuple[str, ...]  # question formats: {name} {Name} {he} {a} {b}
    money_restate: str
    money_conclusion: str  # {c}: the result
    items: tuple[str, ...]  # question formats, also {He} {his} {item} {verb}
    items_restate: str
    items_conclusion: str


WORD_FORMS = {
    "add": StoryForms(
        "add", GAIN_VERBS,
        ("{Name} has ${a} and earns ${b} more. How much money does {name} have now?",
         "A book costs ${a} and a bag costs ${b}. How much do they cost together?",
         "{Name} saved ${a} last month and ${b} this month. How many dollars did {he} save in total?",
         "{Name} earned ${a} on Monday and ${b} on Tuesday. How much did {he} earn in all?",
         "A shirt costs ${a} and a hat costs ${b}. What is the total cost?"),
        "the two amounts are ${a} and ${b}, and the question wants the total, so I add them.",
        "The total is ${c}.",
        ("{Name} has {a} {item}. {He} {verb} {b} more. How many {item} does {name} have now?",
         "{Name} had {a} {item} and then {verb} {b} more. How many {item} does {he} have altogether?",
         "There are {a} {item} in a room and {b} more are brought in. How many {item} are there now?",
         "{Name} has {a} {item} and {his} friend has {b}. How many {item} do they have in total?",
         "{Name} starts with {a} {item}. Later {he} {verb} {b} more. How many {item} does {he} have in all?",
         "A shop had {a} {item} and {verb} {b} more. How many {item} does the shop have now?",
         "{a} {item} are on a table. Someone puts {b} more there. How many {item} are on the table now?",
         "What is the total number of {item} if {name} has {a} and {his} friend has {b}?"),
        "the story starts with {a} {item} and adds {b} more, so the total is {a} + {b}.",
        "There are {c} {item}."),
    "sub": StoryForms(
        "sub", LOSS_VERBS,
        ("{Name} has ${a} and spends ${b}. How much money is left?",
         "{Name} had ${a}. {He} paid ${b} for a gift. How many dollars does {he} have left?",
         "A bike costs ${a}. {Name} has ${b}. How much more money does {he} need?",
         "{Name} had ${a} and bought a toy for ${b}. How much money does {he} have now?",
         "A coat is ${a}. It is on sale for ${b} off. What is the new price?"),
        "I start from ${a} and take away ${b}, so I subtract {a} - {b}.",
        "The amount is ${c}.",
        ("{Name} has {a} {item} and {verb} {b} of them. How many {item} are left?",
         "{Name} had {a} {item}. {He} {verb} {b}. How many {item} does {name} have left?",
         "There were {a} {item}. {b} of them were taken away. How many {item} remain?",
         "{Name} has {a} {item} and {his} friend has {b}. How many more does {name} have?",
         "{Name} starts with {a} {item} and {verb} {b}. How many {item} are left now?",
         "A shop had {a} {item} and sold {b}. How many {item} are left?",
         "{a} {item} were in a jar. {Name} took out {b}. How many {item} are in the jar now?",
         "{Name} had {a} {item}, but {he} {verb} {b} of them. How many does {he} still have?"),
        "the story starts with {a} {item} and {b} go, so what is left is {a} - {b}.",
        "{c} {item} are left."),
}


def word_turn(rng: random.Random, w: Work, op: str) -> Turn:
    """A one-step addition or subtraction story (money 30 %, items 70 %)."""
    forms = WORD_FORMS[op]
    a, b = (add_pair if op == "add" else sub_pair)(rng)
    (name, he, his), item = person(rng), rng.choice(ITEMS)
    c = value(op, a, b)
    slots = dict(a=a, b=b, c=c, name=name, Name=cap(name), he=he, He=cap(he), his=his, item=item)
    if rng.random() < 0.3:
        q = rng.choice(forms.money)
        restate, concl = forms.money_restate, forms.money_conclusion
        ctx = {"kind": "money", "name": name, "he": he}
    else:
        slots["verb"] = rng.choice(forms.verbs)[0]
        q = rng.choice(forms.items)
        restate, concl = forms.items_restate, forms.items_conclusion
        ctx = {"kind": "items", "name": name, "he": he, "item": item}
    question = styled(rng, q.format(**slots))
    stages, reading = reasoning(rng, w, restate.format(**slots), [Step(op, a, b, "")], concl.format(**slots))
    return Turn("word_" + op, question, stages, f"Answer: {c}", c, context=ctx, reading=reading)


def word_mul_turn(rng: random.Random, w: Work) -> Turn:
    n, m = rng.randint(2, 9), rng.randint(2, 99)
    (name, he, his), item = person(rng), rng.choice(ITEMS)
    r = rng.random()
    if r < 0.35:
        unit, speed, per = rng.choice(UNITS)
        veh = rng.choice(VEHICLES)
        q = rng.choice((f"If {veh} travels {m} {speed} for {n} {per}, how far does it go?",
                        f"{cap(veh)} moves at {m} {speed}. How many {unit} does it cover in {n} {per}?",
                        f"{cap(veh)} goes {m} {speed} for {n} {per}. What distance does it travel?",
                        f"How far does {veh} go in {n} {per} at {m} {speed}?",
                        f"At {m} {speed}, how far will {veh} travel in {n} {per}?"))
        restate = (f"distance is speed times time. The speed is {m} {speed} and the time is {n} {per}, "
                   f"so the distance is {m} × {n} {unit}.")
        a, b = m, n
        ctx = {"kind": "distance", "unit": unit}
        concl = f"It travels {m * n} {unit}."
    elif r < 0.55:
        q = rng.choice((f"One ticket costs ${m}. How much do {n} tickets cost?",
                        f"{cap(name)} buys {n} shirts at ${m} each. How much does {he} pay?",
                        f"A meal costs ${m}. What do {n} meals cost?"))
        restate = f"there are {n} equal prices of ${m}, so the cost is {n} × {m} dollars."
        a, b = n, m
        ctx = {"kind": "money", "name": name, "he": he}
        concl = f"The cost is ${m * n}."
    else:
        box = rng.choice(CONTAINERS)
        q = rng.choice((f"{cap(name)} has {n} {box} with {m} {item} in each. How many {item} are there in total?",
                        f"There are {n} {box} and each holds {m} {item}. How many {item} is that?",
                        f"Each of {n} {box} has {m} {item}. How many {item} are there altogether?",
                        f"{cap(name)} puts {m} {item} in each of {n} {box}. How many {item} does {he} use?",
                        f"{n} {box}, {m} {item} in every one. How many {item} in all?"))
        restate = f"there are {n} {box} of {m} {item} each, so the total is {n} × {m}."
        a, b = n, m
        ctx = {"kind": "items", "name": name, "he": he, "item": item}
        concl = f"There are {m * n} {item}."
    stages, reading = reasoning(rng, w, restate, [Step("mul", a, b, "")], concl)
    return Turn("word_mul", styled(rng, q), stages, f"Answer: {m * n}", m * n, context=ctx, reading=reading)


def word_multi_turn(rng: random.Random, w: Work, n_steps: int) -> Turn:
    """Two or three steps: (optionally n boxes of m), then a loss and a gain (or the reverse)."""
    (name, he, his), item = person(rng), rng.choice(ITEMS)
    steps: list[Step] = []
    sentences = []
    if n_steps == 3:
        n, m = rng.randint(2, 9), rng.randint(3, 99)
        box = rng.choice(CONTAINERS)
        total = n * m
        sentences.append(f"{cap(name)} buys {n} {box} of {m} {item}.")
        steps.append(Step("mul", n, m, f"{cap(name)} buys {n} {box} of {m} {item}, so {he} starts with {n} × {m}.",
                          f"{n} {box} of {m}, so {n} × {m}"))
        restate = f"{name} starts with {n} {box} of {m} {item}, then some go and some come."
    else:
        total = rng.randint(20, 999)
        sentences.append(f"{cap(name)} has {total} {item}.")
        restate = f"{name} starts with {total} {item}, then some go and some come."
    order = ["loss", "gain"] if rng.random() < 0.6 else ["gain", "loss"]
    for j, what in enumerate(order):
        subject = rng.choice((f"Then {he}", f"After that, {he}", f"Later, {he}", f"Next {he}")) if j else cap(he)
        if what == "loss":
            x = rng.randint(1, total)
            verb = rng.choice(LOSS_VERBS)[0]
            sentences.append(f"{subject} {verb} {x}.")
            steps.append(Step("sub", total, x, f"{cap(name)} {verb} {x}, so I subtract {total} - {x}.",
                              f"{he} {verb} {x}, so minus {x}"))
            total -= x
        else:
            x = rng.randint(1, 400)
            verb = rng.choice(GAIN_VERBS)[0]
            sentences.append(f"{subject} {verb} {x} more.")
            steps.append(Step("add", total, x, f"{cap(name)} {verb} {x} more, so I add {total} + {x}.",
                              f"{he} {verb} {x} more, so plus {x}"))
            total += x
    q = " ".join(sentences) + " " + rng.choice((f"How many {item} does {name} have now?",
                                                f"How many {item} does {he} have at the end?",
                                                f"How many {item} are there now?",
                                                f"How many {item} does {name} have in the end?",
                                                f"How many {item} now?"))
    kind = "word_three" if n_steps == 3 else "word_two"
    stages, reading = reasoning(rng, w, restate, steps, f"{cap(name)} has {total} {item} at the end.")
    return Turn(kind, styled(rng, q), stages, f"Answer: {total}", total,
                context={"kind": "items", "name": name, "he": he, "item": item}, reading=reading)


# --- follow-ups ------------------------------------------------------------------------------

def follow_up_ops(p: int | None) -> list[str]:
    """The follow-up operations the contract's domain allows on a previous answer ``p``."""
    if p is None:
        return []
    ops = (["add", "sub"] if p >= 1 else ["add"]) if p <= 999 else []
    return ops + (["mul"] if 2 <= p <= 99 else [])


def follow_up_turn(rng: random.Random, w: Work, prev: Turn) -> Turn:
    """A question about the previous answer (one of ``follow_up_ops(prev.answer)``)."""
    p = prev.answer
    ctx = prev.context
    op = rng.choice(follow_up_ops(p))
    x = {"add": lambda: operand(rng, 1), "sub": lambda: rng.randint(1, p), "mul": lambda: rng.randint(2, 9)}[op]()
    story = ctx.get("kind") == "items" and op != "mul" and rng.random() < 0.7
    if story:
        he, item = ctx["he"], ctx["item"]
        verb = rng.choice(GAIN_VERBS if op == "add" else LOSS_VERBS)
        q = rng.choice((f"and if {he} {verb[0]} {x} more?" if op == "add" else f"and if {he} {verb[0]} {x}?",
                        f"What if {he} {verb[0]} {x}{' more' if op == 'add' else ''}?",
                        f"Now {he} {verb[0]} {x}{' more' if op == 'add' else ''}. How many {item} now?",
                        f"and then {he} {verb[0]} {x}{' more' if op == 'add' else ''}?"))
        intro = (f"{cap(he)} {verb[0]} {x}{' more' if op == 'add' else ''}, so I "
                 f"{'add' if op == 'add' else 'subtract'} {expr(op, p, x)}.")
        concl = f"Now there are {value(op, p, x)} {item}."
    else:
        forms = {"add": (f"now add {x} to that", f"Add {x} to that.", f"and plus {x}?", f"What about {x} more?",
                         f"then add {x}", f"Now add {x} to the answer.", f"what if you add {x} to it?",
                         f"and {x} more?"),
                 "sub": (f"subtract {x} from that", f"Now take away {x}.", f"and minus {x}?", f"What if you take {x} away?",
                         f"Subtract {x} from the result.", f"then subtract {x}", f"now take {x} from that"),
                 "mul": (f"multiply that by {x}", f"Now multiply it by {x}.", f"and times {x}?", f"What is that times {x}?",
                         f"Multiply the result by {x}.", f"now {x} times that", f"and if you multiply that by {x}?")}
        q = rng.choice(forms[op])
        verb = {"add": "add", "sub": "subtract", "mul": "multiply by"}[op]
        intro = f"The question asks me to {verb} {x}, so I work out {expr(op, p, x)}."
        concl = f"The new result is {value(op, p, x)}."
    restate = rng.choice((f"this follows on from my previous answer, which was {p}.",
                          f"the last answer was {p}, and this question builds on it.",
                          f"\"that\" here means my previous answer, {p}."))
    st = Step(op, p, x, intro)
    q = styled(rng, q, prefixed=False)
    new_ctx = dict(ctx) if story else {"kind": "bare"}
    stages, reading = reasoning(rng, w, restate, [st], concl)
    return Turn("follow_" + op, q, stages, f"Answer: {st.result}", st.result, context=new_ctx, reading=reading)


# --- out of domain ---------------------------------------------------------------------------

OOD_QUESTIONS = {
    "greeting": ("Hello!", "Hi", "hey there", "Good morning!", "Hi, how are you?", "hello, nice to meet you",
                 "Hey! How's it going?", "Good evening."),
    "identity": ("Who are you?", "what are you?", "Hello, who are you?", "What can you do?", "Are you a person?",
                 "What is your name?", "Tell me about yourself.", "what kind of model are you?"),
    "knowledge": ("What is the capital of France?", "Who wrote Hamlet?", "Why is the sky blue?",
                  "How far is the moon?", "What year did the war end?", "Who is the president?",
                  "What is the tallest mountain?", "How do plants make food?", "What is the weather today?",
                  "Translate hello into Spanish.", "What is the meaning of life?", "Can you divide 84 by 4?",
                  "What is the square root of 144?"),
    "code": ("Write a Python function to sort a list.", "Can you write some code for me?", "How do I reverse a string in Java?",
             "write a bash script that lists files", "Fix my JavaScript bug.", "Write hello world in C."),
    "joke": ("Tell me a joke.", "tell me something funny", "Can you write a poem?", "Sing me a song.",
             "Write a story about a dragon.", "Do you know any riddles?"),
}
OOD_TOPIC = {"greeting": "is a greeting", "identity": "asks who I am and what I can do",
             "knowledge": "is a general question, not an arithmetic problem",
             "code": "asks for code, not an arithmetic problem",
             "joke": "asks for a joke or a story, not an arithmetic problem"}
OOD_REPLIES = {
    "greeting": ("Hello! I can only do arithmetic word problems: addition, subtraction and multiplication. "
                 "Ask me one, for example \"What is 17 + 25?\"",
                 "Hi! I am a small model that only does arithmetic. Give me a sum, a difference or a product to work out."),
    "identity": ("I am a small reasoning model that only does arithmetic: addition, subtraction and multiplication, "
                 "written as numbers or as word problems.",
                 "I am a tiny assistant that can only do arithmetic word problems. I cannot help with anything else."),
    "other": ("I can only do arithmetic word problems, so I cannot help with that. Ask me an addition, "
              "subtraction or multiplication question instead.",
              "Sorry, I only know arithmetic: addition, subtraction and multiplication. That question is outside "
              "what I can do."),
}


def ood_turn(rng: random.Random, w: Work) -> Turn:
    topic = rng.choice(tuple(OOD_QUESTIONS))
    q = styled(rng, rng.choice(OOD_QUESTIONS[topic]), prefixed=False)
    reading = f"The user's message {OOD_TOPIC[topic]}."
    think = (f"{reading} I am a small model that only does arithmetic, "
             f"adding, subtracting and multiplying numbers, so I should say that briefly and honestly "
             f"and not make anything up.")
    reply = rng.choice(OOD_REPLIES.get(topic, OOD_REPLIES["other"]))
    return Turn("ood", q, [("ood", think)], reply, None, context={"kind": "ood"}, reading=reading)


# --- conversations ---------------------------------------------------------------------------

def new_turn(rng: random.Random, w: Work, kind: str) -> Turn:
    if kind in ("add", "sub", "mul"):
        return bare_turn(rng, w, kind)
    return {"word_add": lambda r, w: word_turn(r, w, "add"), "word_sub": lambda r, w: word_turn(r, w, "sub"),
            "word_mul": word_mul_turn,
            "word_two": lambda r, w: word_multi_turn(r, w, 2), "word_three": lambda r, w: word_multi_turn(r, w, 3),
            "ood": ood_turn}[kind](rng, w)


def draw_turn(rng: random.Random, make) -> Turn:
    """``make(Work)`` until its reply computes no held-out triple."""
    while True:
        w = Work()
        try:
            turn = make(w)
        except HeldOutTriple:
            continue
        turn.triples = w.triples
        return turn


def conversation(rng: random.Random) -> tuple[list[Turn], str | None]:
    kinds, weights = zip(*KIND_WEIGHTS.items())
    n_turns = rng.choices(tuple(N_TURNS_WEIGHTS), tuple(N_TURNS_WEIGHTS.values()))[0]
    turns: list[Turn] = []
    for i in range(n_turns):
        prev = turns[-1] if turns else None
        turn = None
        if prev is not None and follow_up_ops(prev.answer) and rng.random() < FOLLOW_UP_RATE:
            turn = draw_turn(rng, lambda w, prev=prev: follow_up_turn(rng, w, prev))
        if turn is None:
            kind = rng.choices(kinds, weights)[0]
            turn = draw_turn(rng, lambda w, kind=kind: new_turn(rng, w, kind))
        turns.append(turn)
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < SYSTEM_RATE else None
    return turns, system


def training_conversations(n: int, seed: int = 0) -> list[tuple[list[Turn], str | None]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def training_examples(n: int, seed: int = 0) -> list[Example]:
    """Training sequences from conversations of seed ``seed``: one per turn, in order, ``n`` in all."""
    rng = random.Random(seed)
    out: list[Example] = []
    while len(out) < n:
        turns, system = conversation(rng)
        out += [Example(turns[:i + 1], system) for i in range(len(turns))]
    return out[:n]


def heldout_examples(n: int, seed: int = 12345) -> list[Example]:
    """Single-turn problems (the corpus's own phrasings) whose first computation is a held-out
    triple, with their reference replies (not training data: used by tests and calibration)."""
    rng = random.Random(seed)
    kinds = [k for k in KIND_WEIGHTS if k != "ood"]
    weights = [KIND_WEIGHTS[k] for k in kinds]
    out = []
    while len(out) < n:
        kind = rng.choices(kinds, weights)[0]
        w = Work(strict=False)
        turn = new_turn(rng, w, kind)
        if is_heldout(*w.triples[0]):
            turn.triples = w.triples
            out.append(Example([turn], None))
    return out


def corpus_stats(examples: list[Example], tok) -> dict:
    """Figures of a sample of training sequences under tokenizer ``tok`` (a ``bpe.Tokenizer``):
    kinds, turns, reply and stage lengths in tokens (stages cut at every qwen3 cue, no minimum
    length, as the stage detector cuts generated text), cues per 1000 reply tokens."""
    import numpy as np

    from saem_gguf.defaultmodel.evaluate import stage_bounds

    seq_len, reply_len, stage_len, n_stages = [], [], [], []
    cues: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for e in examples:
        prompt, reply = tok.encode(e.prompt), tok.encode(e.completion)[:-1]  # without <|im_end|>
        bounds, found, _ = stage_bounds(tok, reply)
        seq_len.append(len(prompt) + len(reply) + 1)
        reply_len.append(len(reply))
        stage_len += np.diff(bounds).tolist()
        n_stages.append(len(bounds) - 1)
        for c in found:
            cues[c] = cues.get(c, 0) + 1
        kinds[e.kind] = kinds.get(e.kind, 0) + 1

    def summary(x) -> dict:
        x = np.asarray(x)
        return {"mean": round(float(x.mean()), 1), "median": float(np.median(x)),
                "p10": float(np.percentile(x, 10)), "p90": float(np.percentile(x, 90)), "max": int(x.max())}

    n_tok = sum(reply_len)
    return {"sequences": len(examples), "kind_share": {k: round(v / len(examples), 3) for k, v in sorted(kinds.items())},
            "turn_of_sequence": {str(i + 1): sum(len(e.turns) == i + 1 for e in examples) for i in range(6)},
            "sequence_tokens": summary(seq_len), "reply_tokens": summary(reply_len),
            "stages_per_reply": summary(n_stages), "stage_tokens": summary(stage_len),
            "cues_per_1000_reply_tokens": {c: round(1000 * n / n_tok, 2)
                                           for c, n in sorted(cues.items(), key=lambda kv: -kv[1])}}


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Print generated training conversations, or their statistics.")
    p.add_argument("-n", type=int, default=5, help="training sequences (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", action="store_true", help="print corpus_stats as JSON instead of the text")
    p.add_argument("--model", help="GGUF whose tokenizer --stats counts with (default: the embedded model)")
    a = p.parse_args(argv)
    examples = training_examples(a.n, seed=a.seed)
    if not a.stats:
        for ex in examples:
            print(ex.text)
            print("-" * 60)
        return 0
    from saem_gguf.default_model import default_model_path
    from saem_gguf.defaultmodel.bpe import Tokenizer

    print(json.dumps(corpus_stats(examples, Tokenizer.from_gguf(a.model or default_model_path())), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
