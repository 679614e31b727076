"""llama-server's sampler names (saem_gguf.samplers): canonical names, llama.cpp's aliases and
characters, unknown ones skipped, adaptive_p refused; `serve --samplers` parses them in one line;
generate and chat draw with llama.cpp's common chain where one of its samplers is set.
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


def test_what_llama_cpp_pythons_chain_lacks_takes_llama_cpps_chain():
    """A sampler llama-cpp-python's chain lacks, set away from llama.cpp's default (off), or a named
    order, samples with llama.cpp's common chain (samplers.llama_server_chain; compared with stock
    llama-server in tests/test_serve_reference.py), in generate and chat too: the engine draws with
    it, seeded, and goes back to llama-cpp-python's chain for the next generation."""
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
        prompt = "2 + 2 = 4. 2 + 2 = 4. 2 + 2 ="
        plain = SamplingConfig(temp=0.9, seed=3)
        dry = SamplingConfig(temp=0.9, seed=3, dry_multiplier=0.8, dry_allowed_length=1)
        first = eng.generate(prompt, 16, dry).tokens
        assert first == eng.generate(prompt, 16, dry).tokens  # seeded: the same draw again
        assert first != eng.generate(prompt, 16, plain).tokens
        assert eng.llm._saem_common_chain is None  # not left set for the next sampler
        # at --temp 0 the common chain's temperature keeps the most likely token alone: greedy
        greedy = eng.generate(prompt, 16).tokens
        assert eng.generate(prompt, 16, SamplingConfig(seed=3, samplers=("top_k", "temperature"))).tokens == greedy
    finally:
        eng.close()


def test_generate_and_chat_take_llama_cpps_sampler_flags_and_refuse_bad_values_in_one_line():
    for argv, needle in ((["generate", "-p", "hi", "--mirostat", "3"], "--mirostat"),
                         (["generate", "-p", "hi", "--dry-multiplier", "nan"], "--dry-multiplier"),
                         (["chat", "--samplers", "top_k;adaptive_p"], "adaptive_p sampler is not supported"),
                         (["chat", "--xtc-threshold", "x"], "--xtc-threshold")):
        r = run_cli(*argv)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and needle in last and "Traceback" not in r.stderr, (argv, r.stderr)
    r = run_cli("generate", "-p", "hi", "-n", "4", "--temp", "0.8", "-s", "1", "--top-nsigma", "1", "--dry-multiplier",
                "0.5", "--xtc-probability", "0.5", "--dynatemp-range", "0.3", "--sampling-seq", "edskypmxt",
                "--no-warmup", "--quiet")
    assert r.returncode == 0, r.stderr
