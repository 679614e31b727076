"""llama-server's sampler names (saem_gguf.samplers): canonical names, llama.cpp's aliases and
characters, unknown ones skipped, adaptive_p refused; `serve --samplers` parses them in one line.
The chains themselves are compared with stock llama-server in tests/test_serve_reference.py."""

from __future__ import annotations

import pytest

from conftest import run_cli
from saem_gguf.engine import SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.samplers import CANONICAL, DEFAULT_ORDER, cli_sampler_order, sampler_order


def test_names_aliases_and_characters():
    assert sampler_order(["top_k", "Top-P", "topk", "nucleus", "TEMP", "typ", "min-p", "penalties", "infill"]) == \
        ("top_k", "top_p", "top_k", "top_p", "temperature", "typ_p", "min_p", "penalties", "infill")
    assert sampler_order("kypmteix?d") == ("top_k", "typ_p", "top_p", "min_p", "temperature", "penalties",
                                           "infill", "xtc", "dry")
    assert sampler_order(["bogus", "tfs_z"]) == () and sampler_order("") == ()
    assert cli_sampler_order("penalties;top_k;;temperature") == ("penalties", "top_k", "temperature")
    assert set(DEFAULT_ORDER) <= set(CANONICAL)


def test_adaptive_p_and_unknown_names_in_a_config_are_refused():
    with pytest.raises(SaemError, match="adaptive_p sampler is not supported"):
        sampler_order(["top_k", "adaptive-p"])
    with pytest.raises(SaemError, match="unknown or unsupported sampler 'bogus'"):
        SamplingConfig(samplers=("bogus",))
    assert SamplingConfig(samplers=("top_k", "infill")).samplers == ("top_k", "infill")


def test_serve_refuses_a_bad_samplers_flag_in_one_line():
    r = run_cli("serve", "--samplers", "top_k;adaptive_p", "--port", "0")
    assert r.returncode == 2 and "--samplers: the adaptive_p sampler is not supported here" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_what_llama_cpp_pythons_chain_lacks_takes_llama_cpps_chain_and_is_serves():
    """A sampler llama-cpp-python's chain lacks, set away from llama.cpp's default (off), or a named
    order, samples with llama.cpp's common chain (samplers.llama_server_chain; compared with stock
    llama-server in tests/test_serve_reference.py); generate and chat, whose reference is
    llama-cpp-python, refuse it in one line rather than sample otherwise than asked."""
    from saem_gguf.default_model import default_model_path
    from saem_gguf.engine import Engine, EngineConfig

    assert not SamplingConfig().server_chain and not SamplingConfig(temp=0.7, repeat_penalty=1.2).server_chain
    for over in ({"dry_multiplier": 0.8}, {"xtc_probability": 0.5}, {"top_n_sigma": 1.0}, {"dynatemp_range": 0.5},
                 {"mirostat": 2}, {"dry_sequence_breakers": ("\n",)}, {"samplers": ("top_k",)}):
        assert SamplingConfig(**over).server_chain, over
    with pytest.raises(SaemError, match="mirostat must be 0"):
        SamplingConfig(mirostat=3)
    with pytest.raises(SaemError, match="finite"):
        SamplingConfig(dry_multiplier=float("nan"))
    eng = Engine(EngineConfig(model=default_model_path(), n_ctx=256, progress=False))
    try:
        with pytest.raises(SaemError, match="are serve's"):
            eng.stream("hi", 4, SamplingConfig(dry_multiplier=0.8))
        assert eng.generate("hi", 2).tokens  # the engine goes on
    finally:
        eng.close()


def test_generate_and_chat_refuse_serves_sampler_flags_by_name():
    for cmd in ("generate", "chat"):
        r = run_cli(cmd, "--dry-multiplier", "0.8", "-p", "hi") if cmd == "generate" else \
            run_cli(cmd, "--mirostat", "2")
        assert r.returncode == 2 and f"is a llama.cpp flag that {cmd} does not take" in r.stderr, r.stderr
