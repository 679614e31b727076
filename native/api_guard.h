// The C API's error convention, shared by every native/*_api.cpp: run the body, turn a saem_error
// (or any other exception) into its SAEM_E_* code and a per-thread message for saem_last_error().
#pragma once

#include "moe_cache.h"

#include <cstdint>
#include <exception>
#include <new>
#include <string>

// set / clear the message saem_last_error() returns on this thread (moe_api.cpp)
void saem_set_last_error(const std::string & msg);

template <typename F>
int32_t saem_guarded(const char * fn, F && f) {
    try {
        saem_set_last_error("");
        return f();
    } catch (const saem_error & e) {
        saem_set_last_error(std::string(fn) + ": " + e.what());
        return e.code;
    } catch (const std::bad_alloc &) {
        saem_set_last_error(std::string(fn) + ": out of memory");
        return SAEM_E_ALLOC;
    } catch (const std::exception & e) {
        saem_set_last_error(std::string(fn) + ": " + e.what());
        return SAEM_E_INTERNAL;
    } catch (...) {
        saem_set_last_error(std::string(fn) + ": unknown exception");
        return SAEM_E_INTERNAL;
    }
}
