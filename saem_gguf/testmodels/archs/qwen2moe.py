"""Qwen2-MoE (e.g. Qwen1.5-MoE-A2.7B): biased QKV, routed experts plus a gated shared expert."""

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, attention, moe, shared_expert


@register
class Qwen2Moe(ArchDef):
    name = "qwen2moe"

    def hparams(self, w, spec) -> None:
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)

    def layer(self, add, W, il) -> None:
        attention(add, W, il, bias=True)
        moe(add, W, il)
        shared_expert(add, W, il)
