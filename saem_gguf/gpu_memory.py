"""The GPUs llama.cpp sees and their free memory, through ggml's backend device registry.

llama-cpp-python 0.3.36 binds no ``ggml_backend_dev_*`` function, so they are called with ctypes on
the same libggml / libggml-base that ``load_llama_cpp`` loaded (dlopen returns the loaded copies):
what is reported is exactly what llama.cpp will allocate from. A CPU-only build, or a CUDA build
on a machine without a usable GPU, reports none.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from saem_gguf.llama_lib import load_llama_cpp

# enum ggml_backend_dev_type (ggml-backend.h)
_GPU_TYPES = {1: "gpu", 2: "igpu"}


@dataclass(frozen=True)
class GpuMemory:
    name: str  # ggml device name, e.g. "CUDA0"
    description: str  # e.g. "NVIDIA H200"
    free_bytes: int
    total_bytes: int


def _bind(lib: ctypes.CDLL, name: str, restype, argtypes) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def gpu_memory() -> list[GpuMemory]:
    """Every GPU device ggml registered, with its free and total memory now."""
    from pathlib import Path

    llama_cpp = load_llama_cpp()
    lib_dir = Path(llama_cpp.llama_cpp._base_path)
    reg = ctypes.CDLL(str(lib_dir / "libggml.so"))  # the registry lives in libggml
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))  # device methods in libggml-base
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    count = _bind(reg, "ggml_backend_dev_count", sz, [])
    get = _bind(reg, "ggml_backend_dev_get", vp, [sz])
    dev_type = _bind(base, "ggml_backend_dev_type", ctypes.c_int, [vp])
    dev_name = _bind(base, "ggml_backend_dev_name", ctypes.c_char_p, [vp])
    dev_desc = _bind(base, "ggml_backend_dev_description", ctypes.c_char_p, [vp])
    dev_mem = _bind(base, "ggml_backend_dev_memory", None,
                    [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
    out = []
    for i in range(count()):
        dev = get(i)
        if dev_type(dev) not in _GPU_TYPES:
            continue
        free, total = sz(0), sz(0)
        dev_mem(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GpuMemory(dev_name(dev).decode(), (dev_desc(dev) or b"").decode(),
                             int(free.value), int(total.value)))
    return out
