// saem_gguf native C API (saem_native.h): argument checking, error codes, no exception escapes.

#include "api_guard.h"
#include "moe_cache.h"

#include "llama-context.h"
#include "llama-model.h"

#include "ggml-backend.h"
// the buffer type struct, to copy the CPU one (saem_plain_cpu_buft); reached through llama's src/
#include "../ggml/src/ggml-backend-impl.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

static thread_local std::string g_last_error;

void saem_set_last_error(const std::string & msg) {
    g_last_error = msg;
}

#define CHECK_CTX(ctx) \
    if (!(ctx)) { throw saem_error(SAEM_E_INVALID_ARG, "ctx is NULL"); }

#define CHECK_PTR(p) \
    if (!(p)) { throw saem_error(SAEM_E_INVALID_ARG, #p " is NULL"); }

static const saem_layer & moe_layer(const saem_moe_cache & c, int32_t il) {
    const saem_layer & L = c.layer(il);
    if (L.n_expert == 0) {
        throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(il) + " has no experts");
    }
    return L;
}

static void check_len(const char * what, int32_t n, int32_t want) {
    if (n != want) {
        throw saem_error(SAEM_E_INVALID_ARG, std::string(what) + " has " + std::to_string(n) + " entries, expected " + std::to_string(want));
    }
}

static bool model_has_experts(const llama_context * ctx) {
    for (const auto & l : saem_ctx_access::model(*ctx).layers) {
        if (l.ffn_down_exps) {
            return true;
        }
    }
    return false;
}

ggml_backend_buffer_type * saem_plain_cpu_buft() {
    // a copy of the CPU buffer type under another address: patch 0008 tells the two apart, and
    // anything that does use the copy gets the CPU buffer type's behaviour
    static ggml_backend_buffer_type plain = *ggml_backend_cpu_buffer_type();
    return &plain;
}

extern "C" {

const char * saem_last_error(void) {
    return g_last_error.c_str();
}

void * saem_expert_host_buft(int32_t want_pinned, int32_t * is_pinned) {
    if (is_pinned) {
        *is_pinned = 0;
    }
    if (want_pinned) {
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            const auto type = ggml_backend_dev_type(d);
            if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
                ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(d);
                if (buft) {
                    if (is_pinned) {
                        *is_pinned = 1;
                    }
                    return buft;
                }
            }
        }
    }
    return saem_plain_cpu_buft();
}

const char * saem_expert_tensor_regex(void) {
    // same as llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): matches weights, biases and scales
    return "\\.ffn_(up|down|gate|gate_up)_(ch|)exps";
}

int32_t saem_moe_n_layers(const struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return (int32_t) saem_ctx_access::model(*ctx).layers.size();
    });
}

int32_t saem_moe_get_layer_info(const struct llama_context * ctx, int32_t il, struct saem_moe_layer_info * out) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        CHECK_PTR(out);
        saem_describe_layer(ctx, il, *out);
        return SAEM_OK;
    });
}

int32_t saem_moe_cache_init(struct llama_context * ctx, const int32_t * n_slots, int32_t n_layers) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        CHECK_PTR(n_slots);
        if (!model_has_experts(ctx)) {
            throw saem_error(SAEM_E_NOT_MOE, std::string("model (") + llm_arch_name(saem_ctx_access::model(*ctx).arch) +
                    ") has no expert layers");
        }
        saem_get_or_create_cache(ctx)->init(n_slots, n_layers);
        return SAEM_OK;
    });
}

int32_t saem_moe_cache_is_init(const struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        const saem_moe_cache * c = saem_get_cache(ctx);
        return c && c->initialised ? 1 : 0;
    });
}

static saem_moe_cache & need_cache(const llama_context * ctx) {
    saem_moe_cache * c = saem_get_cache(ctx);
    if (!c || !c->initialised) {
        if (!model_has_experts(ctx)) {
            throw saem_error(SAEM_E_NOT_MOE, "the model has no expert layers");
        }
        throw saem_error(SAEM_E_NO_CACHE, "the expert cache is not initialised (saem_moe_cache_init)");
    }
    return *c;
}

int32_t saem_moe_set_slot_map(struct llama_context * ctx, int32_t il, const int32_t * expert_to_slot, int32_t n_expert) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        CHECK_PTR(expert_to_slot);
        saem_moe_cache & c = need_cache(ctx);
        const saem_layer & L = moe_layer(c, il);
        check_len("expert_to_slot", n_expert, L.n_expert);
        c.set_map(il, expert_to_slot);
        return SAEM_OK;
    });
}

int32_t saem_moe_get_slot_map(const struct llama_context * ctx, int32_t il, int32_t * expert_to_slot, int32_t n_expert) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        CHECK_PTR(expert_to_slot);
        saem_moe_cache & c = need_cache(ctx);
        const saem_layer & L = moe_layer(c, il);
        check_len("expert_to_slot", n_expert, L.n_expert);
        std::copy(L.slot_of.begin(), L.slot_of.end(), expert_to_slot);
        return SAEM_OK;
    });
}

int32_t saem_moe_get_slot_owner(const struct llama_context * ctx, int32_t il, int32_t * slot_to_expert, int32_t n_slots) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        saem_moe_cache & c = need_cache(ctx);
        const saem_layer & L = moe_layer(c, il);
        check_len("slot_to_expert", n_slots, L.n_slots);
        if (n_slots > 0) {
            CHECK_PTR(slot_to_expert);
            std::copy(L.owner.begin(), L.owner.end(), slot_to_expert);
        }
        return SAEM_OK;
    });
}

static int32_t copy_impl(const char * fn, llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t update_map, bool async) {
    return saem_guarded(fn, [&]() -> int32_t {
        CHECK_CTX(ctx);
        saem_moe_cache & c = need_cache(ctx);
        moe_layer(c, il);
        c.copy_expert(il, expert, slot, update_map != 0, async);
        return SAEM_OK;
    });
}

int32_t saem_moe_copy_expert(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t update_map) {
    return copy_impl(__func__, ctx, il, expert, slot, update_map, false);
}

int32_t saem_moe_copy_expert_async(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t update_map) {
    return copy_impl(__func__, ctx, il, expert, slot, update_map, true);
}

int32_t saem_moe_copy_experts_async(struct llama_context * ctx, const int32_t * copies, int32_t n) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        if (n < 0) {
            throw saem_error(SAEM_E_INVALID_ARG, "n < 0");
        }
        saem_moe_cache & c = need_cache(ctx);
        if (n > 0) {
            CHECK_PTR(copies);
            c.copy_experts_async(copies, n);
        }
        return SAEM_OK;
    });
}

int32_t saem_moe_set_slot_maps(struct llama_context * ctx, const int32_t * layers, const int32_t * expert_to_slot, int32_t n, int32_t n_expert) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        if (n < 0 || n_expert < 0) {
            throw saem_error(SAEM_E_INVALID_ARG, n < 0 ? "n < 0" : "n_expert < 0");
        }
        saem_moe_cache & c = need_cache(ctx);
        if (n > 0) {
            CHECK_PTR(layers);
            CHECK_PTR(expert_to_slot);
            for (int32_t i = 0; i < n; i++) {
                moe_layer(c, layers[i]);
            }
            c.set_maps(layers, expert_to_slot, n, n_expert);
        }
        return SAEM_OK;
    });
}

int32_t saem_moe_copy_query(struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        saem_moe_cache & c = need_cache(ctx);
        return c.copy_query() ? 1 : 0;
    });
}

int32_t saem_moe_copy_sync(struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        saem_moe_cache & c = need_cache(ctx);
        c.copy_sync();
        return SAEM_OK;
    });
}

int32_t saem_moe_set_counting(struct llama_context * ctx, int32_t mode) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        if (mode != SAEM_COUNT_OFF && mode != SAEM_COUNT_ON && mode != SAEM_COUNT_IDS) {
            throw saem_error(SAEM_E_INVALID_ARG, "counting mode " + std::to_string(mode) + " (0 off, 1 counts, 2 counts + ids)");
        }
        if (!model_has_experts(ctx)) {
            throw saem_error(SAEM_E_NOT_MOE, "the model has no expert layers");
        }
        saem_moe_cache * c = saem_get_or_create_cache(ctx);
        if ((c->counting != SAEM_COUNT_OFF) != (mode != SAEM_COUNT_OFF)) {
            c->topo_version++; // the count outputs are added / removed
        }
        c->counting = mode;
        return SAEM_OK;
    });
}

int32_t saem_moe_get_counting(const struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        const saem_moe_cache * c = saem_get_cache(ctx);
        return c ? c->counting : SAEM_COUNT_OFF;
    });
}

int32_t saem_moe_get_counts(const struct llama_context * ctx, int32_t il, int32_t which, int64_t * counts, int32_t n_expert) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        CHECK_PTR(counts);
        if (which != 0 && which != 1) {
            throw saem_error(SAEM_E_INVALID_ARG, "which must be 0 (last ubatch) or 1 (accumulated)");
        }
        const saem_moe_cache * c = saem_get_cache(ctx);
        if (!c) {
            saem_moe_layer_info info;
            saem_describe_layer(ctx, il, info);
            if (info.n_expert == 0) {
                throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(il) + " has no experts");
            }
            check_len("counts", n_expert, info.n_expert);
            std::fill(counts, counts + n_expert, 0);
            return SAEM_OK;
        }
        const saem_layer & L = moe_layer(*c, il);
        check_len("counts", n_expert, L.n_expert);
        const auto & v = which == 0 ? L.cnt_last : L.cnt_total;
        std::copy(v.begin(), v.end(), counts);
        return SAEM_OK;
    });
}

int32_t saem_moe_reset_counts(struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        saem_moe_cache * c = saem_get_cache(ctx);
        if (c) {
            for (auto & L : c->layers) {
                std::fill(L.cnt_total.begin(), L.cnt_total.end(), 0);
                std::fill(L.cnt_last .begin(), L.cnt_last .end(), 0);
                L.last_ids.clear();
                L.last_n_tokens = 0;
                L.last_slot_uses = 0;
            }
            c->counted_tokens = 0;
            c->publish_routing();
        }
        return SAEM_OK;
    });
}

int64_t saem_moe_counted_tokens(const struct llama_context * ctx) {
    int64_t n = 0;
    const int32_t rc = saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        const saem_moe_cache * c = saem_get_cache(ctx);
        n = c ? c->counted_tokens : 0;
        return SAEM_OK;
    });
    return rc < 0 ? rc : n;
}

// The cache whose last top-k ids the two readers below return (mode SAEM_COUNT_IDS only).
static const saem_moe_cache * ids_cache(const llama_context * ctx, int32_t cap) {
    if (cap < 0) {
        throw saem_error(SAEM_E_INVALID_ARG, "cap < 0");
    }
    const saem_moe_cache * c = saem_get_cache(ctx);
    if (!c || c->counting != SAEM_COUNT_IDS) {
        throw saem_error(SAEM_E_INVALID_ARG, "top-k ids are kept only with counting mode SAEM_COUNT_IDS (2)");
    }
    return c;
}

// The routing's shape (routing_shape) with what a caller of the int16 readers cannot be given refused.
static int64_t routing_fits(const saem_moe_cache & c, int32_t & nt, int32_t & nl, int32_t & nu, int64_t & slot_uses, int32_t & max_expert) {
    const int64_t need = c.routing_shape(nt, nl, nu, slot_uses, max_expert);
    if (nl == 0) {
        throw saem_error(SAEM_E_NOT_MOE, "the model has no expert layers");
    }
    if (max_expert > INT16_MAX) {
        throw saem_error(SAEM_E_UNSUPPORTED, "expert ids do not fit int16");
    }
    if (need > INT32_MAX) {
        throw saem_error(SAEM_E_INVALID_ARG, "the routing of this ubatch does not fit one call");
    }
    return need;
}

int32_t saem_moe_get_last_ids(const struct llama_context * ctx, int32_t il, int32_t * ids, int32_t cap, int32_t * n_tokens, int32_t * n_used) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        const saem_moe_cache * c = ids_cache(ctx, cap);
        const saem_layer & L = moe_layer(*c, il);
        const int32_t n = (int32_t) L.last_ids.size();
        const int32_t nt = n > 0 ? L.last_n_tokens : 0;
        if (n_tokens) { *n_tokens = nt; }
        if (n_used)   { *n_used   = nt > 0 ? n / nt : L.n_used; }
        if (cap > 0) {
            CHECK_PTR(ids);
            std::copy(L.last_ids.begin(), L.last_ids.begin() + std::min(cap, n), ids);
        }
        return n;
    });
}

int32_t saem_moe_get_last_routing(const struct llama_context * ctx, int16_t * out, int32_t cap, int32_t * n_tokens, int32_t * n_layers, int32_t * n_used,
        int64_t * n_slot_uses) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        const saem_moe_cache * c = ids_cache(ctx, cap);
        int32_t nt, nl, nu, max_expert;
        int64_t slot_uses;
        const int64_t need = routing_fits(*c, nt, nl, nu, slot_uses, max_expert);
        if (n_slot_uses) { *n_slot_uses = slot_uses; }
        if (n_tokens) { *n_tokens = nt; }
        if (n_layers) { *n_layers = nl; }
        if (n_used)   { *n_used   = nu; }
        if (need == 0 || cap < need) {
            return (int32_t) need;  // sizing call, or a buffer too small: nothing written
        }
        CHECK_PTR(out);
        c->write_routing(out, nt, nl, nu);
        return (int32_t) need;
    });
}

int32_t saem_moe_routing_sink(struct llama_context * ctx, int32_t cap, int64_t ** header, int16_t ** ids) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        CHECK_PTR(header);
        CHECK_PTR(ids);
        if (cap == 0) {  // off, in any counting mode
            if (saem_moe_cache * c = saem_get_cache(ctx)) {
                c->sink_header.clear();
                c->sink_header.shrink_to_fit();
                c->sink_ids.clear();
                c->sink_ids.shrink_to_fit();
            }
            *header = nullptr;
            *ids = nullptr;
            return SAEM_OK;
        }
        ids_cache(ctx, cap);  // refuses cap < 0 and a counting mode that keeps no ids
        saem_moe_cache * c = saem_get_cache(ctx);
        int32_t nt, nl, nu, max_expert;
        int64_t slot_uses;
        routing_fits(*c, nt, nl, nu, slot_uses, max_expert);  // refuses what the sink could not hold
        if (c->sink_header.empty()) {
            c->sink_header.assign(SAEM_SINK_HEADER, 0);
        }
        if ((int32_t) c->sink_ids.size() < cap) {
            c->sink_ids.assign(cap, (int16_t) -1);
        }
        c->publish_routing();
        *header = c->sink_header.data();
        *ids = c->sink_ids.data();
        return (int32_t) c->sink_ids.size();
    });
}

int32_t saem_moe_set_stock_min_batch(struct llama_context * ctx, int32_t n) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        if (n < 1) {
            throw saem_error(SAEM_E_INVALID_ARG, "stock_min_batch must be >= 1");
        }
        if (!model_has_experts(ctx)) {
            throw saem_error(SAEM_E_NOT_MOE, "the model has no expert layers");
        }
        saem_moe_cache * c = saem_get_or_create_cache(ctx);
        if (c->stock_min_batch != n) {
            c->stock_min_batch = n;
            c->topo_version++;
        }
        return SAEM_OK;
    });
}

int32_t saem_moe_get_stock_min_batch(const struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        const saem_moe_cache * c = saem_get_cache(ctx);
        if (c) {
            return c->stock_min_batch;
        }
        const char * env = getenv("GGML_OP_OFFLOAD_MIN_BATCH");
        return env && atoi(env) > 0 ? atoi(env) : 32;
    });
}

} // extern "C"
