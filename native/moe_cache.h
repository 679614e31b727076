// Internal state of the saem_gguf expert cache (one per llama_context). See docs/NATIVE.md.
#pragma once

#include "saem_hooks.h"
#include "saem_native.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct llama_context;
struct llama_model;
struct saem_ram_state;  // ram_tier.cpp: readahead thread, locked ranges

// access to llama_context internals (friend of llama_context, see patches/0004)
struct saem_ctx_access {
    static saem_moe_cache *& cache(llama_context & c);
    static const llama_model & model(const llama_context & c);
    static ggml_backend_sched_t sched(const llama_context & c);
    static ggml_backend_t backend_for(const llama_context & c, ggml_backend_dev_t dev);
    static void need_reserve(llama_context & c);
    static void synchronize(llama_context & c);
};

// error carrying a SAEM_E_* code; the C API turns it into a return value + saem_last_error()
struct saem_error : std::runtime_error {
    int32_t code;
    saem_error(int32_t code, const std::string & msg) : std::runtime_error(msg), code(code) {}
};

enum saem_layer_mode : uint8_t {
    SAEM_MODE_STOCK   = 0, // no expert resident (or no slots): stock graph
    SAEM_MODE_MIXED   = 1, // some resident: device branch + host branch
    SAEM_MODE_ALL_DEV = 2, // every expert resident: device branch only
};

enum { SAEM_MAT_MAX = 3 };

// a device (GPU) that holds slots: copy stream + events
struct saem_device {
    ggml_backend_dev_t         dev     = nullptr;
    ggml_backend_buffer_type_t buft    = nullptr;
    bool                       is_host = true;     // CPU device: sync copies, aux tensors read in place
    bool                       zero_slot = false;  // non-resident rows hit an all-zero slot (GPU) instead
                                                   // of being skipped (CPU; SAEM_MOE_ZERO_SLOT=1 forces it,
                                                   // =0 skips on a GPU too: patch 0007)
    bool                       copy_aux = false;   // whole device copies of the per-expert biases/scales
                                                   // (GPU; SAEM_MOE_ZERO_SLOT=2 forces it on the CPU too)
    ggml_context *             ctx     = nullptr;  // metadata of this device's tensors
    ggml_backend_buffer_t      buf     = nullptr;  // slots + aux copies of all layers on this device
    // CPU device only: the slots of expert matrices the model holds repacked (CPU_REPACK, as stock
    // loads Q4_0 / Q4_K / ... experts on AVX2), in that buffer type too, so that a slot holds the
    // host tensor's bytes as they are and its MUL_MAT_ID runs the same repacked kernel
    ggml_backend_buffer_type_t buft_repacked = nullptr;
    ggml_context *             ctx_repacked  = nullptr;
    ggml_backend_buffer_t      buf_repacked  = nullptr;
    ggml_backend_t             copy_backend = nullptr; // own stream for async copies (GPU only)
    ggml_backend_event_t       ev_copy    = nullptr;   // recorded on copy_backend after async copies
    ggml_backend_event_t       ev_compute = nullptr;   // recorded on the compute backend after each graph
    bool                       ev_compute_valid = false;
    bool                       copy_pending = false;   // async copies issued, not yet waited on by a decode
    bool                       copy_unsynced = false;  // async copies issued, host not yet synced
};

struct saem_layer {
    int il       = -1;
    int n_expert = 0;
    int n_used   = 0;
    int n_slots  = 0;
    int dev_idx  = -1;   // into saem_moe_cache::devs (when n_slots > 0)

    // host (model) tensors; mats[] in copy order: gate_up|up, gate, down
    int           n_mats = 0;
    bool          fused  = false;
    ggml_tensor * h_up = nullptr, * h_gate = nullptr, * h_gate_up = nullptr, * h_down = nullptr;
    ggml_tensor * h_up_b = nullptr, * h_gate_b = nullptr, * h_gate_up_b = nullptr, * h_down_b = nullptr;
    ggml_tensor * h_up_s = nullptr, * h_gate_s = nullptr, * h_down_s = nullptr;
    ggml_tensor * h_mat[SAEM_MAT_MAX] = {};

    // device tensors: slot copies [ne0, ne1, n_slots (+1 zero slot on a GPU)] and whole aux copies
    ggml_tensor * d_mat[SAEM_MAT_MAX] = {};
    ggml_tensor * d_up_b = nullptr, * d_gate_b = nullptr, * d_gate_up_b = nullptr, * d_down_b = nullptr;
    ggml_tensor * d_up_s = nullptr, * d_gate_s = nullptr, * d_down_s = nullptr;

    // maps (graph inputs): dev ids (slot, or zero slot / -1), host ids (expert, or -1)
    std::vector<int32_t> map_dev;
    std::vector<int32_t> map_host;
    std::vector<int32_t> slot_of;  // expert -> slot or -1 (the user-visible map)
    std::vector<int32_t> owner;    // slot -> expert whose weights the slot holds, or -1
    int n_resident = 0;
    saem_layer_mode mode = SAEM_MODE_STOCK;

    // routing counters
    std::vector<int64_t> cnt_last;
    std::vector<int64_t> cnt_total;
    std::vector<int32_t> last_ids;  // [n_tokens][n_used]
    int last_n_tokens = 0;
    int64_t last_slot_uses = 0;     // of the last ubatch's (token, k) uses, those a slot served

    // RAM tier: routed experts the graph's prefetch op advised (one task per layer, so no race)
    uint64_t ram_route_prefetched = 0;

    void    rebuild_maps();          // mode/n_resident from slot_of
    size_t  expert_nbytes() const;
};

struct saem_moe_cache {
    llama_context * lctx = nullptr;

    std::vector<saem_layer> layers;   // one per model layer (n_expert == 0 for dense layers)
    std::vector<saem_device> devs;
    bool initialised = false;         // saem_moe_cache_init() succeeded with at least one slot

    int32_t  counting        = SAEM_COUNT_OFF;
    int64_t  counted_tokens  = 0;
    int32_t  stock_min_batch = 32;
    uint64_t topo_version    = 1;     // bumped on any topology change (sig)
    std::vector<int64_t> sink_header;    // saem_moe_routing_sink: SAEM_SINK_HEADER entries, empty when off
    std::vector<int16_t> sink_ids;       // its cap entries
    std::shared_ptr<saem_ram_state> ram;  // RAM tier state, made on first use (ram_tier.cpp)
    bool     ram_route_prefetch = false;  // graph op: madvise(WILLNEED) the routed experts before their matmuls

    explicit saem_moe_cache(llama_context * lctx);
    ~saem_moe_cache();

    void free_slots();                                     // drop devices/buffers, keep counters
    void init(const int32_t * n_slots, int32_t n_layers);  // throws saem_error
    void copy_expert(int il, int e, int s, bool update_map, bool async);
    void copy_experts_async(const int32_t * copies, int32_t n);   // [n][il, expert, slot], all checked first
    bool copy_query();
    void copy_sync();
    void set_map(int il, const int32_t * e2s);
    void set_maps(const int32_t * ils, const int32_t * e2s, int32_t n, int32_t n_expert);  // all checked first
    void layer_modes_changed();
    void wait_copies_on_compute();                         // before graph compute
    void record_compute();                                 // after graph compute
    // the last ubatch's routing as saem_moe_get_last_routing returns it (moe_cache.cpp)
    int64_t routing_shape(int32_t & nt, int32_t & nl, int32_t & nu, int64_t & slot_uses, int32_t & max_expert) const;
    void    write_routing(int16_t * out, int32_t nt, int32_t nl, int32_t nu) const;  // nt * nl * nu entries
    void    publish_routing();                             // into the sink, if on (throws nothing)

    saem_layer & layer(int il);                            // throws SAEM_E_LAYER
    const saem_layer & layer(int il) const;
};

// shared helpers (moe_cache.cpp)
saem_moe_cache * saem_get_cache(const llama_context * ctx);      // may be null
saem_moe_cache * saem_get_or_create_cache(llama_context * ctx);  // creates the counters-only object
bool saem_arch_supported(const llama_model & model, std::string & why);
// RAM tier (ram_tier.cpp): madvise(MADV_WILLNEED) the experts in ids[0..n) of layer L (the routed
// experts of a ubatch, called from the graph before their MUL_MAT_IDs)
void saem_ram_prefetch_routed(saem_layer & L, const int32_t * ids, int64_t n);
void saem_describe_layer(const llama_context * ctx, int il, saem_moe_layer_info & out); // throws saem_error
