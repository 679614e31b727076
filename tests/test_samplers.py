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
