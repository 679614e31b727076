#include "saem_native.h"

#ifndef SAEM_LLAMA_COMMIT
#define SAEM_LLAMA_COMMIT "unknown"
#endif

extern "C" const char * saem_native_version(void) {
    return "saem-native 0.2.0 (llama.cpp " SAEM_LLAMA_COMMIT ")";
}

extern "C" int32_t saem_native_abi_version(void) {
    return SAEM_NATIVE_ABI_VERSION;
}
