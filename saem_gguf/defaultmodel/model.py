"""The qwen3moe model in PyTorch, for training only (PyTorch is a development dependency).

It computes exactly what llama.cpp's qwen3moe graph computes (src/models/qwen3moe.cpp):
RMSNorm (eps 1e-6) before attention and FFN; Q/K RMS-normed per head, then NEOX RoPE
(pairs i, i + head_dim/2; base 10000; llama.cpp's rope type for QWEN3MOE is NEOX); causal GQA
attention scaled by 1/sqrt(head_dim); MoE FFN: softmax over all experts, top-k, the k weights
renormalised to sum 1 (build_moe_ffn with norm_w = true), SwiGLU experts; final RMSNorm and an
untied output matrix. Parameter shapes are the GGUF tensors' NumPy shapes, so export is a copy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    n_vocab: int
    n_layer: int = 6
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff_exp: int = 128
    n_expert: int = 16
    n_expert_used: int = 2
    rope_base: float = 10000.0
    eps: float = 1e-6

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(T: int, head_dim: int, base: float, device=None):
    half = head_dim // 2
    inv = base ** (-torch.arange(half, dtype=torch.float32, device=device) * 2 / head_dim)
    ang = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()  # [T, half]


def apply_rope_neox(x, cos, sin):
    """x [B, T, H, D]; NEOX: rotate (x[i], x[i + D/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=False)
        self.k = nn.Linear(c.n_embd, c.n_head_kv * c.head_dim, bias=False)
        self.v = nn.Linear(c.n_embd, c.n_head_kv * c.head_dim, bias=False)
        self.o = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.eps)
        self.k_norm = RMSNorm(c.head_dim, c.eps)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, c.n_head, c.head_dim))
        k = self.k_norm(self.k(x).view(B, T, c.n_head_kv, c.head_dim))
        v = self.v(x).view(B, T, c.n_head_kv, c.head_dim)
        q, k = apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)
        rep = c.n_head // c.n_head_kv
        k = k.repeat_interleave(rep, dim=2)  # q head h uses kv head h // rep (ggml broadcast)
        v = v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        return self.o(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim))


class MoE(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        E, Fd, D = c.n_expert, c.n_ff_exp, c.n_embd
        self.router = nn.Linear(D, E, bias=False)  # ffn_gate_inp [E, D]
        self.gate = nn.Parameter(torch.empty(E, Fd, D))  # ffn_gate_exps
        self.up = nn.Parameter(torch.empty(E, Fd, D))  # ffn_up_exps
        self.down = nn.Parameter(torch.empty(E, D, Fd))  # ffn_down_exps

    def forward(self, x):
        """x [N, D] -> (y [N, D], aux load-balancing loss, expert ids [N, k])."""
        c = self.c
        probs = F.softmax(self.router(x), dim=-1)  # [N, E]
        w, idx = probs.topk(c.n_expert_used, dim=-1)
        w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
        # the (token, slot) pairs sorted by expert, each expert's rows one group of a grouped
        # matmul: no padding to the busiest expert (a trained router's busiest takes 1.6x the
        # mean), and gate and up in one product. 10-25 % faster a training step than three
        # bmm calls on a padded [expert, slot, dim] batch (docs/DEFAULT_MODEL.md).
        N, D = x.shape
        k, E, Fd = c.n_expert_used, c.n_expert, c.n_ff_exp
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts_t = torch.bincount(flat, minlength=E)
        ends = torch.cumsum(counts_t, 0).to(torch.int32)
        tok = order // k
        gate_up = torch.cat([self.gate, self.up], 1)  # [E, 2 Fd, D]
        h = F.grouped_mm(x[tok], gate_up.transpose(1, 2), offs=ends)  # [N k, 2 Fd]
        h = F.silu(h[:, :Fd]) * h[:, Fd:]
        yg = F.grouped_mm(h, self.down.transpose(1, 2), offs=ends)  # [N k, D]
        y = x.new_zeros(N, D).index_add(0, tok, yg * w.reshape(-1)[order, None])
        # Switch-style load-balancing loss: n_expert * sum_e (share of slots on e) * (mean prob of e)
        p_mean = probs.mean(0)
        f = counts_t.to(x.dtype) / flat.numel()
        aux = c.n_expert * (f * p_mean).sum()
        return y, aux, idx


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm = RMSNorm(c.n_embd, c.eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.n_embd, c.eps)
        self.moe = MoE(c)

    def forward(self, x, cos, sin, keep):
        """keep: flat indices of the real (unpadded) tokens, or None for all."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        B, T, D = x.shape
        h = self.ffn_norm(x).reshape(B * T, D)
        if keep is None:
            y, aux, idx = self.moe(h)
            return x + y.view(B, T, D), aux, idx.view(B, T, -1)
        y_k, aux, idx_k = self.moe(h[keep])  # padding never reaches the experts
        y = torch.zeros_like(h).index_copy_(0, keep, y_k)
        idx = torch.full((B * T, idx_k.shape[1]), -1, dtype=idx_k.dtype).index_copy_(0, keep, idx_k)
        return x + y.view(B, T, D), aux, idx.view(B, T, -1)


class MoEModel(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.n_vocab, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.n_embd, c.eps)
        self.output = nn.Linear(c.n_embd, c.n_vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        res = std / math.sqrt(2 * self.c.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("attn.o.weight", "moe.down")):
                nn.init.normal_(p, 0.0, res)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids, mask=None, return_routing: bool = False):
        """ids [B, T] (mask [B, T] bool: real tokens) -> logits [B, T, V], mean aux loss (and
        per-layer expert ids [L, B, T, k], -1 at padding)."""
        B, T = ids.shape
        cos, sin = rope_tables(T, self.c.head_dim, self.c.rope_base, ids.device)
        x = self.embed(ids)
        keep = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)
        auxes, routes = [], []
        for blk in self.blocks:
            x, aux, idx = blk(x, cos, sin, keep)
            auxes.append(aux)
            routes.append(idx)
        logits = self.output(self.norm(x))
        aux = torch.stack(auxes).mean()
        if return_routing:
            return logits, aux, torch.stack(routes)
        return logits, aux

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def gguf_tensors(self):
        """(name, float32 NumPy array in GGUF NumPy order, kind) in file order."""
        import numpy as np

        def a(t):
            return t.detach().to(torch.float32).cpu().numpy().astype(np.float32)

        out = [("token_embd.weight", a(self.embed.weight), "f16")]
        for il, b in enumerate(self.blocks):
            p = f"blk.{il}."
            out += [
                (p + "attn_norm.weight", a(b.attn_norm.weight), "f32"),
                (p + "attn_q.weight", a(b.attn.q.weight), "f16"),
                (p + "attn_k.weight", a(b.attn.k.weight), "f16"),
                (p + "attn_v.weight", a(b.attn.v.weight), "f16"),
                (p + "attn_output.weight", a(b.attn.o.weight), "f16"),
                (p + "attn_q_norm.weight", a(b.attn.q_norm.weight), "f32"),
                (p + "attn_k_norm.weight", a(b.attn.k_norm.weight), "f32"),
                (p + "ffn_norm.weight", a(b.ffn_norm.weight), "f32"),
                (p + "ffn_gate_inp.weight", a(b.moe.router.weight), "f32"),
                (p + "ffn_gate_exps.weight", a(b.moe.gate), "expert"),
                (p + "ffn_up_exps.weight", a(b.moe.up), "expert"),
                (p + "ffn_down_exps.weight", a(b.moe.down), "expert"),
            ]
        out += [("output_norm.weight", a(self.norm.weight), "f32"),
                ("output.weight", a(self.output.weight), "f16")]
        return out
