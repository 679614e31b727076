"""DeepSeek-V2/V3 style: MLA-compressed KV attention (legacy unsplit kv_b, no Q LoRA; needs
n_head_kv == n_head), leading dense
layers (n_dense_lead), sigmoid routing with a selection bias, group-limited expert selection,
normalised + scaled weights, one shared expert. ``extra=(("fused_gate_up", "1"),)`` writes the
experts as one fused ffn_gate_up_exps tensor (as recent conversions do)."""

import gguf
import numpy as np

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, blk, dense_ffn
from saem_gguf.testmodels.weights import RESIDUAL_SCALE

KV_LORA_RANK = 32
QK_ROPE = 8


def _extra(spec, key: str, default: str) -> str:
    return dict(spec.extra).get(key, default)


@register
class Deepseek2(ArchDef):
    name = "deepseek2"

    def hparams(self, w, spec) -> None:
        w.add_key_length(spec.head_dim + QK_ROPE)  # qk_nope + qk_rope
        w.add_value_length(spec.head_dim)
        w.add_rope_dimension_count(QK_ROPE)
        w.add_q_lora_rank(0)
        w.add_kv_lora_rank(KV_LORA_RANK)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_shared_count(1)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        groups = int(_extra(spec, "expert_groups", "2"))
        if groups > 1:
            w.add_expert_group_count(groups)
            w.add_expert_group_used_count(max(1, groups // 2))

    def layer(self, add, W, il) -> None:
        s = W.spec
        if s.dense:
            raise ValueError(f"no dense {self.name} test model (use arch llama for a dense model)")
        if s.n_head_kv != s.n_head:
            raise ValueError("deepseek2 test models need n_head_kv == n_head (MHA after kv_b)")
        n_qk = s.head_dim + QK_ROPE
        add(blk(il, "attn_norm.weight"), W.norm_weight(s.n_embd), "f32")
        add(blk(il, "attn_q.weight"), W.normal(s.n_head * n_qk, s.n_embd), "f16")
        add(blk(il, "attn_kv_a_mqa.weight"), W.normal(KV_LORA_RANK + QK_ROPE, s.n_embd), "f16")
        add(blk(il, "attn_kv_a_norm.weight"), W.norm_weight(KV_LORA_RANK), "f32")
        add(blk(il, "attn_kv_b.weight"), W.normal(s.n_head * (s.head_dim + s.head_dim), KV_LORA_RANK), "f16")
        add(blk(il, "attn_output.weight"), W.normal(s.n_embd, s.n_head * s.head_dim, scale=RESIDUAL_SCALE), "f16")
        if il < s.n_dense_lead:
            dense_ffn(add, W, il)
            return
        add(blk(il, "ffn_norm.weight"), W.norm_weight(s.n_embd), "f32")
        add(blk(il, "ffn_gate_inp.weight"), W.router(il), "f32")
        add(blk(il, "exp_probs_b.bias"), W.normal(s.n_expert, scale=0.5), "f32")
        ex = W.experts()
        if _extra(s, "fused_gate_up", "0") == "1":
            # [n_expert, 2*n_ff, n_embd]: gate rows first, then up (llama.cpp views gate at offset 0)
            add(blk(il, "ffn_gate_up_exps.weight"),
                np.concatenate([ex["ffn_gate_exps"], ex["ffn_up_exps"]], axis=1), "expert")
        else:
            add(blk(il, "ffn_gate_exps.weight"), ex["ffn_gate_exps"], "expert")
            add(blk(il, "ffn_up_exps.weight"), ex["ffn_up_exps"], "expert")
        add(blk(il, "ffn_down_exps.weight"), ex["ffn_down_exps"], "expert")
        add(blk(il, "ffn_gate_shexp.weight"), W.normal(s.n_ff_exp, s.n_embd), "f16")
        add(blk(il, "ffn_up_shexp.weight"), W.normal(s.n_ff_exp, s.n_embd), "f16")
        add(blk(il, "ffn_down_shexp.weight"), W.normal(s.n_embd, s.n_ff_exp, scale=RESIDUAL_SCALE * 4), "f16")
