// saem_gguf native C API, compiled into libllama (see CMakeLists.txt) so it can reach llama.cpp
// internals. Mirrored one-to-one by saem_gguf/native_api.py; keep the two in step.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SAEM_NATIVE_ABI_VERSION 1

// Version string of the saem_gguf native layer, e.g. "saem-native 0.1.0 (llama.cpp 0c1e570)".
// Its presence proves the patched library (not a stock libllama) is the one loaded.
const char * saem_native_version(void);

// ABI version of this header; Python refuses a library whose ABI differs.
int32_t saem_native_abi_version(void);

#ifdef __cplusplus
}
#endif
