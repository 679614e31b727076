"""llama-server's sampler order (its ``--samplers`` flag and a request's ``samplers`` field): the
chain llama.cpp's ``common_sampler_init`` builds (common/sampling.cpp of the vendored source), for
`serve`, where a request or the server names the order.

The chain: the logit bias first (the request's biases, then -inf for every end-of-generation token
under ``ignore_eos``), then one member per named sampler, in the named order, then a seeded draw.
``temperature`` is llama.cpp's extended one (``temp_ext`` with no dynamic range: at temperature 0
or below it keeps the most likely token alone); ``penalties`` looks back ``repeat_last_n`` tokens;
``infill`` is llama.cpp's fill-in-the-middle sampler (what llama.vscode asks for on /infill). A
sampler left out is not applied at all: without ``temperature`` the draw is at temperature 1.
``dry``, ``xtc`` and ``top_n_sigma`` are accepted and, as their parameters here are llama.cpp's
defaults, which turn them off, add nothing; ``adaptive_p`` is refused. Names are llama.cpp's
(``top_k``, ``top_p``, ``typ_p``, ``min_p``, ``temperature``, ``penalties``, ``infill``, ...) with
its aliases (``top-k``, ``topk``, ``nucleus``, ``temp``, ``typ``; any case), or one character each
(``k``, ``p``, ``y``, ``m``, ``t``, ``e``, ``i``, ...); a name it does not know is skipped, as
llama-server skips it.

Without a named order the chain stays llama-cpp-python's (engine.SamplingConfig), which for the
same settings draws the same tokens as llama-server's default order.
"""

from __future__ import annotations

from saem_gguf.errors import SaemError

# llama.cpp's canonical names, and the character of each (common_sampler_type_to_chr)
CANONICAL = {"dry": "d", "top_k": "k", "top_p": "p", "top_n_sigma": "s", "typ_p": "y", "min_p": "m",
             "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
# llama-server's default order (common_params_sampling::samplers)
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
# off at llama.cpp's default parameters, which are the only ones here: no member
OFF_BY_DEFAULT = frozenset(("dry", "xtc", "top_n_sigma"))
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


def llama_server_chain(lc, vocab, n_vocab: int, order: tuple[str, ...], *, temp: float, top_k: int, top_p: float,
                       min_p: float, typical_p: float, repeat_last_n: int, repeat_penalty: float,
                       frequency_penalty: float, presence_penalty: float, logit_bias: list[tuple[int, float]],
                       seed: int):
    """A llama-cpp-python ``LlamaSampler`` holding llama-server's chain for ``order`` (the module
    docstring); ``min_keep`` is llama.cpp's default, 0."""
    from llama_cpp import _internals

    chain = _internals.LlamaSampler()
    add = lambda member: lc.llama_sampler_chain_add(chain.sampler, member)  # noqa: E731
    if logit_bias:
        add(logit_bias_sampler(lc, n_vocab, logit_bias))
    for name in order:
        if name in OFF_BY_DEFAULT:
            continue
        if name == "top_k":
            add(lc.llama_sampler_init_top_k(top_k))
        elif name == "top_p":
            add(lc.llama_sampler_init_top_p(top_p, 0))
        elif name == "typ_p":
            add(lc.llama_sampler_init_typical(typical_p, 0))
        elif name == "min_p":
            add(lc.llama_sampler_init_min_p(min_p, 0))
        elif name == "temperature":
            add(lc.llama_sampler_init_temp_ext(temp, 0.0, 1.0))
        elif name == "infill":
            add(lc.llama_sampler_init_infill(vocab))
        elif name == "penalties":
            add(lc.llama_sampler_init_penalties(n_vocab, repeat_last_n, repeat_penalty, frequency_penalty,
                                                presence_penalty))
        else:  # sampler_order never yields another name
            raise SaemError(f"unknown sampler {name!r}")
    add(lc.llama_sampler_init_dist(seed))
    return chain
