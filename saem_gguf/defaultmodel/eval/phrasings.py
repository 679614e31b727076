"""The evaluation's own phrasings of in-domain questions, follow-ups and out-of-domain turns.

These lists were written apart from the training corpus's templates (``corpus.py``), from the
model contract (the domain, the operator words) and from how people ask a chat assistant
arithmetic questions, without reading the corpus; that is what makes them *held-out phrasings*.
Keep it that way: do not copy templates between this file and the corpus in either direction.

Placeholders: ``{a}``, ``{b}``, ``{c}``, ``{d}`` operands in the order they are computed (the first
computation is ``a op b``); ``{name}``, ``{they}`` (subject pronoun), ``{their}``; ``{x}`` the
operand of a follow-up. Each operation's templates state the operands in the order of the triple
that ``split.is_heldout`` is asked about.
"""

from __future__ import annotations

# --- bare questions: symbols and operator words ----------------------------------------------

ADD = (
    "{a}+{b}",
    "{a} + {b} = ?",
    "what's {a} plus {b}",
    "Calculate {a} + {b}.",
    "could you add {a} and {b}?",
    "How much is {a} plus {b}?",
    "I need the sum of {a} and {b}",
    "sum of {a} and {b}?",
    "tell me {a} plus {b}",
    "Work out {a} + {b} for me.",
    "what do you get if you add {a} and {b}",
    "{b} added to {a} makes what?",
    "Add {b} to {a}.",
    "Find the sum of {a} and {b}.",
)

SUB = (
    "{a}-{b}",
    "{a} - {b} = ?",
    "what's {a} minus {b}",
    "Calculate {a} - {b}.",
    "subtract {b} from {a}",
    "How much is {a} take away {b}?",
    "what is the difference of {a} and {b}?",
    "Find {a} minus {b}.",
    "{a} take away {b} leaves how much?",
    "Work out {a} - {b} for me.",
    "could you subtract {b} from {a}?",
    "tell me the difference between {a} and {b}",
)

MUL = (
    "{a}*{b}",
    "{a} x {b}",
    "{a} × {b} = ?",
    "what's {a} times {b}",
    "Calculate {a} * {b}.",
    "{a} multiplied by {b}?",
    "multiply {a} by {b}",
    "What is the product of {a} and {b}?",
    "how much is {a} times {b}?",
    "Work out {a} × {b} for me.",
    "the product of {a} and {b} please",
)

# Filler around a bare question: (before, after). Any case is in the domain; the question's case
# is varied separately (``problems.ProblemMaker.vary_case``). A question that already asks
# politely (REQUEST_WORDS) gets no filler; EXPRESSION_FILLER goes only around a bare expression
# ("12 + 5").
REQUEST_WORDS = ("please", "could you", "for me", "tell me", "i need")
FILLER = (
    ("", ""),
    ("", "?"),
    ("quick question: ", ""),
    ("hi! ", ""),
    ("Hey, ", ""),
    ("Help me with this: ", ""),
    ("", ", thanks"),
    ("", " please"),
)
EXPRESSION_FILLER = (
    ("can you tell me ", "?"),
    ("I was wondering, what is ", "?"),
    ("please, ", ""),
)

# --- word problems ---------------------------------------------------------------------------

NAMES = (("Maya", "she", "her"), ("Omar", "he", "his"), ("Lena", "she", "her"), ("Tom", "he", "his"),
         ("Priya", "she", "her"), ("Diego", "he", "his"), ("Aisha", "she", "her"), ("Ben", "he", "his"))

ITEMS = ("stickers", "marbles", "stamps", "shells", "cards", "pencils", "beads", "coins")

WORD_ADD = (
    "{name} collected {a} {items} on Monday and {b} more on Tuesday. How many {items} did {they} "
    "collect altogether?",
    "A library had {a} books and got {b} new ones this week. How many books does the library "
    "have now?",
    "{name} has {a} {items}. A friend gives {name} {b} more. How many {items} does {they} have now?",
    "There are {a} {items} in one jar and {b} in another jar. How many {items} are there in "
    "total?",
    "{name} paid {a} dollars for a bike and {b} dollars for a helmet. How much did {they} spend "
    "in all?",
    "A hiker walked {a} km on the first day and {b} km on the second. How far did the hiker walk?",
)

WORD_SUB = (
    "{name} had {a} {items} and gave {b} of them to a friend. How many {items} are left?",
    "A shop had {a} umbrellas and sold {b}. How many umbrellas remain?",
    "{name} has {a} dollars and spends {b} dollars on a game. How much money does {they} have "
    "left?",
    "A road is {a} km long. After driving {b} km, how many km are still to go?",
    "There were {a} people in a hall and {b} went home. How many people stayed?",
    "{name} needs {a} points to win and has {b}. How many more points does {they} need?",
)

WORD_MUL = (
    "{name} buys {a} packs of {items} with {b} in each pack. How many {items} is that?",
    "A box holds {b} eggs. How many eggs are in {a} boxes?",
    "{name} buys {a} tickets at {b} dollars each. How much does {they} pay?",
    "There are {a} rows of chairs with {b} chairs in each row. How many chairs are there?",
    "Each bag has {b} {items}, and {name} has {a} bags. How many {items} does {they} have?",
)

# distance = speed x hours: {a} the speed, {b} the hours
WORD_DISTANCE = (
    "A car drives at {a} km per hour for {b} hours. How far does it travel?",
    "A cyclist rides {a} miles each hour for {b} hours. What distance does the cyclist cover?",
    "If a boat goes {a} km an hour, how many km does it go in {b} hours?",
    "{name} runs at {a} km per hour for {b} hours. How many km does {they} run?",
)

# Two steps: (template, first operation, second operation). The first computation is a op b,
# the second (that result) op c.
TWO_STEP = (
    ("{name} has {a} {items}, buys {b} more, and then gives away {c}. How many {items} does {they} "
     "have now?", "add", "sub"),
    ("A bus has {a} passengers. At the first stop {b} get off and {c} get on. How many "
     "passengers are on the bus now?", "sub", "add"),
    ("{name} buys {a} bags with {b} apples in each bag and eats {c} apples. How many apples are "
     "left?", "mul", "sub"),
    ("A train travels at {a} km per hour for {b} hours and then another {c} km. How far does it "
     "travel in total?", "mul", "add"),
    ("{name} saved {a} dollars, spent {b} dollars on shoes and then earned {c} dollars. How much "
     "money does {they} have now?", "sub", "add"),
)

# Three steps: ((a op1 b) op2 c) op3 d
THREE_STEP = (
    ("{name} starts with {a} dollars, earns {b} dollars, spends {c} dollars and then earns {d} "
     "more. How much money does {they} have at the end?", "add", "sub", "add"),
    ("A farmer picks {a} baskets of plums with {b} plums in each basket, sells {c} plums and then "
     "picks {d} more. How many plums does the farmer have?", "mul", "sub", "add"),
    ("A tank holds {a} litres. {b} litres are added, then {c} litres are used and {d} more are "
     "used. How many litres are in the tank now?", "add", "sub", "sub"),
)

# --- follow-up turns that refer to the previous answer ---------------------------------------

FOLLOW_ADD = ("now add {x} to that", "and if you add {x} more?", "ok, and that plus {x}?",
              "What do I get if I add {x} to it?", "plus {x}?")
FOLLOW_SUB = ("subtract {x} from that", "and take away {x}?", "now what if we subtract {x}?",
              "Then minus {x}?", "what's that minus {x}")
FOLLOW_MUL = ("multiply that by {x}", "and times {x}?", "what if I multiply it by {x}?",
              "Now multiply the result by {x}.")
# follow-ups in the words of a story (only after a word problem with a named person)
FOLLOW_STORY_ADD = ("and if {they} gets {x} more?", "What if {they} finds another {x}?")
FOLLOW_STORY_SUB = ("what if {they} then gives away {x}?", "And if {they} loses {x} of them?")

# --- out-of-domain turns ---------------------------------------------------------------------

OUT_OF_DOMAIN = (
    "Hello!",
    "hi there, how are you?",
    "Who are you?",
    "what can you do?",
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "How tall is Mount Everest?",
    "Write a Python function that reverses a string.",
    "can you give me some javascript code for a button",
    "Tell me a joke.",
    "Do you know any good jokes about cats?",
    "What's the weather like today?",
    "Translate 'good morning' into Spanish.",
    "Good night!",
    "What year did the first man land on the moon?",
    "thanks, bye",
    "Recommend me a good book.",
    "Why is the sky blue?",
)
