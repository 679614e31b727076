"""saem_gguf: stage-aware per-expert residency for MoE GGUF models on a patched llama.cpp."""

__version__ = "0.1.0"

from saem_gguf.llama_lib import bind_library_path as _bind_library_path

# `import saem_gguf` first, then `import llama_cpp`: the bindings load the patched library
_bind_library_path()


def __getattr__(name: str):
    # `from saem_gguf import Llama` loads llama.cpp; a plain `import saem_gguf` does not
    if name == "Llama":
        from saem_gguf.api import Llama

        return Llama
    raise AttributeError(f"module 'saem_gguf' has no attribute {name!r}")


__all__ = ["Llama", "__version__"]
