"""A NumPy forward pass of a qwen3moe GGUF over its dequantized weights (no PyTorch, no llama.cpp).

It is the reference the tests hold llama.cpp's logits to, and it returns the routing (the
top-k experts of every token in every layer) that llama.cpp computes internally, so traces of
the default model need no native hooks. The maths is llama.cpp's qwen3moe graph
(src/models/qwen3moe.cpp, build_moe_ffn): RMSNorm; Q/K RMS-norm per head; NEOX RoPE; causal GQA
softmax attention scaled by 1/sqrt(head_dim); softmax router -> top-k -> weights renormalised to
sum 1; SwiGLU experts; final RMSNorm; output matrix (token_embd if there is none). Computed in
float64 from the stored (dequantized) weights, so its only difference from llama.cpp is
llama.cpp's own arithmetic (F16 / Q8_0 activations in its matmuls, F16 KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from saem_gguf.errors import SaemError


@dataclass
class GGUFWeights:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    eps: float
    rope_base: float
    tensors: dict[str, np.ndarray]  # NumPy order, float64

    def t(self, name: str) -> np.ndarray:
        return self.tensors[name]


def _field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        if default is None:
            raise SaemError(f"GGUF has no {key}")
        return default
    return f.contents()


def load_weights(path: str | Path) -> GGUFWeights:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch != "qwen3moe":
        raise SaemError(f"the reference forward handles qwen3moe, not {arch}")
    n_embd = int(_field(r, f"{arch}.embedding_length"))
    n_head = int(_field(r, f"{arch}.attention.head_count"))
    tensors = {}
    for t in r.tensors:
        tensors[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)
    return GGUFWeights(
        arch=arch, n_layer=int(_field(r, f"{arch}.block_count")), n_embd=n_embd, n_head=n_head,
        n_head_kv=int(_field(r, f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(_field(r, f"{arch}.attention.key_length", n_embd // n_head)),
        n_expert=int(_field(r, f"{arch}.expert_count")), n_expert_used=int(_field(r, f"{arch}.expert_used_count")),
        eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(_field(r, f"{arch}.rope.freq_base", 10000.0)), tensors=tensors)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_neox(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """x [T, H, D]: rotate the pairs (i, i + D/2) by pos * base^(-2i/D)."""
    D = x.shape[-1]
    half = D // 2
    ang = pos[:, None].astype(np.float64) * base ** (-np.arange(half, dtype=np.float64) * 2 / D)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(w: GGUFWeights, tokens, margins: bool = False, routing: np.ndarray | None = None):
    """Logits [T, n_vocab] (float64) for every position, and the routing [T, n_layer, k]
    (expert ids, highest router probability first). With ``margins``, also [T, n_layer]: the
    router probability of the k-th chosen expert minus that of the best unchosen one (a tiny
    margin is a near tie, which other arithmetic may break the other way).

    ``routing`` ([T, n_layer, k] expert ids, e.g. what llama.cpp chose) forces the experts each
    token runs through instead of this forward's top-k; their gate weights are still this
    forward's router probabilities, renormalised. Comparing logits under one routing removes
    near-tie expert swaps from the comparison."""
    ids = np.asarray(tokens, np.int64)
    T = ids.shape[0]
    H, Hkv, Dh, E, K = w.n_head, w.n_head_kv, w.head_dim, w.n_expert, w.n_expert_used
    pos = np.arange(T)
    x = w.t("token_embd.weight")[ids]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    forced = None
    if routing is not None:
        forced = np.asarray(routing, np.int64)
        if forced.shape != (T, w.n_layer, K) or forced.min() < 0 or forced.max() >= E:
            raise ValueError(f"routing must be [{T}, {w.n_layer}, {K}] expert ids < {E}, got {forced.shape}")
    routing = np.empty((T, w.n_layer, K), np.int64)
    margin = np.full((T, w.n_layer), np.inf)
    rep = H // Hkv
    for il in range(w.n_layer):
        p = f"blk.{il}."
        h = _rms(x, w.t(p + "attn_norm.weight"), w.eps)
        q = (h @ w.t(p + "attn_q.weight").T).reshape(T, H, Dh)
        k = (h @ w.t(p + "attn_k.weight").T).reshape(T, Hkv, Dh)
        v = (h @ w.t(p + "attn_v.weight").T).reshape(T, Hkv, Dh)
        q = _rope_neox(_rms(q, w.t(p + "attn_q_norm.weight"), w.eps), pos, w.rope_base)
        k = _rope_neox(_rms(k, w.t(p + "attn_k_norm.weight"), w.eps), pos, w.rope_base)
        k = np.repeat(k, rep, axis=1)  # q head h reads kv head h // rep
        v = np.repeat(v, rep, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(Dh) + causal[None]
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", att, v).reshape(T, H * Dh)
        x = x + o @ w.t(p + "attn_output.weight").T
        # MoE FFN
        h = _rms(x, w.t(p + "ffn_norm.weight"), w.eps)
        logits = h @ w.t(p + "ffn_gate_inp.weight").T  # [T, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        order = np.argsort(-probs, axis=-1, kind="stable")
        sel = order[:, :K] if forced is None else forced[:, il]
        routing[:, il] = sel
        if K < E:
            margin[:, il] = (np.take_along_axis(probs, order[:, K - 1:K], -1)
                             - np.take_along_axis(probs, order[:, K:K + 1], -1))[:, 0]
        wts = np.take_along_axis(probs, sel, -1)
        wts /= np.maximum(wts.sum(-1, keepdims=True), 6.103515625e-5)
        gate, up, down = (w.t(p + "ffn_gate_exps.weight"), w.t(p + "ffn_up_exps.weight"),
                          w.t(p + "ffn_down_exps.weight"))
        y = np.zeros_like(x)
        for e in range(E):
            rows, slots = np.nonzero(sel == e)
            if rows.size == 0:
                continue
            he = h[rows]
            ye = (_silu(he @ gate[e].T) * (he @ up[e].T)) @ down[e].T
            y[rows] += ye * wts[rows, slots][:, None]
        x = x + y
    x = _rms(x, w.t("output_norm.weight"), w.eps)
    out = w.tensors.get("output.weight", w.t("token_embd.weight"))
    if margins:
        return x @ out.T, routing, margin
    return x @ out.T, routing
