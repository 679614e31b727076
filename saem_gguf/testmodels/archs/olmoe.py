"""OLMoE (e.g. OLMoE-1B-7B): full-width Q/K norms, softmax top-k routing without renormalisation,
no shared expert; experts are feed_forward_length wide. Needs n_head_kv == n_head (the K norm spans
n_embd)."""

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, blk, moe
from saem_gguf.testmodels.weights import RESIDUAL_SCALE


@register
class Olmoe(ArchDef):
    name = "olmoe"

    def feed_forward_length(self, spec) -> int:
        return spec.n_ff_exp  # llama.cpp sizes OLMoE experts with feed_forward_length

    def layer(self, add, W, il) -> None:
        s = W.spec
        if s.dense:
            raise ValueError(f"no dense {self.name} test model (use arch llama for a dense model)")
        if s.n_head_kv != s.n_head or s.n_head * s.head_dim != s.n_embd:
            raise ValueError("olmoe test models need n_head_kv == n_head and n_head * head_dim == n_embd")
        add(blk(il, "attn_norm.weight"), W.norm_weight(s.n_embd), "f32")
        add(blk(il, "attn_q.weight"), W.normal(s.n_embd, s.n_embd), "f16")
        add(blk(il, "attn_k.weight"), W.normal(s.n_embd, s.n_embd), "f16")
        add(blk(il, "attn_v.weight"), W.normal(s.n_embd, s.n_embd), "f16")
        add(blk(il, "attn_output.weight"), W.normal(s.n_embd, s.n_embd, scale=RESIDUAL_SCALE), "f16")
        add(blk(il, "attn_q_norm.weight"), W.norm_weight(s.n_embd), "f32")
        add(blk(il, "attn_k_norm.weight"), W.norm_weight(s.n_embd), "f32")
        moe(add, W, il)
