"""A chat answer asked for as JSON (serving.output_format): the grammar llama-server builds (the
thinking first, then the JSON, maybe fenced) and the content its parser captures (the JSON alone),
whole and streamed. tests/test_serve_reference.py compares the answers with stock llama-server."""

from __future__ import annotations

import random
import re

import pytest

from saem_gguf.serving.output_format import (
    JSON_OBJECT, JsonAnswer, answer_grammar, excluding_rules, json_answer_text, thinking_of,
)
from saem_gguf.thinking import THINK_CLOSE

# llama-server's rules for "</think>" (its generation_settings.grammar), their names aside
STOCK_UNTIL = """until-4 ::= | [<] until-4-01 | [^<] until-4
until-4-01 ::= | [<] until-4-01 | [/] until-4-02 | [^/<] until-4
until-4-02 ::= | [<] until-4-01 | [t] until-4-03 | [^<t] until-4
until-4-03 ::= | [<] until-4-01 | [h] until-4-04 | [^<h] until-4
until-4-04 ::= | [<] until-4-01 | [i] until-4-05 | [^<i] until-4
until-4-05 ::= | [<] until-4-01 | [n] until-4-06 | [^<n] until-4
until-4-06 ::= | [<] until-4-01 | [k] until-4-07 | [^<k] until-4
until-4-07 ::= | [<] until-4-01 | [^<>] until-4"""


def _machine(rules: list[str]) -> dict[str, list[tuple[bool, set[str], str]]]:
    """Each state's alternatives as (negated, characters, next state); every state may end."""
    out = {}
    for rule in rules:
        name, body = rule.split(" ::= ")
        alts = []
        for alt in map(str.strip, body.split("|")):
            m = re.fullmatch(r"\[(\^?)((?:\\.|[^\]\\])*)\] (\S+)", alt)
            if m:
                alts.append((m.group(1) == "^", set(re.sub(r"\\x(..)|\\(.)", lambda e: chr(int(e[1], 16)) if e[1] else e[2], m.group(2))), m.group(3)))
            else:
                assert alt == "", alt
        out[name] = alts
    return out


def _accepts(machine, start: str, text: str) -> bool:
    states = {start}
    for c in text:
        states = {nxt for s in states for neg, chars, nxt in machine[s] if (c not in chars) == neg}
    return bool(states)


@pytest.mark.parametrize("literal", [THINK_CLOSE, "aab", "abab", "]^-\\"])
def test_excluding_rules_match_text_without_the_literal(literal):
    machine = _machine(excluding_rules("u", literal))
    rng = random.Random(7)
    alphabet = sorted(set(literal)) + ["x"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 3 * len(literal) + 2)))
        assert _accepts(machine, "u", text) == (literal not in text), text


def test_excluding_rules_are_llama_servers_for_the_thinking_tag():
    ours, stock = _machine(excluding_rules("u", THINK_CLOSE)), _machine(STOCK_UNTIL.splitlines())
    rename = {"u": "until-4", **{f"u-{i}": f"until-4-0{i}" for i in range(1, 8)}}
    assert {rename[k]: sorted((n, sorted(c), rename[s]) for n, c, s in v) for k, v in ours.items()} \
        == {k: sorted((n, sorted(c), s) for n, c, s in v) for k, v in stock.items()}


def test_answer_grammar_starts_where_the_prompt_leaves_off():
    optional, opened, none = (answer_grammar(JSON_OBJECT, t) for t in ("optional", "open", "none"))
    assert optional.startswith('root ::= space ("<think>" think-until "</think>")? space ("```json" space ')
    assert opened.startswith('root ::= think-until "</think>" space ("```json" space ')
    assert none.startswith('root ::= space space ("```json" space ') and "think-until" not in none
    for g in (optional, opened, none):  # the schema's rules renamed, one shared whitespace rule
        assert "response-format ::= response-format-object" in g and g.count("space ::=") == 1
        assert "\nobject ::=" not in g and "root ::= object" not in g


@pytest.mark.parametrize("prompt, template, fmt, where", [
    ("<|im_start|>assistant\n", "... </think> ...", "auto", "optional"),
    ("<|im_start|>assistant\n", "... </think> ...", "none", "none"),
    ("<|im_start|>assistant\n", "no thinking here", "auto", "none"),
    ("<|im_start|>assistant\n<think>\n", "... </think> ...", "auto", "open"),
    ("<|im_start|>assistant\n<think>\n", "... </think> ...", "none", "open"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "... </think> ...", "auto", "none"),
])
def test_where_the_answer_starts(prompt, template, fmt, where):
    assert thinking_of(prompt, template, fmt) == where


@pytest.mark.parametrize("text, content", [
    ('{ "a" : 1 }', '{ "a" : 1 }'), ('\n\n   { "a" : 1 }  \n', '{ "a" : 1 }'),
    ('```json\n{"a": 1}\n```', '{"a": 1}'), (' ```json {"a": "`x`"} ``` ', '{"a": "`x`"}'),
    ('{"a": "x``"}', '{"a": "x``"}'), ("", ""), ("``", "``"), ("```json", ""),
])
def test_the_content_is_the_json_alone(text, content):
    assert json_answer_text(text) == content


@pytest.mark.parametrize("text", ['\n\n   { "a" : 1 }  \n', '```json\n{"a": "`x` y"}\n```\n', '{"a": [1, 2]} `',
                                  ' ``', "```json"])
def test_a_stream_cut_anywhere_sends_the_whole_content(text):
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text) - 1)))
        answer, sent, bounds = JsonAnswer(), "", [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            sent += answer.add(text[a:b])
            assert json_answer_text(text).startswith(sent)  # nothing sent is taken back
        assert sent + answer.end() == json_answer_text(text), cuts
