// saem_gguf expert cache: layer discovery, slot allocation, host -> slot copies, events, counters.
// See docs/NATIVE.md for the design.

#include "moe_cache.h"

#include "llama-context.h"
#include "llama-model.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

//
// llama_context access (saem_ctx_access is a friend of llama_context)
//

saem_moe_cache *& saem_ctx_access::cache(llama_context & c) { return c.saem; }
const llama_model & saem_ctx_access::model(const llama_context & c) { return c.model; }
ggml_backend_sched_t saem_ctx_access::sched(const llama_context & c) { return c.sched.get(); }
void saem_ctx_access::need_reserve(llama_context & c) { c.sched_need_reserve = true; }
void saem_ctx_access::synchronize(llama_context & c) { c.synchronize(); }

ggml_backend_t saem_ctx_access::backend_for(const llama_context & c, ggml_backend_dev_t dev) {
    for (const auto & b : c.backends) {
        if (ggml_backend_get_device(b.get()) == dev) {
            return b.get();
        }
    }
    return nullptr;
}

saem_moe_cache * saem_get_cache(const llama_context * ctx) {
    return saem_ctx_access::cache(const_cast<llama_context &>(*ctx));
}

saem_moe_cache * saem_get_or_create_cache(llama_context * ctx) {
    saem_moe_cache *& c = saem_ctx_access::cache(*ctx);
    if (!c) {
        c = new saem_moe_cache(ctx);
        // the cache may add graph nodes: let the next decode re-reserve with a larger node budget
        saem_ctx_access::need_reserve(*ctx);
    }
    return c;
}

//
// architectures: the graph hook is generic (every arch goes through build_moe_ffn), but only the
// ones below were verified bit-exact by tests/test_native_*.py; others are refused at cache init.
//

bool saem_arch_supported(const llama_model & model, std::string & why) {
    const std::string arch_name = llm_arch_name(model.arch);
    // SAEM_MOE_ARCH_DENY=name[,name..]: treat these as unsupported (exercises the refusal path)
    if (const char * deny = getenv("SAEM_MOE_ARCH_DENY")) {
        const std::string list = std::string(",") + deny + ",";
        if (list.find("," + arch_name + ",") != std::string::npos) {
            why = "architecture '" + arch_name + "' is not supported by the expert cache (SAEM_MOE_ARCH_DENY)";
            return false;
        }
    }
    switch (model.arch) {
        case LLM_ARCH_LLAMA:      // Mixtral-style
        case LLM_ARCH_QWEN2MOE:   // + shared expert (outside build_moe_ffn, untouched)
        case LLM_ARCH_QWEN3MOE:
        case LLM_ARCH_OLMOE:
        case LLM_ARCH_DEEPSEEK2:  // fused gate_up when present, exp_probs_b, group-limited routing
        case LLM_ARCH_OPENAI_MOE: // gpt-oss: biases, softmax-weight routing, swiglu_oai
        case LLM_ARCH_GLM4_MOE:
            return true;
        default:
            break;
    }
    const char * env = getenv("SAEM_MOE_ALLOW_ANY_ARCH");
    if (env && atoi(env) != 0) {
        return true;
    }
    why = "architecture '" + arch_name +
          "' is not supported by the expert cache yet (verified: llama, qwen2moe, qwen3moe, olmoe, "
          "deepseek2, gpt-oss, glm4moe; SAEM_MOE_ALLOW_ANY_ARCH=1 overrides, unverified)";
    return false;
}

//
// saem_layer
//

size_t saem_layer::expert_nbytes() const {
    size_t n = 0;
    for (int k = 0; k < n_mats; ++k) {
        n += h_mat[k]->nb[2];
    }
    return n;
}

//
// saem_moe_cache
//

static void scan_layer(const llama_model & model, int il, saem_layer & L) {
    const llama_layer & ml = model.layers[il];
    L.il = il;
    L.h_up      = ml.ffn_up_exps;
    L.h_gate    = ml.ffn_gate_exps;
    L.h_gate_up = ml.ffn_gate_up_exps;
    L.h_down    = ml.ffn_down_exps;
    L.h_up_b      = ml.ffn_up_exps_b;
    L.h_gate_b    = ml.ffn_gate_exps_b;
    L.h_gate_up_b = ml.ffn_gate_up_exps_b;
    L.h_down_b    = ml.ffn_down_exps_b;
    L.h_up_s   = ml.ffn_up_exps_s;
    L.h_gate_s = ml.ffn_gate_exps_s;
    L.h_down_s = ml.ffn_down_exps_s;

    if (!L.h_down || (!L.h_up && !L.h_gate_up)) {
        L.n_expert = 0;
        L.n_used   = 0;
        L.n_mats   = 0;
        return;
    }
    L.n_expert = (int) L.h_down->ne[2];
    L.n_used   = (int) model.hparams.n_expert_used(il);
    L.fused    = L.h_gate_up != nullptr;
    L.n_mats   = 0;
    if (L.fused) {
        L.h_mat[L.n_mats++] = L.h_gate_up;
    } else {
        L.h_mat[L.n_mats++] = L.h_up;
        if (L.h_gate) {
            L.h_mat[L.n_mats++] = L.h_gate;
        }
    }
    L.h_mat[L.n_mats++] = L.h_down;
}

saem_moe_cache::saem_moe_cache(llama_context * lctx) : lctx(lctx) {
    const llama_model & model = saem_ctx_access::model(*lctx);
    layers.resize(model.layers.size());
    for (size_t il = 0; il < layers.size(); ++il) {
        saem_layer & L = layers[il];
        scan_layer(model, (int) il, L);
        L.cnt_last .assign(L.n_expert, 0);
        L.cnt_total.assign(L.n_expert, 0);
        L.slot_of  .assign(L.n_expert, -1);
        L.map_host .resize(L.n_expert);
        L.map_dev  .resize(L.n_expert);
        L.rebuild_maps();
    }
    const char * env = getenv("GGML_OP_OFFLOAD_MIN_BATCH");
    if (env && atoi(env) > 0) {
        stock_min_batch = atoi(env);
    }
}

saem_moe_cache::~saem_moe_cache() {
    free_slots();
}

saem_layer & saem_moe_cache::layer(int il) {
    if (il < 0 || il >= (int) layers.size()) {
        throw saem_error(SAEM_E_LAYER, "layer " + std::to_string(il) + " out of range [0, " + std::to_string(layers.size()) + ")");
    }
    return layers[il];
}

const saem_layer & saem_moe_cache::layer(int il) const {
    return const_cast<saem_moe_cache *>(this)->layer(il);
}

void saem_layer::rebuild_maps() {
    n_resident = 0;
    for (int e = 0; e < n_expert; ++e) {
        if (slot_of[e] >= 0) {
            n_resident++;
        }
    }
    if (n_slots == 0 || n_resident == 0) {
        mode = SAEM_MODE_STOCK;
    } else if (n_resident == n_expert) {
        mode = SAEM_MODE_ALL_DEV;
    } else {
        mode = SAEM_MODE_MIXED;
    }
}

// fill the graph-input maps of a layer (needs to know whether its device has a zero slot)
static void fill_input_maps(saem_layer & L, bool zero_slot) {
    const int32_t none_dev = zero_slot ? L.n_slots : -1; // zero slot on a GPU, skip flag on the CPU
    for (int e = 0; e < L.n_expert; ++e) {
        const int32_t s = L.slot_of[e];
        L.map_dev [e] = s >= 0 ? s  : none_dev;
        L.map_host[e] = s >= 0 ? -1 : e;
    }
}

void saem_moe_cache::free_slots() {
    // nothing may still read the slots or write them
    for (auto & d : devs) {
        if (d.copy_backend) {
            ggml_backend_synchronize(d.copy_backend);
        }
    }
    for (auto & d : devs) {
        if (d.ev_copy)    { ggml_backend_event_free(d.ev_copy); }
        if (d.ev_compute) { ggml_backend_event_free(d.ev_compute); }
        if (d.copy_backend) { ggml_backend_free(d.copy_backend); }
        if (d.buf) { ggml_backend_buffer_free(d.buf); }
        if (d.ctx) { ggml_free(d.ctx); }
        if (d.buf_repacked) { ggml_backend_buffer_free(d.buf_repacked); }
        if (d.ctx_repacked) { ggml_free(d.ctx_repacked); }
    }
    devs.clear();
    for (auto & L : layers) {
        L.n_slots = 0;
        L.dev_idx = -1;
        for (auto & t : L.d_mat) { t = nullptr; }
        L.d_up_b = L.d_gate_b = L.d_gate_up_b = L.d_down_b = nullptr;
        L.d_up_s = L.d_gate_s = L.d_down_s = nullptr;
        L.owner.clear();
        std::fill(L.slot_of.begin(), L.slot_of.end(), -1);
        L.rebuild_maps();
        fill_input_maps(L, false);
    }
    initialised = false;
}

// The buffer type ggml-cpu repacks weights in (repack.cpp; its name is its identity: the type is not
// exported from ggml-cpu). Its tensors hold rows interleaved in groups, whole groups within one
// expert, so an expert's bytes are at the same offsets as in the file, but only ggml-cpu's repacked
// kernels read them.
static bool is_cpu_repack(ggml_backend_buffer_type_t buft) {
    return buft && strcmp(ggml_backend_buft_name(buft), "CPU_REPACK") == 0;
}

// Can the cache copy tensor t's experts into slots on a device (to_cpu: the CPU)? Plain host
// memory always; a repacked tensor into CPU slots only (they are repacked alike).
static bool host_copyable(const ggml_tensor * t, bool to_cpu, std::string & why) {
    if (!t) {
        return true;
    }
    if (!t->buffer || !t->data) {
        why = std::string("tensor ") + t->name + " is not allocated";
        return false;
    }
    const bool repacked = is_cpu_repack(ggml_backend_buffer_get_type(t->buffer));
    if (!ggml_backend_buffer_is_host(t->buffer) && !(repacked && to_cpu)) {
        why = std::string("tensor ") + t->name + " is in buffer '" + ggml_backend_buffer_name(t->buffer) + "', not " +
              (repacked ? "plain host memory a device can copy from (a repacked layout: keep the expert tensors "
                          "in plain host memory with a saem_expert_host_buft() override)"
                        : "host memory (an AMX or other extra buffer, or a device buffer: keep the expert tensors in "
                          "host memory with a saem_expert_host_buft() override, or load the model with "
                          "use_extra_bufts=false)");
        return false;
    }
    if (!ggml_is_contiguous(t)) {
        why = std::string("tensor ") + t->name + " is not contiguous";
        return false;
    }
    return true;
}

// the device a layer's slots live on (model.dev_layer; the CPU when it has none)
static ggml_backend_dev_t slot_device(const llama_model & model, int il) {
    ggml_backend_dev_t dev = model.dev_layer(il);
    return dev ? dev : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

static bool device_is_cpu(ggml_backend_dev_t dev) {
    return ggml_backend_buft_is_host(ggml_backend_dev_buffer_type(dev));
}

static bool layer_host_copyable(const saem_layer & L, bool to_cpu, std::string & why) {
    const ggml_tensor * ts[] = { L.h_up, L.h_gate, L.h_gate_up, L.h_down, L.h_up_b, L.h_gate_b,
                                 L.h_gate_up_b, L.h_down_b, L.h_up_s, L.h_gate_s, L.h_down_s };
    for (const ggml_tensor * t : ts) {
        if (!host_copyable(t, to_cpu, why)) {
            return false;
        }
    }
    return true;
}

static bool buft_is_pinned(ggml_backend_buffer_type_t buft) {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        const auto type = ggml_backend_dev_type(d);
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            if (ggml_backend_dev_host_buffer_type(d) == buft) {
                return true;
            }
        }
    }
    return false;
}

void saem_describe_layer(const llama_context * ctx, int il, saem_moe_layer_info & out) {
    const llama_model & model = saem_ctx_access::model(*ctx);
    if (il < 0 || il >= (int) model.layers.size()) {
        throw saem_error(SAEM_E_LAYER, "layer " + std::to_string(il) + " out of range [0, " + std::to_string(model.layers.size()) + ")");
    }
    saem_layer tmp;
    const saem_moe_cache * c = saem_get_cache(ctx);
    const saem_layer * L = nullptr;
    if (c) {
        L = &c->layers[il];
    } else {
        scan_layer(model, il, tmp);
        L = &tmp;
    }
    memset(&out, 0, sizeof(out));
    out.il            = il;
    out.n_expert      = L->n_expert;
    out.n_expert_used = L->n_used;
    out.n_slots       = L->n_slots;
    out.n_resident    = L->n_resident;
    out.n_mats        = L->n_mats;
    out.fused_gate_up = L->fused ? 1 : 0;
    for (int k = 0; k < SAEM_MAT_MAX; ++k) {
        out.type[k] = k < L->n_mats ? (int32_t) L->h_mat[k]->type : -1;
        out.mat_nbytes[k] = k < L->n_mats ? (uint64_t) L->h_mat[k]->nb[2] : 0;
    }
    out.expert_nbytes = L->n_expert ? L->expert_nbytes() : 0;
    const ggml_tensor * aux[] = { L->h_up_b, L->h_gate_b, L->h_gate_up_b, L->h_down_b, L->h_up_s, L->h_gate_s, L->h_down_s };
    for (const ggml_tensor * t : aux) {
        out.aux_nbytes += t ? ggml_nbytes(t) : 0;
    }
    std::string why;
    ggml_backend_dev_t dev = slot_device(model, il);
    out.device_is_host = device_is_cpu(dev) ? 1 : 0;
    out.host_copyable = L->n_expert > 0 && layer_host_copyable(*L, out.device_is_host != 0, why) ? 1 : 0;
    out.host_pinned   = out.host_copyable && buft_is_pinned(ggml_backend_buffer_get_type(L->h_down->buffer)) ? 1 : 0;
    for (int k = 0; k < L->n_mats; ++k) {
        const ggml_tensor * h = L->h_mat[k];
        if (h->buffer && is_cpu_repack(ggml_backend_buffer_get_type(h->buffer))) {
            out.host_repacked |= 1 << k;
        }
    }
    snprintf(out.device, sizeof(out.device), "%s", ggml_backend_dev_name(dev));
}

void saem_moe_cache::init(const int32_t * n_slots, int32_t n_layers) {
    const llama_model & model = saem_ctx_access::model(*lctx);

    if (n_layers != (int32_t) layers.size()) {
        throw saem_error(SAEM_E_INVALID_ARG, "n_slots has " + std::to_string(n_layers) + " entries, the model has " +
                std::to_string(layers.size()) + " layers");
    }
    bool any_moe   = false;
    bool any_slots = false;
    for (int il = 0; il < n_layers; ++il) {
        const saem_layer & L = layers[il];
        any_moe = any_moe || L.n_expert > 0;
        if (n_slots[il] < 0) {
            throw saem_error(SAEM_E_SLOT, "layer " + std::to_string(il) + ": negative slot count");
        }
        if (n_slots[il] > 0 && L.n_expert == 0) {
            throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(il) + " has no experts, it takes 0 slots");
        }
        if (n_slots[il] > L.n_expert) {
            throw saem_error(SAEM_E_SLOT, "layer " + std::to_string(il) + ": " + std::to_string(n_slots[il]) +
                    " slots for " + std::to_string(L.n_expert) + " experts");
        }
        any_slots = any_slots || n_slots[il] > 0;
    }
    if (!any_moe) {
        throw saem_error(SAEM_E_NOT_MOE, std::string("model (") + llm_arch_name(model.arch) + ") has no expert layers");
    }
    if (any_slots) {
        std::string why;
        if (!saem_arch_supported(model, why)) {
            throw saem_error(SAEM_E_UNSUPPORTED, why);
        }
        for (int il = 0; il < n_layers; ++il) {
            if (n_slots[il] > 0 && !layer_host_copyable(layers[il], device_is_cpu(slot_device(model, il)), why)) {
                throw saem_error(SAEM_E_NOT_HOST, "layer " + std::to_string(il) + ": " + why);
            }
        }
    }

    // nothing in flight may use the old slots
    saem_ctx_access::synchronize(*lctx);
    free_slots();
    topo_version++;

    if (!any_slots) {
        return;
    }

    // the CUDA skip of negative ids (patch 0007) covers the quantized paths only
    bool all_quantized = true;
    for (int il = 0; il < n_layers; ++il) {
        for (int k = 0; n_slots[il] > 0 && k < layers[il].n_mats; ++k) {
            all_quantized = all_quantized && ggml_is_quantized(layers[il].h_mat[k]->type);
        }
    }

    // group the layers by device, one tensor context + buffer per device
    for (int il = 0; il < n_layers; ++il) {
        if (n_slots[il] == 0) {
            continue;
        }
        ggml_backend_dev_t dev = slot_device(model, il);
        int idx = -1;
        for (size_t i = 0; i < devs.size(); ++i) {
            if (devs[i].dev == dev) {
                idx = (int) i;
            }
        }
        if (idx < 0) {
            saem_device d;
            d.dev     = dev;
            d.buft    = ggml_backend_dev_buffer_type(dev);
            d.is_host = ggml_backend_buft_is_host(d.buft);
            // SAEM_MOE_ZERO_SLOT=1 (zero slot) / =2 (+ aux copies): the GPU scheme on the CPU (test
            // hook); =0: non-resident rows skipped on a GPU too (patch 0007), where the CUDA skip
            // is implemented: quantized expert matrices (mmvq/mmq), else the zero slot stays
            const char * zs = getenv("SAEM_MOE_ZERO_SLOT");
            const int zsv = zs ? atoi(zs) : -1;
            d.zero_slot = zsv >= 1 || (!d.is_host && (zsv != 0 || !all_quantized));
            d.copy_aux  = !d.is_host || zsv >= 2;
            ggml_init_params ip = {
                /*.mem_size   =*/ ggml_tensor_overhead() * 16 * layers.size(),
                /*.mem_buffer =*/ nullptr,
                /*.no_alloc   =*/ true,
            };
            d.ctx = ggml_init(ip);
            if (!d.ctx) {
                free_slots();
                throw saem_error(SAEM_E_ALLOC, "ggml_init failed");
            }
            devs.push_back(d);
            idx = (int) devs.size() - 1;
        }
        saem_layer & L = layers[il];
        L.dev_idx = idx;
        L.n_slots = n_slots[il];
    }

    for (auto & L : layers) {
        if (L.n_slots == 0) {
            continue;
        }
        saem_device & d = devs[L.dev_idx];
        const int64_t n_alloc = L.n_slots + (d.zero_slot ? 1 : 0); // + the zero slot
        for (int k = 0; k < L.n_mats; ++k) {
            const ggml_tensor * h = L.h_mat[k];
            ggml_context * ctx = d.ctx;
            ggml_backend_buffer_type_t hbuft = ggml_backend_buffer_get_type(h->buffer);
            if (is_cpu_repack(hbuft)) { // d is the CPU (checked above)
                if (!d.ctx_repacked) {
                    ggml_init_params ip = { ggml_tensor_overhead() * SAEM_MAT_MAX * layers.size(), nullptr, true };
                    d.ctx_repacked  = ggml_init(ip);
                    d.buft_repacked = hbuft;
                    if (!d.ctx_repacked) {
                        free_slots();
                        throw saem_error(SAEM_E_ALLOC, "ggml_init failed");
                    }
                }
                ctx = d.ctx_repacked;
            }
            // ggml's repacked MUL_MAT_ID takes 3-D weights only, and a 1-slot tensor is 2-D
            // (ggml_n_dims): such a layer gets a second slot that is never mapped
            const int64_t n_mat = ctx == d.ctx_repacked ? std::max<int64_t>(n_alloc, 2) : n_alloc;
            L.d_mat[k] = ggml_new_tensor_3d(ctx, h->type, h->ne[0], h->ne[1], n_mat);
            ggml_format_name(L.d_mat[k], "saem.blk.%d.slots.%d", L.il, k);
        }
        auto dup = [&](ggml_tensor * h) -> ggml_tensor * {
            if (!h) {
                return nullptr;
            }
            if (!d.copy_aux) {
                return h; // the CPU reads the model's own tensor
            }
            ggml_tensor * t = ggml_dup_tensor(d.ctx, h);
            ggml_format_name(t, "saem.%s", h->name);
            return t;
        };
        L.d_up_b = dup(L.h_up_b); L.d_gate_b = dup(L.h_gate_b); L.d_gate_up_b = dup(L.h_gate_up_b); L.d_down_b = dup(L.h_down_b);
        L.d_up_s = dup(L.h_up_s); L.d_gate_s = dup(L.h_gate_s); L.d_down_s = dup(L.h_down_s);
        L.owner.assign(L.n_slots, -1);
        std::fill(L.slot_of.begin(), L.slot_of.end(), -1);
        L.rebuild_maps();
        fill_input_maps(L, d.zero_slot);
    }

    // a context without tensors gets no buffer (ggml_backend_alloc_ctx_tensors_from_buft returns NULL)
    auto alloc = [this](ggml_context * ctx, ggml_backend_buffer_type_t buft) -> ggml_backend_buffer_t {
        if (!ctx || !ggml_get_first_tensor(ctx)) {
            return nullptr;
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (!buf) {
            const std::string name = ggml_backend_buft_name(buft);
            free_slots();
            throw saem_error(SAEM_E_ALLOC, "failed to allocate the expert slots in " + name);
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(buf, 0); // the zero slot (and any padding) must be all zeros
        return buf;
    };
    for (auto & d : devs) {
        d.buf          = alloc(d.ctx, d.buft);
        d.buf_repacked = alloc(d.ctx_repacked, d.buft_repacked);
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(d.dev, &props);
        if (!d.is_host && props.caps.async && props.caps.events) {
            d.copy_backend = ggml_backend_dev_init(d.dev, nullptr);
            d.ev_copy      = ggml_backend_event_new(d.dev);
            d.ev_compute   = ggml_backend_event_new(d.dev);
            if (!d.copy_backend || !d.ev_copy || !d.ev_compute) {
                // no async support: copies will be synchronous
                if (d.ev_copy)    { ggml_backend_event_free(d.ev_copy);    d.ev_copy = nullptr; }
                if (d.ev_compute) { ggml_backend_event_free(d.ev_compute); d.ev_compute = nullptr; }
                if (d.copy_backend) { ggml_backend_free(d.copy_backend); d.copy_backend = nullptr; }
            }
        }
    }

    // whole copies of the per-expert biases / scales on the device
    for (auto & L : layers) {
        if (L.n_slots == 0 || !devs[L.dev_idx].copy_aux) {
            continue;
        }
        const std::pair<ggml_tensor *, ggml_tensor *> aux[] = {
            { L.d_up_b, L.h_up_b }, { L.d_gate_b, L.h_gate_b }, { L.d_gate_up_b, L.h_gate_up_b }, { L.d_down_b, L.h_down_b },
            { L.d_up_s, L.h_up_s }, { L.d_gate_s, L.h_gate_s }, { L.d_down_s, L.h_down_s },
        };
        for (const auto & [dt, ht] : aux) {
            if (dt) {
                ggml_backend_tensor_set(dt, ht->data, 0, ggml_nbytes(ht));
            }
        }
    }

    initialised = true;
    topo_version++;
}

void saem_moe_cache::layer_modes_changed() {
    topo_version++;
}

static void check_slot_args(const saem_moe_cache & c, const saem_layer & L, int e, int s) {
    if (!c.initialised) {
        throw saem_error(SAEM_E_NO_CACHE, "the expert cache is not initialised (saem_moe_cache_init)");
    }
    if (L.n_expert == 0) {
        throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(L.il) + " has no experts");
    }
    if (e < 0 || e >= L.n_expert) {
        throw saem_error(SAEM_E_EXPERT, "layer " + std::to_string(L.il) + ": expert " + std::to_string(e) +
                " out of range [0, " + std::to_string(L.n_expert) + ")");
    }
    if (s < 0 || s >= L.n_slots) {
        throw saem_error(SAEM_E_SLOT, "layer " + std::to_string(L.il) + ": slot " + std::to_string(s) +
                " out of range [0, " + std::to_string(L.n_slots) + ")");
    }
}

// Move expert e's weights from the host into slot s of L; nothing else changes. Returns true when
// the copy was queued on the device's copy stream (the caller records the copy event). Before the
// first queued copy of a batch (wait_compute) the stream waits for the last submitted compute,
// which may still read the slot.
static bool move_expert(saem_moe_cache & c, saem_layer & L, saem_device & d, int e, int s, bool async, bool wait_compute) {
    if (d.is_host) {
        // CPU slots: decode is synchronous on the CPU, nothing can be reading the slot now. A memcpy,
        // as the CPU buffer's set_tensor does, which a repacked slot's set_tensor would not do (it
        // repacks a whole tensor): expert e's bytes, repacked or not, are at the same offsets.
        for (int k = 0; k < L.n_mats; ++k) {
            const ggml_tensor * h = L.h_mat[k];
            memcpy((char *) L.d_mat[k]->data + (size_t) s * h->nb[2], (const char *) h->data + (size_t) e * h->nb[2], h->nb[2]);
        }
        return false;
    }
    if (async && d.copy_backend) {
        if (wait_compute && d.ev_compute_valid) {
            ggml_backend_event_wait(d.copy_backend, d.ev_compute);
        }
        for (int k = 0; k < L.n_mats; ++k) {
            const ggml_tensor * h = L.h_mat[k];
            ggml_backend_tensor_set_async(d.copy_backend, L.d_mat[k], (const char *) h->data + (size_t) e * h->nb[2],
                    (size_t) s * h->nb[2], h->nb[2]);
        }
        return true;
    }
    // synchronous: wait for in-flight graphs and async copies, then copy
    ggml_backend_t cb = saem_ctx_access::backend_for(*c.lctx, d.dev);
    if (cb) {
        ggml_backend_synchronize(cb);
    }
    if (d.copy_backend) {
        ggml_backend_synchronize(d.copy_backend);
        d.copy_unsynced = false;
    }
    for (int k = 0; k < L.n_mats; ++k) {
        const ggml_tensor * h = L.h_mat[k];
        ggml_backend_tensor_set(L.d_mat[k], (const char *) h->data + (size_t) e * h->nb[2], (size_t) s * h->nb[2], h->nb[2]);
    }
    return false;
}

// The copy stream of d has queued copies: the next decode waits for them on the device.
static void queued_copies(saem_device & d) {
    ggml_backend_event_record(d.ev_copy, d.copy_backend);
    d.copy_pending  = true;
    d.copy_unsynced = true;
}

// Whoever is mapped to slot s of L goes back to the host: its weights are being replaced (before
// the data moves, so a failed copy leaves no map entry on the slot).
static void unmap_slot(saem_layer & L, int s) {
    for (int e2 = 0; e2 < L.n_expert; ++e2) {
        if (L.slot_of[e2] == s) {
            L.slot_of[e2] = -1;
        }
    }
}

// The graph's input maps of L from its slot_of; returns whether the layer's mode changed (only
// rebuild_maps sets the mode, so the mode before this call is the one the last graph was built for).
static bool refresh_maps(const saem_moe_cache & c, saem_layer & L) {
    const saem_layer_mode old_mode = L.mode;
    L.rebuild_maps();
    fill_input_maps(L, L.dev_idx >= 0 && c.devs[L.dev_idx].zero_slot);
    return L.mode != old_mode;
}

void saem_moe_cache::copy_expert(int il, int e, int s, bool update_map, bool async) {
    saem_layer & L = layer(il);
    check_slot_args(*this, L, e, s);
    saem_device & d = devs[L.dev_idx];

    unmap_slot(L, s);
    if (move_expert(*this, L, d, e, s, async, true)) {
        queued_copies(d);
    }
    L.owner[s] = e;
    if (update_map) {
        L.slot_of[e] = s;
    }
    if (refresh_maps(*this, L)) {
        layer_modes_changed();
    }
}

void saem_moe_cache::copy_experts_async(const int32_t * copies, int32_t n) {
    // every entry is checked before anything moves: a bad one leaves the cache as it was
    for (int32_t i = 0; i < n; ++i) {
        check_slot_args(*this, layer(copies[3 * i]), copies[3 * i + 1], copies[3 * i + 2]);
    }
    std::vector<char> dev_queued(devs.size(), 0);
    std::vector<int> touched;                       // layers, in first-touch order
    for (int32_t i = 0; i < n; ++i) {
        saem_layer & L = layer(copies[3 * i]);
        const int e = copies[3 * i + 1];
        const int s = copies[3 * i + 2];
        if (std::find(touched.begin(), touched.end(), L.il) == touched.end()) {
            touched.push_back(L.il);
        }
        unmap_slot(L, s);
        // one wait for the last compute and one copy event per device for the whole batch: the
        // stream runs its copies in order, so the event after the last covers them all
        if (move_expert(*this, L, devs[L.dev_idx], e, s, true, !dev_queued[L.dev_idx])) {
            dev_queued[L.dev_idx] = 1;
        }
        L.owner[s] = e;
    }
    for (size_t di = 0; di < devs.size(); ++di) {
        if (dev_queued[di]) {
            queued_copies(devs[di]);
        }
    }
    bool changed = false;
    for (const int il : touched) {
        changed = refresh_maps(*this, layer(il)) || changed;
    }
    if (changed) {
        layer_modes_changed();
    }
}

bool saem_moe_cache::copy_query() {
    bool done = true;
    for (auto & d : devs) {
        if (d.copy_unsynced && d.ev_copy) {
            if (ggml_backend_event_query(d.ev_copy)) {
                d.copy_unsynced = false;
            } else {
                done = false;
            }
        }
    }
    return done;
}

void saem_moe_cache::copy_sync() {
    for (auto & d : devs) {
        if (d.copy_unsynced && d.ev_copy) {
            ggml_backend_event_synchronize(d.ev_copy);
        }
        d.copy_unsynced = false;
    }
}

// Throws unless e2s (n_expert entries) is a valid map for L: each slot at most once, and only for
// the expert it holds.
static void check_map(const saem_moe_cache & c, const saem_layer & L, const int32_t * e2s) {
    if (!c.initialised) {
        throw saem_error(SAEM_E_NO_CACHE, "the expert cache is not initialised (saem_moe_cache_init)");
    }
    if (L.n_expert == 0) {
        throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(L.il) + " has no experts");
    }
    const int il = L.il;
    std::vector<int32_t> used(L.n_slots, -1);
    for (int e = 0; e < L.n_expert; ++e) {
        const int32_t s = e2s[e];
        if (s == -1) {
            continue;
        }
        if (s < 0 || s >= L.n_slots) {
            throw saem_error(SAEM_E_SLOT, "layer " + std::to_string(il) + ": expert " + std::to_string(e) + " -> slot " +
                    std::to_string(s) + " out of range [-1, " + std::to_string(L.n_slots) + ")");
        }
        if (used[s] >= 0) {
            throw saem_error(SAEM_E_MAP, "layer " + std::to_string(il) + ": slot " + std::to_string(s) + " mapped by experts " +
                    std::to_string(used[s]) + " and " + std::to_string(e));
        }
        if (L.owner[s] != e) {
            throw saem_error(SAEM_E_MAP, "layer " + std::to_string(il) + ": slot " + std::to_string(s) + " holds expert " +
                    std::to_string(L.owner[s]) + ", not " + std::to_string(e) + " (copy it first)");
        }
        used[s] = e;
    }
}

// Put a checked map in force; returns whether the layer's mode changed.
static bool apply_map(const saem_moe_cache & c, saem_layer & L, const int32_t * e2s) {
    std::copy(e2s, e2s + L.n_expert, L.slot_of.begin());
    return refresh_maps(c, L);
}

void saem_moe_cache::set_map(int il, const int32_t * e2s) {
    saem_layer & L = layer(il);
    check_map(*this, L, e2s);
    if (apply_map(*this, L, e2s)) {
        layer_modes_changed();
    }
}

void saem_moe_cache::set_maps(const int32_t * ils, const int32_t * e2s, int32_t n, int32_t n_expert) {
    // every map is checked before any is set: a bad one leaves every map as it was
    for (int32_t i = 0; i < n; ++i) {
        const saem_layer & L = layer(ils[i]);
        if (L.n_expert != 0 && L.n_expert != n_expert) {
            throw saem_error(SAEM_E_INVALID_ARG, "expert_to_slot has " + std::to_string(n_expert) +
                    " entries per layer, layer " + std::to_string(L.il) + " has " + std::to_string(L.n_expert) + " experts");
        }
        check_map(*this, L, e2s + (size_t) i * n_expert);
        for (int32_t j = 0; j < i; ++j) {
            if (ils[j] == ils[i]) {
                throw saem_error(SAEM_E_INVALID_ARG, "layer " + std::to_string(ils[i]) + " given twice");
            }
        }
    }
    bool changed = false;
    for (int32_t i = 0; i < n; ++i) {
        changed = apply_map(*this, layer(ils[i]), e2s + (size_t) i * n_expert) || changed;
    }
    if (changed) {
        layer_modes_changed();
    }
}

void saem_moe_cache::wait_copies_on_compute() {
    for (auto & d : devs) {
        if (d.copy_pending && d.ev_copy) {
            ggml_backend_t cb = saem_ctx_access::backend_for(*lctx, d.dev);
            if (cb) {
                ggml_backend_event_wait(cb, d.ev_copy); // device-side wait, the host goes on
            } else {
                ggml_backend_event_synchronize(d.ev_copy);
            }
        }
        d.copy_pending = false;
    }
}

void saem_moe_cache::record_compute() {
    for (auto & d : devs) {
        if (d.ev_compute) {
            ggml_backend_t cb = saem_ctx_access::backend_for(*lctx, d.dev);
            if (cb) {
                ggml_backend_event_record(d.ev_compute, cb);
                d.ev_compute_valid = true;
            }
        }
    }
}

//
// the last ubatch's routing: every MoE layer's last top-k ids, token-major [n_tokens][n_layers][n_used]
//

int64_t saem_moe_cache::routing_shape(int32_t & nt, int32_t & nl, int32_t & nu, int64_t & slot_uses, int32_t & max_expert) const {
    nt = nl = nu = max_expert = 0;
    slot_uses = 0;
    for (const saem_layer & L : layers) {
        if (L.n_expert == 0) {
            continue;
        }
        nl++;
        nu = std::max(nu, L.n_used);
        max_expert = std::max(max_expert, L.n_expert);
        if (!L.last_ids.empty()) {
            nt = std::max(nt, L.last_n_tokens);
            slot_uses += L.last_slot_uses;
        }
    }
    return (int64_t) nt * nl * nu;
}

void saem_moe_cache::write_routing(int16_t * out, int32_t nt, int32_t nl, int32_t nu) const {
    std::fill(out, out + (int64_t) nt * nl * nu, (int16_t) -1);
    int32_t l = 0;
    for (const saem_layer & L : layers) {
        if (L.n_expert == 0) {
            continue;
        }
        const int32_t lt = L.last_ids.empty() ? 0 : L.last_n_tokens;
        const int32_t lu = lt > 0 ? (int32_t) L.last_ids.size() / lt : 0;
        for (int32_t t = 0; t < lt; t++) {
            // a layer that computed fewer tokens (the last one: only rows whose logits are
            // wanted) fills the ubatch's last rows
            int16_t * row = out + ((int64_t) (nt - lt + t) * nl + l) * nu;
            for (int32_t k = 0; k < lu; k++) {
                row[k] = (int16_t) L.last_ids[(size_t) t * lu + k];
            }
        }
        l++;
    }
}

void saem_moe_cache::publish_routing() {
    if (sink_header.empty()) {
        return;
    }
    int32_t nt, nl, nu, max_expert;
    int64_t slot_uses;
    const int64_t need = routing_shape(nt, nl, nu, slot_uses, max_expert);
    int64_t * h = sink_header.data();
    h[SAEM_SINK_NEED]        = need;
    h[SAEM_SINK_N_TOKENS]    = nt;
    h[SAEM_SINK_N_LAYERS]    = nl;
    h[SAEM_SINK_N_USED]      = nu;
    h[SAEM_SINK_N_SLOT_USES] = slot_uses;
    // ids that do not fit int16 were refused when the sink was made
    if (need > 0 && need <= (int64_t) sink_ids.size()) {
        write_routing(sink_ids.data(), nt, nl, nu);
    }
    h[SAEM_SINK_SERIAL]++;
}

//
// hooks called by the patched llama_context
//

void saem_moe_before_compute(saem_moe_cache * c) {
    if (c) {
        c->wait_copies_on_compute();
    }
}

void saem_moe_cache_free(saem_moe_cache * c) {
    delete c;
}
