"""The grammar of a chat answer asked for as JSON (``response_format``, ``json_schema`` on
/v1/chat/completions), as llama-server builds it for its chat formats (common/chat.cpp's
generated parser; its ``generation_settings.grammar`` shows it):

    root  ::= <generation prompt> space ("<think>" until-</think> "</think>")? space
              ("```json" space response-format space "```" | space response-format space)
    space ::= | " " | "\\n"{1,2} [ \\t]{0,20}

So a reasoning model thinks first and then answers in JSON, and the JSON may stand in a
```` ```json ```` fence. llama-server feeds the generation prompt to the grammar before the first
token; here the grammar starts after the prompt instead, at the same place: with the thinking block
optional, inside a block the prompt opened (``<think>`` at its end), or past one the prompt closed
(Qwen3's ``enable_thinking`` false). Without a reasoning template, or with the reasoning format
``none``, there is no thinking block (llama-server answers a 400 for ``none`` where the prompt
opened one; here the block is closed first).

``response-format`` is the schema's grammar from llama-cpp-python's converter (the one serve uses
for every schema), with its whitespace rule replaced by the one above. llama-server converts with
llama.cpp's C++ converter, which differs in small ways: it puts whitespace before a closing
bracket where llama-cpp-python's puts it after a value, and its strings refuse control characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from saem_gguf.grammar import _GBNF_LEXEME
from saem_gguf.thinking import THINK_CLOSE, THINK_OPEN, forced_open_prefix, template_reasons

SPACE = 'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}'  # llama.cpp's json-schema-to-grammar SPACE_RULE
# llama.cpp's converter's grammar for {"type": "object"}, which llama-server makes of a chat's
# {"type": "json_object"} (its generation_settings.grammar, on the vendored source): taken as it
# is, so that such answers are llama-server's (llama-cpp-python's converter places whitespace
# otherwise: a model that writes "{  }" there could only write a string in it)
JSON_OBJECT = r"""root ::= object
array ::= "[" space ( value ("," space value)* )? space "]"
boolean ::= ("true" | "false")
char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})
decimal-part ::= [0-9]{1,16}
integral-part ::= [0] | [1-9] [0-9]{0,15}
null ::= "null"
number ::= ("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?
object ::= "{" space ( string ":" space value ("," space string ":" space value)* )? space "}"
string ::= "\"" char* "\""
value ::= object | array | string | number | boolean | null
""" + SPACE + "\n"
ANSWER = '("```json" space response-format space "```" | space response-format space)'
_RULE_NAME = re.compile(r"^([A-Za-z0-9_-]+)\s*::=", re.MULTILINE)
_IDENTIFIER = re.compile(r"[A-Za-z0-9_-]+|\{[^}]*\}")  # a rule name, or a repetition count {m,n}


def thinking_of(prompt: str, template: str, reasoning_format: str) -> str:
    """Where an answer to ``prompt`` (a chat's rendered text) starts, for ``answer_grammar``."""
    if forced_open_prefix(prompt) is not None:
        return "open"
    if reasoning_format == "none" or not template_reasons(template) or prompt.rstrip().endswith(THINK_CLOSE):
        return "none"
    return "optional"


def answer_grammar(schema_grammar: str, thinking: str) -> str:
    """The grammar of a chat answer holding ``schema_grammar``'s JSON, from the first generated
    token on. ``thinking``: ``"optional"`` (a reasoning template, nothing open), ``"open"`` (the
    prompt ends inside a thinking block), ``"none"`` (no block, or the prompt closed one)."""
    head = {"optional": f'space ("{THINK_OPEN}" think-until "{THINK_CLOSE}")? space',
            "open": f'think-until "{THINK_CLOSE}" space',
            "none": "space space"}[thinking]
    rules = [f"root ::= {head} {ANSWER}", SPACE]
    if thinking != "none":
        rules += excluding_rules("think-until", THINK_CLOSE)
    return "\n".join(rules + [_renamed(schema_grammar)]) + "\n"


def excluding_rules(name: str, literal: str) -> list[str]:
    """GBNF rules ``name``, ``name-1``, ... matching any text that does not contain ``literal``
    (llama.cpp's ``until`` rules: one state per character of ``literal`` matched so far, each
    allowed to end)."""
    def state(i: int) -> str:
        return name if i == 0 else f"{name}-{i}"

    def after(matched: str) -> int:  # KMP: the longest end of ``matched`` that begins ``literal``
        for k in range(min(len(matched), len(literal)), 0, -1):
            if matched.endswith(literal[:k]):
                return k
        return 0

    chars = sorted(set(literal))
    rules = []
    for i in range(len(literal)):
        alternatives, leaving = [""], []
        for c in chars:
            j = after(literal[:i] + c)
            if j == len(literal):
                leaving.append(c)  # completes the literal: not allowed
            elif j > 0:
                alternatives.append(f"[{_class_char(c)}] {state(j)}")
                leaving.append(c)
        alternatives.append(f"[^{''.join(map(_class_char, leaving))}] {state(0)}")
        rules.append(f"{state(i)} ::= " + " | ".join(alternatives))
    return rules


def _class_char(c: str) -> str:
    """``c`` inside a GBNF character class (llama.cpp's parse_char escapes; ``^`` by its code, as
    it would negate a class it opened)."""
    return "\\x5E" if c == "^" else "\\" + c if c in "]\\-[" else c


def _renamed(grammar: str) -> str:
    """``grammar`` with ``root`` named ``response-format`` and its other rules ``response-format-*``,
    except ``space``, which becomes the shared one above (its definition dropped)."""
    names = set(_RULE_NAME.findall(grammar))

    def name(n: str) -> str:
        return "response-format" if n == "root" else n if n == "space" else f"response-format-{n}"

    out, at = [], 0
    for m in _GBNF_LEXEME.finditer(grammar):  # literals, classes, comments stay as they are
        out.append(_IDENTIFIER.sub(lambda r: name(r.group()) if r.group() in names else r.group(),
                                   grammar[at:m.start()]))
        out.append(m.group())
        at = m.end()
    out.append(_IDENTIFIER.sub(lambda r: name(r.group()) if r.group() in names else r.group(), grammar[at:]))
    lines = "".join(out).splitlines()
    return "\n".join(ln for ln in lines if not ln.startswith("space ::="))


FENCE_OPEN, FENCE_CLOSE = "```json", "```"


@dataclass
class JsonAnswer:
    """An answer's content as llama-server's parser captures it under these grammars: the JSON
    alone, without the whitespace around it or the ```` ```json ```` fence. Fed piece by piece
    (``add``), it releases only what is decided: whitespace and backticks at the end wait for the
    text after them, and a beginning that may still become the fence waits for it."""

    text: str = ""
    sent: int = 0

    def _json(self, final: bool) -> str:
        body = self.text.lstrip()
        if body.startswith(FENCE_OPEN):
            body = body[len(FENCE_OPEN):].lstrip()
            if final:
                body = body.rstrip()
                body = body[:-len(FENCE_CLOSE)].rstrip() if body.endswith(FENCE_CLOSE) else body
        elif not final and FENCE_OPEN.startswith(body):
            return ""  # "", "``": the fence may be coming
        return body.rstrip() if final else body.rstrip(" \t\r\n`")

    def add(self, piece: str, final: bool = False) -> str:
        """The content ``piece`` releases."""
        self.text += piece
        body = self._json(final)
        out = body[self.sent:]
        self.sent = max(self.sent, len(body))
        return out

    def end(self) -> str:
        return self.add("", final=True)


def json_answer_text(text: str) -> str:
    """A whole answer's content (``JsonAnswer`` fed at once)."""
    return JsonAnswer().add(text, final=True)
