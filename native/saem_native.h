// saem_gguf native C API, compiled into libllama (see CMakeLists.txt) so it can reach llama.cpp
// internals. Mirrored one-to-one by saem_gguf/native_api.py; keep the two in step.
//
// Per-expert residency for MoE models: the expert tensors of a MoE layer stay in host memory (the
// model's own tensors); a per-layer cache of N "slots" in the layer's device memory holds copies of
// some experts, and a per-layer expert -> slot map says which. At every decode, tokens routed to a
// mapped expert compute from its slot on the device, the others compute in place on the CPU from the
// host tensors, and the two partial results are summed before the next layer (docs/NATIVE.md).
//
// Conventions
//   * Every int32_t-returning function returns SAEM_OK (0) or a value >= 0 documented with it on
//     success, and a negative SAEM_E_* code on failure; saem_last_error() then holds a message
//     (per thread). No call aborts the process on bad arguments.
//   * "layer" is the model layer index il in [0, saem_moe_n_layers()); layers without experts have
//     n_expert == 0 and accept only 0 slots.
//   * Not thread-safe with respect to llama_decode() on the same context: call these between decodes.
//   * Map changes and copies take effect at the next llama_decode(); the graph is rebuilt only when a
//     layer's mode (no expert resident / some / all) changes, a plain map change reuses it.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SAEM_NATIVE_ABI_VERSION 8

#if defined(_WIN32)
#    define SAEM_API __declspec(dllexport)
#else
#    define SAEM_API __attribute__((visibility("default")))
#endif

struct llama_context;
struct llama_model_params;

// status codes
#define SAEM_OK                  0
#define SAEM_E_INVALID_ARG      -1  // NULL pointer, wrong array length, bad mode value
#define SAEM_E_LAYER            -2  // layer index out of range
#define SAEM_E_EXPERT           -3  // expert index out of range
#define SAEM_E_SLOT             -4  // slot index out of range (or the layer has no slots)
#define SAEM_E_NO_CACHE         -5  // saem_moe_cache_init() has not been called
#define SAEM_E_NOT_MOE          -6  // the model (or this layer) has no experts
#define SAEM_E_UNSUPPORTED      -7  // architecture / tensor layout not supported by the cache
#define SAEM_E_NOT_HOST         -8  // expert tensors not in plain host memory (repacked or device)
#define SAEM_E_MAP              -9  // invalid map: slot used twice, or slot does not hold that expert
#define SAEM_E_ALLOC           -10  // device memory allocation failed
#define SAEM_E_BACKEND         -11  // backend failure (copy, event)
#define SAEM_E_INTERNAL        -12  // unexpected C++ exception
#define SAEM_E_OS              -13  // an OS call refused (mlock, madvise, mincore); the message has errno's text

// Version string of the saem_gguf native layer, e.g. "saem-native 0.2.0 (llama.cpp 0c1e570)".
// Its presence proves the patched library (not a stock libllama) is the one loaded.
SAEM_API const char * saem_native_version(void);

// ABI version of this header; Python refuses a library whose ABI differs.
SAEM_API int32_t saem_native_abi_version(void);

// Message of the last failing call on this thread ("" if none).
SAEM_API const char * saem_last_error(void);

// Host buffer type to keep expert tensors in (for llama_model_tensor_buft_override.buft): the pinned
// host buffer type of the first GPU when want_pinned != 0 and a GPU backend exists, else a stand-in
// for the CPU buffer type that keeps the tensors in the CPU buffer itself (mapped under mmap) and
// out of the extra buffer types (repacked, AMX) an override to the CPU buffer type would consider
// (patch 0008): every other weight may then load with extra buffer types, as stock loads it.
// *is_pinned (may be NULL) says which. Never NULL.
SAEM_API void * saem_expert_host_buft(int32_t want_pinned, int32_t * is_pinned);

// 1 when this build's CPU backend has ggml's AMX kernels (compiled for a CPU with AMX) but an AMX
// tile instruction faults here, tried once per process in a forked child: some virtual machines
// report AMX and grant the tile state, then fault on its first use (llama.cpp issue 20824), and
// llama.cpp then crashes on the first prompt of a model whose quantized matrices went to the AMX
// buffer. 0 otherwise (no AMX kernels, the tiles work, or the probe could not run).
SAEM_API int32_t saem_cpu_amx_tiles_fault(void);

// Regex matching every expert tensor name (ffn_{up,gate,down,gate_up}_exps and their biases/scales),
// for llama_model_tensor_buft_override.pattern. Static storage.
SAEM_API const char * saem_expert_tensor_regex(void);

struct saem_moe_layer_info {
    int32_t  il;
    int32_t  n_expert;        // 0 for a layer without experts
    int32_t  n_expert_used;
    int32_t  n_slots;         // current cache slots of the layer (0 before cache init)
    int32_t  n_resident;      // experts currently mapped to a slot
    int32_t  n_mats;          // expert matrices: 3 (up, gate, down) or 2 (gate_up, down) or 2 (up, down)
    int32_t  fused_gate_up;   // 1 if the layer uses a fused ffn_gate_up_exps tensor
    int32_t  host_copyable;   // 1 if the cache can copy the expert tensors into the layer's slots: plain
                              // host memory, or (slots on the CPU) ggml-cpu's repacked layout
    int32_t  host_pinned;     // 1 if they are in a GPU's pinned host buffer (async copies overlap)
    int32_t  device_is_host;  // 1 if the layer's device (where slots live) is the CPU
    int32_t  host_repacked;   // bit k set: matrix k is in ggml-cpu's repacked layout (CPU_REPACK), as
                              // llama.cpp loads Q4_0 / Q4_K / IQ4_NL / MXFP4 experts on AVX2 CPUs
    int32_t  type[3];         // ggml_type of matrix 0..n_mats-1 (-1 unused)
    uint64_t mat_nbytes[3];   // bytes of one expert in matrix 0..n_mats-1 (0 unused)
    uint64_t expert_nbytes;   // bytes of one expert, all matrices (what one copy moves)
    uint64_t aux_nbytes;      // bytes of the per-expert bias/scale tensors copied whole at init
    char     device[64];      // name of the layer's device, e.g. "CUDA0" or "CPU"
};

// Number of model layers (including layers without experts), or < 0.
SAEM_API int32_t saem_moe_n_layers(const struct llama_context * ctx);

// Describe layer il. Works before cache init.
SAEM_API int32_t saem_moe_get_layer_info(const struct llama_context * ctx, int32_t il, struct saem_moe_layer_info * out);

// (Re)initialise the expert cache: n_slots[il] slots for each layer il (n_layers entries, 0 allowed,
// must be 0 for layers without experts). Slots are allocated once, in the layer's device buffer type
// (a CPU buffer on a CPU-only build). All maps start all-host, all slots empty. Fails, leaving no
// cache, with SAEM_E_UNSUPPORTED for an architecture not verified (docs/NATIVE.md), SAEM_E_NOT_HOST
// when a layer with slots has expert tensors outside plain host memory, SAEM_E_ALLOC when out of
// device memory. All-zero n_slots frees the cache.
SAEM_API int32_t saem_moe_cache_init(struct llama_context * ctx, const int32_t * n_slots, int32_t n_layers);

// 1 if a cache is initialised, 0 if not.
SAEM_API int32_t saem_moe_cache_is_init(const struct llama_context * ctx);

// Set layer il's map: expert_to_slot[e] = slot, or -1 to compute expert e on the host (n_expert
// entries). A slot may appear once, and only for the expert it holds (saem_moe_get_slot_owner).
SAEM_API int32_t saem_moe_set_slot_map(struct llama_context * ctx, int32_t il, const int32_t * expert_to_slot, int32_t n_expert);

// Read layer il's map into expert_to_slot (n_expert entries).
SAEM_API int32_t saem_moe_get_slot_map(const struct llama_context * ctx, int32_t il, int32_t * expert_to_slot, int32_t n_expert);

// Read which expert each slot of layer il holds (-1 = empty), n_slots entries.
SAEM_API int32_t saem_moe_get_slot_owner(const struct llama_context * ctx, int32_t il, int32_t * slot_to_expert, int32_t n_slots);

// Copy expert `expert` of layer il from host memory into `slot`. Whatever expert was mapped to the
// slot goes back to the host at once (its map entry becomes -1). With update_map != 0 the expert is
// mapped to the slot. The synchronous version returns when the data is in the slot. The async version
// queues the copy on a separate copy stream (waiting, on the device, for the last submitted decode
// to finish with the slots) and returns; the next decode waits on the device, not the host, for it.
// On a CPU-only build, or a layer whose device is the CPU, the async version copies synchronously.
SAEM_API int32_t saem_moe_copy_expert      (struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t update_map);
SAEM_API int32_t saem_moe_copy_expert_async(struct llama_context * ctx, int32_t il, int32_t expert, int32_t slot, int32_t update_map);

// n async copies in one call, in order: copies[3 i], copies[3 i + 1], copies[3 i + 2] = il, expert,
// slot of copy i, each as saem_moe_copy_expert_async(ctx, il, expert, slot, 0). Every entry is
// checked before any copy starts (an error leaves the cache as it was); on a device the batch waits
// once for the last submitted decode and records one copy event. One call for a decode step's
// decisions instead of one per copy.
SAEM_API int32_t saem_moe_copy_experts_async(struct llama_context * ctx, const int32_t * copies, int32_t n);

// Set the maps of n layers in one call: layers[i] gets expert_to_slot[i * n_expert ...] (n_expert
// entries each, the layers' expert count), each as saem_moe_set_slot_map. Every map is checked
// before any is set (an error leaves every map as it was); a layer may appear once.
SAEM_API int32_t saem_moe_set_slot_maps(struct llama_context * ctx, const int32_t * layers, const int32_t * expert_to_slot, int32_t n, int32_t n_expert);

// 1 if all async copies issued so far have completed, 0 if some are in flight.
SAEM_API int32_t saem_moe_copy_query(struct llama_context * ctx);

// Block the host until all async copies issued so far have completed.
SAEM_API int32_t saem_moe_copy_sync(struct llama_context * ctx);

// Routing counters, read from a graph output (no eval callback):
//   SAEM_COUNT_OFF   no counting (default, no graph change)
//   SAEM_COUNT_ON    per-layer per-expert counts of the last ubatch and accumulated since reset
//   SAEM_COUNT_IDS   as ON, and keep the per-token top-k ids of the last ubatch
// Counting works with or without a cache.
#define SAEM_COUNT_OFF 0
#define SAEM_COUNT_ON  1
#define SAEM_COUNT_IDS 2
SAEM_API int32_t saem_moe_set_counting(struct llama_context * ctx, int32_t mode);
SAEM_API int32_t saem_moe_get_counting(const struct llama_context * ctx);

// counts[e] for layer il (n_expert entries): which = 0 last ubatch, 1 accumulated since reset.
SAEM_API int32_t saem_moe_get_counts(const struct llama_context * ctx, int32_t il, int32_t which, int64_t * counts, int32_t n_expert);

// Zero the accumulated counts (and the number of counted ubatches/tokens) of all layers.
SAEM_API int32_t saem_moe_reset_counts(struct llama_context * ctx);

// Tokens counted since the last reset (sum over ubatches), or < 0.
SAEM_API int64_t saem_moe_counted_tokens(const struct llama_context * ctx);

// Top-k expert ids of the last ubatch for layer il (mode SAEM_COUNT_IDS): writes up to cap ints,
// token-major ([n_tokens][n_expert_used]), sets *n_tokens and *n_used (may be NULL); returns the
// number of ints the full ids need (call with cap 0 to size the buffer).
SAEM_API int32_t saem_moe_get_last_ids(const struct llama_context * ctx, int32_t il, int32_t * ids, int32_t cap, int32_t * n_tokens, int32_t * n_used);

// Top-k expert ids of the last ubatch for every MoE layer at once (mode SAEM_COUNT_IDS): int16,
// token-major [n_tokens][n_layers][n_used], MoE layers in model order. A layer that computed fewer
// tokens (llama.cpp runs the last layer only for the rows whose logits are wanted) fills the
// ubatch's last rows; every other entry is -1. Sets *n_tokens, *n_layers, *n_used (may be NULL)
// and returns the number of int16 the array needs; writes it only when cap >= that number (call
// with cap 0 to size the buffer). One call per decoded token instead of one per layer.
// *n_slot_uses (may be NULL): how many of those (token, layer, k) uses a slot served, under the
// maps that ubatch ran with (0 for a layer on the stock graph), so a caller need not look the ids
// up in its own copy of the maps.
SAEM_API int32_t saem_moe_get_last_routing(const struct llama_context * ctx, int16_t * out, int32_t cap, int32_t * n_tokens, int32_t * n_layers, int32_t * n_used,
                                           int64_t * n_slot_uses);

// The same routing without a call per decoded token (mode SAEM_COUNT_IDS): a buffer the native
// layer owns, where after every compute that counts (and after saem_moe_reset_counts) it writes
// what saem_moe_get_last_routing would return at that moment. *header -> int64_t[SAEM_SINK_HEADER]
// (the SAEM_SINK_* fields below), *ids -> int16_t[capacity], written only when the ubatch's
// routing fits (need <= capacity; else read it with saem_moe_get_last_routing). Returns the
// capacity: at least cap (a sink already that large is kept, so its pointers stay the same; a
// larger cap moves it, and pointers from earlier calls are then invalid). The header is filled at
// once with the current routing. cap 0 turns the sink off (both pointers NULL, returns 0). The
// pointers stay valid until then or until the context is freed. Why: from Python every call costs
// tens of microseconds after a decode (docs/POLICIES.md, per-token cost); reading memory does not.
#define SAEM_SINK_SERIAL      0  // +1 at every write (a reader can tell a new ubatch from the last)
#define SAEM_SINK_NEED        1  // int16 entries the routing needs: n_tokens * n_layers * n_used
#define SAEM_SINK_N_TOKENS    2
#define SAEM_SINK_N_LAYERS    3
#define SAEM_SINK_N_USED      4
#define SAEM_SINK_N_SLOT_USES 5
#define SAEM_SINK_HEADER      6
SAEM_API int32_t saem_moe_routing_sink(struct llama_context * ctx, int32_t cap, int64_t ** header, int16_t ** ids);

// Ubatches with n_tokens >= n use the stock graph (no cache; on a GPU build llama.cpp then uploads
// the used experts itself, op offload). Default 32 (GGML_OP_OFFLOAD_MIN_BATCH). n >= 1.
SAEM_API int32_t saem_moe_set_stock_min_batch(struct llama_context * ctx, int32_t n);
SAEM_API int32_t saem_moe_get_stock_min_batch(const struct llama_context * ctx);

// ---- RAM tier (native/ram_tier.cpp, docs/RAM_TIER.md) ----------------------------------------
// With the model memory-mapped (llama.cpp's default on the CPU), each expert tensor is a view of the
// GGUF file's read-only shared mapping, so the kernel's page cache decides which experts are in RAM.
// These calls let the caller decide: where each (layer, expert) lies in the mapping, read it ahead
// of use, release it, ask how much of it is resident, and lock the non-expert weights in RAM. None
// changes a byte the model computes with (advice on read-only file pages). Linux; layer/expert
// arguments as above. Callable with or without an expert cache.

// 1 if every expert tensor lies in llama.cpp's file mapping (buffer "CPU_Mapped"), 0 if not
// (loaded without mmap, repacked, or on a device; saem_last_error() then says which tensor and why).
SAEM_API int32_t saem_ram_experts_mapped(const struct llama_context * ctx);

// The bytes of expert `expert` of layer il: one range per expert matrix, in saem_moe_layer_info's
// order (gate_up|up, gate, down): addr[k] its first byte in this process, nbytes[k] its length
// (= mat_nbytes[k]). Writes min(cap, n_mats) ranges and returns n_mats (cap 0 sizes).
SAEM_API int32_t saem_ram_expert_ranges(const struct llama_context * ctx, int32_t il, int32_t expert,
                                        uint64_t * addr, uint64_t * nbytes, int32_t cap);

// Read n experts of layer il ahead of use (every page holding a byte of theirs):
//   SAEM_RAM_PREFETCH_MADVISE  madvise(MADV_WILLNEED): the kernel queues readahead and returns
//   SAEM_RAM_PREFETCH_THREAD   queued for the context's readahead thread, which faults the pages in
//                              (MADV_POPULATE_READ, Linux >= 5.14; else one read per page)
// Experts not in the mapping: SAEM_E_NOT_HOST.
#define SAEM_RAM_PREFETCH_MADVISE 0
#define SAEM_RAM_PREFETCH_THREAD  1
SAEM_API int32_t saem_ram_prefetch(struct llama_context * ctx, int32_t il, const int32_t * experts, int32_t n, int32_t method);

// Read-ahead of the routed experts inside the graph (on != 0): after each MoE layer's router, an
// op issues madvise(MADV_WILLNEED) for the experts the ubatch routes to, before the expert
// matmuls that read them (layers computed on the host; results unchanged). Off by default.
SAEM_API int32_t saem_ram_set_route_prefetch(struct llama_context * ctx, int32_t on);

// Routed experts the graph's read-ahead has advised since the context was made (each expert once
// per layer and ubatch), or < 0.
SAEM_API int64_t saem_ram_route_prefetched(const struct llama_context * ctx);

// Block until the readahead thread has finished what was queued (at once if it has nothing).
SAEM_API int32_t saem_ram_prefetch_wait(struct llama_context * ctx);

// Release n experts of layer il: advise the pages wholly inside their ranges (a page shared with
// another tensor stays). Returns the advice applied:
//   SAEM_RAM_RELEASE_AUTO      the first of PAGEOUT, COLD, DONTNEED this kernel accepts
//   SAEM_RAM_RELEASE_PAGEOUT   madvise(MADV_PAGEOUT): reclaim now (Linux >= 5.4)
//   SAEM_RAM_RELEASE_COLD      madvise(MADV_COLD): move to the inactive list, reclaimed first (>= 5.4)
//   SAEM_RAM_RELEASE_DONTNEED  madvise(MADV_DONTNEED): unmap from this process; the clean pages stay
//                              cached, unmapped, where reclaim finds them before mapped ones
#define SAEM_RAM_RELEASE_AUTO     0
#define SAEM_RAM_RELEASE_PAGEOUT  1
#define SAEM_RAM_RELEASE_COLD     2
#define SAEM_RAM_RELEASE_DONTNEED 3
SAEM_API int32_t saem_ram_release(struct llama_context * ctx, int32_t il, const int32_t * experts, int32_t n, int32_t advice);

// Pages of the expert's ranges resident in RAM (mincore) and how many pages they span.
SAEM_API int32_t saem_ram_expert_residency(const struct llama_context * ctx, int32_t il, int32_t expert,
                                           uint64_t * resident_pages, uint64_t * total_pages);

// mlock the pages of every non-expert weight tensor in host memory (a page shared with an expert
// tensor included), replacing any earlier lock of this context; *locked_bytes (may be NULL) = bytes
// locked. Refused (RLIMIT_MEMLOCK, EPERM, ENOMEM): SAEM_E_OS with the limit in the message, and
// nothing stays locked. The lock ends with the context or saem_ram_unlock_non_expert().
SAEM_API int32_t saem_ram_lock_non_expert(struct llama_context * ctx, uint64_t * locked_bytes);
SAEM_API int32_t saem_ram_unlock_non_expert(struct llama_context * ctx);

#ifdef __cplusplus
}
#endif
