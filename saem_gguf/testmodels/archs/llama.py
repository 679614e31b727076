"""Llama with experts (Mixtral style: arch "llama" + expert_count), or a dense Llama."""

from saem_gguf.testmodels.archs import register
from saem_gguf.testmodels.archs.base import ArchDef, attention, dense_ffn, moe


@register
class Llama(ArchDef):
    name = "llama"

    def feed_forward_length(self, spec) -> int:
        # Mixtral-style llama has no expert_feed_forward_length: experts are n_ff wide
        return spec.n_ff_dense if spec.dense else spec.n_ff_exp

    def layer(self, add, W, il) -> None:
        attention(add, W, il)
        (dense_ffn if W.spec.dense else moe)(add, W, il)
