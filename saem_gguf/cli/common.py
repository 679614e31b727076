"""Flags shared by the commands that load a model (llama.cpp's names and meanings) and their validation.

Every value is checked here, so a bad one is a one-line usage error (exit 2) before anything loads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from saem_gguf.budget import ECR_HELP, parse_ecr, parse_ecr_list, parse_size, parse_vram_budget
from saem_gguf.cli.arg_types import bounded_int, finite_float, non_negative_float
from saem_gguf.engine import KV_CACHE_TYPES, ROPE_SCALING, RopeConfig
from saem_gguf.errors import SaemError
from saem_gguf.numa import LLAMA_NUMA_STRATEGIES
from saem_gguf.samplers import cli_sampler_order, sampler_order

if TYPE_CHECKING:
    from saem_gguf.engine import SamplingConfig


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _threads(text: str) -> int:
    """-t / -tb: a count of threads; 0 or less is every CPU, as llama.cpp's arg.cpp reads it
    (std::thread::hardware_concurrency; here the CPUs this process may run on, as the default)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    return v if v > 0 else len(os.sched_getaffinity(0))


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def int_list_arg(text: str) -> tuple[int, ...]:
    """Comma-separated integers ("1,8"; empty items skipped), for list options such as --batch."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _usage(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` with its SaemError turned into argparse's usage error (exit 2, one line)."""
    from saem_gguf.errors import SaemError

    def convert(text: str):
        try:
            return parse(text)
        except SaemError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


ecr_arg = _usage(parse_ecr)
ecr_list_arg = _usage(parse_ecr_list)
_size = _usage(parse_size)


def _rope_scale(text: str) -> float:
    """--rope-scale N: llama.cpp's --rope-freq-scale 1/N."""
    factor = finite_float(text)
    if factor <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return 1.0 / factor


def rope_config(args: argparse.Namespace) -> RopeConfig:
    return RopeConfig(scaling=args.rope_scaling, freq_base=args.rope_freq_base, freq_scale=args.rope_freq_scale,
                      yarn_orig_ctx=args.yarn_orig_ctx, yarn_ext_factor=args.yarn_ext_factor,
                      yarn_attn_factor=args.yarn_attn_factor, yarn_beta_slow=args.yarn_beta_slow,
                      yarn_beta_fast=args.yarn_beta_fast)


def _n_gpu_layers(text: str) -> int:
    """llama.cpp's -ngl: a layer count, 'auto' or 'all' (-1: every layer, see the help)."""
    if text in ("auto", "all"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers, auto or all, got {text!r}") from None


def on_off_auto(text: str) -> str:
    """llama.cpp's on/off/auto value words (-fa, --color; common/arg.cpp is_truthy / is_falsey /
    is_autoy)."""
    for value, words in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0")),
                         ("auto", ("auto", "-1"))):
        if text in words:
            return value
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {text!r}")


def _overrides(text: str) -> list:
    from saem_gguf.tensor_overrides import parse_overrides

    return _usage(parse_overrides)(text)


def _kv_overrides(text: str) -> list:
    from saem_gguf.kv_overrides import parse_kv_overrides

    return list(_usage(parse_kv_overrides)(text))


class _Extend(argparse.Action):
    """Repeated -ot or --override-kv add to the list, as in llama.cpp."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *values])


_vram_budget = _usage(parse_vram_budget)


def add_model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    from saem_gguf.costmodel import HW_PRESETS

    g = p.add_argument_group("model (llama.cpp flags, same names and meanings)")
    g.add_argument("-m", "--model", type=Path, required=model_required, default=None,
                   help="GGUF model" + ("" if model_required else " (default: the embedded model)"))
    g.add_argument("-c", "--ctx-size", type=_non_negative_int, default=None,
                   help="context size (default: 4096, or the model's own context length where it is shorter; "
                        "0: the model's own, as llama.cpp's default)")
    g.add_argument("-t", "--threads", type=_threads, default=None,
                   help="CPU threads of a one-token decode, as llama.cpp's -t (0 or less: every CPU this "
                        "process may use; default: the same, but serve has its own rule, see its help)")
    g.add_argument("-tb", "--threads-batch", dest="threads_batch", type=_threads, default=None,
                   help="CPU threads of a ubatch of several tokens (a prompt, a batch step of several "
                        "sequences), as llama.cpp's -tb (0 or less: every CPU; default: as -t)")
    g.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=_n_gpu_layers,
                   default=None, metavar="N|auto|all",
                   help="layers whose weights go to the GPU (default auto; auto and all = every layer, as "
                        "llama.cpp without -fit; experts are placed by --policy whatever this says; a "
                        "CPU build ignores it)")
    g.add_argument("-b", "--batch-size", dest="n_batch", type=_positive_int, default=2048, metavar="N",
                   help="logical maximum batch size (2048)")
    g.add_argument("-ub", "--ubatch-size", dest="n_ubatch", type=_positive_int, default=512, metavar="N",
                   help="physical maximum batch size (512); routing is read after each ubatch")
    g.add_argument("-fa", "--flash-attn", type=on_off_auto, default="auto", metavar="on|off|auto",
                   help="Flash Attention (default auto: llama.cpp enables it where the device supports it)")
    g.add_argument("-ctk", "--cache-type-k", choices=KV_CACHE_TYPES, default="f16", metavar="TYPE",
                   help=f"KV cache type for K: {', '.join(KV_CACHE_TYPES)} (f16)")
    g.add_argument("-ctv", "--cache-type-v", choices=KV_CACHE_TYPES, default="f16", metavar="TYPE",
                   help=f"KV cache type for V: {', '.join(KV_CACHE_TYPES)} (f16; quantized V needs "
                        "Flash Attention)")
    g.add_argument("-ot", "--override-tensor", dest="tensor_overrides", type=_overrides, action=_Extend,
                   default=[], metavar="PATTERN=BUFT[,...]",
                   help="put tensors whose name matches the regex PATTERN in buffer type BUFT (CPU, "
                        "CUDA0, ...); repeatable. Under expert management expert tensors stay in host "
                        "memory: a pattern sending them to a device is refused")
    g.add_argument("--override-kv", dest="kv_overrides", type=_kv_overrides, action=_Extend, default=[],
                   metavar="KEY=TYPE:VALUE[,...]",
                   help="override model metadata by key, as llama.cpp (types int, float, bool, str; e.g. "
                        "qwen3moe.expert_used_count=int:6); repeatable. Checked before the load as the "
                        "file's values are")
    g.add_argument("-nkvo", "--no-kv-offload", dest="offload_kqv", action="store_false",
                   help="keep the KV cache in host memory (not on the GPU), as llama.cpp's")
    g.add_argument("-kvo", "--kv-offload", dest="offload_kqv", action="store_true", default=True,
                   help="the KV cache on the GPU with the layers (the default)")
    r = p.add_argument_group("RoPE context scaling (llama.cpp's flags; default: the model's own)")
    r.add_argument("--rope-scaling", choices=tuple(ROPE_SCALING), default=None,
                   help="RoPE frequency scaling method (the model's, else linear)")
    r.add_argument("--rope-scale", dest="rope_freq_scale", type=_rope_scale, default=None, metavar="N",
                   help="context scaling factor: expands the context N times (--rope-freq-scale 1/N)")
    r.add_argument("--rope-freq-base", type=non_negative_float, default=None, metavar="N",
                   help="RoPE base frequency, for NTK-aware scaling (0: the model's)")
    r.add_argument("--rope-freq-scale", type=non_negative_float, default=None, metavar="N",
                   help="RoPE frequency scaling factor: expands the context 1/N times (0: the model's)")
    r.add_argument("--yarn-orig-ctx", type=_non_negative_int, default=None, metavar="N",
                   help="YaRN: the model's original context size (0: its training context)")
    for flag, meaning in (("--yarn-ext-factor", "extrapolation mix factor (0: full interpolation; negative: by "
                                                "the method)"),
                          ("--yarn-attn-factor", "scale sqrt(t) or attention magnitude"),
                          ("--yarn-beta-slow", "high correction dim or alpha"),
                          ("--yarn-beta-fast", "low correction dim or beta")):
        r.add_argument(flag, type=finite_float, default=None, metavar="N", help=f"YaRN: {meaning}")
    g.add_argument("--mlock", action="store_true", help="keep the model in RAM (no swapping)")
    g.add_argument("--no-mmap", dest="use_mmap", action="store_false",
                   help="read the model into memory instead of memory-mapping it")
    g.add_argument("-nr", "--no-repack", dest="use_extra_bufts", action="store_false",
                   help="llama.cpp's: no repacked or AMX layouts for the weights (with a GPU the expert "
                        "tensors never get them: the GPU copies them as the file has them)")
    g.add_argument("--numa", choices=tuple(LLAMA_NUMA_STRATEGIES), default=None,
                   help="llama.cpp's NUMA strategy: distribute (spread threads over all nodes), isolate "
                        "(threads on the node execution started on), numactl (the CPU map numactl gives)")
    g.add_argument("--pin-gpu-node", action="store_true",
                   help="pin the CPU expert threads, and the weights they read, to the NUMA node nearest "
                        "the GPU (saem_gguf's own; a no-op on one node)")
    g.add_argument("--hw", default="measure", metavar="PRESET|measure|FILE.json",
                   help="hardware the placement cost model prices CPU runs and copies with: a preset ("
                        f"{', '.join(HW_PRESETS)}), measure (this machine, measured once and cached), or "
                        "a saved profile (default measure)")
    g.add_argument("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
                   help="llama.cpp's log and placement details")
    g.add_argument("--quiet", action="store_true", help="no progress bars or notes")
    g.add_argument("--log-disable", action="store_true",
                   help="llama.cpp's: no log at all (--quiet, and llama.cpp's log stays off even with -v)")


def add_placement_args(p: argparse.ArgumentParser, multi: bool = False) -> None:
    from saem_gguf.policies import POLICIES

    g = p.add_argument_group("expert placement")
    if multi:
        g.add_argument("--policies", default="cpu-moe,lru,saem",
                       help=f"comma-separated policies ({', '.join(POLICIES)})")
        g.add_argument("--ecr", type=ecr_list_arg, default="12.5%,25%,50%",
                       help="comma-separated; each an " + ECR_HELP)
    else:
        g.add_argument("--policy", choices=sorted(POLICIES), default=None, metavar="POLICY",
                       help=f"placement policy (default saem): {', '.join(POLICIES)}")
        g.add_argument("-cmoe", "--cpu-moe", action="store_true",
                       help="llama.cpp's: every expert on the CPU (= --policy cpu-moe)")
        g.add_argument("-ncmoe", "--n-cpu-moe", type=_non_negative_int, default=None, metavar="N",
                       help="llama.cpp's: the experts of the first N layers on the CPU, the rest on the "
                            "GPU (= --policy n-cpu-moe with that N instead of one from the budget)")
        x = g.add_mutually_exclusive_group()
        x.add_argument("--ecr", type=ecr_arg, default=None, metavar="R",
                       help=ECR_HELP + " (default: 25%% without a GPU, --vram-budget auto with one)")
        x.add_argument("--vram-budget", type=_vram_budget, default=None, metavar="SIZE",
                       help="device memory for the model, e.g. 8G, or auto (free GPU memory at start "
                            "minus a margin; the default when a GPU is present): sizes the expert cache")
    g.add_argument("--profile", type=Path, default=None, metavar="PROFILE.json",
                   help="calibration profile (cue set, thresholds) from `calibrate`")
    add_ram_tier_args(p)


def ram_budget_arg(text: str) -> int | str:
    """--ram-budget's value: a size or auto (a usage error otherwise)."""
    from saem_gguf.ram_tier import parse_ram_budget

    return _usage(parse_ram_budget)(text)


def ram_policy_choices() -> list[str]:
    """What --ram-policy accepts: the policies that choose experts without the future."""
    from saem_gguf.policies import POLICIES
    from saem_gguf.ram_tier import FIXED_POLICIES

    return sorted(n for n in POLICIES if n not in FIXED_POLICIES and n != "oracle")


def add_ram_tier_args(p: argparse.ArgumentParser) -> None:
    """The RAM tier's flags (saem_gguf/ram_tier.py), for every command that places experts."""
    from saem_gguf.ram_tier import PREFETCH_METHODS

    choosable = ram_policy_choices()
    g = p.add_argument_group("RAM tier (a memory-mapped model larger than RAM)")
    g.add_argument("--ram-budget", type=ram_budget_arg, default=None, metavar="SIZE|auto",
                   help="expert bytes kept resident in RAM, e.g. 8G, or auto (available memory, within "
                        "the memory cgroup's limit, minus the non-expert weights, KV cache and a "
                        "margin); the non-expert weights are locked in RAM, the experts the RAM policy "
                        "picks are read ahead and the others released (default: off, the kernel's page "
                        "cache decides). Needs the model memory-mapped (not --no-mmap)")
    g.add_argument("--ram-policy", choices=choosable, default=None, metavar="POLICY",
                   help="policy choosing the RAM-resident experts (default: --policy's, or saem when "
                        f"that one places all or nothing): {', '.join(choosable)}")
    g.add_argument("--ram-prefetch", choices=tuple(PREFETCH_METHODS), default="madvise",
                   help="how experts are read ahead: madvise (MADV_WILLNEED, the kernel reads "
                        "asynchronously) or thread (a readahead thread faults them in) (madvise)")
    g.add_argument("--no-ram-route-prefetch", dest="ram_route_prefetch", action="store_false",
                   help="do not read the experts a token routes to ahead inside the graph (their pages "
                        "then fault in with the kernel's readahead around each fault)")


_LOGIT_BIAS = re.compile(r"\s*(\d+)\s*([+-])\s*(\S+)\s*")


def _logit_bias(text: str) -> tuple[int, float]:
    """llama.cpp's ``TOKEN_ID(+/-)BIAS`` (``15043+1``, ``15043-inf``), stricter: the bias must be
    a whole number (llama.cpp's stof reads ``1x`` as 1)."""
    m = _LOGIT_BIAS.fullmatch(text)
    try:
        bias = float(m.group(3)) if m else math.nan
    except ValueError:
        bias = math.nan
    if math.isnan(bias):
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf, got {text!r}")
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


def _temperature(text: str) -> float:
    return max(finite_float(text), 0.0)  # llama.cpp's arg.cpp clamps it so


def _repeat_penalty(text: str) -> float:
    from saem_gguf.engine import SamplingConfig

    v = finite_float(text)
    try:  # llama.cpp's check, SamplingConfig's
        SamplingConfig(repeat_penalty=v)
    except SaemError as e:
        raise argparse.ArgumentTypeError(str(e).replace("repeat_penalty ", "")) from None
    return v


def unit_float(text: str) -> float:
    v = finite_float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return v


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def _int_at_least(minimum: int, meaning: str = "", maximum: int = INT32_MAX) -> Callable[[str], int]:
    """An argparse type: an integer from ``minimum`` to ``maximum`` (INT32_MAX: llama.cpp reads
    these flags with std::stoi, which refuses a value past int32; ctypes would wrap it round)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{meaning}, got {v}")
        if v > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {v}")
        return v

    return parse


def _n_predict(text: str) -> int:
    """-n: a count of tokens, or -1 (until end of generation or a full context); llama-completion's
    -2 ("until context filled") is the same here, where the context does not shift."""
    v = _int_at_least(-2, " (-1 = until the context is full)")(text)
    return -1 if v == -2 else v


def _seed(text: str) -> int | None:
    """llama.cpp's -s: an unsigned 32-bit seed; -1 (= 4294967295) asks for a random one (None)."""
    from saem_gguf.engine import SEED_RANDOM

    v = _int_at_least(-1, " (-1 = a random seed)", maximum=2**64)(text)
    if v in (-1, SEED_RANDOM):
        return None
    if v > SEED_RANDOM:
        raise argparse.ArgumentTypeError(f"must be at most {SEED_RANDOM - 1}, or -1 for a random seed; got {v}")
    return v


def placement_policy(args: argparse.Namespace) -> str:
    """The one policy --policy, -cmoe and -ncmoe name; two that disagree, or -ncmoe with a cache size,
    are a usage error."""
    from saem_gguf.errors import UsageError

    chosen = {name for name, given in (("cpu-moe", args.cpu_moe), ("n-cpu-moe", args.n_cpu_moe is not None))
              if given}
    if args.policy is not None:
        chosen.add(args.policy)
    if len(chosen) > 1:
        raise UsageError(f"-cmoe, -ncmoe and --policy name different policies: {', '.join(sorted(chosen))}")
    if args.n_cpu_moe is not None and (args.ecr is not None or args.vram_budget is not None):
        raise UsageError("-ncmoe N sizes the expert cache in whole layers: give no --ecr or --vram-budget")
    return chosen.pop() if chosen else "saem"


def add_sampling_args(p: argparse.ArgumentParser, n_predict: int = 256) -> None:
    """llama.cpp's sampling flags (common/arg.cpp names and meanings), sampled by llama-cpp-python's
    chain; the one different default is --temp 0 (greedy)."""
    g = p.add_argument_group("sampling (llama.cpp flags; the default --temp 0 is greedy, unlike "
                             "llama.cpp's 0.8)")
    g.add_argument("-n", "--predict", "--n-predict", dest="n_predict", default=n_predict, metavar="N",
                   type=_n_predict,
                   help=f"tokens to generate ({n_predict}; -1 = until end of generation or a "
                                     "full context, -2 the same, as llama-completion's; capped at the room the "
                                     "context has left)")
    g.add_argument("--temp", "--temperature", dest="temp", type=_temperature, default=0.0, metavar="N",
                   help="temperature (default 0 = greedy; llama.cpp's default is 0.8; below 0 is 0, as "
                        "llama.cpp reads it)")
    g.add_argument("--top-k", type=_int_at_least(INT32_MIN), default=40, metavar="N",
                   help="top-k sampling (40, 0 = disabled)")
    g.add_argument("--top-p", type=finite_float, default=0.95, metavar="N",
                   help="top-p sampling (0.95, 1.0 = disabled)")
    g.add_argument("--min-p", type=finite_float, default=0.05, metavar="N",
                   help="min-p sampling (0.05, 0.0 = disabled)")
    g.add_argument("--typical", "--typical-p", dest="typical", type=finite_float, default=1.0, metavar="N",
                   help="locally typical sampling, parameter p (1.0 = disabled)")
    g.add_argument("--repeat-last-n", type=_int_at_least(0), default=64, metavar="N",
                   help="last n tokens to consider for penalize (64, 0 = disabled)")
    g.add_argument("--repeat-penalty", type=_repeat_penalty, default=1.0, metavar="N",
                   help="penalize repeat sequence of tokens (1.0 = disabled; greater than 0)")
    g.add_argument("--presence-penalty", type=finite_float, default=0.0, metavar="N",
                   help="repeat alpha presence penalty (0.0 = disabled)")
    g.add_argument("--frequency-penalty", type=finite_float, default=0.0, metavar="N",
                   help="repeat alpha frequency penalty (0.0 = disabled)")
    g.add_argument("-s", "--seed", type=_seed, default=None, metavar="SEED",
                   help="RNG seed: any value is a fixed seed, 0 too (default -1: a random one, shown by "
                        "--verbose and --json)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="ignore end-of-generation tokens and continue generating")
    g.add_argument("-l", "--logit-bias", dest="logit_bias", type=_logit_bias, action="append", default=[],
                   metavar="TOKEN_ID(+/-)BIAS",
                   help="modifies the likelihood of a token appearing in the completion, e.g. 15043+1 or "
                        "15043-1 (15043-inf bans it); repeatable")
    g.add_argument("-r", "--reverse-prompt", dest="reverse_prompt", action="append", default=[],
                   metavar="PROMPT", help="stop generating at PROMPT (the text ends before it); repeatable")
    g.add_argument("-e", "--escape", action=argparse.BooleanOptionalAction, default=True,
                   help="process escape sequences (\\n, \\r, \\t, \\', \\\", \\\\, \\xHH) in the prompt (-p, -f), "
                        "-r and --dry-sequence-breaker, as llama.cpp does (default: on; --no-escape keeps them "
                        "as typed)")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--grammar", default=None, metavar="GRAMMAR",
                   help="BNF-like grammar (GBNF, llama.cpp's) to constrain generations to")
    c.add_argument("--grammar-file", default=None, metavar="FNAME", help="file to read the grammar from")
    c.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="JSON schema to constrain generations to (https://json-schema.org/), e.g. `{}` for "
                        "any JSON object")
    c.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE",
                   help="file to read the JSON schema from")


_ESCAPED = {ord("n"): 0x0A, ord("r"): 0x0D, ord("t"): 0x09, ord("'"): 0x27, ord('"'): 0x22, ord("\\"): 0x5C}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def _hex_pair(a: int, b: int) -> int | None:
    """The byte C's strtol(.., 16) reads from the two characters after a ``\\x`` where it reads
    both (llama.cpp checks that it did): two hex digits, or one after a blank or a sign (strtol
    skips the one and takes the other; a minus wraps as char(-n) does); None where it does not."""
    if b not in _HEX:
        return None
    if a in _HEX:
        return int(bytes((a, b)), 16)
    if a in b" \t\n\v\f\r+":
        return int(chr(b), 16)
    if a == ord("-"):
        return -int(chr(b), 16) & 0xFF
    return None


def process_escapes(text: str, flag: str) -> str:
    """``text`` as llama.cpp's ``string_process_escapes`` (common/common.cpp) leaves it, which its
    ``-e/--escape`` (on by default) applies to the prompt, ``-r`` and ``--dry-sequence-breaker``:
    ``\\n \\r \\t \\' \\" \\\\`` become the character they name and ``\\xHH`` that byte; any
    other backslash stays, with what follows it. On the UTF-8 bytes, as llama.cpp; a result that
    is not UTF-8 (a ``\\xHH`` byte that is not part of a character) is one line."""
    data = text.encode("utf-8", "surrogateescape")
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        c = data[i]
        if c != 0x5C or i + 1 == n:
            out.append(c)
            i += 1
            continue
        d = data[i + 1]
        if d in _ESCAPED:
            out.append(_ESCAPED[d])
            i += 2
            continue
        if d == ord("x") and i + 3 < n:
            byte = _hex_pair(data[i + 2], data[i + 3])
            if byte is not None:
                out.append(byte)
                i += 4
                continue
        out += bytes((c, d))
        i += 2
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SaemError(f"{flag} is not UTF-8 once its escape sequences are processed (byte 0x{out[e.start]:02x} at "
                        f"{e.start}); --no-escape keeps them as typed") from None


def add_prompt_args(p: argparse.ArgumentParser, required: bool, what: str) -> None:
    """llama.cpp's -p/--prompt and -f/--file (one of them), for ``what`` the text is."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("-p", "--prompt", help=f"{what} text")
    src.add_argument("-f", "--file", type=Path, metavar="FNAME",
                     help=f"a file containing the {what} (one trailing newline dropped, as llama.cpp)")


def utf8_arg(text: str, flag: str) -> str:
    """``text`` from the command line; bytes that are not UTF-8 arrive as lone surrogates
    (Python's surrogateescape) and cannot be tokenized, so they are refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SaemError(f"{flag} is not valid UTF-8 (byte 0x{ord(text[e.start]) & 0xFF:02x} at "
                        f"position {e.start})") from None
    return text


def prompt_arg(args: argparse.Namespace) -> str | None:
    """The text of -p or -f (``add_prompt_args``), its escapes processed under -e as llama.cpp
    processes them (a prompt read with -f too: it is the same prompt string there), or None
    where neither is given; -sys is checked to be UTF-8 here too."""
    if args.system is not None:
        utf8_arg(args.system, "-sys/--system-prompt")
    if args.prompt is not None:
        flag = "-p/--prompt"
        text = utf8_arg(args.prompt, flag)
    elif args.file is not None:
        flag = f"-f {args.file}"
        try:
            text = args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SaemError(f"cannot read the prompt file {args.file}: {e}") from None
        text = text[:-1] if text.endswith("\n") else text
    else:
        return None
    return _escaped(args, text, flag)


def _system_prompt_file(path: str) -> str:
    """llama.cpp's -sysf: the file's text, one trailing newline dropped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{path!r} is not UTF-8 text") from None
    return text[:-1] if text.endswith("\n") else text


def add_chat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat")
    g.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None, metavar="PROMPT",
                   help="system prompt (with the model's chat template)")
    g.add_argument("-sysf", "--system-prompt-file", dest="system", type=_system_prompt_file, metavar="FNAME",
                   help="a file containing the system prompt (one trailing newline dropped, as llama.cpp; "
                        "the later of -sys and -sysf holds)")
    g.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="chat template for a GGUF without one (or to replace it): a Jinja file, or the "
                        "name of a llama-cpp-python chat format (chatml, llama-2, llama-3, gemma, ...); "
                        "without both, llama-cpp-python's fallback llama-2 is used")
    g.add_argument("--chat-template-file", dest="chat_template", metavar="JINJA_TEMPLATE_FILE",
                   help="llama.cpp's name for --chat-template FILE")
    g.add_argument("--jinja", action="store_true",
                   help="accepted for llama.cpp's command lines: chat templates are always Jinja here")
    g.add_argument("--chat-template-kwargs", type=_json_object, default={}, metavar="STRING",
                   help="additional variables for the chat template, a JSON object, e.g. "
                        "'{\"enable_thinking\": false}'")
    g.add_argument("-rea", "--reasoning", choices=("on", "off", "auto"), default="auto",
                   help="reasoning (thinking) in the chat: on or off set the template's enable_thinking "
                        "(Qwen3 and others read it); auto leaves it to the template (default)")
    g.add_argument("--reasoning-budget", type=_int_at_least(-1, " (-1 = unrestricted)"), default=-1, metavar="N",
                   help="token budget for thinking: -1 for unrestricted, 0 for immediate end, N>0 for token "
                        "budget (default: -1); where the chat template has a <think> block, its </think> is "
                        "forced once the budget is spent")
    g.add_argument("--reasoning-budget-message", default="", metavar="MESSAGE",
                   help="message injected before the end-of-thinking tag when reasoning budget is exhausted "
                        "(default: none; plain text, no control tokens parsed)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def chat_template_kwargs(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """--chat-template-kwargs, then --reasoning on|off as enable_thinking (as llama.cpp sets it);
    a name the chat handler sets itself is one line before the model loads."""
    from saem_gguf.engine import check_template_kwargs

    variables = dict(getattr(args, "chat_template_kwargs", {}))
    reasoning = getattr(args, "reasoning", "auto")
    if reasoning != "auto":
        variables["enable_thinking"] = reasoning == "on"
    check_template_kwargs(variables)
    return tuple(variables.items())


# llama.cpp's --samplers (names separated by ';', unknown ones skipped) and --sampling-seq (one
# character per sampler, e.g. edskypmxt)
_samplers = _usage(cli_sampler_order)
_sampling_seq = _usage(sampler_order)


class _DryBreakers(argparse.Action):
    """llama.cpp's --dry-sequence-breaker: the first one given replaces the defaults, each adds
    one, "none" clears them."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        given = getattr(namespace, self.dest) or []  # None: the defaults, not given yet
        setattr(namespace, self.dest, [] if value == "none" else [*given, value])


def add_llama_sampler_args(p: argparse.ArgumentParser, request_defaults: bool = False) -> None:
    """llama.cpp's sampler order and the samplers of its common chain that llama-cpp-python's
    lacks (their flags, names and defaults; each off at its default). Any of them set draws with
    llama.cpp's common chain (SamplingConfig.server_chain); under ``request_defaults`` (serve)
    they are the settings of a request that does not set its own."""
    g = p.add_argument_group(
        "llama.cpp's sampler order and samplers beyond llama-cpp-python's (off by default; any of them set "
        "draws with llama.cpp's common chain, as " + ("llama-server; the defaults of a request)"
                                                      if request_defaults else "llama-cli)"))
    g.add_argument("--samplers", type=_samplers, default=None, metavar="SEQUENCE",
                   help="sampler order" + (" for requests that name none" if request_defaults else "")
                        + ", names separated by ';' (e.g. penalties;top_k;top_p;min_p;temperature; also dry, "
                          "typ_p, top_n_sigma, xtc, infill): the chain llama.cpp's common sampler builds, a "
                          "sampler left out not applied (default: llama-cpp-python's chain, which draws as "
                          "llama.cpp's default order)")
    g.add_argument("--sampler-seq", "--sampling-seq", dest="samplers", type=_sampling_seq, metavar="SEQUENCE",
                   help="--samplers as one character each (e.g. edskypmxt), as llama.cpp's")
    g.add_argument("--dry-multiplier", type=finite_float, default=0.0, metavar="N",
                   help="DRY repetition penalty multiplier (0.0 = disabled)")
    g.add_argument("--dry-base", type=finite_float, default=1.75, metavar="N",
                   help="DRY base value (1.75; below 1.0 ignored, as llama.cpp)")
    g.add_argument("--dry-allowed-length", type=bounded_int(0, 1 << 30), default=2, metavar="N",
                   help="repetitions longer than this are penalized by DRY (2)")
    g.add_argument("--dry-penalty-last-n", type=bounded_int(0, 1 << 30), default=64, metavar="N",
                   help="tokens DRY scans for repetitions (64, 0 = disabled)")
    g.add_argument("--dry-sequence-breaker", dest="dry_sequence_breakers", action=_DryBreakers, default=None,
                   metavar="STRING",
                   help="a DRY sequence breaker; the first replaces the defaults ('\\n', ':', '\"', '*'), "
                        "'none' clears them")
    g.add_argument("--xtc-probability", type=finite_float, default=0.0, metavar="N",
                   help="XTC probability (0.0 = disabled)")
    g.add_argument("--xtc-threshold", type=finite_float, default=0.1, metavar="N",
                   help="XTC threshold (0.1; above 0.5 disables XTC)")
    g.add_argument("--top-nsigma", "--top-n-sigma", dest="top_n_sigma", type=finite_float, default=-1.0,
                   metavar="N", help="top-n-sigma sampling (-1.0 = disabled)")
    g.add_argument("--dynatemp-range", type=finite_float, default=0.0, metavar="N",
                   help="dynamic temperature range (0.0 = disabled)")
    g.add_argument("--dynatemp-exp", dest="dynatemp_exponent", type=finite_float, default=1.0, metavar="N",
                   help="dynamic temperature exponent (1.0)")
    g.add_argument("--mirostat", type=bounded_int(0, 2), default=0, metavar="N",
                   help="Mirostat sampling: 1 Mirostat, 2 Mirostat 2.0 (top-k, top-p, ... then not applied; "
                        "0 = disabled)")
    g.add_argument("--mirostat-lr", dest="mirostat_eta", type=finite_float, default=0.1, metavar="N",
                   help="Mirostat learning rate, parameter eta (0.1)")
    g.add_argument("--mirostat-ent", dest="mirostat_tau", type=finite_float, default=5.0, metavar="N",
                   help="Mirostat target entropy, parameter tau (5.0)")


def _escaped(args: argparse.Namespace, text: str, flag: str) -> str:
    """``text`` of ``flag`` with its escape sequences processed where ``-e/--escape`` is on."""
    return process_escapes(text, flag) if args.escape else text


def llama_sampler_settings(args: argparse.Namespace) -> dict:
    """``add_llama_sampler_args``' values, as SamplingConfig fields (none for a command without
    them)."""
    if not hasattr(args, "dry_multiplier"):
        return {}
    out = {"samplers": args.samplers}
    out.update({name: getattr(args, name) for name in (
        "dry_multiplier", "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold",
        "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "mirostat", "mirostat_eta", "mirostat_tau")})
    if args.dry_base >= 1.0:
        out["dry_base"] = args.dry_base
    if args.dry_sequence_breakers is not None:
        out["dry_sequence_breakers"] = tuple(_escaped(args, b, "--dry-sequence-breaker")
                                             for b in args.dry_sequence_breakers)
    return out


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    from saem_gguf.engine import SamplingConfig

    return SamplingConfig(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          typical_p=args.typical, repeat_penalty=args.repeat_penalty,
                          repeat_last_n=args.repeat_last_n, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, ignore_eos=args.ignore_eos,
                          stop=tuple(_escaped(args, r, "-r/--reverse-prompt") for r in args.reverse_prompt),
                          grammar=grammar_arg(args),
                          logit_bias=tuple(args.logit_bias), reasoning_budget=getattr(args, "reasoning_budget", -1),
                          reasoning_budget_message=getattr(args, "reasoning_budget_message", ""),
                          **llama_sampler_settings(args))


def grammar_arg(args: argparse.Namespace) -> str | None:
    """The GBNF of --grammar / --grammar-file / -j / -jf (a JSON schema turned into a grammar as
    llama-cpp-python does), or None; an unreadable file or a bad schema is one SaemError line.
    Whether llama.cpp parses the grammar is checked against the model's vocabulary at load."""
    from saem_gguf.grammar import json_schema_grammar

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise SaemError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise SaemError(f"{flag} {path}: not UTF-8 text") from None

    if args.grammar is not None:
        return args.grammar
    if args.grammar_file is not None:
        return read(args.grammar_file, "--grammar-file")
    if args.json_schema is not None:
        return json_schema_grammar(args.json_schema, "-j/--json-schema")
    if args.json_schema_file is not None:
        return json_schema_grammar(read(args.json_schema_file, "-jf/--json-schema-file"),
                                   f"-jf/--json-schema-file {args.json_schema_file}")
    return None
