"""ctypes mirror of native/saem_native.h, one function per C function. Nothing else uses ctypes.

The functions live in the patched libllama itself; the handle is the one llama-cpp-python loaded
(``llama_cpp.llama_cpp._lib``), so there is exactly one copy of the library in the process.
"""

from __future__ import annotations

import ctypes

from saem_gguf.errors import BuildError
from saem_gguf.llama_lib import load_llama_cpp

ABI_VERSION = 1  # SAEM_NATIVE_ABI_VERSION


def _lib() -> ctypes.CDLL:
    lib = load_llama_cpp().llama_cpp._lib
    if not hasattr(lib, "saem_native_version"):
        raise BuildError("the loaded libllama has no saem_native_version: it is not the patched build")
    return lib


# const char * saem_native_version(void);
def saem_native_version() -> str:
    f = _lib().saem_native_version
    f.restype = ctypes.c_char_p
    f.argtypes = []
    return f().decode()


# int32_t saem_native_abi_version(void);
def saem_native_abi_version() -> int:
    f = _lib().saem_native_abi_version
    f.restype = ctypes.c_int32
    f.argtypes = []
    return int(f())
