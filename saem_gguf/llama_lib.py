"""Loads llama-cpp-python's bindings on top of OUR patched libllama, never a stock one.

llama-cpp-python reads LLAMA_CPP_LIB_PATH once, at import; so this module sets it before the
first ``import llama_cpp`` anywhere in the process, and refuses to continue if something imported
llama_cpp earlier from another place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from saem_gguf.build import BuildConfig, find_build
from saem_gguf.errors import BuildError

BUILD_HINT = "run `python -m saem_gguf build` (or `bash setup.sh`) first"


def resolve_library_dir() -> Path:
    """$SAEM_GGUF_LIB_DIR if set; else the cached build of the current sources (CUDA build first)."""
    env = os.environ.get("SAEM_GGUF_LIB_DIR")
    if env:
        p = Path(env)
        if not (p / "libllama.so").exists():
            raise BuildError(f"SAEM_GGUF_LIB_DIR={env} holds no libllama.so")
        return p
    want_cuda = os.environ.get("SAEM_GGUF_CUDA")
    candidates = []
    if want_cuda != "0":
        candidates.append(BuildConfig(cuda=True))
    if want_cuda != "1":
        candidates.append(BuildConfig())
    for cfg in candidates:
        lib = find_build(cfg)
        if lib:
            return lib
    raise BuildError(f"the patched llama.cpp for the current sources is not built: {BUILD_HINT}")


def bind_library_path() -> Path | None:
    """Point llama-cpp-python at the patched library before anything imports it.

    ``import saem_gguf`` calls this, so ``import saem_gguf, llama_cpp`` works in the project's
    environment (whose llama-cpp-python has no library of its own). Quiet when nothing is built
    yet or ``llama_cpp`` is already imported: ``load_llama_cpp`` reports those cases."""
    if "llama_cpp" in sys.modules:
        return None
    try:
        lib_dir = resolve_library_dir()
    except BuildError:
        return None
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return lib_dir


def load_llama_cpp() -> ModuleType:
    """Import ``llama_cpp`` bound to the patched library and return the module."""
    lib_dir = resolve_library_dir()
    mod = sys.modules.get("llama_cpp")
    if mod is not None:
        loaded = Path(mod.llama_cpp._base_path).resolve()
        if loaded != lib_dir.resolve():
            raise BuildError(f"llama_cpp was already imported from {loaded}, not from {lib_dir}; "
                             "import saem_gguf before llama_cpp")
        return mod
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    try:
        import llama_cpp
    except ImportError as e:
        raise BuildError(f"llama-cpp-python could not be imported ({e}); {BUILD_HINT}") from e
    except (OSError, FileNotFoundError, RuntimeError) as e:
        raise BuildError(f"could not load {lib_dir}/libllama.so ({e}); {BUILD_HINT}") from e
    return llama_cpp
