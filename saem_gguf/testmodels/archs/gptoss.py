"""gpt-oss (OpenAI MoE): attention sinks, biased Q/K/V/O, alternating sliding-window layers, a
biased router with softmax over the selected experts' logits (SOFTMAX_WEIGHT), biased experts with
the clamped swiglu_oai activation, post-attention norm."""

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, attention, blk
from saem_gguf.testmodels.weights import RESIDUAL_SCALE


@register
class GptOss(ArchDef):
    name = "gpt-oss"

    def hparams(self, w, spec) -> None:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_sliding_window(16)

    def layer(self, add, W, il) -> None:
        s = W.spec
        if s.dense:
            raise ValueError(f"no dense {self.name} test model (use arch llama for a dense model)")
        attention(add, W, il, bias=True)
        add(blk(il, "attn_output.bias"), W.normal(s.n_embd, scale=0.1), "f32")
        add(blk(il, "attn_sinks.weight"), W.normal(s.n_head, scale=1.0), "f32")
        add(blk(il, "post_attention_norm.weight"), W.norm_weight(s.n_embd), "f32")
        add(blk(il, "ffn_gate_inp.weight"), W.router(il), "f32")
        add(blk(il, "ffn_gate_inp.bias"), W.normal(s.n_expert, scale=0.1), "f32")
        for name, arr in W.experts().items():
            add(blk(il, f"{name}.weight"), arr, "expert")
        add(blk(il, "ffn_gate_exps.bias"), W.normal(s.n_expert, s.n_ff_exp, scale=0.1), "f32")
        add(blk(il, "ffn_up_exps.bias"), W.normal(s.n_expert, s.n_ff_exp, scale=0.1), "f32")
        add(blk(il, "ffn_down_exps.bias"), W.normal(s.n_expert, s.n_embd, scale=RESIDUAL_SCALE), "f32")
