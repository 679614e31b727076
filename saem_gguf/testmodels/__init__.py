"""Small, real MoE GGUF models for tests: deterministic from a seed, planted routing, real BPE.

    from saem_gguf.testmodels import ModelSpec, ensure_model
    path = ensure_model(ModelSpec(arch="qwen3moe", expert_type="q4_0"))
"""

from saem_gguf.testmodels.archs import ARCHS, get_arch
from saem_gguf.testmodels.spec import EXPERT_TYPES, STAGE_PLANT, ModelSpec
from saem_gguf.testmodels.weights import Weights
from saem_gguf.testmodels.writer import ensure_model, write_gguf, write_model

__all__ = ["ARCHS", "EXPERT_TYPES", "STAGE_PLANT", "ModelSpec", "Weights", "ensure_model", "get_arch",
           "write_gguf", "write_model"]
