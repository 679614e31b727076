"""Grammar-constrained sampling (llama.cpp's ``--grammar``, ``--json-schema``; the server's
``response_format``), on llama.cpp's own grammar sampler, with the two ways it can abort the
process taken out.

llama-cpp-python puts the grammar into its sampler chain after the penalties and before the
samplers (``Llama._init_sampler``), and ``llama_sampler_sample`` applies the chain and accepts the
chosen token. Two inputs abort the process there:

* a grammar llama.cpp cannot parse: ``llama_sampler_init_grammar`` returns NULL, which
  llama-cpp-python adds to the chain as it is;
* a dead end: a grammar that allows no token at a step (the model's vocabulary cannot spell
  what it requires next, or ``--ignore-eos`` bars the end-of-generation token a completed
  grammar allows alone). Every candidate is then at -inf, the sampler picks one anyway, and
  the grammar's accept of a token it does not allow throws (``llama_grammar_accept_impl``:
  "Unexpected empty grammar stack") or aborts (``GGML_ABORT`` on an end-of-generation token) in
  C++, which ends the process.

Here the grammar is parsed against the model's vocabulary with its error caught
(``grammar_sampler``, ``check_grammar``), and
``ChainSampler`` does what ``llama_sampler_sample`` does, one chain member at a time, so that
after the grammar's member it can see a dead end and stop the generation (``GrammarDeadEnd``)
before any member accepts a token. Where the grammar allows a token, the members, their order
and their inputs are llama-cpp-python's, so the tokens are the same (tests/test_fidelity.py).

``serve`` samples as llama-server does instead (``ChainSampler(grammar_last=True)``, llama.cpp's
``common_sampler_sample``): the chain runs without the grammar, and only where its token breaks
the grammar do the grammar and then the chain run again, a second draw. At temperature 0 both
orders give the same token; with a seeded draw they give different ones, so each front end
follows its own reference (tests/test_serve_reference.py, "seeded-grammar").
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import sys
import tempfile
import threading

import numpy as np

from saem_gguf.errors import SaemError
from saem_gguf.llama_lib import load_llama_cpp

# llama_token_data {int32 id; float logit; float p}: 12 bytes, no padding
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
GRAMMAR_ROOT = "root"
# llama.cpp's grammar parser recurses once per nested group (about 450 bytes of stack each), and
# its left-recursion check and stack expansion once per rule along a chain of leading references
# (about 120 bytes each): on an 8 MiB stack 19,000 nested groups or 80,000 chained rules are a
# segfault (measured; tests/test_grammar.py runs stock llama.cpp into it). A grammar may use a
# quarter of the stack: 4,660 nested groups on 8 MiB. llama-cpp-python's schema converter nests
# one group per character of a string's maxLength, and llama.cpp's own repetition bound refuses
# those past about 1,000-1,500 deep, so no converted schema meets this bound.
GROUP_STACK_BYTES = 450
RULE_STACK_BYTES = 120
_DEFAULT_STACK = 8 << 20  # glibc's thread stack where RLIMIT_STACK is unlimited is larger
# GBNF as llama.cpp's parser reads it: literals, character classes and tokens (which may hold
# parentheses), comments, definitions and groups
_GBNF_LEXEME = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|<[^>]*>|#[^\r\n]*|::=|[()]', re.DOTALL)
# fd 2 is the process's: two server threads checking grammars at once would each save the other's
# redirection and could leave fd 2 on a deleted temporary file
_FD2_LOCK = threading.Lock()


class GrammarDeadEnd(SaemError):
    """The grammar allows no token at this step: the generation ends here (llama.cpp would
    abort)."""


def json_schema_grammar(schema: str, what: str = "the JSON schema") -> str:
    """GBNF for a JSON schema, by llama-cpp-python's converter (``json_schema_to_gbnf``, the
    one its server uses for ``response_format``); a schema that is not JSON or that the
    converter refuses is one SaemError line naming ``what``."""
    load_llama_cpp()  # the package binds its library on import: the patched one
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        json.loads(schema)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's decoder goes
        raise SaemError(f"{what} is not JSON: {e}") from None
    try:
        return json_schema_to_gbnf(schema)
    except Exception as e:  # noqa: BLE001 - the converter raises what it meets (KeyError, TypeError, ...)
        raise SaemError(f"{what} cannot be turned into a grammar: {type(e).__name__}: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object: llama-cpp-python's ``JSON_GBNF`` (its ``response_format`` json_object)."""
    load_llama_cpp()
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def check_grammar(lc, vocab, grammar: str, what: str = "the grammar") -> None:
    """``grammar_sampler``'s check alone (the sampler freed): where the sampler is built later,
    elsewhere (a server's decode thread), or after other work that should not happen first."""
    lc.llama_sampler_free(grammar_sampler(lc, vocab, grammar, what))


def grammar_sampler(lc, vocab, grammar: str, what: str = "the grammar"):
    """llama.cpp's grammar sampler for ``grammar`` (GBNF) on ``vocab``: a grammar llama.cpp
    cannot parse is one SaemError line with the parser's reason, not a NULL sampler in the chain.
    (The parser prints its error and the whole grammar to fd 2: caught here, so the user sees one
    line.)"""
    if not grammar.strip():
        raise SaemError(f"{what} is empty")
    depth, rules = grammar_shape(grammar)
    max_depth, max_rules = grammar_bounds()
    if depth > max_depth:
        raise SaemError(f"{what} nests groups {depth} deep; llama.cpp's parser would overflow the stack "
                        f"(at most {max_depth} with this stack size, ulimit -s)")
    if rules > max_rules:
        raise SaemError(f"{what} has {rules} rules and groups; llama.cpp would overflow the stack on a chain "
                        f"of them (at most {max_rules} with this stack size, ulimit -s)")
    with _FD2_LOCK, tempfile.TemporaryFile() as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(caught.fileno(), 2)
            smpl = lc.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), GRAMMAR_ROOT.encode())
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if smpl:
            return smpl
        caught.seek(0)
        printed = caught.read().decode("utf-8", "replace")
    reason = re.search(r"error parsing grammar: ([^\n]*)", printed)
    raise SaemError(f"llama.cpp cannot parse {what}: " + (reason.group(1) if reason else
                    f"no '{GRAMMAR_ROOT}' rule, or left recursion (GBNF: llama.cpp's grammars/README.md)"))


def grammar_bounds(stack_bytes: int | None = None) -> tuple[int, int]:
    """(deepest group nesting, most rules) a grammar may have on a thread stack of
    ``stack_bytes`` (default: this process's, ``ulimit -s``): a quarter of it for llama.cpp's
    recursion."""
    if stack_bytes is None:
        soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
        stack_bytes = _DEFAULT_STACK if soft == resource.RLIM_INFINITY else soft
        threads = threading.stack_size()  # read once: another thread may set it meanwhile
        if threads:  # set by someone in this process: new threads get that
            stack_bytes = min(stack_bytes, threads)
    return stack_bytes // 4 // GROUP_STACK_BYTES, stack_bytes // 4 // RULE_STACK_BYTES


def grammar_shape(grammar: str) -> tuple[int, int]:
    """(deepest group nesting, rules defined plus groups) of GBNF text: what llama.cpp's
    recursion depends on. Parentheses inside literals, classes, tokens and comments do not count."""
    depth = deepest = rules = 0
    for m in _GBNF_LEXEME.finditer(grammar):
        lexeme = m.group()
        if lexeme == "(":
            depth += 1
            rules += 1
            deepest = max(deepest, depth)
        elif lexeme == ")":
            depth = max(depth - 1, 0)
        elif lexeme == "::=":
            rules += 1
    return deepest, rules


class ChainSampler:
    """llama-cpp-python's sampler chain (``LlamaSampler``), sampled as ``llama_sampler_sample``
    samples it, one member at a time, with what that cannot do: a grammar member at
    ``grammar_index`` whose dead end stops before anything is accepted (``GrammarDeadEnd``), and
    a reasoning budget (saem_gguf.thinking) that, while it forces a token, leaves every other
    candidate at -inf before the chain runs (as llama.cpp's common sampler applies its budget
    first), and accepts each sampled token. Stands in for the ``LlamaSampler`` (``sample``,
    ``sampler``, ``close``)."""

    def __init__(self, lc, chain, n_vocab: int, grammar_index: int | None = None, budget=None,
                 grammar_last: bool = False) -> None:
        self._lc = lc
        self.chain = chain  # the LlamaSampler: it owns (and frees) every member
        self.sampler = chain.sampler
        self._grammar_index = -1 if grammar_index is None else grammar_index
        # llama-server's order (common_sampler_sample): the chain without the grammar first, and
        # only where its token breaks the grammar, the grammar and then the chain again (a second
        # draw). The same tokens as the grammar in the chain at temperature 0, others when drawn.
        self._grammar_last = grammar_last and self._grammar_index >= 0
        self.budget = budget  # a thinking.ReasoningBudget, or None
        self._n = lc.llama_sampler_chain_n(self.sampler)
        # llama-cpp-python's chain at temperature 0 ends in a greedy pick, which sets no probability
        self._greedy = self._n > 0 and lc.llama_sampler_name(
            lc.llama_sampler_chain_get(self.sampler, self._n - 1)) == b"greedy"
        self._cur = np.empty(n_vocab, _TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)  # a step's candidates start in id order
        self._cur_p = lc.llama_token_data_array(
            data=self._cur.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=n_vocab, selected=-1,
            sorted=False)

    def sample(self, ctx, idx: int = -1) -> int:
        """The token sampled from the logits of output ``idx`` of ``ctx`` (a LlamaContext), accepted
        by every member; GrammarDeadEnd where the grammar allows none (nothing accepted)."""
        lc = self._lc
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx.ctx, idx), shape=(self._cur.shape[0],))
        if self._grammar_last:
            token = self._select(logits, with_grammar=False)
            if not self._grammar_allows(token):
                token = self._select(logits, with_grammar=True)
        else:
            token = self._select(logits, with_grammar=True)
        lc.llama_sampler_accept(self.sampler, token)
        if self.budget is not None:
            self.budget.accept(token)
        return token

    def _select(self, logits: np.ndarray, with_grammar: bool) -> int:
        """The token the members select from ``logits`` (after the budget's forcing): in chain order
        with the grammar in its place, or without it; under ``grammar_last`` the grammar, where
        applied, comes first (it only sets -inf, which the penalties and biases keep)."""
        lc, cur, cur_p = self._lc, self._cur, self._cur_p
        n = cur.shape[0]
        cur["id"] = self._ids
        cur["logit"] = logits
        cur["p"] = 0.0
        forced = None if self.budget is None else self.budget.forced()
        if forced is not None:
            keep = cur["logit"][forced]
            cur["logit"] = -np.inf
            cur["logit"][forced] = keep
        cur_p.size, cur_p.selected, cur_p.sorted = n, -1, False
        ref = ctypes.byref(cur_p)
        order = list(range(self._n))
        if self._grammar_last:
            order.remove(self._grammar_index)
            if with_grammar:
                order.insert(0, self._grammar_index)
        for i in order:
            lc.llama_sampler_apply(lc.llama_sampler_chain_get(self.sampler, i), ref)
            if i == self._grammar_index and not np.isfinite(cur["logit"][:cur_p.size]).any():
                raise GrammarDeadEnd("the grammar allows no token here (the vocabulary cannot continue it, "
                                     "or it is complete and the end of generation is barred): generation stopped")
        if not 0 <= cur_p.selected < cur_p.size:
            raise SaemError(f"the sampler chain selected no token ({cur_p.selected})")
        return int(cur_p.data[cur_p.selected].id)

    def drawn_probabilities(self, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(the last drawn token's probability, the ``n`` most probable candidates with theirs,
        most probable first), as the chain left them at that draw: llama-server's
        ``post_sampling_probs`` (``common_sampler_get_candidates`` sorted by probability, the
        ones of probability 0 left out). A chain ending in a greedy pick (llama-cpp-python's at
        temperature 0) gives the drawn token probability 1 and the others 0, as llama.cpp's
        temperature 0 followed by its draw does."""
        cur_p = self._cur_p
        data = np.ctypeslib.as_array(cur_p.data, shape=(cur_p.size,))  # a member may have moved it
        chosen = int(data["id"][cur_p.selected])
        if self._greedy:
            return 1.0, ((chosen, 1.0),)[:n]
        p = data["p"]
        best = np.argsort(-p, kind="stable")[:n]
        best = best[p[best] > 0]
        return float(p[cur_p.selected]), tuple((int(data["id"][i]), float(p[i])) for i in best)

    def _grammar_allows(self, token: int) -> bool:
        """Whether the grammar member leaves ``token`` possible next (llama-server's check of a
        single-token array)."""
        lc = self._lc
        one = np.array([(token, 1.0, 0.0)], _TOKEN_DATA)
        arr = lc.llama_token_data_array(data=one.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=1,
                                        selected=-1, sorted=False)
        lc.llama_sampler_apply(lc.llama_sampler_chain_get(self.sampler, self._grammar_index), ctypes.byref(arr))
        return bool(np.isfinite(one["logit"][0]))

    def accept_prompt(self, tokens) -> None:
        """Feed the prompt to every member but the grammar, which only follows what is generated
        (llama.cpp's ``common_sampler_accept(..., is_generated=false)``); the budget neither."""
        lc = self._lc
        members = [self.sampler] if self._grammar_index < 0 else \
            [lc.llama_sampler_chain_get(self.sampler, i) for i in range(self._n) if i != self._grammar_index]
        for token in tokens:
            for m in members:
                lc.llama_sampler_accept(m, token)

    def close(self) -> None:
        self.chain.close()
