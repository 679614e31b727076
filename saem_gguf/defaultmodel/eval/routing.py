"""The routing of a generated reply, read from llama.cpp itself.

The conversation (prompt and reply tokens) is evaluated again in one ubatch in a plain
llama-cpp-python context of the patched library, with expert-id counting on, and
``saem_moe_get_last_routing`` returns every token's top-k experts in every MoE layer. One
batched pass gives the decode's routing up to floating-point rounding in near ties of the
router (docs/DEFAULT_MODEL.md, "llama.cpp vs the NumPy reference"), at a fraction of its cost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class RoutingReader:
    def __init__(self, model_path: str | Path, n_ctx: int) -> None:
        from saem_gguf.llama_lib import load_llama_cpp

        llama_cpp = load_llama_cpp()
        # one ubatch holds a whole conversation, so one read returns all of its routing
        self.llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   verbose=False, seed=0)
        self.n_ctx = n_ctx

    def routing(self, prompt_ids: list[int], gen_ids: list[int]) -> np.ndarray:
        """int16 [len(gen_ids), n_moe_layers, n_expert_used]: the experts of the reply's tokens,
        with the prompt as their context."""
        from saem_gguf import native_api as na

        ids = list(prompt_ids) + list(gen_ids)
        if len(ids) > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit the routing context ({self.n_ctx})")
        ctx = self.llm.ctx
        na.saem_moe_set_counting(ctx, na.SAEM_COUNT_IDS)
        try:
            self.llm.reset()
            self.llm.eval(ids)
            routed = na.saem_moe_get_last_routing(ctx)
        finally:
            na.saem_moe_set_counting(ctx, na.SAEM_COUNT_OFF)
        return routed[len(prompt_ids):]

    @property
    def n_expert(self) -> int:
        return int(self.llm.metadata[f"{self.llm.metadata['general.architecture']}.expert_count"])

    def close(self) -> None:
        self.llm.close()
