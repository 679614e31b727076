"""saem_gguf: stage-aware per-expert residency for MoE GGUF models on a patched llama.cpp."""

__version__ = "0.1.0"
