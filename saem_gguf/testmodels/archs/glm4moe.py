"""GLM-4.5 MoE: biased QKV with Q/K norms, sigmoid routing with a selection bias (exp_probs_b),
normalised and scaled weights, one shared expert, leading dense layers (n_dense_lead)."""

import gguf

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, attention, blk
from saem_gguf.testmodels.weights import RESIDUAL_SCALE


@register
class Glm4Moe(ArchDef):
    name = "glm4moe"

    def hparams(self, w, spec) -> None:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_expert_shared_count(1)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_weights_scale(1.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    def layer(self, add, W, il) -> None:
        s = W.spec
        if s.dense:
            raise ValueError(f"no dense {self.name} test model (use arch llama for a dense model)")
        attention(add, W, il, bias=True, qk_norm=True)
        add(blk(il, "post_attention_norm.weight"), W.norm_weight(s.n_embd), "f32")  # the FFN norm
        if il < s.n_dense_lead:
            add(blk(il, "ffn_gate.weight"), W.normal(s.n_ff_dense, s.n_embd), "f16")
            add(blk(il, "ffn_up.weight"), W.normal(s.n_ff_dense, s.n_embd), "f16")
            add(blk(il, "ffn_down.weight"), W.normal(s.n_embd, s.n_ff_dense, scale=RESIDUAL_SCALE * 4), "f16")
            return
        add(blk(il, "ffn_gate_inp.weight"), W.router(il), "f32")
        add(blk(il, "exp_probs_b.bias"), W.normal(s.n_expert, scale=0.5), "f32")
        for name, arr in W.experts().items():
            add(blk(il, f"{name}.weight"), arr, "expert")
        # shared expert, n_ff_exp wide (n_expert_shared = 1)
        add(blk(il, "ffn_gate_shexp.weight"), W.normal(s.n_ff_exp, s.n_embd), "f16")
        add(blk(il, "ffn_up_shexp.weight"), W.normal(s.n_ff_exp, s.n_embd), "f16")
        add(blk(il, "ffn_down_shexp.weight"), W.normal(s.n_embd, s.n_ff_exp, scale=RESIDUAL_SCALE * 4), "f16")
