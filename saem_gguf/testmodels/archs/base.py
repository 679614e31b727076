"""Building blocks shared by the test-model architectures (tensor names as llama.cpp expects)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from saem_gguf.testmodels.spec import ModelSpec
from saem_gguf.testmodels.weights import RESIDUAL_SCALE, Weights

# add(name, array in NumPy order, kind): kind "f32" | "f16" | "expert" (the spec's expert type)
AddTensor = Callable[[str, np.ndarray, str], None]


class ArchDef:
    name = ""
    moe = True  # False: the architecture is dense-only here

    def hparams(self, w, spec: ModelSpec) -> None:  # w: gguf.GGUFWriter
        """Architecture-specific metadata beyond the common keys."""

    def feed_forward_length(self, spec: ModelSpec) -> int:
        """{arch}.feed_forward_length: the dense FFN size (some architectures use it for experts)."""
        return spec.n_ff_dense

    def layer(self, add: AddTensor, W: Weights, il: int) -> None:
        raise NotImplementedError


def blk(il: int, name: str) -> str:
    return f"blk.{il}.{name}"


def attention(add: AddTensor, W: Weights, il: int, *, qk_norm: bool = False,
              bias: bool = False) -> None:
    s = W.spec
    n_q, n_kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    add(blk(il, "attn_norm.weight"), W.norm_weight(s.n_embd), "f32")
    add(blk(il, "attn_q.weight"), W.normal(n_q, s.n_embd), "f16")
    add(blk(il, "attn_k.weight"), W.normal(n_kv, s.n_embd), "f16")
    add(blk(il, "attn_v.weight"), W.normal(n_kv, s.n_embd), "f16")
    add(blk(il, "attn_output.weight"), W.normal(s.n_embd, n_q, scale=RESIDUAL_SCALE), "f16")
    if bias:
        add(blk(il, "attn_q.bias"), W.normal(n_q, scale=0.1), "f32")
        add(blk(il, "attn_k.bias"), W.normal(n_kv, scale=0.1), "f32")
        add(blk(il, "attn_v.bias"), W.normal(n_kv, scale=0.1), "f32")
    if qk_norm:
        add(blk(il, "attn_q_norm.weight"), W.norm_weight(s.head_dim), "f32")
        add(blk(il, "attn_k_norm.weight"), W.norm_weight(s.head_dim), "f32")


def moe(add: AddTensor, W: Weights, il: int) -> None:
    s = W.spec
    add(blk(il, "ffn_norm.weight"), W.norm_weight(s.n_embd), "f32")
    add(blk(il, "ffn_gate_inp.weight"), W.router(il), "f32")
    for name, arr in W.experts().items():
        add(blk(il, f"{name}.weight"), arr, "expert")


def shared_expert(add: AddTensor, W: Weights, il: int, *, gated: bool = True) -> None:
    s = W.spec
    if gated:
        add(blk(il, "ffn_gate_inp_shexp.weight"), W.normal(s.n_embd), "f32")
    add(blk(il, "ffn_gate_shexp.weight"), W.normal(s.n_ff_shexp, s.n_embd), "f16")
    add(blk(il, "ffn_up_shexp.weight"), W.normal(s.n_ff_shexp, s.n_embd), "f16")
    add(blk(il, "ffn_down_shexp.weight"),
        W.normal(s.n_embd, s.n_ff_shexp, scale=RESIDUAL_SCALE * 4), "f16")


def dense_ffn(add: AddTensor, W: Weights, il: int) -> None:
    s = W.spec
    add(blk(il, "ffn_norm.weight"), W.norm_weight(s.n_embd), "f32")
    add(blk(il, "ffn_gate.weight"), W.normal(s.n_ff_dense, s.n_embd), "f16")
    add(blk(il, "ffn_up.weight"), W.normal(s.n_ff_dense, s.n_embd), "f16")
    add(blk(il, "ffn_down.weight"), W.normal(s.n_embd, s.n_ff_dense, scale=RESIDUAL_SCALE * 4), "f16")
