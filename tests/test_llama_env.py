"""llama.cpp's LLAMA_ARG_* environment variables and its --flag_name spelling on generate, chat and
serve (llama_env.py): the packaged table is the vendored arg.cpp's, a variable is read as its flag
before the command line (which wins, with llama.cpp's warning), the two-way and flag forms read
their values as llama.cpp's handlers do, and what cannot be taken is one usage line naming the
variable. The comparison with the stock llama-server is in test_serve_reference."""

from __future__ import annotations

import pytest

from saem_gguf.build.source import fetch_sdist
from saem_gguf.cli.llama_env import command_example, env_options_in_arg_cpp, llama_cpp_env_options, options_for
from saem_gguf.cli.llama_flags import sdist_arg_cpp
from saem_gguf.cli.main import build_parser
from test_llama_flags import _usage_error  # one usage line, exit 2


@pytest.fixture(autouse=True)
def _no_llama_env(monkeypatch):
    """Each test starts from an environment without llama.cpp's variables."""
    import os

    for name in list(os.environ):
        if name.startswith("LLAMA_") or name == "HF_TOKEN":
            monkeypatch.delenv(name)


def test_the_packaged_table_is_the_vendored_arg_cpps():
    options = env_options_in_arg_cpp(sdist_arg_cpp(fetch_sdist(quiet=True)))
    assert tuple(options) == llama_cpp_env_options()
    by_env = {o.env: o for o in options}
    assert by_env["LLAMA_ARG_CTX_SIZE"].flags == ("-c", "--ctx-size") and by_env["LLAMA_ARG_CTX_SIZE"].kind == "int"
    assert by_env["LLAMA_ARG_KV_UNIFIED"].negative == ("-no-kvu", "--no-kv-unified")
    assert by_env["LLAMA_ARG_ENDPOINT_METRICS"].kind == "void"
    assert by_env["LLAMA_ARG_PORT"].examples == {"SERVER"}
    # a comment line before the flags (-mmdev), and a named example list (mmproj_examples)
    assert by_env["MTMD_BACKEND_DEVICE"].flags == ("-mmdev", "--mmproj-device")
    assert by_env["LLAMA_ARG_MMPROJ"].examples == {"MTMD", "SERVER", "CLI", "TTS"}


def test_an_option_declared_for_one_program_and_for_the_rest_is_that_programs_there():
    # -np: server slots in llama-server (its own declaration), parallel sequences elsewhere
    assert [o.examples for o in options_for("SERVER") if o.env == "LLAMA_ARG_N_PARALLEL"] == [{"SERVER"}]
    assert [o.examples for o in options_for("CLI") if o.env == "LLAMA_ARG_N_PARALLEL"] == [{"COMMON"}]


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_each_flag_taken_reads_a_value_where_llama_cpp_reads_one(command):
    """A variable's text goes to the flag as llama.cpp's handler takes it: a value for an int or
    string option, none for a flag or a two-way option."""
    parser = build_parser().commands[command]
    ours = parser._option_string_actions
    checked = 0
    for option in options_for(command_example(parser)):
        for flag in (*option.flags, *option.negative):
            if flag in ours:
                assert (ours[flag].nargs == 0) == (option.kind in ("void", "bool")), (option, flag)
                checked += 1
    assert checked > 40


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))



def test_a_variable_is_read_and_the_command_line_wins_with_llama_cpps_warning(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "1234")
    monkeypatch.setenv("LLAMA_ARG_TOP_K", "7")
    args = _parse("generate", "-p", "x")
    assert (args.ctx_size, args.top_k) == (1234, 7)
    assert capsys.readouterr().err == ""
    args = _parse("generate", "-p", "x", "-c", "99")
    assert (args.ctx_size, args.top_k) == (99, 7)
    assert capsys.readouterr().err == ("warn: LLAMA_ARG_CTX_SIZE environment variable is set, but will be "
                                       "overwritten by command line argument -c\n")
    assert _parse("serve", "--ctx-size=98").ctx_size == 98


def test_a_value_that_begins_with_a_dash_is_a_value(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_N_PREDICT", "-1")
    monkeypatch.setenv("LLAMA_ARG_ALIAS", "-x-")
    args = _parse("serve")
    assert (args.n_predict, args.alias) == (-1, "-x-")


def test_variables_of_llama_server_only_are_not_read_by_generate(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_PORT", "9999")  # llama-completion has no --port: ignored, as there
    assert _parse("serve").port == 9999
    assert _parse("generate", "-p", "x").ctx_size is None


def test_a_command_of_this_project_reads_no_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "not a number")
    assert _parse("inspect", str(tmp_path / "m.gguf")).command == "inspect"


def test_two_way_options_read_their_value_and_the_no_twin(monkeypatch, capsys):
    for value, unified in [("1", True), ("on", True), ("enabled", True), ("false", False), ("off", False)]:
        monkeypatch.setenv("LLAMA_ARG_KV_UNIFIED", value)
        assert _parse("serve").kv_unified is unified, value
    monkeypatch.setenv("LLAMA_ARG_KV_UNIFIED", "1")
    monkeypatch.setenv("LLAMA_ARG_NO_KV_UNIFIED", "")  # set at all: the negative form, before the other
    assert _parse("serve").kv_unified is False
    monkeypatch.delenv("LLAMA_ARG_NO_KV_UNIFIED")
    monkeypatch.setenv("LLAMA_ARG_KV_UNIFIED", "yes")
    err = _usage_error(capsys, "serve")
    assert "environment variable LLAMA_ARG_KV_UNIFIED=yes: invalid boolean value" in err


def test_a_flag_is_applied_where_its_variable_is_truthy(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_METRICS", "1")
    assert _parse("serve").metrics is True
    monkeypatch.setenv("LLAMA_ARG_ENDPOINT_METRICS", "0")  # not truthy: nothing applied, as in llama.cpp
    assert _parse("serve").metrics is False


def test_a_value_the_flag_refuses_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "12abc")  # llama.cpp's stoi would read 12
    assert ("error: python -m saem_gguf chat: environment variable LLAMA_ARG_CTX_SIZE=12abc: invalid int value: "
            "'12abc'") in _usage_error(capsys, "chat")
    monkeypatch.delenv("LLAMA_ARG_CTX_SIZE")
    monkeypatch.setenv("LLAMA_ARG_FLASH_ATTN", "maybe")
    assert "environment variable LLAMA_ARG_FLASH_ATTN=maybe: " in _usage_error(capsys, "serve")


def test_a_variable_for_an_option_the_command_does_not_take_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_ARG_CACHE_REUSE", "256")
    assert ("environment variable LLAMA_ARG_CACHE_REUSE=256 sets llama.cpp's --cache-reuse, which serve does "
            "not take (unset it)") in _usage_error(capsys, "serve")
    monkeypatch.delenv("LLAMA_ARG_CACHE_REUSE")
    monkeypatch.setenv("LLAMA_ARG_NO_HOST", "0")  # a flag whose variable is not truthy: nothing to take
    assert _parse("serve").command == "serve"
    monkeypatch.setenv("HF_TOKEN", "hf_x")  # llama.cpp's -hft, for downloads; other tools read it too
    assert _parse("chat").command == "chat"


def test_underscores_in_a_flag_read_as_dashes_as_llama_cpp_reads_them(capsys):
    args = _parse("generate", "--ctx_size", "64", "--n_predict=5", "-p", "x", "--top_k", "3",
                  "--reverse-prompt=--top_k")  # a value is left as it is
    assert (args.ctx_size, args.n_predict, args.top_k, args.reverse_prompt) == (64, 5, 3, ["--top_k"])
    assert "--cache-reuse is a llama.cpp flag that serve does not take" in _usage_error(capsys, "serve",
                                                                                        "--cache_reuse", "1")


def test_help_names_each_flags_variable():
    text = build_parser().commands["serve"].format_help()
    assert "(env: LLAMA_ARG_CTX_SIZE)" in " ".join(text.split())
    assert "(env: LLAMA_ARG_KV_UNIFIED, LLAMA_ARG_NO_KV_UNIFIED)" in " ".join(text.split())
