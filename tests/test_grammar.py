"""Grammar-constrained output (saem_gguf.grammar): the same tokens as stock llama-cpp-python with the
same grammar, a dead end that stops the generation where stock llama.cpp aborts, and bad grammars
and schemas refused in one line, from the engine, the CLI and the server's protocol."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from conftest import REPO
from fidelity_helpers import engine, reference, result_row, same, stock_env, stock_lib  # noqa: F401
from saem_gguf.default_model import default_model_path
from saem_gguf.engine import SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.grammar import json_object_grammar, json_schema_grammar
from saem_gguf.serving.output_format import JSON_OBJECT
from saem_gguf.serving.protocol import ApiError, ChatRequest, CompletionRequest, parse_request, request_grammar

PROMPT = "What is 12 + 7?"
YES_NO = 'root ::= ("yes" | "no") " because " [a-z ]+ "."'
SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string"}},
                     "required": ["answer", "why"]})
N = 24


@pytest.fixture(scope="module")
def model():
    # the embedded model: a real tokenizer whose byte tokens spell any text, so a grammar never
    # leaves stock llama.cpp at a dead end (where it would abort: below)
    return default_model_path()


def test_same_tokens_as_stock_llama_cpp_python_with_a_grammar(model, stock_lib):  # noqa: F811
    cases = [{"kind": "completion", "prompt": PROMPT, "max_tokens": N, "grammar": YES_NO},
             {"kind": "completion", "prompt": PROMPT, "max_tokens": N, "grammar": YES_NO, "temperature": 0.9,
              "seed": 7},
             {"kind": "completion", "prompt": PROMPT, "max_tokens": N, "json_schema": SCHEMA},
             {"kind": "completion", "prompt": PROMPT, "max_tokens": N}]
    ref = reference(stock_lib, model, cases)
    eng = engine(model, "saem")
    try:
        got = [eng.generate(PROMPT, N, SamplingConfig(grammar=YES_NO)),
               eng.generate(PROMPT, N, SamplingConfig(grammar=YES_NO, temp=0.9, seed=7)),
               eng.generate(PROMPT, N, SamplingConfig(grammar=json_schema_grammar(SCHEMA)))]
        plain = eng.generate(PROMPT, N)
    finally:
        eng.close()
    for what, ours, want in zip(("greedy", "seeded", "json schema"), got, ref):
        same(result_row(ours), want[0], what)
    # the grammar did constrain: the unconstrained text is another one, and each text is its grammar's
    assert plain.text == ref[3][0]["text"] and plain.text != got[0].text
    assert re.fullmatch(r"(yes|no) because [a-z ]+\.?", got[0].text), got[0].text
    assert got[2].text.lstrip().startswith("{") and "answer" in got[2].text


STOCK_DEAD_END = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
vocab, n = llm._model.vocab, llm.n_vocab()
eog = [t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t)]
bias = (llama_cpp.llama_logit_bias * len(eog))(*[llama_cpp.llama_logit_bias(t, float("-inf")) for t in eog])
chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_logit_bias(n, len(eog), bias))
llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_grammar(vocab, b'root ::= "yes"', b"root"))
llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
llm.eval(llm.tokenize(b"hi"))
for _ in range(8):
    llm.eval([llama_cpp.llama_sampler_sample(chain, llm._ctx.ctx, -1)])
print("survived")
"""


def test_a_dead_end_ends_the_generation_where_stock_llama_cpp_aborts(model, stock_lib):  # noqa: F811
    """--ignore-eos bars the one token a completed grammar allows. Stock llama.cpp's chain picks a
    barred token anyway and its grammar throws through the C API (the process aborts); the engine
    sees the dead end after the grammar's member and ends the generation, accepting nothing."""
    r = subprocess.run([sys.executable, "-c", STOCK_DEAD_END, str(model)], capture_output=True, text=True,
                       timeout=300, env={**stock_env(stock_lib), "GGML_NO_BACKTRACE": "1"}, cwd=REPO,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))  # no core file
    assert r.returncode != 0 and "survived" not in r.stdout, (r.returncode, r.stdout)
    assert "Unexpected empty grammar stack" in r.stderr, r.stderr[-2000:]
    eng = engine(model, "saem")
    try:
        res = eng.generate("hi", 8, SamplingConfig(grammar='root ::= "yes"', ignore_eos=True))
        assert (res.text, res.finish_reason) == ("yes", "stop")
        assert any("the grammar allows no token here" in n for n in eng.notes)
        # the engine goes on: the next generation (no grammar) is the same as on a fresh engine
        after = eng.generate(PROMPT, 8).text
    finally:
        eng.close()
    fresh = engine(model, "saem")
    try:
        assert fresh.generate(PROMPT, 8).text == after
    finally:
        fresh.close()


STOCK_DEEP = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
smpl = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, sys.stdin.read().encode(), b"root")
print("parsed" if smpl else "null")
"""
DEEP_GROUPS = "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000
LONG_CHAIN = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(70_000)) + 'r70000 ::= "a"\n'


@pytest.mark.parametrize("grammar,words", [(DEEP_GROUPS, "nests groups 100000 deep"),
                                           (LONG_CHAIN, "has 70002 rules and groups")])
def test_a_grammar_that_overflows_stock_llama_cpp_is_one_line(model, stock_lib, llama_cpp, grammar, words):  # noqa: F811
    """llama.cpp's parser recurses per nested group and per chained rule: stock llama.cpp dies of a
    segfault on these two (the grammar is a request field of a server); here they are refused."""
    from saem_gguf.grammar import check_grammar

    r = subprocess.run([sys.executable, "-c", STOCK_DEEP, str(model)], input=grammar, capture_output=True, text=True,
                       timeout=300, env=stock_env(stock_lib), cwd=REPO,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    assert r.returncode == -11 and "parsed" not in r.stdout, (r.returncode, r.stdout, r.stderr[-500:])
    eng = engine(model, "cpu-moe")
    try:
        with pytest.raises(SaemError, match=re.escape(words)) as e:
            check_grammar(llama_cpp, eng.llm._model.vocab, grammar)
        assert "\n" not in str(e.value)
    finally:
        eng.close()


def _at_bounds(depth: int, rules: int) -> tuple[str, str]:
    return ("root ::= " + "(" * depth + '"a"' + ")" * depth,
            "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(rules - 2)) + f'r{rules - 2} ::= "a"\n')


def test_the_stack_bounds_leave_room_for_real_grammars(model, llama_cpp):
    """At the bounds llama.cpp parses, on this process's stack and on a 1 MiB thread stack with that
    stack's bounds; the schema converter's grammars fit (a string of maxLength 1,000 nests 1,000
    groups: llama.cpp's own repetition bound refuses about 1,500); parentheses in literals,
    classes, tokens and comments do not count."""
    import threading

    from saem_gguf.grammar import check_grammar, grammar_bounds, grammar_shape

    depth, rules = grammar_bounds()
    assert grammar_bounds(8 << 20) == (4660, 17476) and depth >= 4000
    at_depth, at_rules = _at_bounds(depth, rules)
    assert grammar_shape(at_depth) == (depth, depth + 1) and grammar_shape(at_rules) == (0, rules)
    assert grammar_shape('root ::= ( "(" [(\\]] <|(|> # ((( \n x ::= (a (b)) "\\"(" )') == (3, 5)
    long_string = json_schema_grammar(json.dumps({"type": "string", "maxLength": 1000}))
    assert grammar_shape(long_string)[0] == 1000
    small = grammar_bounds(1 << 20)
    eng = engine(model, "cpu-moe")
    errors: list[BaseException] = []

    def check(*grammars: str) -> None:
        try:
            for grammar in grammars:
                check_grammar(llama_cpp, eng.llm._model.vocab, grammar)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        check(at_depth, at_rules, long_string, json_object_grammar())
        old = threading.stack_size(1 << 20)
        try:
            thread = threading.Thread(target=check, args=_at_bounds(*small))
            thread.start()
        finally:
            threading.stack_size(old)
        thread.join()
    finally:
        eng.close()
    assert not errors, [str(e) for e in errors]


@pytest.mark.parametrize("grammar,words", [
    ("root ::= foo", "Undefined rule identifier 'foo'"),
    ('root ::= "a', "unexpected end of input"),
    ('main ::= "a"', "no 'root' rule"),
    ('root ::= root "a"', "left recursion"),
    ("   ", "the grammar is empty"),
])
def test_a_grammar_llama_cpp_cannot_parse_is_one_line(model, grammar, words, capfd):
    eng = engine(model, "cpu-moe")
    try:
        capfd.readouterr()
        with pytest.raises(SaemError, match=re.escape(words)) as e:
            eng.generate(PROMPT, 4, SamplingConfig(grammar=grammar))
        assert "\n" not in str(e.value)
        assert "error parsing grammar" not in capfd.readouterr().err  # the parser's own print is caught
    finally:
        eng.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "saem_gguf", "generate", "--quiet", "-p", PROMPT, "-n", "16",
                           *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_cli_flags_are_llama_cpps(tmp_path):
    (tmp_path / "g.gbnf").write_text(YES_NO)
    (tmp_path / "s.json").write_text(SCHEMA)
    by_text = _cli("--grammar", YES_NO)
    by_file = _cli("--grammar-file", str(tmp_path / "g.gbnf"))
    assert by_text.returncode == 0 and by_file.returncode == 0, by_text.stderr + by_file.stderr
    assert by_text.stdout == by_file.stdout and re.match(r"(yes|no) because", by_text.stdout)
    by_schema = _cli("-j", SCHEMA)
    by_schema_file = _cli("-jf", str(tmp_path / "s.json"))
    assert by_schema.returncode == 0 and by_schema.stdout == by_schema_file.stdout
    assert by_schema.stdout.lstrip().startswith("{")


@pytest.mark.parametrize("args,rc,words", [
    (["--grammar", "root ::= x"], 1, "llama.cpp cannot parse the grammar: Undefined rule identifier 'x'"),
    (["--grammar-file", "/nonexistent/g.gbnf"], 1, "--grammar-file /nonexistent/g.gbnf: cannot read it"),
    (["-j", "{not json"], 1, "-j/--json-schema is not JSON"),
    (["-j", '{"$ref": "#/nowhere"}'], 1, "-j/--json-schema cannot be turned into a grammar"),
    (["-jf", "/"], 1, "-jf/--json-schema-file /: cannot read it"),
    # a binary file (was an internal error: a UnicodeDecodeError has no strerror)
    (["--grammar-file", str(REPO / "saem_gguf/data/default-model.gguf")], 1,
     "default-model.gguf: not UTF-8 text"),
    (["-jf", str(REPO / "saem_gguf/data/default-model.gguf")], 1, "default-model.gguf: not UTF-8 text"),
    (["--grammar", "root ::= \"a\"", "-j", "{}"], 2, "not allowed with argument"),
])
def test_cli_bad_grammar_or_schema_is_one_line(args, rc, words):
    r = _cli(*args)
    assert r.returncode == rc, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


# --- the server's requests (protocol only; tests/test_serve.py runs a server) -------------------
def _req(kind, **kw):
    base = {"messages": [{"role": "user", "content": "x"}]} if kind is ChatRequest else {"prompt": "x"}
    return parse_request(json.dumps({**base, **kw}).encode(), kind)


def test_requests_name_their_grammar():
    schema = json.loads(SCHEMA)
    assert request_grammar(_req(ChatRequest)) is None
    assert request_grammar(_req(ChatRequest, response_format={"type": "text"})) is None
    assert request_grammar(_req(ChatRequest, response_format={"type": "json_object"})) == JSON_OBJECT  # llama-server's
    via_schema = json_schema_grammar(json.dumps(schema))
    assert request_grammar(_req(ChatRequest, response_format={"type": "json_object", "schema": schema})) == via_schema
    assert request_grammar(_req(ChatRequest, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})) == via_schema
    assert request_grammar(_req(CompletionRequest, json_schema=schema)) == via_schema
    assert request_grammar(_req(CompletionRequest, grammar=YES_NO)) == YES_NO


@pytest.mark.parametrize("kind,fields,words", [
    (ChatRequest, {"grammar": YES_NO, "response_format": {"type": "json_object"}}, "give one of grammar, response_format"),
    (CompletionRequest, {"grammar": YES_NO, "json_schema": {}}, "give one of grammar, json_schema"),
    (CompletionRequest, {"grammar": " "}, "the grammar is empty"),
    (CompletionRequest, {"json_schema": {"$ref": "#/nowhere"}}, "json_schema cannot be turned into a grammar"),
    (ChatRequest, {"response_format": {"type": "json_schema"}}, "needs response_format.json_schema.schema"),
    (ChatRequest, {"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_grammar_requests_are_400(kind, fields, words):
    with pytest.raises(ApiError) as e:
        request_grammar(_req(kind, **fields))
    assert e.value.status == 400 and words in e.value.message and "\n" not in e.value.message


def test_the_python_api_takes_llama_cpp_pythons_grammar(model):
    from llama_cpp import LlamaGrammar

    from saem_gguf import Llama

    eng = engine(model, "saem")
    try:
        want = eng.generate(PROMPT, N, SamplingConfig(grammar=YES_NO)).text
    finally:
        eng.close()
    llm = Llama(str(model), n_ctx=512, n_threads=2, verbose=False)
    try:
        got = llm.create_completion(PROMPT, max_tokens=N, temperature=0.0,
                                    grammar=LlamaGrammar.from_string(YES_NO, verbose=False))
        assert got["choices"][0]["text"] == want
        with pytest.raises(SaemError, match="Undefined rule"):  # not a NULL sampler in the chain
            llm.create_completion(PROMPT, max_tokens=4, grammar=LlamaGrammar.from_string("root ::= x"))
    finally:
        llm.close()


def test_serve_refuses_a_default_grammar_it_cannot_parse():
    r = subprocess.run([sys.executable, "-m", "saem_gguf", "serve", "--port", "0", "--quiet", "--no-warmup",
                        "--grammar", "root ::= x"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["error: llama.cpp cannot parse the grammar: Undefined rule identifier 'x'"], r.stderr


def test_concurrent_checks_keep_fd2_and_their_own_reasons(model, llama_cpp):
    """The server checks request grammars on worker threads; each check sends fd 2 to a file for the
    parser's print: the checks must not mix their reasons, and fd 2 must end where it was."""
    import concurrent.futures

    from saem_gguf.grammar import check_grammar

    eng = engine(model, "cpu-moe")
    before = os.fstat(2)
    try:
        def check(i: int) -> str:
            try:
                check_grammar(llama_cpp, eng.llm._model.vocab, f"root ::= rule{i}")
            except SaemError as e:
                return str(e)
            return "parsed"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            reasons = list(pool.map(check, range(64)))
    finally:
        eng.close()
    assert reasons == [f"llama.cpp cannot parse the grammar: Undefined rule identifier 'rule{i}'" for i in range(64)]
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
