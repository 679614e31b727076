"""Deterministic weights for test models, with planted routing.

Why the routing follows the text: every token's embedding is dominated by its group's direction
(orthonormal directions, one per group); attention and expert outputs are scaled small, so the
residual stream entering each MoE layer still points along the token's group direction; each
expert's router row is that direction scaled by `routing_strength`. So a token's top-k experts are
its group's experts, in every layer (through a per-layer permutation), whatever the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from saem_gguf.testmodels.spec import ModelSpec
from saem_gguf.testmodels.vocab import Vocab

RESIDUAL_SCALE = 0.05  # attention / expert output weights: small, so group directions dominate


class Weights:
    """Random tensors in NumPy order (reverse of ggml's ne), all float32, from one seeded RNG."""

    def __init__(self, spec: ModelSpec, vocab: Vocab) -> None:
        self.spec = spec
        self.vocab = vocab
        self.rng = np.random.default_rng(spec.seed)
        n_groups = spec.n_groups
        if n_groups > spec.n_embd:
            raise ValueError("n_expert / n_expert_used groups must fit in n_embd directions")
        q, _ = np.linalg.qr(self.rng.standard_normal((spec.n_embd, spec.n_embd)))
        self.directions = q[:, :n_groups].T.astype(np.float32)  # [n_groups, n_embd]
        self.token_group = self._token_groups()
        self.layer_perm = [self.rng.permutation(spec.n_expert) if spec.n_expert else None
                           for _ in range(spec.n_layer)]

    def _token_groups(self) -> np.ndarray:
        spec, vocab = self.spec, self.vocab
        groups = self.rng.integers(0, spec.n_groups, size=vocab.size).astype(np.int32)
        for words, g in spec.planted:
            for i, tok in enumerate(vocab.tokens):
                text = tok.replace("Ġ", "").replace("Ċ", "").lower()
                if len(text) >= 3 and any(text in w.lower() for w in words):
                    groups[i] = g % spec.n_groups
        return groups

    def group_experts(self, il: int, group: int) -> np.ndarray:
        """The experts that tokens of ``group`` are routed to in layer ``il``, strongest first."""
        k = self.spec.n_expert_used
        return self.layer_perm[il][group * k:(group + 1) * k]

    # --- tensors -----------------------------------------------------------------------------
    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        fan_in = shape[-1]
        return (self.rng.standard_normal(shape) * (scale / np.sqrt(fan_in))).astype(np.float32)

    def norm_weight(self, n: int) -> np.ndarray:
        return (1.0 + 0.05 * self.rng.standard_normal(n)).astype(np.float32)

    def embedding(self) -> np.ndarray:
        spec = self.spec
        base = self.directions[self.token_group] * np.sqrt(spec.n_embd)
        noise = self.rng.standard_normal((self.vocab.size, spec.n_embd)) * 0.4
        return (base + noise).astype(np.float32)

    def router(self, il: int) -> np.ndarray:
        """[n_expert, n_embd]: expert e's row is its group's direction, rank-weighted."""
        spec = self.spec
        w = np.zeros((spec.n_expert, spec.n_embd), np.float32)
        for g in range(spec.n_groups):
            for rank, e in enumerate(self.group_experts(il, g)):
                w[e] = self.directions[g] * (spec.routing_strength * (1.0 - 0.1 * rank)
                                              / np.sqrt(spec.n_embd))
        return w + self.normal(spec.n_expert, spec.n_embd, scale=0.05)

    def experts(self) -> dict[str, np.ndarray | PooledExperts]:
        s = self.spec
        n = s.expert_pool if 0 < s.expert_pool < s.n_expert else s.n_expert
        mats = {
            "ffn_gate_exps": self.normal(n, s.n_ff_exp, s.n_embd),
            "ffn_up_exps": self.normal(n, s.n_ff_exp, s.n_embd),
            "ffn_down_exps": self.normal(n, s.n_embd, s.n_ff_exp, scale=RESIDUAL_SCALE * 4),
        }
        if n == s.n_expert:
            return mats
        index = self.rng.integers(0, n, size=s.n_expert)
        return {k: PooledExperts(v, index) for k, v in mats.items()}


@dataclass(frozen=True)
class PooledExperts:
    """An expert tensor whose experts are ``pool[index[e]]`` (quantized once per pool entry)."""

    pool: np.ndarray  # [n_pool, rows, cols]
    index: np.ndarray  # [n_expert]
