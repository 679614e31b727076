// Internal C++ interface between the patched llama.cpp sources and native/.
//
// The patches (patches/0005, 0006, 0008) call exactly these functions; everything
// behind them lives in native/. Not part of the public C API (saem_native.h).
#pragma once

#include <cstdint>

struct ggml_backend_buffer_type;
struct ggml_tensor;
struct llm_graph_context;
class  llm_graph_result;
struct saem_moe_cache;

// One pass of the expert FFN in build_moe_ffn (see native/moe_graph.cpp).
struct saem_moe_branch {
    ggml_tensor * ids      = nullptr; // I32 [n_expert_used, n_tokens]: ids for this branch's MUL_MAT_IDs
    int32_t       mm_flags = 0;       // ggml_mul_mat_id_set_flags() for them (SKIP_NEG or 0)

    // expert weights [*, *, n_matrices] (device slots or the model's host tensors)
    ggml_tensor * up      = nullptr;
    ggml_tensor * gate    = nullptr;
    ggml_tensor * gate_up = nullptr;
    ggml_tensor * down    = nullptr;

    // per-expert biases / scales, always indexed by the EXPERT id (full copies on the device)
    ggml_tensor * up_b      = nullptr;
    ggml_tensor * gate_b    = nullptr;
    ggml_tensor * gate_up_b = nullptr;
    ggml_tensor * up_s      = nullptr;
    ggml_tensor * gate_s    = nullptr;
    ggml_tensor * down_s    = nullptr;
};

struct saem_moe_plan {
    int             n_branches = 0;
    saem_moe_branch br[2];
    ggml_tensor *   down_b = nullptr; // down bias, applied once after the branch outputs are summed
};

// Called by llm_graph_context::build_moe_ffn for every MoE FFN while a cache object is attached to
// the context. Adds the routing-count outputs when counting is on. Returns true (and fills plan)
// when the expert FFN must run as branches; false keeps the stock code path untouched.
bool saem_moe_graph_layer(saem_moe_cache * c, const llm_graph_context & g, int il,
        ggml_tensor * selected_experts,
        ggml_tensor * up_exps, ggml_tensor * gate_exps, ggml_tensor * gate_up_exps, ggml_tensor * down_exps,
        saem_moe_plan & plan);

// Graph-topology signature; a change forbids graph reuse (llm_graph_params::allow_reuse).
uint64_t saem_moe_graph_sig(const saem_moe_cache * c);

// Extra graph nodes the cache may add (llama_context::graph_max_nodes).
uint32_t saem_moe_graph_extra_nodes(const saem_moe_cache * c);

// llama_context::process_ubatch, around graph_compute.
void saem_moe_before_compute(saem_moe_cache * c);
void saem_moe_after_compute (saem_moe_cache * c, llm_graph_result * res);

// ~llama_context.
void saem_moe_cache_free(saem_moe_cache * c);

// llama_model_loader::create_tensor (patch 0008): an override to this buffer type puts the tensor
// in the CPU buffer type itself, never in an extra (repacked, AMX) one. A stand-in: never allocated
// from. saem_expert_host_buft() returns it where no GPU pinned buffer is wanted.
ggml_backend_buffer_type * saem_plain_cpu_buft();
