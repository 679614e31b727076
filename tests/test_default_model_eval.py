"""The held-out evaluation of the default model (saem_gguf.defaultmodel.eval): the sets, the scoring
of real replies, the stage statistics and TCseq baselines, and floors a little under the shipped
model's measured figures (docs/DEFAULT_MODEL.md, "Evaluation")."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from saem_gguf.defaultmodel.eval import problems, report, run, scoring, stages, tcseq_baselines
from saem_gguf.defaultmodel.eval.harness import EvalConfig, evaluate
from saem_gguf.defaultmodel.split import is_heldout

WELL_FORMED = ("<think>\nFirst, I add 25 and 17. The ones make 12, so I carry 1.\nLet me verify: 42 - 17 = 25."
               "\nTherefore, the sum is 42.\n</think>\n\nAnswer: 42")
REFUSAL = "<think>\nThis is not arithmetic.\n</think>\n\nI can only do arithmetic word problems."


# --- the sets ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sets():
    return problems.make_sets(seed=5, per_kind=6, n_conversations=25, n_out_of_domain=10)


def numbers_in(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def in_domain(op: str, a: int, b: int) -> bool:
    if op == "mul":
        return (2 <= a <= 9 and 2 <= b <= 99) or (2 <= b <= 9 and 2 <= a <= 99)
    return 0 <= a <= 999 and 0 <= b <= 999 and (op == "add" or a >= b)


def test_sets_are_reproducible_from_their_seed(sets):
    again = problems.make_sets(seed=5, per_kind=6, n_conversations=25, n_out_of_domain=10)
    assert again == sets
    other = problems.make_sets(seed=6, per_kind=6, n_conversations=25, n_out_of_domain=10)
    assert [t.question for t in other.single] != [t.question for t in sets.single]


def test_every_question_computes_a_heldout_triple_in_the_domain(sets):
    turns = list(sets.single) + [t for c in sets.conversations for t in c.turns]
    assert {t.kind for t in sets.single} == set(problems.SINGLE_KINDS)
    for t in turns:
        if not t.in_domain:
            continue
        # the steps chain up to the answer, each step in the domain, never negative
        result = None
        for i, (op, a, b) in enumerate(t.steps):
            assert in_domain(op, a, b), t
            if i:
                assert a == result, t
            result = problems.apply(op, a, b)
            assert result >= 0, t
        assert result == t.answer, t
        if t.role != problems.FOLLOW_UP:
            assert is_heldout(*t.steps[0]), t
            op, a, b = t.steps[0]
            assert {a, b} <= set(numbers_in(t.question)), t
    follow = [t for t in turns if t.role == problems.FOLLOW_UP]
    assert follow and sum(t.heldout for t in follow) >= 0.8 * len(follow)


def test_conversations_mix_follow_ups_independent_and_out_of_domain_turns(sets):
    for conv in sets.conversations:
        assert len(conv.turns) == 3 and conv.structure in problems.STRUCTURES
        for prev, turn in zip(conv.turns, conv.turns[1:]):
            if turn.role == problems.FOLLOW_UP:
                assert turn.steps[0][1] == prev.answer
    roles = {(i, t.role, t.in_domain) for c in sets.conversations for i, t in enumerate(c.turns)}
    assert {(1, problems.FOLLOW_UP, True), (2, problems.FOLLOW_UP, True), (1, problems.INDEPENDENT, True),
            (2, problems.INDEPENDENT, True), (0, problems.FIRST, False), (1, problems.INDEPENDENT, False)} <= roles
    assert all(not t.in_domain and t.answer is None for t in sets.out_of_domain)


def test_bad_arguments_are_one_line_errors(capsys):
    from saem_gguf.defaultmodel.eval.cli import main

    for args in (["--per-kind", "-1"], ["--model", "/no/such.gguf"], ["--capacity", "2"]):
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit) as usage:
        main(["--per-kind", "x"])
    assert usage.value.code == 2


def test_phrasings_do_not_come_from_the_training_corpus():
    code = ("import sys; import saem_gguf.defaultmodel.eval.harness, saem_gguf.defaultmodel.evaluate; "
            "assert 'saem_gguf.defaultmodel.corpus' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- scoring ----------------------------------------------------------------------------------

def test_scoring_follows_the_contract():
    s = scoring.score_reply(WELL_FORMED)
    assert s.well_formed(True) and s.correct(42) and not s.correct(43) and s.stage_cues == 2
    assert not s.correct(None)  # an answer is not a refusal
    broken = {
        "no think": WELL_FORMED.replace("<think>\n", ""),
        "unclosed": WELL_FORMED.replace("</think>", ""),
        "two answers": WELL_FORMED + "\nAnswer: 42",
        "no cue": "<think>\nFirst, 25 + 17 = 42.\n</think>\n\nAnswer: 42",
        "no number": WELL_FORMED.replace("Answer: 42", "Answer: forty-two"),
    }
    for why, text in broken.items():
        assert not scoring.score_reply(text).well_formed(True), why
    assert not scoring.score_reply(broken["two answers"]).correct(42)
    r = scoring.score_reply(REFUSAL)
    assert r.well_formed(False) and r.correct(None) and not r.well_formed(True)
    assert not scoring.score_reply(REFUSAL + "\n\nAnswer: 7").correct(None)
    assert not scoring.score_reply(REFUSAL.replace("arithmetic word", "math")).correct(None)


def test_stages_are_cut_at_every_cue_and_the_answer_is_not_a_reasoning_stage():
    pieces = [w.encode() for w in re.findall(r"</?think>|\w+|\s|[^\w\s]", WELL_FORMED)]
    assert b"".join(pieces).decode() == WELL_FORMED
    st = stages.reply_stages(pieces)
    assert st.openers == ("", "Let me verify", "Therefore", "</think>")
    assert st.bounds[0] == 0 and st.bounds[-1] == len(pieces)
    assert list(st.reasoning_lengths) == list(np.diff(st.bounds)[:3])
    stats = stages.length_statistics([st, st])
    assert stats["n_stages"] == 6 and stats["stages_per_reply_mean"] == 3
    assert stats["length_median"] == float(np.median(np.diff(st.bounds)[:3]))


def test_tcseq_baselines_detect_order():
    """Stages whose experts carry into the next stage are coherent: stage s routes 20 tokens to
    the experts of stage s - 1's own block and 10 to a block of its own. Shuffling the rows within
    a reply or across replies breaks that; the pooled shuffle deals back exactly the same rows."""
    rng = np.random.default_rng(1)
    routes, bounds = [], []
    for _ in range(12):
        blocks = rng.permutation(8)  # 8 blocks of 4 of 32 experts; 7 stages, each with its own
        rows = []
        for s in range(1, 8):
            for block, n in ((blocks[s - 1], 20), (blocks[s], 10)):
                rows += [rng.choice(np.arange(4 * block, 4 * block + 4), 2, replace=False) for _ in range(n)]
        routes.append(np.array(rows, np.int16).reshape(-1, 1, 2))
        bounds.append(np.arange(0, 30 * 7 + 1, 30))
    res = tcseq_baselines.tcseq_with_baselines(routes, bounds, n_expert=32, n_perm=10)
    assert res["real"]["overall"] > 0.6
    for name in ("rows", "pooled"):
        assert res[name]["max"] < res["real"]["overall"] - 0.1 and res[name]["z"] > 3, (name, res)
    pooled = tcseq_baselines.pooled_shuffled(routes, bounds, rng)
    assert sorted(map(bytes, np.concatenate([p for p, _ in pooled]))) == sorted(map(bytes, np.concatenate(routes)))


# --- real replies from the shipped model ------------------------------------------------------

@pytest.fixture(scope="module")
def model_file():
    from saem_gguf.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def llm(model_file):
    model = run.open_model(model_file, run.context_size(model_file))
    yield model
    model.close()


def test_a_real_conversation_is_run_and_scored(llm):
    """Turn 2 sees turn 1 as the chat template renders it; a real reply is scored by its own
    answer line: right when the expected number is the one it gives, wrong otherwise."""
    conv = problems.make_sets(seed=3, per_kind=0, n_conversations=1, n_out_of_domain=0).conversations[0]
    results = run.run_conversation(llm, conv.turns[:2], max_tokens=600)
    first, second = results
    assert first.reply and first.gen_ids and len(first.gen_pieces) == len(first.gen_ids)
    assert b"".join(first.gen_pieces).decode("utf-8", "replace").startswith(first.reply[:20])
    seen = llm.detokenize(second.prompt_ids, special=True).decode("utf-8", "replace")
    assert conv.turns[0].question in seen and conv.turns[1].question in seen
    assert seen.index(conv.turns[0].question) < seen.index(conv.turns[1].question)
    assert len(second.prompt_ids) > len(first.prompt_ids)

    got = first.score
    if got.answer is not None:  # judge the real reply against its own number and another one
        assert got.correct(got.answer) and not got.correct(got.answer + 1)
        wrong = scoring.score_reply(re.sub(r"Answer: -?\d+", f"Answer: {got.answer + 1}", first.reply))
        assert not wrong.correct(got.answer)
    assert first.correct == (got.answer_marks == 1 and got.answer == conv.turns[0].answer)
    tallied = report.tally(results)
    assert tallied["n"] == 2 and tallied["correct"] == sum(r.correct for r in results)


# Floors: a little under the figures measured on the shipped model v4 (docs/DEFAULT_MODEL.md,
# "Evaluation"), checked on a smaller draw with the same seed (a few seconds under the lock),
# each leaving room for one reply that another CPU's arithmetic turns differently.
# Measured, full evaluation / this draw: single-turn 67/108 = 0.620 / 5/9; turns 2 and 3 in
# domain 46/72 = 0.639 / 7/9; refusals 36/36 / 6/6; well formed 248/248 / all; median reasoning
# stage 120 / 142.5 tokens. The first model (v1) predates the contract this evaluation checks
# (2 of 108 single-turn answers, no refusal); it has no floors.
V1_SHA256 = "bbd3a7bab2684e1fd852e3de96bcac82e142c71dff1b4b0b23a09050951ec13d"
FLOOR_SINGLE = 0.44
FLOOR_LATER_TURNS = 0.6
FLOOR_REFUSAL = 0.8
FLOOR_WELL_FORMED = 0.95
FLOOR_STAGE_MEDIAN = 100  # tokens; the contract asks for >= 60


def test_shipped_model_meets_its_floors(model_file):
    from saem_gguf.build.source import sha256_file

    if sha256_file(model_file) == V1_SHA256:
        pytest.skip("the first default model predates the evaluation's contract")
    res = evaluate(EvalConfig(model=model_file, per_kind=1, n_conversations=5, n_out_of_domain=4, n_perm=0))
    h = res["headline"]
    assert h["single_turn_accuracy"] >= FLOOR_SINGLE, res["failures"]
    assert h["later_turn_accuracy"] >= FLOOR_LATER_TURNS, res["failures"]
    assert h["out_of_domain_refusal"] >= FLOOR_REFUSAL, res["failures"]
    assert h["well_formed"] >= FLOOR_WELL_FORMED, res["failures"]
    assert res["stages"]["length_median"] >= FLOOR_STAGE_MEDIAN, res["stages"]
