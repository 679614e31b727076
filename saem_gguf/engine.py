"""The engine: a GGUF opened on the patched llama.cpp with stage-aware expert placement attached.

``Engine`` validates the model file first (clear errors, no llama.cpp crash on a bad file), pins
CPU threads per ``--pin-gpu-node``, loads the model through llama-cpp-python (``SaemLlama``, a ``Llama``
subclass, so ``create_completion`` / ``create_chat_completion`` / streaming keep working), sizes
the expert cache (``--ecr`` or ``--vram-budget``), and hooks every decode: routing is read from
the native counters, fed with the token's text to the stage detector, and the policy's
residency changes are issued as async expert copies before the next decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

import numpy as np

from saem_gguf import numa
from saem_gguf.budget import (
    AUTO, auto_margin, format_size, plan_auto, plan_from_budget, plan_from_ecr, slots_fitting,
)
from saem_gguf.detokenize import detokenize
from saem_gguf.errors import SaemError
from saem_gguf.gpu_memory import gpu_memory
from saem_gguf.grammar import ChainSampler, GrammarDeadEnd, check_grammar, grammar_sampler
from saem_gguf.harmony import ANALYSIS_START, END, template_is_harmony
from saem_gguf.interrupts import deferred_signals
from saem_gguf.llama_lib import load_llama_cpp
from saem_gguf.resources import available_memory, checked_engine_inputs
from saem_gguf.thinking import (THINK_CLOSE, THINK_OPEN, ReasoningBudget, forced_open_prefix, open_block_tokens,
                                template_reasons)
from saem_gguf.trace import ModelSignature, SequenceTrace

DEFAULT_ECR = 0.25
# What host memory the expert slots leave free after loading, where they are host memory: what
# the first decodes still allocate (compute buffers touched on first use, the sampler, Python)
HOST_SLOT_MARGIN_BYTES = 64 << 20
HOST_SLOT_MARGIN_FRACTION = 0.02
# What pinned experts must leave of the available memory: pinned pages cannot be reclaimed or
# swapped, and the KV cache, compute buffers and the rest of the machine need their share
PINNED_MARGIN_BYTES = 1 << 30
PINNED_MARGIN_FRACTION = 0.10
# architectures whose cue set is more specific than the general one
FAMILY_CUES = {"qwen3moe": "qwen3", "deepseek2": "deepseek-r1", "gpt-oss": "gpt-oss"}
# Policies that rank a stage a cue opens by the profile's per-cue stage routing (saem-cue's blend).
CUE_RANKING_POLICIES = ("saem", "saem-cue")


def pin_experts(expert_bytes: int, available: int | None) -> bool:
    """With a GPU, do the experts go to pinned host memory (fast copies to the GPU, read into
    memory at load) or stay mapped from the file? Pinned where they fit in the memory available
    less ``PINNED_MARGIN_*`` (or nothing says what is available). Why: the whole experts are read
    into memory that cannot be reclaimed, and where they do not fit (a 17 GiB Qwen3-30B-A3B on a
    16 GiB machine) the load ends in an out-of-memory kill, where llama.cpp's --n-cpu-moe runs
    from the mapped file."""
    if available is None:
        return True
    return expert_bytes <= available - PINNED_MARGIN_BYTES - int(PINNED_MARGIN_FRACTION * available)


class HostSlotsShort(SaemError):
    """Expert slots in host memory that do not fit in the memory available (``what``: why);
    ``fits``: how many slots per layer would."""

    def __init__(self, message: str, what: str, fits: int) -> None:
        super().__init__(message)
        self.what, self.fits = what, fits


# llama.cpp's -ctk/-ctv values (common/arg.cpp kv_cache_types)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_ATTN = ("on", "off", "auto")
MAX_PARALLEL = 256  # LLAMA_MAX_SEQ (src/llama-cparams.h)
# matrix types ggml's AMX buffer runs with tile instructions (ggml-cpu/amx/common.h,
# qtype_has_amx_kernels); F16 there runs on AVX-512, no tiles
AMX_TILE_TYPES = frozenset(("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))


ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}  # llama.cpp's --rope-scaling names, LLAMA_ROPE_SCALING_TYPE_*


@dataclass(frozen=True)
class RopeConfig:
    """llama.cpp's RoPE and YaRN context flags, for a context longer than the model was trained
    on (Qwen3's 32k stretched to 128k: ``--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx
    32768``). Each left at None is llama-cpp-python's default (the model's own RoPE)."""

    scaling: str | None = None  # --rope-scaling none|linear|yarn
    freq_base: float | None = None  # --rope-freq-base
    freq_scale: float | None = None  # --rope-freq-scale, or 1 / --rope-scale
    yarn_orig_ctx: int | None = None  # --yarn-orig-ctx
    yarn_ext_factor: float | None = None  # --yarn-ext-factor (negative: from the scaling type)
    yarn_attn_factor: float | None = None  # --yarn-attn-factor
    yarn_beta_slow: float | None = None  # --yarn-beta-slow
    yarn_beta_fast: float | None = None  # --yarn-beta-fast

    def __post_init__(self) -> None:
        if self.scaling is not None and self.scaling not in ROPE_SCALING:
            raise SaemError(f"rope scaling must be one of {', '.join(ROPE_SCALING)}, got {self.scaling!r}")
        for name in ("freq_base", "freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_slow",
                     "yarn_beta_fast"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise SaemError(f"rope {name} must be a finite number, got {v}")
        if self.freq_base is not None and self.freq_base < 0 or self.freq_scale is not None and self.freq_scale < 0:
            raise SaemError("--rope-freq-base and --rope-freq-scale must be >= 0 (0: the model's)")
        if self.yarn_orig_ctx is not None and self.yarn_orig_ctx < 0:
            raise SaemError(f"--yarn-orig-ctx must be >= 0 (0: the model's training context), got {self.yarn_orig_ctx}")

    def llama_kwargs(self) -> dict:
        """As llama-cpp-python's ``Llama`` keyword arguments (those given only)."""
        out = {"rope_scaling_type": ROPE_SCALING[self.scaling]} if self.scaling is not None else {}
        for name, kw in (("freq_base", "rope_freq_base"), ("freq_scale", "rope_freq_scale"),
                         ("yarn_orig_ctx", "yarn_orig_ctx"), ("yarn_ext_factor", "yarn_ext_factor"),
                         ("yarn_attn_factor", "yarn_attn_factor"), ("yarn_beta_slow", "yarn_beta_slow"),
                         ("yarn_beta_fast", "yarn_beta_fast")):
            if getattr(self, name) is not None:
                out[kw] = getattr(self, name)
        return out


@dataclass
class EngineConfig:
    model: Path | None = None  # None: the embedded default model
    # -c: 0 the model's own context length; None 4096, or the model's own where it is shorter
    # (resources.context_size)
    n_ctx: int | None = 4096
    # -np: sequences the context holds at once (llama.cpp's n_seq_max). As llama-server does
    # without --kv-unified, the KV cache is split into one stream per sequence, each of
    # n_ctx / n_parallel cells (llama.cpp rounds that up to a multiple of 256); see n_ctx_seq
    n_parallel: int = 1
    # -kvu: one KV stream the sequences share (llama.cpp's kv_unified): each may use the whole
    # context while the others leave it room, as llama-server without -np runs (its -np auto)
    kv_unified: bool = False
    n_threads: int | None = None  # -t: threads of a one-token ubatch (None: every CPU this process may use)
    # -tb: threads of a ubatch of several tokens (a prompt, a batch step of several sequences);
    # None: as n_threads (llama.cpp's default)
    n_threads_batch: int | None = None
    # load-time llama.cpp settings (llama.cpp's flags of the same names, README "Usage"); the
    # defaults are llama-cpp-python's (the Python API's), the CLI passes llama.cpp's
    n_gpu_layers: int | None = None  # -ngl; None or negative: every layer (llama.cpp's auto/all)
    n_batch: int = 512  # -b: logical batch
    n_ubatch: int = 512  # -ub: physical batch (one decode, one routing read)
    flash_attn: str = "off"  # -fa on|off|auto
    cache_type_k: str = "f16"  # -ctk
    cache_type_v: str = "f16"  # -ctv
    use_mmap: bool = True  # --no-mmap clears it
    # -nr/--no-repack clears it: llama.cpp's extra buffer types (repacked layouts, AMX) for the
    # weights; with a GPU (or the RAM tier) not for the experts, which stay as the file has them
    use_extra_bufts: bool = True
    use_mlock: bool = False  # --mlock
    offload_kqv: bool = True  # -nkvo/--no-kv-offload clears it: the KV cache stays in host memory
    rope: RopeConfig = field(default_factory=lambda: RopeConfig())  # --rope-*, --yarn-*
    tensor_overrides: tuple = ()  # -ot: tensor_overrides.TensorOverride, in order
    kv_overrides: tuple = ()  # --override-kv: (key, value) pairs, saem_gguf.kv_overrides
    numa: str | None = None  # llama.cpp's --numa strategy: distribute | isolate | numactl
    pin_gpu_node: bool = False  # pin CPU expert threads and weights to the GPU's NUMA node
    n_cpu_moe: int | None = None  # -ncmoe N: the n-cpu-moe policy with the experts of blocks < N on the CPU
    policy: str = "saem"
    ecr: float | None = None
    vram_budget: int | str | None = None  # bytes, or budget.AUTO (free VRAM; the default with a GPU)
    profile: Path | None = None
    hw: str = "measure"  # the cost model's hardware: a preset, measure, or a profile JSON
    # the RAM tier (ram_tier.py): expert bytes kept resident of a memory-mapped model (bytes, or
    # budget.AUTO); None: off, the kernel's page cache decides
    ram_budget: int | str | None = None
    ram_policy: str | None = None  # None: --policy's (saem when that one is fixed)
    ram_prefetch: str = "madvise"  # ram_tier.PREFETCH_METHODS
    ram_route_prefetch: bool = True  # the routed experts read ahead inside the graph
    # sampling seed, llama.cpp's meaning: any value is a fixed seed (0 too); None or -1: a random
    # one, drawn at load (Engine.seed says which, to repeat the run)
    seed: int | None = None
    chat_template: str | None = None  # a Jinja file or a llama-cpp-python chat format name
    # more variables for the chat template (llama.cpp's --chat-template-kwargs, --reasoning on|off:
    # enable_thinking), JSON values; a chat request's own are merged over them
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    verbose: bool = False
    record: bool = False  # keep a routing trace of what is decoded
    progress: bool = True  # a loading progress bar (on a terminal)

    def __post_init__(self) -> None:
        if self.flash_attn not in FLASH_ATTN:
            raise SaemError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {self.flash_attn!r}")
        for what, t in (("cache_type_k", self.cache_type_k), ("cache_type_v", self.cache_type_v)):
            if t not in KV_CACHE_TYPES:
                raise SaemError(f"{what} must be one of {', '.join(KV_CACHE_TYPES)}, got {t!r}")
        if not 1 <= self.n_parallel <= MAX_PARALLEL:
            raise SaemError(f"n_parallel (-np) must be in 1..{MAX_PARALLEL}, got {self.n_parallel}")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise SaemError(f"batch sizes must be >= 1, got -b {self.n_batch} -ub {self.n_ubatch}")
        if self.kv_overrides:
            from saem_gguf.kv_overrides import merged

            merged(self.kv_overrides)  # a key given twice is refused
        if self.n_cpu_moe is not None and (self.n_cpu_moe < 0 or self.policy != "n-cpu-moe"):
            raise SaemError(f"n_cpu_moe (-ncmoe) must be >= 0 and goes with the n-cpu-moe policy, got "
                            f"{self.n_cpu_moe} with policy {self.policy}")


SEED_RANDOM = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp draws a seed itself


def resolve_seed(seed: int | None) -> int:
    """``seed`` if it is a fixed seed, else a random one (never SEED_RANDOM itself)."""
    if seed is None or seed == -1 or seed == SEED_RANDOM:
        return random.SystemRandom().randrange(SEED_RANDOM)
    if not 0 <= seed < SEED_RANDOM:
        raise SaemError(f"seed {seed} is out of range (0 .. {SEED_RANDOM - 1}, or -1 for a random one)")
    return seed


@dataclass(frozen=True)
class SamplingConfig:
    """llama.cpp's sampling settings (``common/arg.cpp`` names and defaults), sampled by
    llama-cpp-python's own chain (penalties, then greedy at temp <= 0, else top-k, typical, top-p,
    min-p, temperature, a seeded draw), so the same settings give llama-cpp-python's tokens; where
    ``server_chain`` (a sampler order named, or a sampler that chain lacks turned on), by llama.cpp's
    common chain instead (saem_gguf.samplers), so they give llama-cli's and llama-server's.

    Unlike llama.cpp the default temperature is 0 (greedy: reproducible, placement-independent)."""

    temp: float = 0.0
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    typical_p: float = 1.0  # 1: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64  # tokens the penalties look back on; 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: the engine's seed
    ignore_eos: bool = False  # end-of-generation tokens get logit -inf (llama.cpp's --ignore-eos)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    # GBNF the output must follow (llama.cpp's --grammar; saem_gguf.grammar): checked against the
    # model's vocabulary before generating; a dead end ends the generation ("stop")
    grammar: str | None = None
    # llama.cpp's --logit-bias: (token id, bias) pairs, in order, each added to its token's logit
    # first in the chain (-inf bans the token; a token given twice gets both); the ids are checked
    # against the vocabulary before generating
    logit_bias: tuple[tuple[int, float], ...] = ()
    # llama.cpp's --reasoning-budget: tokens a chat's thinking block may take before its end tag
    # is forced (-1: unlimited; 0: it ends at once), where the chat template has one (thinking.py)
    reasoning_budget: int = -1
    # llama.cpp's --reasoning-budget-message: text forced before the end tag (plain text here)
    reasoning_budget_message: str = ""
    # llama.cpp's sampler order (saem_gguf.samplers; --samplers): None keeps llama-cpp-python's
    # chain (or, where a sampler below is on, llama.cpp's default order); canonical names
    # (samplers.sampler_order) build llama.cpp's common sampler chain in that order
    samplers: tuple[str, ...] | None = None
    # llama.cpp's samplers that llama-cpp-python's chain lacks (common/arg.cpp names and defaults,
    # each off at its default): one that is on builds llama.cpp's common sampler chain
    dry_multiplier: float = 0.0  # DRY repetition penalty; 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # tokens DRY scans for repetitions; 0: off
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    xtc_probability: float = 0.0  # XTC; 0: off
    xtc_threshold: float = 0.1  # above 0.5: off
    top_n_sigma: float = -1.0  # <= 0: off
    dynatemp_range: float = 0.0  # dynamic temperature; 0: off
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 1: Mirostat, 2: Mirostat 2.0 (then top-k, top-p, ... are not applied)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # llama-server's min_keep: top-p, min-p, typical and XTC keep at least this many tokens (0: off)
    min_keep: int = 0

    def __post_init__(self) -> None:
        for name in ("temp", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise SaemError(f"{name} must be a finite number, got {v}")
        # llama.cpp's own check (common_sampler_init, --repeat-penalty): the penalty divides logits
        # (a zero one made every repeated token certain); top_p, min_p and typical_p take any value
        # (at or past their ends a sampler does nothing, or keeps one token)
        if not 1.0 / float(np.finfo(np.float32).max) < self.repeat_penalty < math.inf:  # 1/p finite in float32
            raise SaemError(f"repeat_penalty must be finite and greater than 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise SaemError(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        if any(not s for s in self.stop):
            raise SaemError("a stop string must not be empty")
        if any(math.isnan(bias) for _, bias in self.logit_bias):
            raise SaemError("a logit bias must be a number or -inf, not NaN")
        for name in ("dry_multiplier", "dry_base", "xtc_probability", "xtc_threshold", "top_n_sigma",
                     "dynatemp_range", "dynatemp_exponent", "mirostat_tau", "mirostat_eta"):
            if not math.isfinite(getattr(self, name)):
                raise SaemError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.dry_allowed_length < 0 or self.dry_penalty_last_n < 0 or self.min_keep < 0:
            raise SaemError("dry_allowed_length, dry_penalty_last_n and min_keep must be >= 0")
        if self.mirostat not in (0, 1, 2):
            raise SaemError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat}")
        if self.samplers is not None:
            from saem_gguf.samplers import CANONICAL, UNSUPPORTED

            bad = [n for n in self.samplers if n not in CANONICAL or n in UNSUPPORTED]
            if bad:
                raise SaemError(f"unknown or unsupported sampler {bad[0]!r}")
        if self.reasoning_budget < -1:
            raise SaemError(f"the reasoning budget must be -1 (unlimited) or a count of tokens >= 0, "
                            f"got {self.reasoning_budget}")

    @property
    def server_chain(self) -> bool:
        """Sampled by llama.cpp's common sampler chain (saem_gguf.samplers), not llama-cpp-python's:
        an order is named, or a sampler its chain lacks is set away from llama.cpp's default."""
        return self.samplers is not None or any(
            getattr(self, name) != getattr(GREEDY, name) for name in (
                "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
                "xtc_probability", "xtc_threshold", "top_n_sigma", "dynatemp_range", "dynatemp_exponent",
                "mirostat", "mirostat_tau", "mirostat_eta", "min_keep"))

    def chain_logit_bias(self, eog_tokens: Iterable[int]) -> list[tuple[int, float]]:
        """The logit-bias member's entries: ``logit_bias``, then -inf for every end-of-generation
        token under ``ignore_eos`` (llama.cpp appends them the same way)."""
        return [*self.logit_bias, *((t, -math.inf) for t in eog_tokens if self.ignore_eos)]


# what llama-cpp-python's chat handler and Jinja formatter pass to a template themselves, or
# take as their own arguments: a template variable by one of these names would not reach it
RESERVED_TEMPLATE_VARIABLES = frozenset((
    "messages", "eos_token", "bos_token", "raise_exception", "add_generation_prompt", "functions",
    "function_call", "tools", "tool_choice", "strftime_now", "llama", "temperature", "top_p", "top_k",
    "min_p", "typical_p", "stream", "stop", "seed", "response_format", "max_tokens", "presence_penalty",
    "frequency_penalty", "repeat_penalty", "tfs_z", "mirostat_mode", "mirostat_tau", "mirostat_eta",
    "model", "logits_processor", "grammar", "logit_bias", "logprobs", "top_logprobs"))


def check_template_kwargs(variables: dict[str, Any]) -> None:
    """SaemError (one line) for a chat-template variable the chat handler would take for itself."""
    taken = sorted(k for k in variables if k in RESERVED_TEMPLATE_VARIABLES)
    if taken:
        raise SaemError(f"chat template variable {taken[0]!r} is set by the chat handler itself; "
                        "it cannot be given")


def check_token_ids(tokens: Iterable[int], n_vocab: int, what: str) -> None:
    """SaemError (one line) naming the first of ``tokens`` outside the vocabulary."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise SaemError(f"{what} {bad} is not in the vocabulary (0..{n_vocab - 1})")


def check_logit_bias(logit_bias: Iterable[tuple[int, float]], n_vocab: int) -> None:
    """A biased token id outside the vocabulary is one line (llama.cpp skips it silently: a typo
    would go unnoticed)."""
    check_token_ids((t for t, _ in logit_bias), n_vocab, "logit bias token")


GREEDY = SamplingConfig()


@dataclass(frozen=True)
class ChatPrompt:
    """A chat rendered and tokenized as llama-cpp-python's ``create_chat_completion`` does (the
    same chat format, BOS/EOS texts and BOS rule), message contents kept literal."""

    text: str
    tokens: list[int]
    stop: tuple[str, ...]  # the chat format's stop strings


class TokenStream:
    """Iterates (token, text) while generating: ``text`` is the output that token releases (it
    may be empty while a possible stop string is held back; a final (None, text) flushes). After
    the loop: ``finish_reason`` ("stop": end of generation or a stop string; "length": -n or the
    context is exhausted) and ``tokens``, the generated ids."""

    def __init__(self, prompt_token_ids: list[int], seed: int) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.seed = seed
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        # prompt tokens decoded before the first token was drawn (fewer than the prompt's where a
        # prefix was reused); set when the first token comes
        self.prompt_tokens_evaluated = 0
        self._steps: Iterator[tuple[int | None, bytes]] = iter(())

    def __iter__(self) -> Iterator[tuple[int | None, bytes]]:
        return self._steps


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int  # how many prompt tokens were evaluated
    seconds_prompt: float
    seconds_decode: float
    events: list = field(default_factory=list)
    finish_reason: str = "length"
    seed: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds_decode if self.seconds_decode > 0 else 0.0


def _with_extra(cues, extra):
    """``cues`` plus the cues of ``extra`` it lacks (saem-cue watches both)."""
    have = {t.casefold() for t in cues.texts}
    extra = extra.subset([t for t in extra.texts if t.casefold() not in have])
    return cues.merged(extra) if len(extra) else cues


class _PromptCaptured(Exception):
    """Raised by a capturing SaemLlama.create_completion: what a chat handler would generate from."""

    def __init__(self, tokens: list[int], stop) -> None:
        super().__init__("prompt captured")
        self.tokens = tokens
        self.stop = tuple([stop] if isinstance(stop, str) else stop or ())


@functools.cache  # one class per process: saem_gguf.Llama subclasses the one Engine loads with
def _make_llama_class(llama_cpp):
    class SaemLlama(llama_cpp.Llama):
        """``Llama`` whose every ubatch is followed by the engine's hook (routing -> placement).

        ``Llama.__init__`` assigns ``self.model_params`` / ``self.context_params`` before it loads
        the model and creates the context; these properties amend them on the way:

        - ``saem_experts_on_host``: the expert tensors load into plain (pinned, with a GPU, unless
          ``saem_experts_pinned`` is false: then mapped from the file) host memory the native cache
          can copy from;
        - ``saem_n_seq_max``: the context holds that many sequences (``-np``), one KV stream each,
          as in llama-server with ``-np N``, or with ``saem_kv_unified`` one stream they share
          (``-kvu``, llama-server's default without ``-np``);
        - ``saem_tensor_overrides`` (the user's ``-ot``, resolved): appended after that expert
          override, so it decides the expert tensors and the user's patterns everything else;
        - ``saem_no_repack``: llama.cpp's ``-nr`` (``use_extra_bufts`` off), which ``Llama`` cannot
          express;
        - ``saem_flash_attn_auto``: llama.cpp's ``-fa auto``, which ``Llama`` cannot express (its
          ``flash_attn`` is a bool), set once the model is loaded, right before the context;
        - a progress callback (it moves ``saem_progress``'s bar, if any) that cancels the load when
          Ctrl-C or SIGTERM arrives, which then raises from ``__init__`` (a large model stops
          loading at once, not minutes later)."""

        def __init__(self, *args, saem_hook: Callable[[list[int]], None] | None = None,
                     saem_experts_on_host: bool = False, saem_experts_pinned: bool = True,
                     saem_progress: TextIO | None = None,
                     saem_tensor_overrides: list[tuple[bytes, int]] | None = None,
                     saem_flash_attn_auto: bool = False, saem_n_seq_max: int = 1, saem_kv_unified: bool = False,
                     saem_no_repack: bool = False, **kw):
            self._saem_hook = None
            self.saem_tokens_evaluated = 0  # every token eval() has decoded (a stream's prompt count)
            self._saem_no_repack = saem_no_repack
            self._saem_n_seq_max = saem_n_seq_max
            self._saem_kv_unified = saem_kv_unified
            self._saem_on_host = saem_experts_on_host
            self._saem_pinned = saem_experts_pinned
            self._saem_user_overrides = saem_tensor_overrides or []
            self._saem_fa_auto = saem_flash_attn_auto
            self._saem_bar = None
            if saem_progress is not None:
                from tqdm import tqdm

                self._saem_bar = tqdm(total=100, desc="loading", unit="%", file=saem_progress,
                                      bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
            try:
                # a signal during the load cancels it (the progress callback) and is raised on
                # the way out of this block (interrupts.py)
                with deferred_signals() as self._saem_deferred:
                    try:
                        super().__init__(*args, **kw)
                    except ValueError:
                        # llama-cpp-python's "Failed to load model" for a cancelled load: the
                        # signal is what happened
                        if self._saem_deferred.signum is None:
                            raise
                    else:
                        if self._saem_deferred.signum is not None:
                            self.close()  # loaded before the signal was seen: freed at once
            finally:
                if self._saem_bar is not None:
                    self._saem_bar.close()
            # reached only when the signal's own handler did not raise (it only set a flag)
            if self._saem_deferred.signum is not None:
                name = signal.Signals(self._saem_deferred.signum).name
                raise SaemError(f"loading {kw.get('model_path', 'the model')} was cancelled by {name}")
            # each decode call is one ubatch, so each ubatch's routing is read before the next
            self._saem_ubatch = llama_cpp.llama_n_ubatch(self.ctx)
            self._saem_hook = saem_hook

        @property
        def model_params(self):
            return self._saem_model_params

        @model_params.setter
        def model_params(self, params) -> None:
            from saem_gguf.tensor_overrides import override_array

            rows = list(self._saem_user_overrides)
            if self._saem_no_repack:
                params.use_extra_bufts = False
            if self._saem_on_host:
                from saem_gguf import native_api as na

                ours = na.keep_experts_on_host(params, pinned=self._saem_pinned)
                rows.insert(0, (ours[0].pattern, ours[0].buft))
            if rows:
                # kept on self: llama.cpp reads the array (and its patterns) while loading
                self._saem_buft_override = override_array(rows)
                params.tensor_buft_overrides = ctypes.cast(self._saem_buft_override, ctypes.c_void_p)
            from llama_cpp import _logger

            bar = self._saem_bar
            deferred = self._saem_deferred
            shown = [0]  # llama.cpp's own callback's percentage

            def progress(p: float, _ud) -> bool:
                # llama.cpp calls this before each tensor it loads; false cancels the load
                if deferred.signum is not None:
                    return False
                percentage = int(np.float32(100) * np.float32(p))  # llama.cpp's float arithmetic
                if percentage > shown[0]:
                    # what llama.cpp's own callback (replaced by this one) logs: a dot each time the
                    # percentage moves, a line break at 100 (shown when --verbose)
                    shown[0] = percentage
                    _logger.llama_log_callback(GGML_LOG_LEVEL_CONT, b".", None)
                    if percentage >= 100:
                        _logger.llama_log_callback(GGML_LOG_LEVEL_CONT, b"\n", None)
                if bar is not None:
                    bar.n = percentage
                    bar.refresh()
                return True

            # kept on self: the C side calls it for as long as the model loads
            self._saem_progress_cb = llama_cpp.llama_progress_callback(progress)
            params.progress_callback = self._saem_progress_cb
            self._saem_model_params = params

        # --- fidelity: the chat prompt's message contents stay literal; --ignore-eos ----------
        _saem_chat_contents: list[str] | None = None  # set while a chat prompt is tokenized
        _saem_capture = False  # create_completion raises _PromptCaptured instead of generating
        _saem_logit_bias: list[tuple[int, float]] | None = None  # SamplingConfig.chain_logit_bias
        _saem_budget = None  # the thinking.ReasoningBudget of the next sampler, or None
        _saem_grammar_last = False  # the next sampler checks its grammar after the chain (llama-server's order)
        # (SamplingConfig, prompt tokens): the next sampler is llama.cpp's common chain for it
        # (samplers.server_sampler), the prompt fed to it first, as llama-cli samples
        _saem_common_chain: tuple[SamplingConfig, list[int]] | None = None
        _saem_specials = None

        def create_chat_completion(self, messages, *args, **kw):
            """llama-cpp-python's, with message contents tokenized as plain text."""
            from saem_gguf.tokenization import content_strings

            self._saem_chat_contents = content_strings(messages)
            try:
                return super().create_chat_completion(messages, *args, **kw)
            finally:
                self._saem_chat_contents = None

        def saem_chat_completion(self, messages, template_kwargs: dict, **kw):
            """``create_chat_completion`` with more chat-template variables: llama-cpp-python's chat
            handler hands keywords it does not take to the template (its create_chat_completion
            has no way to pass them)."""
            from llama_cpp import llama_chat_format

            from saem_gguf.tokenization import content_strings

            handler = (self.chat_handler or self._chat_handlers.get(self.chat_format)
                       or llama_chat_format.get_chat_completion_handler(self.chat_format))
            self._saem_chat_contents = content_strings(messages)
            try:
                return handler(llama=self, messages=messages, **kw, **template_kwargs)
            finally:
                self._saem_chat_contents = None

        def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
            contents = self._saem_chat_contents
            if contents is None or not special:
                return super().tokenize(text, add_bos, special)
            # the chat handler tokenizes the rendered prompt (the only special=True call in it)
            from saem_gguf.tokenization import SpecialTokens, protected_spans, tokenize_protected

            if self._saem_specials is None:
                self._saem_specials = SpecialTokens.of(llama_cpp, self._model.vocab, self.n_vocab())
            spans = protected_spans(text, contents, self._saem_specials)
            if not spans:
                return super().tokenize(text, add_bos, special)
            bos = super().tokenize(b"", add_bos, False)  # [BOS] when the model adds one, else []
            return bos + tokenize_protected(text, spans, self._saem_specials,
                                            lambda b: super(SaemLlama, self).tokenize(b, False, False))

        def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
            """llama-cpp-python's, with pieces longer than 32 bytes kept (saem_gguf.detokenize)."""
            if type(self.tokenizer_) is not llama_cpp.llama_tokenizer.LlamaTokenizer:  # an HF tokenizer
                return super().detokenize(tokens, prev_tokens, special)
            return detokenize(llama_cpp, self._model.vocab, tokens, special, self._model.token_bos())

        def create_completion(self, prompt, *args, **kw):
            if self._saem_capture:
                raise _PromptCaptured(list(prompt), kw.get("stop"))
            return super().create_completion(prompt, *args, **kw)

        def _init_sampler(self, *args, grammar=None, **kw):
            if self._saem_common_chain is not None:
                from saem_gguf.samplers import feed_prompt, server_sampler

                sampling, prompt = self._saem_common_chain
                sampler = server_sampler(llama_cpp, self._model.vocab, self.n_vocab(), sampling,
                                         self._saem_logit_bias or [], self._seed, self._saem_budget)
                feed_prompt(llama_cpp, sampler, prompt)
                return sampler
            sampler = super()._init_sampler(*args, **kw)
            chain = sampler.sampler
            if self._saem_logit_bias:
                from saem_gguf.samplers import logit_bias_sampler

                # llama.cpp's logit bias comes first in its chain: put it before the others
                members = [llama_cpp.llama_sampler_chain_remove(chain, 0)
                           for _ in range(llama_cpp.llama_sampler_chain_n(chain))]
                llama_cpp.llama_sampler_chain_add(chain, logit_bias_sampler(llama_cpp, self.n_vocab(),
                                                                            self._saem_logit_bias))
                for m in members:
                    llama_cpp.llama_sampler_chain_add(chain, m)
            if grammar is None:
                if self._saem_budget is None:
                    return sampler
                return ChainSampler(llama_cpp, sampler, self.n_vocab(), budget=self._saem_budget)
            # where llama-cpp-python adds it: after the penalties (after the logit bias, first),
            # before the samplers; sampled by ChainSampler, which stops at a dead end
            member = grammar_sampler(llama_cpp, self._model.vocab, grammar._grammar)
            names = [llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(chain, i))
                     for i in range(llama_cpp.llama_sampler_chain_n(chain))]
            at = next(i for i, n in enumerate(names) if n.endswith(b"penalties")) + 1
            rest = [llama_cpp.llama_sampler_chain_remove(chain, at)
                    for _ in range(llama_cpp.llama_sampler_chain_n(chain) - at)]
            llama_cpp.llama_sampler_chain_add(chain, member)
            for m in rest:
                llama_cpp.llama_sampler_chain_add(chain, m)
            return ChainSampler(llama_cpp, sampler, self.n_vocab(), at, self._saem_budget, self._saem_grammar_last)

        @property
        def context_params(self):
            params = self._saem_context_params
            if self._saem_fa_auto and getattr(self, "_model", None) is not None:
                # Llama has finished its own settings (the model is loaded): the context comes next
                params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            return params

        @context_params.setter
        def context_params(self, params) -> None:
            # Llama assigns llama.cpp's defaults first and amends them in place; it never sets
            # n_seq_max (but for embeddings, which the engine does not use)
            params.n_seq_max = self._saem_n_seq_max
            params.kv_unified = self._saem_kv_unified
            self._saem_context_params = params

        def eval(self, tokens):
            self.saem_tokens_evaluated += len(tokens)
            hook = self._saem_hook
            if hook is None:
                return super().eval(tokens)
            tokens = list(tokens)
            for i in range(0, len(tokens), self._saem_ubatch):
                chunk = tokens[i:i + self._saem_ubatch]
                super().eval(chunk)
                hook(chunk)

        def close(self) -> None:
            self._saem_closed = True
            super().close()

    _refuse_after_close(SaemLlama, llama_cpp.Llama)
    return SaemLlama


def _refuse_after_close(cls: type, base: type) -> None:
    """Make every public method of ``cls`` (``base``'s and its own) raise a SaemError once
    ``close()`` ran. Why: llama-cpp-python's ``close`` frees the model and context but keeps
    their pointers, so a later call (``llm("hi")`` after ``llm.close()``) reads freed memory and
    the process dies of SIGSEGV, with ``Llama`` as with this class before the guard."""
    names = {n for k in (base, cls) for n, a in vars(k).items()
             if inspect.isfunction(a) and (not n.startswith("_") or n == "__call__") and n != "close"}
    for name in sorted(names):
        setattr(cls, name, _closed_guard(name, getattr(cls, name)))


def _closed_guard(name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if self.__dict__.get("_saem_closed"):
            raise SaemError(f"Llama.{name}: this model was closed (close() freed it); load it again to use it")
        return method(self, *args, **kwargs)
    return guarded


class Engine:
    def __init__(self, cfg: EngineConfig, log: Callable[[str], None] | None = None,
                 construct: Callable[..., Any] | None = None) -> None:
        """``construct``: called with the ``Llama`` keyword arguments in place of the SaemLlama
        class, to load into an existing object (saem_gguf.Llama does: it is the engine's llm)."""
        self.notes: list[str] = []
        self._log = log or (lambda s: None)
        # the model file against what llama.cpp asserts on, -c against memory, -t clamped
        self.cfg, self.info, self.path = checked_engine_inputs(cfg, self.note)
        cfg = self.cfg
        if cfg.ecr is not None and cfg.vram_budget is not None:
            raise SaemError("give --ecr or --vram-budget, not both")
        self.numa_plan = numa.plan(cfg.numa, cfg.pin_gpu_node)
        numa.apply(self.numa_plan)
        self.note(f"NUMA: {self.numa_plan.note}")
        llama_cpp = load_llama_cpp()
        self._llama_cpp = llama_cpp
        self.placement = None
        self.policy_name = "off"
        self._auto_gpu = None
        slots = self._slots_per_layer()
        # the RAM budget is checked before the model loads (a bad one costs no load)
        ram_plan = None
        if cfg.ram_budget is not None and self.info.is_moe:
            from saem_gguf.ram_tier import plan_ram_budget

            ram_plan = plan_ram_budget(self.info, cfg.ram_budget, cfg.n_ctx)
        n_threads = cfg.n_threads or max(1, len(self.numa_plan.cpus))
        n_threads_batch = cfg.n_threads_batch or n_threads
        Cls = construct or _make_llama_class(llama_cpp)
        gpu_offload = bool(llama_cpp.llama_supports_gpu_offload())
        llama_kw = self._llama_load_params(llama_cpp, managed=slots is not None, gpu_offload=gpu_offload)
        self._host_slot_layers = self._host_slot_layers_for(gpu_offload)
        # the bar writes to a duplicate of fd 2, taken before llama.cpp's log silences fd 2
        bar_out = os.fdopen(os.dup(2), "w") if cfg.progress and sys.stderr.isatty() else None
        try:
            with _quiet_stderr(not cfg.verbose), _llama_error_log(llama_cpp) as load_errors:
                self.llm = Cls(
                    model_path=str(self.path), n_ctx=cfg.n_ctx, n_threads=n_threads,
                    n_threads_batch=n_threads_batch, seed=cfg.seed, verbose=cfg.verbose,
                    # tracing wants every prompt token's routing in the last layer too, which
                    # llama.cpp computes only for tokens whose logits are requested
                    logits_all=cfg.record,
                    numa=self.numa_plan.llama_strategy, saem_hook=None,
                    saem_progress=bar_out, saem_n_seq_max=cfg.n_parallel,
                    saem_kv_unified=cfg.kv_unified, **llama_kw)
        except ValueError as e:
            # llama-cpp-python says only "Failed to load model"; llama.cpp's error log says why
            reason = next((line.split("error loading model:", 1)[1] for line in load_errors
                           if "error loading model:" in line), load_errors[0] if load_errors else str(e))
            raise SaemError(f"llama.cpp could not load {self.path}: {reason.strip()}") from None
        finally:
            if bar_out is not None:
                bar_out.close()
        self._in_prompt = False
        self._seq_prompt_tokens = 0
        self._pieces: list[bytes] = []
        self._trace_tokens: list[int] = []
        self.ram_tier = None
        try:
            if slots is not None:
                self._attach_placement(self._auto_slots_after_load(slots))
            if cfg.ram_budget is not None:
                from saem_gguf.ram_tier import RamTierSettings, attach_ram_tier

                self.ram_tier = attach_ram_tier(
                    self.llm, self.placement, self.info, ram_plan,
                    RamTierSettings(cfg.ram_budget, cfg.ram_policy, cfg.ram_prefetch, cfg.ram_route_prefetch), self.note)
            self.llm._saem_hook = self._on_ubatch
            self._setup_generation()
        except BaseException:
            # e.g. a bad profile: free the loaded model now, not whenever the collector runs
            self.llm.close()
            raise

    # --- setup -------------------------------------------------------------------------------
    def _setup_generation(self) -> None:
        cfg, llm = self.cfg, self.llm
        self.seed = resolve_seed(cfg.seed)
        if cfg.verbose:
            self.note(f"seed {self.seed}")
        # llama-cpp-python 0.3.36 reads a constructor seed of 0 as "random": the engine seeds
        # every generation itself (stream), with llama.cpp's meaning of the value
        llm.set_seed(self.seed)
        vocab = llm._model.vocab
        self.eog_tokens = [t for t in range(llm.n_vocab()) if self._llama_cpp.llama_vocab_is_eog(vocab, t)]
        # a token's text depends on the token alone (the vocabulary is fixed): each is detokenized
        # once, not once per generated token (piece, and _piece_after's lone previous token)
        self._piece_of: dict[int, bytes] = {}
        self._detokenized_alone: dict[int, bytes] = {}
        self._fallback_noted = False
        self._plain_format_noted = False
        self._template_source = self.llm.metadata.get("tokenizer.chat_template", "")  # set_chat_template's
        if cfg.chat_template is not None:
            self.set_chat_template(cfg.chat_template)

    @property
    def n_ctx_seq(self) -> int:
        """Tokens one sequence can hold: the whole context with -np 1, else its share of it."""
        return int(self._llama_cpp.llama_n_ctx_seq(self.llm.ctx))

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        self._log(msg)

    def _n_gpu_layers(self) -> int:
        """-ngl as llama.cpp takes it: -1 (every layer) when not given or negative."""
        ngl = self.cfg.n_gpu_layers
        return -1 if ngl is None or ngl < 0 else ngl

    def _host_slot_layers_for(self, gpu_offload: bool) -> list:
        """MoE layers whose expert slots are host memory (_check_host_slots): every one without GPU
        offload, else those -ngl N leaves on the CPU (llama.cpp offloads the last N of the
        n_layer + 1 blocks)."""
        ngl = self._n_gpu_layers()
        first_gpu = max(self.info.n_layer + 1 - ngl, 0) if gpu_offload and ngl >= 0 else 0
        return [m for m in self.info.moe_layers if not gpu_offload or m.index < first_gpu]

    def _llama_load_params(self, llama_cpp, managed: bool, gpu_offload: bool) -> dict:
        """llama.cpp's load-time flags as ``Llama`` keyword arguments (plus the -ot and -fa auto
        amendments ``SaemLlama`` applies), after checking them against expert management."""
        import gguf

        from saem_gguf import native_api as na
        from saem_gguf.kv_overrides import merged
        from saem_gguf.tensor_overrides import check_against_experts, resolve

        cfg = self.cfg
        overrides = list(cfg.tensor_overrides)
        expert_names = [t.name for layer in self.info.moe_layers for t in layer.tensors]
        for msg in check_against_experts(overrides, expert_names, managed):
            self.note(msg)
        ngl = self._n_gpu_layers()
        if cfg.n_gpu_layers is not None and not gpu_offload:
            self.note("no usable GPU (a CPU build of llama.cpp): -ngl is ignored")
        # mmap maps the file's pages wherever the kernel likes: off when the threads are pinned to
        # a node (first touch then places the weights there) and when experts go to pinned host
        # memory (an mmap-backed tensor would bypass that buffer)
        use_mmap = cfg.use_mmap and self.numa_plan.node is None
        pinned = True
        if use_mmap and managed and na.saem_expert_host_buft(True)[1]:
            avail = available_memory()
            pinned = pin_experts(self.info.expert_bytes, avail)
            if pinned:
                use_mmap = False
                self.note("experts load into pinned host memory, so the model is read without mmap")
            else:
                self.note(f"the experts ({format_size(self.info.expert_bytes)}) do not fit in pinned memory beside "
                          f"the {format_size(avail)} available: they stay mapped from the file, as llama.cpp's "
                          "--n-cpu-moe keeps them (copies to the GPU then read pageable memory)")
        no_repack = not cfg.use_extra_bufts
        amx_types = sorted(set(self.info.matrix_types) & AMX_TILE_TYPES)
        # every layer and the output on a GPU (-ngl auto/all, no -ot): no matrix is multiplied on
        # the CPU, so no AMX buffer
        all_on_gpu = (gpu_offload and (ngl < 0 or ngl > self.info.n_layer)
                      and not overrides)
        if not no_repack and amx_types and not all_on_gpu and na.saem_cpu_amx_tiles_fault():
            no_repack = True
            self.note(f"this CPU's AMX tiles fault on use (seen in virtual machines): llama.cpp would crash "
                      f"on the first prompt with this model's {', '.join(amx_types)} matrices in its AMX "
                      "buffer, so the model loads without extra buffer types, as with -nr")
        # Where the expert cache's slots can only be on the CPU (a build without GPU offload), the
        # experts load as stock loads them: repacked where llama.cpp repacks them (Q4_0, Q4_K, IQ4_NL,
        # MXFP4 on AVX2), which CPU slots copy as they are, so they round and run as stock's. With a
        # GPU they go to plain (pinned) host memory a device can copy from; the RAM tier reads them
        # where the file is mapped (CPU_Mapped), which a repacked copy is not.
        experts_on_host = managed and (gpu_offload or cfg.ram_budget is not None)
        if cfg.use_mlock and not llama_cpp.llama_supports_mlock():
            self.note("--mlock is not supported on this system: ignored by llama.cpp")
        kv_type = {name: int(gguf.GGMLQuantizationType[name.upper()]) for name in KV_CACHE_TYPES}
        for flag, name, head in (("-ctk", cfg.cache_type_k, self.info.head_dim_k),
                                 ("-ctv", cfg.cache_type_v, self.info.head_dim_v)):
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kv_type[name])][0]
            if head % block:  # llama.cpp refuses the context then, with this reason in its log only
                raise SaemError(f"{flag} {name} stores rows in blocks of {block}, which do not divide this "
                                f"model's attention head size {head}: use f16, bf16 or f32")
        return dict(
            n_gpu_layers=ngl, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
            flash_attn=cfg.flash_attn == "on", saem_flash_attn_auto=cfg.flash_attn == "auto",
            type_k=kv_type[cfg.cache_type_k], type_v=kv_type[cfg.cache_type_v],
            use_mmap=use_mmap, use_mlock=cfg.use_mlock, saem_no_repack=no_repack,
            offload_kqv=cfg.offload_kqv, **cfg.rope.llama_kwargs(),
            saem_experts_on_host=experts_on_host, saem_experts_pinned=pinned,
            saem_tensor_overrides=resolve(llama_cpp, overrides),
            **({"kv_overrides": merged(cfg.kv_overrides)} if cfg.kv_overrides else {}))

    def _slots_per_layer(self) -> int | None:
        info, cfg = self.info, self.cfg
        if not info.is_moe:
            self.note(f"{info.architecture} is a dense model: expert management is off "
                      f"(--policy {cfg.policy} has nothing to place)")
            return None
        if cfg.n_cpu_moe is not None:
            n_cpu = self._n_cpu_moe_layers()
            self.note(f"-ncmoe {cfg.n_cpu_moe}: the experts of {n_cpu} of {len(info.moe_layers)} MoE "
                      f"layers stay on the CPU, the other layers' experts are all resident")
            self._auto_gpu = None
            return info.n_expert  # the budget of every layer; the n-cpu-moe policy empties the first
        auto = cfg.vram_budget == AUTO or (cfg.vram_budget is None and cfg.ecr is None)
        gpus = gpu_memory() if auto else []
        self._auto_gpu = gpus[0] if gpus else None  # sized from free VRAM, corrected after loading
        if self._auto_gpu is not None:
            g = self._auto_gpu
            plan = plan_auto(info, g.free_bytes, g.total_bytes, cfg.n_ctx)
            self.note(f"--vram-budget auto: {g.description or g.name} has {format_size(g.free_bytes)} free "
                      f"of {format_size(g.total_bytes)}; keeping {format_size(auto_margin(g.total_bytes))}")
        elif cfg.vram_budget == AUTO:
            self.note(f"--vram-budget auto: no GPU (a CPU-only build, or none visible): the expert cache "
                      f"uses the default ECR {DEFAULT_ECR:.0%}")
            plan = plan_from_ecr(info, DEFAULT_ECR, cfg.n_ctx)
        elif cfg.vram_budget is not None:
            plan = plan_from_budget(info, cfg.vram_budget, cfg.n_ctx)
        else:
            plan = plan_from_ecr(info, DEFAULT_ECR if cfg.ecr is None else cfg.ecr, cfg.n_ctx)
        self.cache_plan = plan
        self.note(f"expert cache: {plan.slots_per_layer}/{info.n_expert} slots per layer "
                  f"(ECR {plan.ecr:.1%}, {format_size(plan.cache_bytes)})"
                  + (f"; {plan.note}" if plan.note else ""))
        return plan.slots_per_layer

    def _auto_slots_after_load(self, planned: int) -> int:
        """--vram-budget auto: what llama.cpp left free once the weights, KV cache and compute
        buffers are allocated replaces the estimate the plan was made with, if it is smaller."""
        g = self._auto_gpu
        if g is None:
            return planned
        now = next((x for x in gpu_memory() if x.name == g.name), g)
        fits = slots_fitting(self.info, now.free_bytes, now.total_bytes)
        slots = min(planned, fits)
        self.note(f"--vram-budget auto: {format_size(now.free_bytes)} free after loading: {fits} slots per "
                  f"layer fit, {planned} estimated before; using {slots}/{self.info.n_expert} "
                  f"(ECR {slots / self.info.n_expert:.1%})")
        return slots

    def _check_host_slots(self, n_slots: np.ndarray) -> None:
        """HostSlotsShort when the slots a policy asks for (per model layer) in host memory (a build
        without GPU offload, or layers -ngl leaves on the CPU) do not fit in the memory available
        once llama.cpp has loaded the model and made its context, less a margin. Why: they are
        allocated and zeroed at once, and where they do not fit the kernel's or a cgroup's
        out-of-memory kill ends the process without a word, on a machine where llama.cpp runs the
        same model (a mapped file's pages can be dropped, the slots' cannot)."""
        layers = self._host_slot_layers
        need = sum(int(n_slots[m.index]) * m.bytes_per_expert for m in layers)
        avail = available_memory() if need > 0 else None
        if avail is None:
            return
        margin = HOST_SLOT_MARGIN_BYTES + int(HOST_SLOT_MARGIN_FRACTION * avail)
        if need <= avail - margin:
            return
        per_slot = sum(m.bytes_per_expert for m in layers)
        fits = int(max(0, (avail - margin) // per_slot))
        given = self._cache_size_given()
        what = (f"{format_size(need)} of slots in host memory ({len(layers)} MoE layers on the CPU), more than "
                f"the {format_size(avail)} available after loading less a {format_size(margin)} margin")
        raise HostSlotsShort(f"{given}: the expert cache needs {what}: lower {given.split()[0]}" if given else
                             f"--policy {self.cfg.policy}: the expert cache needs {what}: give a smaller --ecr, "
                             "or another policy", what, fits)

    def _cache_size_given(self) -> str | None:
        """The flag by which the user sized the expert cache (-ncmoe N, --ecr X, --vram-budget SIZE),
        or None where the engine sized it (the default ECR, --vram-budget auto)."""
        cfg = self.cfg
        if cfg.n_cpu_moe is not None:
            return f"-ncmoe {cfg.n_cpu_moe}"
        if cfg.ecr is not None:
            return f"--ecr {cfg.ecr * 100:g}%"
        if cfg.vram_budget not in (None, AUTO):
            return f"--vram-budget {format_size(cfg.vram_budget)}"
        return None

    def _n_cpu_moe_layers(self) -> int:
        """MoE layers among llama.cpp's "first N layers" of -ncmoe N (it counts blocks, blk.0 .. blk.N-1)."""
        return sum(1 for layer in self.info.moe_layers if layer.index < self.cfg.n_cpu_moe)

    def _attach_placement(self, slots: int) -> None:
        from gguf import GGMLQuantizationType

        from saem_gguf import native_api as na

        try:
            try:
                self.set_placement(self.cfg.policy, slots)
            except HostSlotsShort as e:
                # a number of slots the engine chose (the default ECR, --vram-budget auto) shrinks to
                # what fits; one the user gave does not
                if self._cache_size_given() is not None or e.fits >= slots:
                    raise
                self.note(f"expert cache: {slots} slots per layer need {e.what}: using {e.fits}/"
                          f"{self.info.n_expert} (ECR {e.fits / self.info.n_expert:.1%})")
                self.set_placement(self.cfg.policy, e.fits)
        except na.UnsupportedModelError as e:
            self.note(f"expert management is off: {e}")
            self.placement = None
            return
        # what llama.cpp's log calls a CPU_REPACK buffer: said once, since it decides the rounding
        repacked = sorted({GGMLQuantizationType(t).name for i in self.placement.moe_layer_infos
                           for t, r in zip(i.types, i.repacked) if r})
        if repacked:
            self.note(f"experts ({', '.join(repacked)}) stay in the layout llama.cpp repacks them into on this "
                      "CPU (CPU_REPACK), in the expert cache's slots too")

    def set_placement(self, policy: str, slots: int, policy_args: dict | None = None) -> None:
        """(Re)attach placement: ``policy`` over ``slots`` cache slots per MoE layer (``policy_args``:
        keyword arguments of the policy's class, e.g. the default saem's ``layout``). The native
        cache is re-initialised; the model stays loaded (bench switches policies this way)."""
        from saem_gguf.costmodel import CostModel, get_hw
        from saem_gguf.placement import Placement

        if policy == "oracle":
            raise SaemError("the oracle policy needs the future routing: use it with `simulate` on "
                            "a trace, not on a live model")
        if not self.info.is_moe:
            raise SaemError(f"{self.info.architecture} is a dense model: no experts to place")
        detector, calib, cue_counts, routing = self._make_detector(policy)
        # the native layer makes each decode wait for every copy queued before it
        # (moe_cache.cpp wait_copies_on_compute), whatever the profile says
        hw = get_hw(self.cfg.hw).replace(copy_barrier=True)
        cost = CostModel.from_expert_bytes(self.info.moe_layers[0].bytes_per_expert, hw)
        policy_args = dict(policy_args or {})
        if policy == "n-cpu-moe" and self.cfg.n_cpu_moe is not None:
            policy_args["n_cpu_layers"] = self._n_cpu_moe_layers()
        self.placement = None
        self.placement = Placement(self.llm.ctx, policy, slots, cost, detector,
                                   calib_counts=calib, cue_counts=cue_counts, calib_routing=routing,
                                   record=self.cfg.record, policy_args=policy_args,
                                   check_slots=self._check_host_slots,
                                   file_moe_layers=[m.index for m in self.info.moe_layers])
        self.policy_name = policy
        if self.ram_tier is not None:  # the RAM tier outlives a policy switch (bench); its counts restart
            self.ram_tier.reset_stats()
            self.placement.tiers.append(self.ram_tier)
        self.note(f"policy {policy}: {self.placement.policy.summary}")
        prices = getattr(self.placement.policy, "layout_prices", None)
        if prices:
            n_slots = self.placement.state.n_slots
            whole = int((n_slots >= self.info.n_expert).sum())
            tried = ", ".join(f"{n}: {tok:.4g}" for n, tok in prices.items())
            self.note(f"slot layout: {whole} of {n_slots.size} MoE layers fully resident, the rest cached "
                      f"(the fastest replaying the calibration sample; estimated tok/s by whole layers {tried})")
        elif routing is not None and getattr(self.placement.policy, "replays_its_layout", False) \
                and self.placement.policy.ctx.replay_calibration is None:
            # the sample was there, but too short for the placement to replay (calibration_replay)
            from saem_gguf.simulator import MIN_REPLAY_TOKENS

            self.note(f"the profile's calibration sample holds {routing.decoded_tokens} decoded tokens, too few "
                      f"to replay (at least {MIN_REPLAY_TOKENS}): the slot layout is estimated from its counts "
                      f"(calibrate on more prompts to have it replayed)")
        led = getattr(self.placement.policy, "replay_led", None)
        if led:
            leader = self.placement.policy.leader
            self.note(f"saem starts following {leader} (it led {led[leader]} of the calibration replay's "
                      f"{sum(led.values())} steps)")
        if policy == "static-hot" and calib is None:
            self.note("static-hot has no calibration counts (make a profile with `calibrate` and pass "
                      "--profile): it places no expert, every one runs on the CPU")
        if policy == "saem-cue" and not cue_counts:
            self.note("saem-cue has no cue profiles (make them with `calibrate` and pass --profile): "
                      "it ranks like saem")

    def _make_detector(self, policy: str):
        """(stage detector, calibration counts or None, per-cue stage counts or None, the
        calibration routing sample or None).

        With ``--profile``: the profile's detector and statistics. On the embedded model without
        one: the family cue detector (short stages) and the packaged profile's statistics only.
        Under the policies that rank by cue profiles (saem, saem-cue) the detector also watches
        the cues the profile holds stage routing for."""
        import dataclasses

        from saem_gguf.stage.calibrate import Profile
        from saem_gguf.stage.cues import CueSet
        from saem_gguf.stage.detector import DetectorConfig, StageDetector

        info = self.info
        path = self.cfg.profile
        if path is None and self.cfg.model is None:
            from saem_gguf.default_model import default_profile_path

            path = default_profile_path()
        prof = Profile.load(path, expect=self.signature()) if path is not None else None
        calib = cue_counts = extra = routing = None
        if prof is not None:
            routing = prof.routing
            where = f"profile {path}"
            counts = prof.stats.get("expert_counts")
            calib = np.asarray(counts, np.float64) if counts is not None else None
            if calib is not None and calib.shape != (len(info.moe_layers), info.n_expert):
                raise SaemError(f"{where}: expert_counts shape {calib.shape} does not match the model")
            profiles = prof.stats.get("cue_profiles")
            if policy in CUE_RANKING_POLICIES and profiles is not None:
                from saem_gguf.policies.cue_profiles import from_json

                if not isinstance(profiles, dict) or not {"cues", "counts"} <= set(profiles):
                    raise SaemError(f"{where}: cue_profiles must hold 'cues' and 'counts'")
                cue_counts = from_json(profiles["counts"], len(info.moe_layers), info.n_expert, where=where)
                extra = CueSet.from_dict(profiles["cues"], where=where, allow_empty=True)
        shape = dict(n_layer=len(info.moe_layers), n_expert=info.n_expert, top_k=info.n_expert_used)
        if self.cfg.profile is not None:
            if extra is not None:
                prof = dataclasses.replace(prof, cues=_with_extra(prof.cues, extra))
            return StageDetector.from_profile(prof, self.cfg.n_parallel), calib, cue_counts, routing
        cues = CueSet.load(FAMILY_CUES.get(info.architecture, "general"))
        if extra is not None:
            cues = _with_extra(cues, extra)
        # the default minimum stage length (32 tokens) suits the embedded model too: its stages
        # run a median 62 tokens (docs/DEFAULT_MODEL.md), and its profile is calibrated with 32
        return StageDetector(self.cfg.n_parallel, cues, DetectorConfig(), **shape), calib, cue_counts, routing

    # --- the hook ----------------------------------------------------------------------------
    def _on_ubatch(self, tokens: list[int]) -> None:
        p = self.placement
        if self._in_prompt or len(tokens) > 1:
            self._seq_prompt_tokens += len(tokens)
            if p is not None:
                p.on_prompt(len(tokens))
            if self.cfg.record:
                self._trace_tokens.extend(tokens)
                self._pieces.extend(self.piece(t) for t in tokens)
            return
        piece = self.piece(tokens[0])
        if self.cfg.record:
            self._trace_tokens.append(tokens[0])
            self._pieces.append(piece)
        if p is not None:
            p.on_token(piece)

    def piece(self, token: int) -> bytes:
        piece = self._piece_of.get(token)
        if piece is None:
            piece = self._piece_of[token] = self.llm.detokenize([token], special=True)
        return piece

    # --- generation --------------------------------------------------------------------------
    def prompt_tokens(self, prompt: str, parse_special: bool = False) -> list[int]:
        """A raw prompt's tokens as llama-cpp-python's ``create_completion`` makes them: BOS
        first when the GGUF says so (``tokenizer.ggml.add_bos_token``), then the text, with special
        tokens parsed only if ``parse_special`` (create_completion always parses them)."""
        llm = self.llm
        bos = llm._model.token_cls()
        bos = bos if bos != -1 else llm.token_bos()
        head = [bos] if llm._model.add_bos_token() and bos != -1 else []
        return head + (llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=parse_special)
                       if prompt else [])

    def chat_prompt(self, messages: list[dict], template_kwargs: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> ChatPrompt:
        """``messages`` as llama-cpp-python's ``create_chat_completion`` would prompt the model:
        the chat format it picks (the GGUF's template, a known format it recognises, or
        ``--chat-template``), the real BOS/EOS texts, BOS added only when the format does not write
        it; message contents stay literal text (saem_gguf.tokenization). ``template_kwargs``:
        more template variables, over the engine's (``chat_template_kwargs``).
        ``add_generation_prompt`` False: without the assistant's header the template adds last
        (``generation_prompt``)."""
        import jinja2

        llm = self.llm
        variables = {**dict(self.cfg.chat_template_kwargs), **(template_kwargs or {})}
        check_template_kwargs(variables)
        if not llm.metadata.get("tokenizer.chat_template") and self.cfg.chat_template is None \
                and not self._fallback_noted:
            self._fallback_noted = True
            self.note(f"{self.path.name} has no chat template: using llama-cpp-python's fallback "
                      f"format {llm.chat_format!r} (--chat-template FILE|NAME sets one)")
        if variables and not self.chat_template_source() and not self._plain_format_noted:
            self._plain_format_noted = True
            self.note(f"the chat format {llm.chat_format!r} is not a Jinja template: it takes no template "
                      f"variables ({', '.join(sorted(variables))} ignored)")
        llm._saem_capture = True
        try:
            if variables:
                llm.saem_chat_completion(messages, variables, max_tokens=1)
            else:
                llm.create_chat_completion(messages, max_tokens=1)
        except _PromptCaptured as got:
            tokens, stop = got.tokens, got.stop
        except jinja2.TemplateError as e:
            raise SaemError(f"the chat template failed: {e}") from None
        except (ValueError, TypeError, KeyError, IndexError) as e:
            # raise_exception() in a template, or a template indexing messages it did not get
            raise SaemError(f"the chat template failed: {e}") from None
        finally:
            llm._saem_capture = False
        prompt = ChatPrompt(llm.detokenize(tokens, special=True).decode("utf-8", errors="replace"), tokens, stop)
        return prompt if add_generation_prompt else self._without_generation_prompt(prompt, messages, variables)

    def generation_prompt(self, messages: list[dict], variables: dict[str, Any]) -> str:
        """The text the chat template adds for ``add_generation_prompt`` (the assistant's header):
        llama.cpp's ``common_chat_template_generation_prompt``, the template rendered with it past
        where the rendering without it ends."""
        import jinja2

        source = self.chat_template_source()
        if not source:
            raise SaemError(f"the chat format {self.llm.chat_format!r} is not a Jinja template: its prompt always "
                            "ends with the assistant's header (add_generation_prompt false needs a template)")
        formatter = self._jinja_formatter(source)
        rendered = []
        for header in (False, True):
            formatter.add_generation_prompt = header
            try:
                rendered.append(formatter(messages=messages, **variables).prompt)
            except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
                raise SaemError(f"the chat template failed: {e}") from None
        without, with_header = rendered
        common = len(os.path.commonprefix([without, with_header]))
        return with_header[common:]

    def _jinja_formatter(self, source: str):
        """llama-cpp-python's formatter of a Jinja chat template, made as its ``Llama`` makes one of
        a GGUF's template: the model's real BOS/EOS texts, generation stopped at EOS."""
        from llama_cpp import llama_chat_format as lcf

        llm = self.llm
        eos, bos = llm.token_eos(), llm.token_bos()
        return lcf.Jinja2ChatFormatter(template=source,
                                       eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
                                       bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
                                       stop_token_ids=[eos])

    def _without_generation_prompt(self, prompt: ChatPrompt, messages: list[dict],
                                   variables: dict[str, Any]) -> ChatPrompt:
        header = self.generation_prompt(messages, variables)
        if not header:
            return prompt
        tail = self.llm.tokenize(header.encode("utf-8"), add_bos=False, special=True)
        if not prompt.text.endswith(header) or prompt.tokens[-len(tail):] != tail:
            raise SaemError("the chat template's generation prompt could not be cut from the prompt "
                            "(add_generation_prompt false)")
        return ChatPrompt(prompt.text[:-len(header)], prompt.tokens[:-len(tail)], prompt.stop)

    def chat_template_source(self) -> str:
        """The Jinja text chats are rendered with (llama-server's /props ``chat_template``): a
        --chat-template file's, else the GGUF's; "" for a named llama-cpp-python format."""
        return self._template_source

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` for chat: a Jinja file (rendered like a GGUF's own template) or the
        name of one of llama-cpp-python's chat formats."""
        import jinja2
        from llama_cpp import llama_chat_format as lcf

        llm = self.llm
        path = Path(template)
        if path.is_file():
            try:
                source = path.read_text(encoding="utf-8")
                handler = self._jinja_formatter(source).to_chat_handler()
            except jinja2.TemplateSyntaxError as e:
                raise SaemError(f"--chat-template {path}: line {e.lineno}: {e.message}") from None
            except (OSError, UnicodeDecodeError) as e:
                raise SaemError(f"--chat-template {path}: {e}") from None
            llm.chat_handler = handler
            self._template_source = source
            return
        names = sorted(lcf.LlamaChatCompletionHandlerRegistry()._chat_handlers)
        if template not in names:
            raise SaemError(f"--chat-template {template!r} is neither a file nor a chat format "
                            f"(known formats: {', '.join(names)})")
        llm.chat_handler = None
        llm.chat_format = template
        self._template_source = ""

    def stream(self, prompt: str | list[int] | ChatPrompt, n_predict: int = 256,
               sampling: SamplingConfig = GREEDY, reuse_prefix: bool = False,
               parse_special: bool = False) -> TokenStream:
        """Generate from ``prompt`` (text: tokenized by ``prompt_tokens``; a ChatPrompt also brings
        its format's stop strings), as llama-cpp-python's ``create_completion`` does: up to
        ``n_predict`` tokens (-1: until the context is full; capped at the context's room),
        stopping at any end-of-generation token and at stop strings. Where
        ``sampling.server_chain``, drawn by llama.cpp's common chain with the prompt's tokens fed
        to it first, as llama-cli and llama-server draw (a grammar checked after the draw).

        ``reuse_prefix`` keeps the KV cache of a common prefix with the previous call (chat turns);
        otherwise the whole prompt is evaluated, so prompt timings and traces cover all of it."""
        llm = self.llm
        stop = sampling.stop
        if isinstance(prompt, ChatPrompt):
            toks, stop = prompt.tokens, stop + prompt.stop
        elif isinstance(prompt, str):
            toks = self.prompt_tokens(prompt, parse_special)
        else:
            toks = list(prompt)
        if not toks:
            raise SaemError("empty prompt")
        n_ctx = self.n_ctx_seq
        if len(toks) >= n_ctx:
            raise SaemError(f"the prompt ({len(toks)} tokens) does not fit the context ({n_ctx} tokens per "
                            f"sequence)")
        if sampling.grammar is not None:  # before any work: a grammar llama.cpp cannot parse is one line
            check_grammar(self._llama_cpp, llm._model.vocab, sampling.grammar)
        check_logit_bias(sampling.logit_bias, llm.n_vocab())
        room = n_ctx - len(toks)
        limit = room if n_predict < 0 else min(n_predict, room)
        seed = self.seed if sampling.seed is None else resolve_seed(sampling.seed)
        out = TokenStream(toks, seed)
        budget = self.reasoning_budget(toks, prompt.text, sampling) if isinstance(prompt, ChatPrompt) else None
        out._steps = self._steps(out, limit, sampling, tuple(s.encode("utf-8") for s in stop),
                                 reuse_prefix, budget)
        return out

    def reasoning_budget(self, prompt_tokens: list[int], prompt_text: str,
                         sampling: SamplingConfig) -> ReasoningBudget | None:
        """The reasoning budget of a chat generation (thinking.py), its prompt's open thinking block
        already counted; None where there is none: ``sampling.reasoning_budget`` -1, or a chat
        template without a thinking block (as llama-server, which applies it to those alone)."""
        template = self.chat_template_source()
        if sampling.reasoning_budget < 0:
            return None
        if template_is_harmony(template):  # gpt-oss's: the analysis channel (llama.cpp's thinking tags)
            open_tag, close_tag = ANALYSIS_START, END
            opened = prompt_text.rfind(open_tag) > prompt_text.rfind(close_tag)
        elif template_reasons(template):
            open_tag, close_tag = THINK_OPEN, THINK_CLOSE
            opened = forced_open_prefix(prompt_text) is not None
        else:
            return None
        llm = self.llm

        def tags(text: str) -> list[int]:  # the template's own tags: special tokens parsed
            return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

        message = sampling.reasoning_budget_message
        start, end = tags(open_tag), tags(close_tag)
        forced = (llm.tokenize(message.encode("utf-8"), add_bos=False, special=False) if message else []) + end
        budget = ReasoningBudget(start, end, forced, sampling.reasoning_budget, self.piece)
        for tok in open_block_tokens(prompt_tokens, opened, start):
            budget.accept(tok)
        return budget

    def _steps(self, out: TokenStream, limit: int, sampling: SamplingConfig, stops: tuple[bytes, ...],
               reuse_prefix: bool, budget: ReasoningBudget | None = None) -> Iterator[tuple[int | None, bytes]]:
        llm, lc = self.llm, self._llama_cpp
        self.reset_sequence()
        if not reuse_prefix:
            llm.reset()
        self._in_prompt = True  # evals before the first sampled token are the prompt's
        evaluated = llm.saem_tokens_evaluated
        if limit == 0:  # -n 0: the prompt is evaluated (timings, traces), nothing generated
            llm.reset()
            llm.eval(out.prompt_token_ids)
            self._in_prompt = False
            out.prompt_tokens_evaluated = llm.saem_tokens_evaluated - evaluated
            out.finish_reason = "length"
            return
        llm.set_seed(out.seed)
        llm.last_n_tokens_size = sampling.repeat_last_n
        llm._saem_logit_bias = sampling.chain_logit_bias(self.eog_tokens)
        llm._saem_budget = budget
        if sampling.server_chain:
            llm._saem_common_chain = (sampling, out.prompt_token_ids)
        text = StopText(stops)
        out.finish_reason = "length"
        grammar = None
        if sampling.grammar is not None and not sampling.server_chain:  # the common chain brings its own
            from llama_cpp.llama_grammar import LlamaGrammar

            grammar = LlamaGrammar.from_string(sampling.grammar)
        try:
            for tok in llm.generate(out.prompt_token_ids, top_k=sampling.top_k, top_p=sampling.top_p,
                                    min_p=sampling.min_p, typical_p=sampling.typical_p,
                                    temp=max(sampling.temp, 0.0), repeat_penalty=sampling.repeat_penalty,
                                    frequency_penalty=sampling.frequency_penalty,
                                    presence_penalty=sampling.presence_penalty, reset=True, grammar=grammar):
                if self._in_prompt:
                    self._in_prompt = False
                    out.prompt_tokens_evaluated = llm.saem_tokens_evaluated - evaluated
                if lc.llama_vocab_is_eog(llm._model.vocab, tok):
                    out.finish_reason = "stop"
                    break
                out.tokens.append(tok)
                last = len(out.tokens) >= limit
                piece, stopped = text.add(self._piece_after(out.tokens), last)
                if stopped:
                    out.finish_reason = "stop"
                yield tok, piece
                if stopped or last:
                    return
        except GrammarDeadEnd as e:  # nothing was accepted: the text so far stands
            out.finish_reason = "stop"
            self.note(str(e))
        finally:
            llm._saem_logit_bias = None
            llm._saem_budget = None
            llm._saem_common_chain = None
        rest = text.flush()
        if rest:
            yield None, rest

    def _piece_after(self, tokens: list[int]) -> bytes:
        """The text the last of ``tokens`` adds to llama-cpp-python's ``detokenize(tokens)``:
        control tokens print nothing, and only the first token loses a SentencePiece leading space
        (a lone detokenize([t]) would strip every token's)."""
        detok = self.llm.detokenize
        if len(tokens) == 1:
            return detok(tokens)
        prev = tokens[-2]
        alone = self._detokenized_alone.get(prev)
        if alone is None:
            alone = self._detokenized_alone[prev] = detok([prev])
        return detok(tokens[-2:])[len(alone):]

    def generate(self, prompt: str | list[int] | ChatPrompt, n_predict: int = 256,
                 sampling: SamplingConfig = GREEDY, on_piece: Callable[[bytes], None] | None = None,
                 parse_special: bool = False) -> GenerationResult:
        t0 = time.perf_counter()
        out = bytearray()
        t_first = None
        ev0 = len(self.placement.stats.events) if self.placement else 0
        steps = self.stream(prompt, n_predict, sampling, parse_special=parse_special)
        for tok, piece in steps:
            if t_first is None and tok is not None:
                t_first = time.perf_counter()
            out += piece
            if on_piece and piece:
                on_piece(piece)
        t1 = time.perf_counter()
        events = self.placement.stats.events[ev0:] if self.placement else []
        t_first = t_first or t1
        # stream() evaluated the whole prompt (no prefix reuse), so this is its token count
        return GenerationResult(out.decode("utf-8", errors="ignore"), steps.tokens, self._seq_prompt_tokens,
                                t_first - t0, t1 - t_first, list(events), steps.finish_reason or "length",
                                steps.seed, steps.prompt_token_ids)

    def replay(self, prompt: str, continuation: str) -> GenerationResult:
        """Decode ``continuation`` token by token after ``prompt`` (teacher forcing): the same
        one-token decode steps as generation, on text chosen by the caller, so routing follows a
        known reasoning text even on a model that cannot write one. Used by bench --replay.
        Special tokens are parsed in both texts (they carry chat markup)."""
        llm = self.llm
        p_toks = self.prompt_tokens(prompt, parse_special=True)
        c_toks = llm.tokenize(continuation.encode(), add_bos=False, special=True)
        if not p_toks or not c_toks:
            raise SaemError("replay needs a non-empty prompt and continuation")
        if len(p_toks) + len(c_toks) > self.n_ctx_seq:
            raise SaemError(f"replay text ({len(p_toks) + len(c_toks)} tokens) exceeds the context "
                            f"({self.n_ctx_seq} tokens per sequence)")
        self.reset_sequence()
        llm.reset()
        ev0 = len(self.placement.stats.events) if self.placement else 0
        t0 = time.perf_counter()
        self._in_prompt = True
        llm.eval(p_toks)
        self._in_prompt = False
        t1 = time.perf_counter()
        for t in c_toks:
            llm.eval([t])
        t2 = time.perf_counter()
        events = self.placement.stats.events[ev0:] if self.placement else []
        return GenerationResult(continuation, c_toks, len(p_toks), t1 - t0, t2 - t1, list(events),
                                prompt_token_ids=p_toks)

    def reset_sequence(self) -> None:
        self._seq_prompt_tokens = 0
        if self.placement is not None:
            self.placement.reset_sequence()
        self._pieces.clear()
        self._trace_tokens.clear()
        if self.placement is not None:
            self.placement.trace_experts.clear()

    def reset_stats(self) -> None:
        """The placement's and the RAM tier's counts start again from zero (residency stays)."""
        if self.placement is not None:
            self.placement.reset_stats()
        if self.ram_tier is not None:
            self.ram_tier.reset_stats()

    def stats(self) -> dict:
        d = {"model": str(self.path), "architecture": self.info.architecture,
             "policy": self.policy_name if self.placement else "off"}
        if self.placement is not None:
            d.update(self.placement.stats.to_dict())
            # a policy may split the budget unevenly (saem's layout, n-cpu-moe's whole layers):
            # the mean is the budget's bytes per layer, the layout says where they went
            layout = self.placement.state.n_slots
            mean = float(layout.mean()) if layout.size else 0.0
            d["slots_per_layer"] = int(round(mean))
            d["slot_layout"] = layout.tolist()
            d["ecr"] = mean / self.info.n_expert
        if self.ram_tier is not None:
            d.update(self.ram_tier.stats.to_dict())
        return d

    def sequence_trace(self) -> SequenceTrace:
        """The routing trace of the last ``stream``/``generate`` call (EngineConfig.record)."""
        if not self.cfg.record or self.placement is None:
            raise SaemError("tracing needs record=True and a MoE model with expert management on")
        experts = np.concatenate(self.placement.trace_experts, axis=0)
        T = len(self._trace_tokens)
        experts = experts[:T]
        starts = sorted({0} | {e.token for e in self.placement.stats.events if e.token < T})
        return SequenceTrace(token_ids=np.asarray(self._trace_tokens, np.int32), pieces=list(self._pieces),
                             experts=experts, stage_starts=np.asarray(starts, np.int32),
                             prompt_len=min(self._seq_prompt_tokens, T))

    def signature(self) -> ModelSignature:
        i = self.info
        return ModelSignature(arch=i.architecture, n_layer=len(i.moe_layers), n_expert=i.n_expert,
                              n_expert_used=i.n_expert_used,
                              expert_bytes=i.moe_layers[0].bytes_per_expert if i.is_moe else 0,
                              name=i.name)

    def close(self) -> None:
        self.llm.close()


class StopText:
    """The generated text as llama-cpp-python's ``create_completion`` releases it: ``add`` appends
    a token's text and returns what may be shown now, holding back an end that could begin a stop
    string; the text ends before the first stop string found (the first in list order)."""

    def __init__(self, stops: tuple[bytes, ...]) -> None:
        self.stops = stops
        self.text = bytearray()
        self.released = 0  # bytes of text handed out
        self.hit: bytes | None = None  # the stop string that ended the text

    def add(self, piece: bytes, last: bool) -> tuple[bytes, bool]:
        """(the text to release now, whether a stop string ended the text). ``last``: no token
        follows, so nothing is held back."""
        text = self.text
        text += piece
        hit = next((s for s in self.stops if s in text), None)
        if hit is not None:
            self.hit = hit
            del text[text.index(hit):]
            out = bytes(text[self.released:])
            self.released = len(text)
            return out, True
        keep = 0 if last else _held_back(text, self.stops)
        out = bytes(text[self.released:len(text) - keep])
        self.released = len(text) - keep
        return out, False

    def flush(self) -> bytes:
        """What is still held back (the generation ended without a stop string)."""
        out = bytes(self.text[self.released:])
        self.released = len(self.text)
        return out


def _held_back(text: bytearray, stops: tuple[bytes, ...]) -> int:
    """How many bytes at the end of ``text`` could begin a stop string (not shown yet)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


@contextlib.contextmanager
def _quiet_stderr(enabled: bool):
    """llama.cpp logs to fd 2 from C; silence it unless --verbose."""
    if not enabled:
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as dn:
            os.dup2(dn.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


GGML_LOG_LEVEL_ERROR = 4  # enum ggml_log_level in ggml.h (llama_cpp/_logger.py's comment says 3: stale)
GGML_LOG_LEVEL_CONT = 5  # continues the previous line


@contextlib.contextmanager
def _llama_error_log(llama_cpp) -> Iterator[list[str]]:
    """The error lines llama.cpp logs while inside (llama-cpp-python silences fd 2 during a load,
    so they are taken from the log callback); llama-cpp-python's own callback still gets every
    line, and is the callback again on exit."""
    from llama_cpp import _logger

    errors: list[str] = []

    def log(level: int, text: bytes, user_data) -> None:
        if level == GGML_LOG_LEVEL_ERROR:
            errors.append(text.decode("utf-8", "replace"))
        _logger.llama_log_callback(level, text, user_data)

    callback = llama_cpp.llama_log_callback(log)  # kept referenced until restored below
    llama_cpp.llama_log_set(callback, None)
    try:
        yield errors
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, None)
