"""llama.cpp's flags on our command lines: the packaged list is the vendored arg.cpp's, a llama.cpp
flag a command does not take is refused by name in one line (not read as another flag), and the
llama-server / llama-cli flags that mean nothing here (--jinja, -cb, --metrics, --no-webui) or
have another name (--chat-template-file) or are read here (--api-key-file) are taken."""

from __future__ import annotations

import pytest

from saem_gguf.build.source import fetch_sdist
from saem_gguf.cli.llama_flags import flags_in_arg_cpp, llama_cpp_flags, sdist_arg_cpp
from saem_gguf.cli.main import build_parser


def test_the_packaged_list_is_the_vendored_arg_cpps():
    flags = flags_in_arg_cpp(sdist_arg_cpp(fetch_sdist(quiet=True)))
    assert set(flags) == llama_cpp_flags()
    assert {"-cb", "-md", "--lora", "--jinja", "--no-jinja", "-ngl", "--reasoning-budget"} <= set(flags)


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,flag", [
    (["serve", "-md", "draft.gguf"], "-md"),  # argparse alone: -m d, then draft.gguf unrecognised
    (["generate", "-p", "x", "-sp"], "-sp"),  # argparse alone: -s p (an invalid seed)
    (["chat", "-to", "60"], "-to"),  # argparse alone: -t o
    (["generate", "-p", "x", "--lora=a.gguf"], "--lora"),
    (["serve", "--no-jinja"], "--no-jinja"),
    (["generate", "-p", "x", "-cb"], "-cb"),  # batching flags belong to serve
])
def test_a_llama_cpp_flag_not_taken_is_refused_by_name(capsys, argv, flag):
    err = _usage_error(capsys, *argv)
    assert f": {flag} is a llama.cpp flag that {argv[0]} does not take" in err


def test_a_value_that_looks_like_a_llama_cpp_flag_is_given_with_equals():
    args = build_parser().parse_args(["generate", "-p", "x", "--reverse-prompt=-cb"])
    assert args.reverse_prompt == ["-cb"]


def test_llama_server_and_llama_cli_flags_that_mean_nothing_here_are_taken(tmp_path):
    tpl = tmp_path / "t.jinja"
    args = build_parser().parse_args(["serve", "--jinja", "-cb", "--metrics", "--no-webui", "--chat-template-file",
                                      str(tpl)])
    assert args.chat_template == str(tpl)
    args = build_parser().parse_args(["chat", "--jinja", "--chat-template-file", str(tpl)])
    assert args.chat_template == str(tpl)


def test_api_key_file_as_llama_server_reads_it_and_refuses_one_without_keys(tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\n\nalpha\r\n  beta \n#gamma\n")
    args = build_parser().parse_args(["serve", "--api-key", "k0", "--api-key-file", str(keys)])
    assert args.api_keys == ("k0",) and args.api_key_files == [("alpha", "beta")]
    empty = tmp_path / "none.txt"
    empty.write_text("# no key yet\n")
    assert "no API key in" in _usage_error(capsys, "serve", "--api-key-file", str(empty))
    assert "failed to open file" in _usage_error(capsys, "serve", "--api-key-file", str(tmp_path / "missing"))
