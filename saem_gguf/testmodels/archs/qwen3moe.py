"""Qwen3-MoE (e.g. Qwen3-30B-A3B): QK-norm attention, softmax top-k routing, no shared expert."""

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, attention, dense_ffn, moe


@register
class Qwen3Moe(ArchDef):
    name = "qwen3moe"

    def hparams(self, w, spec) -> None:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)

    def layer(self, add, W, il) -> None:
        attention(add, W, il, qk_norm=True)
        (dense_ffn if W.spec.dense else moe)(add, W, il)
