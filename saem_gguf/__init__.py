"""saem_gguf: stage-aware per-expert residency for MoE GGUF models on a patched llama.cpp."""

__version__ = "0.1.0"

from saem_gguf.llama_lib import bind_library_path as _bind_library_path

# `import saem_gguf` first, then `import llama_cpp`: the bindings load the patched library
_bind_library_path()
