"""Shared helpers for tests/test_native_*.py: load a generated model on the CPU, decode with logits
for every token, and observe routing ids through the ``cb_eval`` callback (the reference the native
counters are compared with)."""

from __future__ import annotations

import ctypes
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from saem_gguf import native_api as na
from saem_gguf.llama_lib import load_llama_cpp
from saem_gguf.testmodels import ModelSpec, ensure_model

PROMPT = "First, compute 12 + 7. Wait, let me verify the sum"

# (arch, expert quant) pairs the native tests cover (one generator module per architecture)
NATIVE_ARCHS = ("qwen3moe", "qwen2moe", "llama")
EXTRA_ARCHS = ("olmoe", "deepseek2", "deepseek2+fused", "gpt-oss", "glm4moe")
QUANTS = ("f16", "q8_0", "q4_0")


def spec(arch: str, quant: str, **kw: Any) -> ModelSpec:
    """A small test-model spec; ``arch`` may carry a variant: "deepseek2+fused" (fused gate_up)."""
    arch, _, variant = arch.partition("+")
    kw.setdefault("n_layer", 2)
    kw.setdefault("n_expert", 8)
    kw.setdefault("n_expert_used", 2)
    if arch in ("olmoe", "deepseek2"):
        kw.setdefault("n_head_kv", kw.get("n_head", 4))  # these need n_head_kv == n_head
    if arch in ("deepseek2", "glm4moe"):
        kw.setdefault("n_dense_lead", 1)  # a leading dense layer: no experts, no slots
        kw["n_layer"] = max(kw["n_layer"], 3)
    if variant == "fused":
        kw["extra"] = (("fused_gate_up", "1"),)
    elif variant:
        raise ValueError(f"unknown variant {variant!r}")
    if quant == "q4_k":
        kw.setdefault("n_embd", 256)
        kw.setdefault("n_ff_exp", 256)
        kw.setdefault("head_dim", 64)
    return ModelSpec(arch=arch, expert_type=quant, **kw)


class _TensorHead(ctypes.Structure):
    # leading fields of struct ggml_tensor (ggml.h): type, buffer, ne[4], nb[4]
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4)]


_ggml_fns: dict[str, Any] = {}


def _ggml(name: str) -> Any:
    """ggml functions exported by the loaded libggml-base (for the cb_eval reference only)."""
    if not _ggml_fns:
        llama_cpp = load_llama_cpp()
        lib = ctypes.CDLL(str(llama_cpp.llama_cpp._base_path / "libggml-base.so"))
        f = lib.ggml_get_name
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_char_p
        _ggml_fns["ggml_get_name"] = f
        f = lib.ggml_nbytes
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_size_t
        _ggml_fns["ggml_nbytes"] = f
        f = lib.ggml_backend_tensor_get
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None
        _ggml_fns["ggml_backend_tensor_get"] = f
    return _ggml_fns[name]


@dataclass
class TopkObserver:
    """cb_eval callback recording the ``ffn_moe_topk-<il>`` tensors: ids[il] = list of per-ubatch
    int32 arrays [n_tokens, n_used]."""

    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def __call__(self, t: int, ask: bool, user: int) -> bool:
        name = _ggml("ggml_get_name")(t).decode()
        if not name.startswith("ffn_moe_topk-"):
            return False if ask else True
        if ask:
            return True
        il = int(name.rsplit("-", 1)[1])
        head = _TensorHead.from_address(t)
        n_used, n_tok = head.ne[0], head.ne[1]
        nbytes = _ggml("ggml_nbytes")(t)
        raw = (ctypes.c_uint8 * nbytes)()
        _ggml("ggml_backend_tensor_get")(t, raw, 0, nbytes)
        flat = np.frombuffer(bytes(raw), dtype=np.uint8)
        out = np.empty((n_tok, n_used), dtype=np.int32)
        for j in range(n_tok):
            for i in range(n_used):
                off = j * head.nb[1] + i * head.nb[0]
                out[j, i] = flat[off:off + 4].view(np.int32)[0]
        self.ids.setdefault(il, []).append(out)
        return True


_LOG_CB: Any = None


def quiet_llama_logs() -> None:
    """Drop llama.cpp's log output (set SAEM_TEST_LLAMA_LOG=1 to keep it)."""
    global _LOG_CB
    if _LOG_CB is not None or os.environ.get("SAEM_TEST_LLAMA_LOG"):
        return
    lc = load_llama_cpp()
    _LOG_CB = lc.llama_log_callback(lambda level, text, user: None)
    lc.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def stock_load_repacks(path) -> bool:
    """Does llama.cpp, loading the model as stock does (extra buffer types on, no override), put
    its experts in the repacked layout (CPU_REPACK: Q4_0 / Q4_K / IQ4_NL / MXFP4 on AVX2 CPUs)?"""
    with Runner(path, repack=True, keep_on_host=False) as r:
        return any(any(i.repacked) for i in layer_infos(r.ctx))


class Runner:
    """One model + context on the CPU (no repacking, so expert tensors are copyable), decoding with
    logits for every token."""

    def __init__(self, path, *, n_ctx: int = 256, n_batch: int = 64, n_ubatch: int = 64,
                 n_threads: int = 2, observer: Callable | None = None, keep_on_host: bool = True,
                 repack: bool = False):
        self.lc = load_llama_cpp()
        lc = self.lc
        quiet_llama_logs()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self._keep = na.keep_experts_on_host(mp, pinned=False) if keep_on_host else None
        mp.use_extra_bufts = repack  # repacked (CPU_REPACK) expert tensors cannot be copied
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        self._cb = None
        if observer is not None:
            self._cb = lc.ggml_backend_sched_eval_callback(observer)
            cp.cb_eval = self._cb
            cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("could not create a context")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_past = 0
        self.batch = lc.llama_batch_init(max(n_batch, 1), 0, 1)

    def close(self) -> None:
        lc = self.lc
        if self.batch is not None:
            lc.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *a: Any) -> None:
        self.close()

    def tokenize(self, text: str) -> list[int]:
        lc = self.lc
        raw = text.encode()
        buf = (lc.llama_token * (len(raw) + 8))()
        n = lc.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        assert n > 0
        return list(buf[:n])

    def reset(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def decode(self, tokens: Sequence[int]) -> np.ndarray:
        """Decode ``tokens`` as one batch; returns float32 logits [len(tokens), n_vocab]."""
        lc = self.lc
        b = self.batch
        n = len(tokens)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = self.n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = True
        rc = lc.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode returned {rc}"
        self.n_past += n
        out = np.empty((n, self.n_vocab), dtype=np.float32)
        for i in range(n):
            p = lc.llama_get_logits_ith(self.ctx, i)
            out[i] = np.ctypeslib.as_array(p, shape=(self.n_vocab,))
        return out

    def greedy(self, prompt: Sequence[int], n: int, before_step: Callable[[int], None] | None = None
               ) -> tuple[list[int], list[np.ndarray]]:
        """Prompt (one batch), then n greedy steps of one token; returns (tokens, logits per step)."""
        self.reset()
        logits = [self.decode(prompt)]
        toks: list[int] = []
        for step in range(n):
            nxt = int(np.argmax(logits[-1][-1]))
            toks.append(nxt)
            if before_step is not None:
                before_step(step)
            logits.append(self.decode([nxt]))
        return toks, logits


def layer_infos(ctx: Any) -> list[na.LayerInfo]:
    return [na.saem_moe_get_layer_info(ctx, il) for il in range(na.saem_moe_n_layers(ctx))]


def random_fill(ctx: Any, rng: random.Random, slots: Sequence[int], p_map: float = 0.5) -> None:
    """Copy random experts into random slots of every layer and map a random subset of them."""
    for info in layer_infos(ctx):
        n_s = slots[info.il]
        if info.n_expert == 0 or n_s == 0:
            continue
        experts = rng.sample(range(info.n_expert), n_s)
        for s in rng.sample(range(n_s), n_s):
            e = experts[s]
            na.saem_moe_copy_expert(ctx, info.il, e, s, update_map=False)
        owner = na.saem_moe_get_slot_owner(ctx, info.il)
        m = [-1] * info.n_expert
        for s, e in enumerate(owner):
            if e >= 0 and rng.random() < p_map:
                m[e] = s
        na.saem_moe_set_slot_map(ctx, info.il, m)


def all_resident(ctx: Any) -> None:
    """n_slots == n_expert everywhere: put expert e in slot (e * 5 + 3) % n and map it."""
    for info in layer_infos(ctx):
        if info.n_expert == 0:
            continue
        n = info.n_expert
        for e in range(n):
            na.saem_moe_copy_expert(ctx, info.il, e, (e * 5 + 3) % n if n % 5 else (n - 1 - e), update_map=True)
