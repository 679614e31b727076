// saem_gguf RAM tier: the expert tensors of a memory-mapped GGUF as byte ranges of the mapping, and
// the OS calls that read them ahead of use, release them, ask what is resident and lock the
// non-expert weights (saem_native.h "RAM tier", docs/RAM_TIER.md).
//
// llama.cpp maps the file read-only and shared, and on the CPU its "CPU_Mapped" buffers point into
// that mapping, so an expert's rows of ffn_{gate_up,up,gate,down}_exps are the page-cache pages of
// its bytes in the file: advice on those addresses is advice on the file's cached pages.

#include "api_guard.h"
#include "moe_cache.h"

#include "llama-context.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

// a page-aligned [begin, end) address range
struct page_range {
    uintptr_t begin = 0;
    uintptr_t end   = 0;
};

size_t page_size() {
    static const size_t ps = (size_t) sysconf(_SC_PAGESIZE);
    return ps;
}

// the pages that hold any byte of [addr, addr + n)
page_range pages_covering(uintptr_t addr, size_t n) {
    const uintptr_t ps = page_size();
    return { addr / ps * ps, (addr + n + ps - 1) / ps * ps };
}

// the pages wholly inside [addr, addr + n) (empty if none): advice that drops pages must not touch
// a page shared with a neighbouring tensor (it may be a locked non-expert weight)
page_range pages_inside(uintptr_t addr, size_t n) {
    const uintptr_t ps = page_size();
    const uintptr_t b = (addr + ps - 1) / ps * ps;
    const uintptr_t e = (addr + n) / ps * ps;
    return e > b ? page_range{ b, e } : page_range{ b, b };
}

std::string errno_text(int err) {
    return std::string(strerror(err)) + " (errno " + std::to_string(err) + ")";
}

bool is_expert_tensor(const saem_layer & L, const ggml_tensor * t) {
    const ggml_tensor * mine[] = { L.h_up, L.h_gate, L.h_gate_up, L.h_down, L.h_up_b, L.h_gate_b,
                                   L.h_gate_up_b, L.h_down_b, L.h_up_s, L.h_gate_s, L.h_down_s };
    return std::find(std::begin(mine), std::end(mine), t) != std::end(mine);
}

bool in_mapping(const ggml_tensor * t) {
    return t->buffer && t->data && strcmp(ggml_backend_buffer_name(t->buffer), "CPU_Mapped") == 0;
}

const saem_layer & expert_layer(const saem_moe_cache & c, int32_t il, int32_t expert) {
    const saem_layer & L = c.layer(il);
    if (L.n_expert == 0) {
        throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(il) + " has no experts");
    }
    if (expert < 0 || expert >= L.n_expert) {
        throw saem_error(SAEM_E_EXPERT, "expert " + std::to_string(expert) + " out of range [0, " +
                std::to_string(L.n_expert) + ")");
    }
    return L;
}

// byte ranges (addr, nbytes) of one expert: its slice of each expert matrix
std::vector<std::pair<uintptr_t, size_t>> expert_bytes(const saem_layer & L, int expert) {
    std::vector<std::pair<uintptr_t, size_t>> out;
    for (int k = 0; k < L.n_mats; ++k) {
        const ggml_tensor * t = L.h_mat[k];
        out.emplace_back((uintptr_t) t->data + (size_t) expert * t->nb[2], (size_t) t->nb[2]);
    }
    return out;
}

} // namespace

// Per-context RAM tier state: the readahead thread and the locked ranges (owned by saem_moe_cache,
// so it ends with the context).
struct saem_ram_state {
    std::mutex              mu;
    std::condition_variable work_cv;
    std::condition_variable idle_cv;
    std::deque<page_range>  queue;
    bool                    busy = false;
    bool                    stop = false;
    std::thread             worker;
    std::vector<page_range> locked;

    ~saem_ram_state() {
        {
            std::lock_guard<std::mutex> lk(mu);
            stop = true;
        }
        work_cv.notify_all();
        if (worker.joinable()) {
            worker.join();
        }
        unlock_all();
    }

    void unlock_all() {
        for (const page_range & r : locked) {
            munlock((void *) r.begin, r.end - r.begin);
        }
        locked.clear();
    }

    void enqueue(const std::vector<page_range> & ranges) {
        {
            std::lock_guard<std::mutex> lk(mu);
            queue.insert(queue.end(), ranges.begin(), ranges.end());
            if (!worker.joinable()) {
                worker = std::thread([this] { run(); });
            }
        }
        work_cv.notify_one();
    }

    void wait_idle() {
        std::unique_lock<std::mutex> lk(mu);
        idle_cv.wait(lk, [this] { return queue.empty() && !busy; });
    }

    // populate each queued range: MADV_POPULATE_READ faults the whole range in with one call
    // (Linux >= 5.14); older kernels refuse it (EINVAL) and get one read per page instead
    void run() {
        bool populate_read = true;
        for (;;) {
            page_range r;
            {
                std::unique_lock<std::mutex> lk(mu);
                work_cv.wait(lk, [this] { return stop || !queue.empty(); });
                if (stop) {
                    return;
                }
                r = queue.front();
                queue.pop_front();
                busy = true;
            }
#ifdef MADV_POPULATE_READ
            if (populate_read && madvise((void *) r.begin, r.end - r.begin, MADV_POPULATE_READ) != 0) {
                populate_read = errno != EINVAL;  // unknown advice: this kernel predates it
            }
            if (!populate_read)
#endif
            {
                volatile uint8_t sink = 0;
                for (uintptr_t p = r.begin; p < r.end; p += page_size()) {
                    sink ^= *(const volatile uint8_t *) p;
                }
                (void) sink;
            }
            {
                std::lock_guard<std::mutex> lk(mu);
                busy = false;
                if (queue.empty()) {
                    idle_cv.notify_all();
                }
            }
        }
    }
};

static saem_ram_state & saem_ram_state_of(saem_moe_cache & c) {
    if (!c.ram) {
        c.ram = std::make_shared<saem_ram_state>();
    }
    return *c.ram;
}

// throws unless every expert tensor lies in llama.cpp's file mapping
static void need_mapped(const saem_moe_cache & c) {
    bool any = false;
    for (const saem_layer & L : c.layers) {
        for (int k = 0; k < L.n_mats; ++k) {
            const ggml_tensor * t = L.h_mat[k];
            if (!in_mapping(t)) {
                throw saem_error(SAEM_E_NOT_HOST, std::string("expert tensor ") + t->name + " is in buffer '" +
                        (t->buffer ? ggml_backend_buffer_name(t->buffer) : "none") +
                        "', not in the model file's mapping (loaded without mmap, repacked, or on a device)");
            }
            any = true;
        }
    }
    if (!any) {
        throw saem_error(SAEM_E_NOT_MOE, "the model has no expert layers");
    }
}

// The cache and layer il for a call on experts[0..n) of it: arguments checked, experts in the mapping.
static std::pair<saem_moe_cache *, const saem_layer *> mapped_layer(llama_context * ctx, int32_t il,
                                                                    const int32_t * experts, int32_t n) {
    if (n < 0 || (n > 0 && !experts)) {
        throw saem_error(SAEM_E_INVALID_ARG, "experts is NULL or n < 0");
    }
    saem_moe_cache & c = *saem_get_or_create_cache(ctx);
    const saem_layer & L = c.layer(il);
    if (L.n_expert == 0) {
        throw saem_error(SAEM_E_NOT_MOE, "layer " + std::to_string(il) + " has no experts");
    }
    for (int32_t i = 0; i < n; ++i) {
        expert_layer(c, il, experts[i]);
    }
    need_mapped(c);
    return { &c, &L };
}

// advice ladder of SAEM_RAM_RELEASE_AUTO, strongest first
static int release_advice_os(int32_t advice) {
    switch (advice) {
#ifdef MADV_PAGEOUT
        case SAEM_RAM_RELEASE_PAGEOUT:  return MADV_PAGEOUT;
#endif
#ifdef MADV_COLD
        case SAEM_RAM_RELEASE_COLD:     return MADV_COLD;
#endif
        case SAEM_RAM_RELEASE_DONTNEED: return MADV_DONTNEED;
        default:                        return -1;
    }
}

void saem_ram_prefetch_routed(saem_layer & L, const int32_t * ids, int64_t n) {
    // each routed expert once: a ubatch of many tokens repeats them
    std::vector<bool> seen(L.n_expert, false);
    for (int64_t i = 0; i < n; ++i) {
        const int32_t e = ids[i];
        if (e < 0 || e >= L.n_expert || seen[e]) {
            continue;
        }
        seen[e] = true;
        L.ram_route_prefetched++;
        for (const auto & [addr, nbytes] : expert_bytes(L, e)) {
            const page_range r = pages_covering(addr, nbytes);
            madvise((void *) r.begin, r.end - r.begin, MADV_WILLNEED);  // advice: a failure only costs speed
        }
    }
}

static int32_t ram_set_route_prefetch(llama_context * ctx, int32_t on) {
    saem_moe_cache & c = *saem_get_or_create_cache(ctx);
    if (on) {
        need_mapped(c);
    }
    if (c.ram_route_prefetch != (on != 0)) {
        c.ram_route_prefetch = on != 0;
        c.topo_version++;  // the graph gains / loses the prefetch ops
    }
    return SAEM_OK;
}

// the C functions' bodies (saem_native.h); the extern "C" wrappers at the end add saem_guarded
static int32_t experts_mapped(llama_context * ctx) {
    saem_moe_cache * c = saem_get_or_create_cache(ctx);
    try {
        need_mapped(*c);
    } catch (const saem_error & e) {
        if (e.code != SAEM_E_NOT_HOST) {
            throw;
        }
        saem_set_last_error(std::string("saem_ram_experts_mapped: ") + e.what());
        return 0;
    }
    return 1;
}

static int32_t ram_expert_ranges(const llama_context * ctx, int32_t il, int32_t expert, uint64_t * addr,
                                    uint64_t * nbytes, int32_t cap) {
    if (cap < 0) {
        throw saem_error(SAEM_E_INVALID_ARG, "cap < 0");
    }
    const saem_moe_cache & c = *saem_get_or_create_cache(const_cast<llama_context *>(ctx));
    const saem_layer & L = expert_layer(c, il, expert);
    const auto ranges = expert_bytes(L, expert);
    if (cap > 0 && (!addr || !nbytes)) {
        throw saem_error(SAEM_E_INVALID_ARG, "addr or nbytes is NULL");
    }
    for (int32_t k = 0; k < std::min<int32_t>(cap, (int32_t) ranges.size()); ++k) {
        addr[k]   = (uint64_t) ranges[k].first;
        nbytes[k] = (uint64_t) ranges[k].second;
    }
    return (int32_t) ranges.size();
}

static int32_t ram_prefetch(llama_context * ctx, int32_t il, const int32_t * experts, int32_t n, int32_t method) {
    if (method != SAEM_RAM_PREFETCH_MADVISE && method != SAEM_RAM_PREFETCH_THREAD) {
        throw saem_error(SAEM_E_INVALID_ARG, "prefetch method " + std::to_string(method) +
                " (0 madvise WILLNEED, 1 readahead thread)");
    }
    const auto [c, L] = mapped_layer(ctx, il, experts, n);
    std::vector<page_range> pages;
    for (int32_t i = 0; i < n; ++i) {
        for (const auto & [addr, nbytes] : expert_bytes(*L, experts[i])) {
            pages.push_back(pages_covering(addr, nbytes));
        }
    }
    if (method == SAEM_RAM_PREFETCH_THREAD) {
        saem_ram_state_of(*c).enqueue(pages);
        return SAEM_OK;
    }
    for (const page_range & r : pages) {
        if (madvise((void *) r.begin, r.end - r.begin, MADV_WILLNEED) != 0) {
            throw saem_error(SAEM_E_OS, "madvise(MADV_WILLNEED): " + errno_text(errno));
        }
    }
    return SAEM_OK;
}

static int32_t ram_prefetch_wait(llama_context * ctx) {
    saem_moe_cache * c = saem_get_cache(ctx);
    if (c && c->ram) {
        c->ram->wait_idle();
    }
    return SAEM_OK;
}

static int32_t ram_release(llama_context * ctx, int32_t il, const int32_t * experts, int32_t n, int32_t advice) {
    if (advice < SAEM_RAM_RELEASE_AUTO || advice > SAEM_RAM_RELEASE_DONTNEED) {
        throw saem_error(SAEM_E_INVALID_ARG, "release advice " + std::to_string(advice) +
                " (0 auto, 1 pageout, 2 cold, 3 dontneed)");
    }
    const auto [c, L] = mapped_layer(ctx, il, experts, n);
    std::vector<page_range> pages;
    for (int32_t i = 0; i < n; ++i) {
        for (const auto & [addr, nbytes] : expert_bytes(*L, experts[i])) {
            pages.push_back(pages_inside(addr, nbytes));
        }
    }
    // AUTO walks down the ladder: a kernel without MADV_PAGEOUT / MADV_COLD answers EINVAL
    const int32_t first = advice == SAEM_RAM_RELEASE_AUTO ? SAEM_RAM_RELEASE_PAGEOUT : advice;
    const int32_t last  = advice == SAEM_RAM_RELEASE_AUTO ? SAEM_RAM_RELEASE_DONTNEED : advice;
    int err = 0;
    for (int32_t a = first; a <= last; ++a) {
        const int os = release_advice_os(a);
        if (os < 0) {
            err = EINVAL;  // not in this system's headers
            continue;
        }
        err = 0;
        for (const page_range & r : pages) {
            if (r.end > r.begin && madvise((void *) r.begin, r.end - r.begin, os) != 0) {
                err = errno;
                break;
            }
        }
        if (err == 0) {
            return a;
        }
        if (err != EINVAL) {
            break;
        }
    }
    throw saem_error(SAEM_E_OS, "madvise release: " + errno_text(err));
}

static int32_t ram_expert_residency(const llama_context * ctx, int32_t il, int32_t expert,
                                       uint64_t * resident_pages, uint64_t * total_pages) {
    const saem_moe_cache & c = *saem_get_or_create_cache(const_cast<llama_context *>(ctx));
    const saem_layer & L = expert_layer(c, il, expert);
    need_mapped(c);
    uint64_t resident = 0, total = 0;
    std::vector<unsigned char> vec;
    for (const auto & [addr, nbytes] : expert_bytes(L, expert)) {
        const page_range r = pages_covering(addr, nbytes);
        const size_t np = (r.end - r.begin) / page_size();
        vec.assign(np, 0);
        if (mincore((void *) r.begin, r.end - r.begin, vec.data()) != 0) {
            throw saem_error(SAEM_E_OS, "mincore: " + errno_text(errno));
        }
        for (unsigned char v : vec) {
            resident += v & 1;
        }
        total += np;
    }
    if (resident_pages) { *resident_pages = resident; }
    if (total_pages)    { *total_pages    = total; }
    return SAEM_OK;
}

// The tensor's data lies in host RAM: a plain host buffer, or one of the CPU's extra buffer types
// (repacked layouts, AMX), which keep their own layout there and so do not say is_host.
static bool in_host_ram(const ggml_tensor * t) {
    if (!t->buffer || !t->data) {
        return false;
    }
    if (ggml_backend_buffer_is_host(t->buffer)) {
        return true;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

static int32_t ram_lock_non_expert(llama_context * ctx, uint64_t * locked_bytes) {
    saem_moe_cache & c = *saem_get_or_create_cache(ctx);
    saem_ram_state & st = saem_ram_state_of(c);
    st.unlock_all();
    const llama_model & model = saem_ctx_access::model(*ctx);
    std::vector<page_range> ranges;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (!in_host_ram(t)) {
            continue;  // device weights: nothing to page
        }
        bool expert = false;
        for (const saem_layer & L : c.layers) {
            expert = expert || is_expert_tensor(L, t);
        }
        if (!expert) {
            // a repacked layout may take more bytes than the file's
            ranges.push_back(pages_covering((uintptr_t) t->data, ggml_backend_buffer_get_alloc_size(t->buffer, t)));
        }
    }
    // merge overlapping / touching ranges: one mlock per run of pages
    std::sort(ranges.begin(), ranges.end(), [](const page_range & a, const page_range & b) { return a.begin < b.begin; });
    std::vector<page_range> merged;
    for (const page_range & r : ranges) {
        if (!merged.empty() && r.begin <= merged.back().end) {
            merged.back().end = std::max(merged.back().end, r.end);
        } else {
            merged.push_back(r);
        }
    }
    uint64_t total = 0;
    for (const page_range & r : merged) {
        total += r.end - r.begin;
    }
    for (const page_range & r : merged) {
        if (mlock((void *) r.begin, r.end - r.begin) != 0) {
            const int err = errno;
            st.unlock_all();
            struct rlimit lim = {};
            getrlimit(RLIMIT_MEMLOCK, &lim);
            const std::string limit = lim.rlim_cur == RLIM_INFINITY ? "unlimited" : std::to_string((uint64_t) lim.rlim_cur) + " bytes";
            throw saem_error(SAEM_E_OS, "mlock of the non-expert weights (" + std::to_string(total) +
                    " bytes) refused: " + errno_text(err) + "; RLIMIT_MEMLOCK is " + limit +
                    " (raise it with `ulimit -l`, or /etc/security/limits.conf memlock)");
        }
        st.locked.push_back(r);
    }
    if (locked_bytes) {
        *locked_bytes = total;
    }
    return SAEM_OK;
}

static int32_t ram_unlock_non_expert(llama_context * ctx) {
    saem_moe_cache * c = saem_get_cache(ctx);
    if (c && c->ram) {
        c->ram->unlock_all();
    }
    return SAEM_OK;
}

#define CHECK_CTX(ctx) \
    if (!(ctx)) { throw saem_error(SAEM_E_INVALID_ARG, "ctx is NULL"); }

extern "C" {

int32_t saem_ram_experts_mapped(const struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return experts_mapped(const_cast<llama_context *>(ctx));
    });
}

int32_t saem_ram_expert_ranges(const struct llama_context * ctx, int32_t il, int32_t expert, uint64_t * addr,
                               uint64_t * nbytes, int32_t cap) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_expert_ranges(ctx, il, expert, addr, nbytes, cap);
    });
}

int32_t saem_ram_prefetch(struct llama_context * ctx, int32_t il, const int32_t * experts, int32_t n, int32_t method) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_prefetch(ctx, il, experts, n, method);
    });
}

int32_t saem_ram_set_route_prefetch(struct llama_context * ctx, int32_t on) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_set_route_prefetch(ctx, on);
    });
}

int64_t saem_ram_route_prefetched(const struct llama_context * ctx) {
    int64_t n = 0;
    const int32_t rc = saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        if (const saem_moe_cache * c = saem_get_cache(ctx)) {
            for (const saem_layer & L : c->layers) {
                n += (int64_t) L.ram_route_prefetched;
            }
        }
        return SAEM_OK;
    });
    return rc < 0 ? rc : n;
}

int32_t saem_ram_prefetch_wait(struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_prefetch_wait(ctx);
    });
}

int32_t saem_ram_release(struct llama_context * ctx, int32_t il, const int32_t * experts, int32_t n, int32_t advice) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_release(ctx, il, experts, n, advice);
    });
}

int32_t saem_ram_expert_residency(const struct llama_context * ctx, int32_t il, int32_t expert,
                                  uint64_t * resident_pages, uint64_t * total_pages) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_expert_residency(ctx, il, expert, resident_pages, total_pages);
    });
}

int32_t saem_ram_lock_non_expert(struct llama_context * ctx, uint64_t * locked_bytes) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_lock_non_expert(ctx, locked_bytes);
    });
}

int32_t saem_ram_unlock_non_expert(struct llama_context * ctx) {
    return saem_guarded(__func__, [&]() -> int32_t {
        CHECK_CTX(ctx);
        return ram_unlock_non_expert(ctx);
    });
}

} // extern "C"
