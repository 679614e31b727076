"""llama.cpp's common sampler chain (``common_sampler_init``, common/sampling.cpp of the vendored
source) and llama-server's sampler order (its ``--samplers`` flag and a request's ``samplers``
field), for what llama-cpp-python's own chain cannot do: a named order, and the samplers it lacks
(DRY, XTC, top-n-sigma, dynamic temperature, Mirostat).

The chain: the logit bias first (the request's biases, then -inf for every end-of-generation token
under ``ignore_eos``), then one member per named sampler, in the named order (llama-server's
default order where none is named), then a seeded draw; under Mirostat (1 or 2) temperature and
the Mirostat draw alone, as llama.cpp builds it. ``temperature`` is llama.cpp's extended one
(``temp_ext``: at temperature 0 or below it keeps the most likely token alone; a
``dynatemp_range`` makes it dynamic); ``penalties`` looks back ``repeat_last_n`` tokens;
``infill`` is llama.cpp's fill-in-the-middle sampler (what llama.vscode asks for on /infill). A
sampler left out is not applied at all: without ``temperature`` the draw is at temperature 1.
``adaptive_p`` is refused. Names are llama.cpp's (``top_k``, ``top_p``, ``typ_p``, ``min_p``,
``temperature``, ``penalties``, ``dry``, ``xtc``, ``top_n_sigma``, ``infill``, ...) with its
aliases (``top-k``, ``topk``, ``nucleus``, ``temp``, ``typ``; any case), or one character each
(``k``, ``p``, ``y``, ``m``, ``t``, ``e``, ``d``, ``x``, ``s``, ``i``, ...); a name it does not
know is skipped, as llama-server skips it.

Where no order is named and every sampler llama-cpp-python lacks is at llama.cpp's default (off),
the chain stays llama-cpp-python's (engine.SamplingConfig.server_chain), which for the same
settings draws the same tokens as llama-server's default order.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from saem_gguf.errors import SaemError

if TYPE_CHECKING:
    from saem_gguf.engine import SamplingConfig

# llama.cpp's canonical names, and the character of each (common_sampler_type_to_chr)
CANONICAL = {"dry": "d", "top_k": "k", "top_p": "p", "top_n_sigma": "s", "typ_p": "y", "min_p": "m",
             "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
# llama-server's default order (common_params_sampling::samplers)
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
UNSUPPORTED = frozenset(("adaptive_p",))


def _aliases() -> dict[str, str]:
    names = {name: name for name in CANONICAL}
    for name in CANONICAL:
        if "_" in name:
            names[name.replace("_", "-")] = name
            names[name.replace("_", "")] = name
    names.update(nucleus="top_p", temp="temperature", typ="typ_p")
    return names


NAMES = _aliases()
BY_CHAR = {c: name for name, c in CANONICAL.items()}


def sampler_order(spec: str | list[str]) -> tuple[str, ...]:
    """The canonical names of a ``samplers`` value: a list of names, or a string of characters
    (llama-server's two forms). Unknown ones are skipped; SaemError for ``adaptive_p``."""
    if isinstance(spec, str):
        order = tuple(BY_CHAR[c] for c in spec if c in BY_CHAR)
    else:
        order = tuple(NAMES[n.lower()] for n in spec if n.lower() in NAMES)
    refused = sorted(UNSUPPORTED.intersection(order))
    if refused:
        raise SaemError(f"the {refused[0]} sampler is not supported here")
    return order


def cli_sampler_order(text: str) -> tuple[str, ...]:
    """llama.cpp's ``--samplers``: names separated by ';' (its separator)."""
    return sampler_order([n for n in text.split(";") if n])


def logit_bias_sampler(lc, n_vocab: int, pairs: list[tuple[int, float]]):
    """llama.cpp's logit-bias member for ``pairs`` (token id, bias), in order, each entry kept (a
    token given twice gets both; LlamaSampler.add_logit_bias takes a dict: one per token)."""
    entries = (lc.llama_logit_bias * len(pairs))(*(lc.llama_logit_bias(t, b) for t, b in pairs))
    return lc.llama_sampler_init_logit_bias(n_vocab, len(pairs), entries)


def llama_server_chain(lc, vocab, n_vocab: int, sampling: SamplingConfig, logit_bias: list[tuple[int, float]],
                       seed: int):
    """A llama-cpp-python ``LlamaSampler`` holding llama.cpp's common sampler chain
    (``common_sampler_init``) for ``sampling``: its ``samplers`` order, llama-server's default
    order where it names none; under Mirostat, temperature and the Mirostat draw alone. The logit
    bias member first (``logit_bias``: the entries, ignore_eos's included); XTC draws from
    ``seed`` as the final draw does."""
    from llama_cpp import _internals

    chain = _internals.LlamaSampler()
    add = lambda member: lc.llama_sampler_chain_add(chain.sampler, member)  # noqa: E731
    if logit_bias:
        add(logit_bias_sampler(lc, n_vocab, logit_bias))
    if sampling.mirostat == 1:
        add(lc.llama_sampler_init_temp(sampling.temp))
        add(lc.llama_sampler_init_mirostat(n_vocab, seed, sampling.mirostat_tau, sampling.mirostat_eta, 100))
        return chain
    if sampling.mirostat == 2:
        add(lc.llama_sampler_init_temp(sampling.temp))
        add(lc.llama_sampler_init_mirostat_v2(seed, sampling.mirostat_tau, sampling.mirostat_eta))
        return chain
    for name in DEFAULT_ORDER if sampling.samplers is None else sampling.samplers:
        if name == "top_k":
            add(lc.llama_sampler_init_top_k(sampling.top_k))
        elif name == "top_p":
            add(lc.llama_sampler_init_top_p(sampling.top_p, sampling.min_keep))
        elif name == "typ_p":
            add(lc.llama_sampler_init_typical(sampling.typical_p, sampling.min_keep))
        elif name == "min_p":
            add(lc.llama_sampler_init_min_p(sampling.min_p, sampling.min_keep))
        elif name == "temperature":
            add(lc.llama_sampler_init_temp_ext(sampling.temp, sampling.dynatemp_range, sampling.dynatemp_exponent))
        elif name == "infill":
            add(lc.llama_sampler_init_infill(vocab))
        elif name == "penalties":
            add(lc.llama_sampler_init_penalties(n_vocab, sampling.repeat_last_n, sampling.repeat_penalty,
                                                sampling.frequency_penalty, sampling.presence_penalty))
        elif name == "dry":
            breakers = [b.encode("utf-8") for b in sampling.dry_sequence_breakers]
            add(lc.llama_sampler_init_dry(vocab, sampling.dry_multiplier, sampling.dry_base,
                                          sampling.dry_allowed_length, sampling.dry_penalty_last_n,
                                          (ctypes.c_char_p * max(len(breakers), 1))(*breakers), len(breakers)))
        elif name == "xtc":
            add(lc.llama_sampler_init_xtc(sampling.xtc_probability, sampling.xtc_threshold, sampling.min_keep, seed))
        elif name == "top_n_sigma":
            add(lc.llama_sampler_init_top_n_sigma(sampling.top_n_sigma))
        else:  # sampler_order never yields another name
            raise SaemError(f"unknown sampler {name!r}")
    add(lc.llama_sampler_init_dist(seed))
    return chain


def feed_prompt(lc, sampler, tokens) -> None:
    """The prompt's tokens into a sampler chain before its first draw, as llama-server's
    ``init_sampler`` and llama-cli feed them: the penalties and DRY look back over the prompt too
    (a grammar does not: grammar.ChainSampler.accept_prompt). Not for ``generate``'s
    llama-cpp-python chain: llama-cpp-python feeds it none."""
    if hasattr(sampler, "accept_prompt"):
        sampler.accept_prompt(tokens)
        return
    for token in tokens:
        lc.llama_sampler_accept(sampler.sampler, token)


def server_sampler(lc, vocab, n_vocab: int, sampling: SamplingConfig, logit_bias: list[tuple[int, float]],
                   seed: int, budget=None):
    """``llama_server_chain``, its grammar checked after the draw and applied only where the drawn
    token breaks it (llama.cpp's ``common_sampler_sample``), and a reasoning budget (a
    ``thinking.ReasoningBudget``) forcing its tokens first: a ``grammar.ChainSampler`` where
    either is there, else the chain itself."""
    from saem_gguf.grammar import ChainSampler, grammar_sampler

    chain = llama_server_chain(lc, vocab, n_vocab, sampling, logit_bias, seed)
    if sampling.grammar is None:
        return chain if budget is None else ChainSampler(lc, chain, n_vocab, budget=budget)
    try:
        member = grammar_sampler(lc, vocab, sampling.grammar)
    except BaseException:
        chain.close()
        raise
    lc.llama_sampler_chain_add(chain.sampler, member)  # where does not matter: grammar_last
    return ChainSampler(lc, chain, n_vocab, lc.llama_sampler_chain_n(chain.sampler) - 1, budget, grammar_last=True)
