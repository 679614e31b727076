"""Resource bounds checked before a model is loaded: the context (-c and the model's own
context_length) against memory, and -t against the machine's cores.

Without these, ``-c 99999999999`` grows until the kernel kills the process, ``-c 2**32`` under a
memory limit ends in a NumPy traceback, a context_length of 2**31-1 makes llama-cpp-python
allocate 8 GiB on every tokenize call, and ``-t 9999`` starts 9,999 threads.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from saem_gguf.budget import format_size
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import ModelInfo, kv_cache_bytes, read_model_info
from saem_gguf.model_check import MAX_CONTEXT

THREADS_PER_CORE_MAX = 2  # -t above this many threads per core only adds contention
TOKEN_BYTES = 4  # llama_token (int32)
LOGIT_BYTES = 4  # float32
N_BATCH = 512  # the engine's n_batch: llama-cpp-python's logits array holds this many rows
# llama-cpp-python's tokenize allocates context_length tokens per call: it may take 1/8 of memory
TOKENIZE_SHARE_INVERSE = 8


@dataclass(frozen=True)
class ContextMemory:
    """Host bytes a context of n_ctx tokens costs, by what llama.cpp and llama-cpp-python allocate."""
    kv_cache: int  # f16 K and V of every layer
    logits: int  # llama-cpp-python's scores array: n_batch (or n_ctx with logits_all) x n_vocab
    token_arrays: int  # input_ids (n_ctx) and one tokenize buffer (the model's context_length)

    @property
    def total(self) -> int:
        return self.kv_cache + self.logits + self.token_arrays


def context_memory(info: ModelInfo, n_ctx: int, logits_all: bool) -> ContextMemory:
    rows = n_ctx if logits_all else min(n_ctx, N_BATCH)
    return ContextMemory(kv_cache=kv_cache_bytes(info, n_ctx),
                         logits=rows * info.n_vocab * LOGIT_BYTES,
                         token_arrays=(n_ctx + info.n_ctx_train) * TOKEN_BYTES)


def available_memory() -> int | None:
    """Bytes this process can still allocate: the least of what the kernel says is available
    (psutil: MemAvailable, reclaimable page cache included), the memory cgroup's room
    (``cgroup_memory_room``) and the address-space limit's (ulimit -v) headroom; None if none is
    known."""
    limits = []
    try:
        limits.append(int(psutil.virtual_memory().available))
    except (OSError, RuntimeError):
        pass
    room = cgroup_memory_room()
    if room is not None:
        limits.append(room)
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft - _vm_size())
    return max(0, min(limits)) if limits else None


def cgroup_memory_room(root: Path = Path("/sys/fs/cgroup"),
                       proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes this process's memory cgroup may still charge beyond its anonymous memory (limit minus
    anon), or None without a limit. Page cache counts against a cgroup but is reclaimable (a
    mapped model's pages among it), so it is not subtracted. cgroup v2 first, then v1's memory
    controller (``root``/memory), as Docker and systemd set either."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        # A line this reader does not understand is skipped: the bound is advice, never a crash.
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            base = root / path.lstrip("/")
            limit_file, anon_key = base / "memory.max", "anon"
        elif "memory" in controllers.split(","):
            base = root / "memory" / path.lstrip("/")
            limit_file, anon_key = base / "memory.limit_in_bytes", "total_rss"
        else:
            continue
        try:
            raw = limit_file.read_text().strip()
            stat = dict(x.split(None, 1) for x in (base / "memory.stat").read_text().splitlines()
                        if " " in x)
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            return max(0, int(raw) - int(stat.get(anon_key, "0")))
        except (OSError, ValueError):
            continue
    return None


def _vm_size() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_context(info: ModelInfo, n_ctx: int, logits_all: bool, available: int | None) -> None:
    """SaemError if ``n_ctx`` is out of llama.cpp's range or its buffers do not fit ``available``."""
    if not 1 <= n_ctx <= MAX_CONTEXT:
        raise SaemError(f"-c {n_ctx} is out of range [1, {MAX_CONTEXT}]")
    if available is None:
        return
    mem = context_memory(info, n_ctx, logits_all)
    # allocated anew on every tokenize call, next to everything else: a small share at most
    if info.n_ctx_train * TOKEN_BYTES * TOKENIZE_SHARE_INVERSE > available:
        raise SaemError(f"{info.path}: {info.architecture}.context_length={info.n_ctx_train} makes "
                        f"every tokenize call allocate {format_size(info.n_ctx_train * TOKEN_BYTES)}, "
                        f"more than 1/{TOKENIZE_SHARE_INVERSE} of the {format_size(available)} of "
                        "memory available")
    if mem.total > available:
        raise SaemError(f"-c {n_ctx} needs {format_size(mem.total)} (KV cache "
                        f"{format_size(mem.kv_cache)}, logits {format_size(mem.logits)}), more than "
                        f"the {format_size(available)} of memory available: lower -c")


def max_threads() -> int:
    return THREADS_PER_CORE_MAX * (os.cpu_count() or 1)


def clamp_threads(n_threads: int | None, note: Callable[[str], None], flag: str = "-t") -> int | None:
    if n_threads is None:
        return None
    if n_threads < 1:
        raise SaemError(f"{flag} {n_threads}: must be >= 1")
    cap = max_threads()
    if n_threads > cap:
        note(f"{flag} {n_threads} is more than {THREADS_PER_CORE_MAX} threads per core: using {cap}")
        return cap
    return n_threads


# -c when none is given: llama.cpp's default is the model's own context length (0), which for the
# large MoE models (40,960-262,144 tokens) would give the KV cache the VRAM the experts need; a model
# trained on less gets its own, as llama.cpp gives it
DEFAULT_CONTEXT = 4096


def at_most_trained(n_ctx: int, info: ModelInfo) -> int:
    """``n_ctx`` capped at the context the model was trained for, where the file says it."""
    return min(n_ctx, info.n_ctx_train) if info.n_ctx_train > 0 else n_ctx


def context_size(info: ModelInfo, n_ctx: int | None) -> int:
    """``-c``, with llama.cpp's 0 read as the context the model was trained for, and None (no
    ``-c``) as DEFAULT_CONTEXT or that context where it is shorter."""
    if n_ctx is None:
        return at_most_trained(DEFAULT_CONTEXT, info)
    if n_ctx != 0:
        return n_ctx
    if info.n_ctx_train <= 0:
        raise SaemError(f"{info.path}: the model gives no context length ({info.architecture}.context_length): "
                        "give -c N")
    return info.n_ctx_train


def checked_engine_inputs(cfg, note: Callable[[str], None]):
    """(cfg with -t and -tb clamped and -c 0 or None made a context size, the validated
    ModelInfo, the model path) for ``Engine``: the model file checked for everything llama.cpp
    asserts on, -c and the model's context against memory."""
    path = cfg.model
    if path is None:
        from saem_gguf.default_model import default_model_path

        path = default_model_path()
    info = read_model_info(path, for_load=True, overrides=cfg.kv_overrides)
    if cfg.n_ctx == 0:
        cfg = dataclasses.replace(cfg, n_ctx=context_size(info, 0))
        note(f"-c 0: the model's context length, {cfg.n_ctx} tokens")
    elif cfg.n_ctx is None:  # the default, said in -c's help: no note on every run of such a model
        cfg = dataclasses.replace(cfg, n_ctx=context_size(info, None))
    check_context(info, cfg.n_ctx, cfg.record, available_memory())
    cfg = dataclasses.replace(cfg, n_threads=clamp_threads(cfg.n_threads, note),
                              n_threads_batch=clamp_threads(cfg.n_threads_batch, note, "-tb"))
    return cfg, info, Path(path)
