// saem_gguf expert cache: the build_moe_ffn hook (branch plan, map inputs, count outputs) and the
// per-ubatch counters. See docs/NATIVE.md.

#include "moe_cache.h"

#include "llama-graph.h"
#include "llama-model.h"
#include "llama-cparams.h"

#include "ggml-backend.h"

#include <cstring>

// Graph input holding, per layer, the two I32 maps (set from the cache at every ubatch) and the
// routing-id outputs read back after the compute. One per graph; found again via dynamic_cast.
class saem_graph_input : public llm_graph_input_i {
public:
    saem_graph_input(saem_moe_cache * cache, uint64_t sig, size_t n_layers)
        : cache(cache), sig(sig), t_map_dev(n_layers, nullptr), t_map_host(n_layers, nullptr), t_ids(n_layers, nullptr) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        for (size_t il = 0; il < t_map_dev.size(); ++il) {
            const saem_layer & L = cache->layers[il];
            if (t_map_dev[il]) {
                ggml_backend_tensor_set(t_map_dev[il], L.map_dev.data(), 0, ggml_nbytes(t_map_dev[il]));
            }
            if (t_map_host[il]) {
                ggml_backend_tensor_set(t_map_host[il], L.map_host.data(), 0, ggml_nbytes(t_map_host[il]));
            }
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        return params.saem == cache && params.saem_sig == sig;
    }

    saem_moe_cache * cache;
    const uint64_t   sig;

    std::vector<ggml_tensor *> t_map_dev;   // I32 [1, n_expert]: expert -> slot (zero slot / -1)
    std::vector<ggml_tensor *> t_map_host;  // I32 [1, n_expert]: expert -> expert or -1
    std::vector<ggml_tensor *> t_ids;       // I32 [n_used, n_tokens] contiguous top-k ids (outputs)
};

static saem_graph_input * find_input(llm_graph_result * res) {
    for (auto & inp : res->inputs) {
        if (auto * p = dynamic_cast<saem_graph_input *>(inp.get())) {
            return p;
        }
    }
    return nullptr;
}

static saem_graph_input * get_input(saem_moe_cache * c, const llm_graph_context & g) {
    saem_graph_input * p = find_input(g.res);
    if (!p) {
        p = static_cast<saem_graph_input *>(g.res->add_input(
                std::make_unique<saem_graph_input>(c, saem_moe_graph_sig(c), c->layers.size())));
    }
    return p;
}

// GGML_OP_MAP_CUSTOM1 (in place on the routed ids, one task): the RAM tier's read-ahead of the
// experts this ubatch routes to, issued after the router and before the expert matmuls that
// depend on this op, so their page faults wait on large reads already in flight instead of each
// starting its own (llama.cpp's mmap readaround). The ids pass through unchanged.
static void saem_route_prefetch_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(a);
    GGML_UNUSED(nth);
    if (ith == 0) {
        saem_ram_prefetch_routed(*static_cast<saem_layer *>(userdata), (const int32_t *) dst->data,
                                 ggml_nelements(dst));
    }
}

// a branch computing from the model's own (host) expert tensors with these ids and MUL_MAT_ID flags
static saem_moe_branch host_branch(const saem_layer & L, ggml_tensor * ids, int32_t mm_flags) {
    saem_moe_branch b;
    b.ids       = ids;
    b.mm_flags  = mm_flags;
    b.up        = L.h_up;
    b.gate      = L.h_gate;
    b.gate_up   = L.h_gate_up;
    b.down      = L.h_down;
    b.up_b      = L.h_up_b;
    b.gate_b    = L.h_gate_b;
    b.gate_up_b = L.h_gate_up_b;
    b.up_s      = L.h_up_s;
    b.gate_s    = L.h_gate_s;
    b.down_s    = L.h_down_s;
    return b;
}

uint64_t saem_moe_graph_sig(const saem_moe_cache * c) {
    return c ? c->topo_version : 0;
}

uint32_t saem_moe_graph_extra_nodes(const saem_moe_cache * c) {
    // per MoE layer: ids cont + reshapes + 2 map inputs + 2 get_rows, a second copy of the expert FFN
    // (3 MUL_MAT_ID, biases, scales, activation variants, views) and the merge: well under 64
    uint32_t n = 0;
    for (const auto & L : c->layers) {
        n += L.n_expert > 0 ? 64 : 0;
    }
    return n;
}

bool saem_moe_graph_layer(saem_moe_cache * c, const llm_graph_context & g, int il,
        ggml_tensor * selected_experts,
        ggml_tensor * up_exps, ggml_tensor * gate_exps, ggml_tensor * gate_up_exps, ggml_tensor * down_exps,
        saem_moe_plan & plan) {
    if (!c || il < 0 || il >= (int) c->layers.size()) {
        return false;
    }
    saem_layer & L = c->layers[il];
    // only the layer's own routed experts (not e.g. an arch's extra expert group)
    if (L.n_expert == 0 || down_exps != L.h_down || up_exps != L.h_up || gate_exps != L.h_gate || gate_up_exps != L.h_gate_up) {
        return false;
    }
    if (g.cparams.warmup) {
        return false; // warmup routes to all experts; no counts, stock graph
    }

    ggml_context * ctx0 = g.ctx0;
    const int64_t n_used   = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];

    ggml_tensor * ids_flat = nullptr; // contiguous [n_used, n_tokens]

    if (c->counting != SAEM_COUNT_OFF) {
        saem_graph_input * inp = get_input(c, g);
        ids_flat = ggml_cont(ctx0, selected_experts);
        g.cb(ids_flat, "saem_ids", il);
        ggml_set_output(ids_flat);
        ggml_build_forward_expand(g.gf, ids_flat);
        inp->t_ids[il] = ids_flat;
    }

    const bool stock_layer = !c->initialised || L.n_slots == 0 || L.mode == SAEM_MODE_STOCK;
    if (c->ram_route_prefetch && (stock_layer || n_tokens >= c->stock_min_batch)) {
        // every expert on the host: one branch, the model's own tensors, ids through the prefetch
        // op (the same ops on the same tensors as the stock graph, so the same results)
        if (!ids_flat) {
            ids_flat = ggml_cont(ctx0, selected_experts);
            g.cb(ids_flat, "saem_ids", il);
        }
        ggml_tensor * ids = ggml_map_custom1_inplace(ctx0, ids_flat, saem_route_prefetch_op, 1, &L);
        g.cb(ids, "saem_ram_prefetch", il);
        plan.br[0]   = host_branch(L, ids, 0);
        plan.down_b  = L.h_down_b;
        plan.n_branches = 1;
        return true;
    }
    if (stock_layer) {
        return false;
    }
    if (g.loras && !g.loras->empty()) {
        return false; // LoRA on expert tensors is not mirrored into the slots: stock graph
    }
    if (n_tokens >= c->stock_min_batch) {
        return false; // large ubatch: stock graph (op offload uploads the used experts)
    }

    const saem_device & d = c->devs[L.dev_idx];
    saem_graph_input * inp = get_input(c, g);

    if (!ids_flat) {
        ids_flat = ggml_cont(ctx0, selected_experts);
        g.cb(ids_flat, "saem_ids", il);
    }
    ggml_tensor * ids_1d = ggml_reshape_1d(ctx0, ids_flat, n_used * n_tokens);

    // device branch: expert -> slot (non-resident: -1 + skip flag on the CPU, the zero slot on a GPU)
    ggml_tensor * map_dev = ggml_new_tensor_2d(ctx0, GGML_TYPE_I32, 1, L.n_expert);
    ggml_set_input(map_dev);
    g.cb(map_dev, "saem_map_dev", il);
    inp->t_map_dev[il] = map_dev;
    ggml_tensor * ids_dev = ggml_reshape_2d(ctx0, ggml_get_rows(ctx0, map_dev, ids_1d), n_used, n_tokens);
    g.cb(ids_dev, "saem_ids_dev", il);

    saem_moe_branch & bd = plan.br[0];
    bd.ids       = ids_dev;
    bd.mm_flags  = (L.mode == SAEM_MODE_MIXED && !d.zero_slot) ? GGML_MUL_MAT_ID_FLAG_SKIP_NEG : 0;
    bd.up        = L.fused ? nullptr : L.d_mat[0];
    bd.gate      = (!L.fused && L.h_gate) ? L.d_mat[1] : nullptr;
    bd.gate_up   = L.fused ? L.d_mat[0] : nullptr;
    bd.down      = L.d_mat[L.n_mats - 1];
    bd.up_b      = L.d_up_b;
    bd.gate_b    = L.d_gate_b;
    bd.gate_up_b = L.d_gate_up_b;
    bd.up_s      = L.d_up_s;
    bd.gate_s    = L.d_gate_s;
    bd.down_s    = L.d_down_s;
    plan.down_b  = L.d_down_b;
    plan.n_branches = 1;

    if (L.mode == SAEM_MODE_MIXED) {
        // host branch: the model's tensors, resident experts skipped
        ggml_tensor * map_host = ggml_new_tensor_2d(ctx0, GGML_TYPE_I32, 1, L.n_expert);
        ggml_set_input(map_host);
        g.cb(map_host, "saem_map_host", il);
        inp->t_map_host[il] = map_host;
        ggml_tensor * host_ids = ggml_get_rows(ctx0, map_host, ids_1d);  // -1 where a slot serves
        if (c->ram_route_prefetch) {  // read ahead only what the host branch will read
            host_ids = ggml_map_custom1_inplace(ctx0, host_ids, saem_route_prefetch_op, 1, &L);
            g.cb(host_ids, "saem_ram_prefetch", il);
        }
        ggml_tensor * ids_host = ggml_reshape_2d(ctx0, host_ids, n_used, n_tokens);
        g.cb(ids_host, "saem_ids_host", il);

        plan.br[1] = host_branch(L, ids_host, GGML_MUL_MAT_ID_FLAG_SKIP_NEG);
        plan.n_branches = 2;
    }
    return true;
}

void saem_moe_after_compute(saem_moe_cache * c, llm_graph_result * res) {
    if (!c) {
        return;
    }
    c->record_compute();

    if (c->counting == SAEM_COUNT_OFF || !res) {
        return;
    }
    saem_graph_input * inp = find_input(res);
    if (!inp) {
        return;
    }
    bool synced = false;
    std::vector<int32_t> buf;
    int64_t n_tokens_ub = -1;
    for (size_t il = 0; il < inp->t_ids.size(); ++il) {
        ggml_tensor * t = inp->t_ids[il];
        if (!t) {
            continue;
        }
        if (!synced) {
            ggml_backend_sched_synchronize(saem_ctx_access::sched(*c->lctx));
            synced = true;
        }
        saem_layer & L = c->layers[il];
        const int64_t n_used   = t->ne[0];
        const int64_t n_tokens = t->ne[1];
        buf.resize(n_used * n_tokens);
        ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
        std::fill(L.cnt_last.begin(), L.cnt_last.end(), 0);
        // the uses a slot served: only a layer whose graph read the maps (t_map_dev), under the map
        // it read (no map changes between a compute and this)
        const bool slots_served = inp->t_map_dev[il] != nullptr;
        int64_t slot_uses = 0;
        for (int32_t e : buf) {
            if (e >= 0 && e < L.n_expert) {
                L.cnt_last[e]++;
                L.cnt_total[e]++;
                slot_uses += slots_served && L.slot_of[e] >= 0;
            }
        }
        L.last_slot_uses = slot_uses;
        if (c->counting == SAEM_COUNT_IDS) {
            L.last_ids = buf;
        } else {
            L.last_ids.clear();
        }
        L.last_n_tokens = (int) n_tokens;
        n_tokens_ub = n_tokens;
    }
    if (n_tokens_ub > 0) {
        c->counted_tokens += n_tokens_ub;
    }
    c->publish_routing();
}
