// C-level test of patches 0001/0002: MUL_MAT_ID with GGML_MUL_MAT_ID_FLAG_SKIP_NEG on the CPU.
//
//  * rows whose id is negative come out as exact (+0) zeros (dst pre-filled with NaN to prove the write)
//  * every other row is bit-identical to an unflagged MUL_MAT_ID with the real ids (skipping whole
//    experts - what the expert cache does - for every type; skipping single rows for vec_dot types)
//  * several types (vec_dot, and Q4_K whose experts with >= 8 rows take the tiled path), thread counts,
//    broadcast src1 (ne11 == 1) and per-slot src1, all-skipped and none-skipped ids
//  * flags round-trip; unflagged ops read 0; the CPU device refuses a flagged op whose weights are in
//    an extra buffer (AMX, ...) while it accepts the unflagged one, but for CPU_REPACK, which
//    implements the flag: there the same checks run on repacked weights (Q4_0, Q4_K, IQ4_NL, MXFP4
//    where this CPU repacks them)
// Prints one line per failure; exit status 0 = all passed.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static int g_fail = 0;
static int g_checks = 0;

#define CHECK(cond, ...) do { g_checks++; if (!(cond)) { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)

static void fill_weights(ggml_tensor * t, std::mt19937 & rng) {
    const int64_t n_per_row = t->ne[0];
    const int64_t nrows = ggml_nrows(t);
    std::vector<float> f(n_per_row * nrows);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto & x : f) {
        x = nd(rng);
    }
    if (t->type == GGML_TYPE_F32) {
        memcpy(t->data, f.data(), f.size() * sizeof(float));
    } else {
        ggml_quantize_chunk(t->type, f.data(), t->data, 0, nrows, n_per_row, nullptr);
    }
}

static void fill_f32(ggml_tensor * t, std::mt19937 & rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    float * p = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        p[i] = nd(rng);
    }
}

// one case: n_as experts [K, M], n_used ids per token, n_tokens tokens; p_skip = probability that an
// expert is skipped (per_row = false: all rows of a skipped expert get -1, as the expert cache does -
// an expert is either computed for all its tokens or for none) or that a row is skipped (per_row).
// weights_buft: the weights in a buffer of that type (CPU_REPACK: its kernels, one gemv per row);
// returns false where it has no layout for the type (nothing was tested), else true.
static bool run_case(ggml_type type, int64_t K, int64_t M, int n_as, int n_used, int n_tokens, bool bcast,
                     double p_skip, bool per_row, int n_threads, uint32_t seed,
                     ggml_backend_buffer_type_t weights_buft = nullptr) {
    std::mt19937 rng(seed);
    ggml_init_params ip = { /*.mem_size =*/ 256u*1024*1024, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context * ctx = ggml_init(ip);
    ggml_init_params ipw = { ggml_tensor_overhead() * 4, nullptr, true };
    ggml_context * ctx_w = weights_buft ? ggml_init(ipw) : nullptr;
    ggml_backend_buffer_t buf_w = nullptr;

    ggml_tensor * as  = ggml_new_tensor_3d(ctx_w ? ctx_w : ctx, type, K, M, n_as);
    if (ctx_w) {
        buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, weights_buft);
        if (!buf_w || !as->extra) { // no layout of this buffer type for this type here
            if (buf_w) { ggml_backend_buffer_free(buf_w); }
            ggml_free(ctx_w);
            ggml_free(ctx);
            return false;
        }
    }
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, bcast ? 1 : n_used, n_tokens);
    ggml_tensor * ids_skip = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    ggml_tensor * ids_full = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
    if (ctx_w) { // quantized here, then written through the buffer (which repacks it)
        std::vector<uint8_t> data(ggml_nbytes(as));
        ggml_tensor plain = *as;
        plain.data = data.data();
        fill_weights(&plain, rng);
        ggml_backend_tensor_set(as, data.data(), 0, data.size());
    } else {
        fill_weights(as, rng);
    }
    fill_f32(b, rng);

    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<bool> skip_expert(n_as);
    for (int e = 0; e < n_as; ++e) {
        skip_expert[e] = u(rng) < p_skip;
    }
    std::vector<int> perm(n_as);
    for (int t = 0; t < n_tokens; ++t) {
        for (int i = 0; i < n_as; ++i) { perm[i] = i; }
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int k = 0; k < n_used; ++k) {
            const int e = perm[k];
            ((int32_t *) ids_full->data)[t * n_used + k] = e;
            const bool skip = per_row ? u(rng) < p_skip : (bool) skip_expert[e];
            ((int32_t *) ids_skip->data)[t * n_used + k] = skip ? -1 - (int)(u(rng) * 3) : e; // -1..-3
        }
    }

    ggml_tensor * r_skip = ggml_mul_mat_id(ctx, as, b, ids_skip);
    ggml_mul_mat_id_set_flags(r_skip, GGML_MUL_MAT_ID_FLAG_SKIP_NEG);
    ggml_tensor * r_full = ggml_mul_mat_id(ctx, as, b, ids_full);

    CHECK(ggml_mul_mat_id_get_flags(r_skip) == GGML_MUL_MAT_ID_FLAG_SKIP_NEG, "flag round trip");
    CHECK(ggml_mul_mat_id_get_flags(r_full) == 0, "unflagged op reads 0");

    // pre-fill the flagged output with NaN: skipped rows must be written
    for (int64_t i = 0; i < ggml_nelements(r_skip); ++i) {
        ((float *) r_skip->data)[i] = NAN;
    }

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, r_skip);
    ggml_build_forward_expand(gf, r_full);
    const ggml_status st = ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    CHECK(st == GGML_STATUS_SUCCESS, "compute status %d", (int) st);

    int bad_zero = 0, bad_row = 0, n_skipped = 0;
    for (int t = 0; t < n_tokens; ++t) {
        for (int k = 0; k < n_used; ++k) {
            const int32_t id = ((int32_t *) ids_skip->data)[t * n_used + k];
            const float * rs = (const float *) ((const char *) r_skip->data + k * r_skip->nb[1] + t * r_skip->nb[2]);
            const float * rf = (const float *) ((const char *) r_full->data + k * r_full->nb[1] + t * r_full->nb[2]);
            if (id < 0) {
                n_skipped++;
                for (int64_t i = 0; i < M; ++i) {
                    if (!(rs[i] == 0.0f && !std::signbit(rs[i]))) { bad_zero++; break; }
                }
            } else if (memcmp(rs, rf, M * sizeof(float)) != 0) {
                bad_row++;
            }
        }
    }
    CHECK(bad_zero == 0 && bad_row == 0,
          "%s%s K=%lld M=%lld n_as=%d n_used=%d n_tokens=%d bcast=%d p_skip=%.2f per_row=%d nth=%d: %d skipped rows not zero, %d rows differ (of %d skipped)",
          weights_buft ? "repacked " : "", ggml_type_name(type), (long long) K, (long long) M, n_as, n_used, n_tokens, (int) bcast,
          p_skip, (int) per_row, n_threads, bad_zero, bad_row, n_skipped);
    ggml_free(ctx);
    if (buf_w) { ggml_backend_buffer_free(buf_w); }
    if (ctx_w) { ggml_free(ctx_w); }
    return true;
}

static ggml_backend_buffer_type_t repack_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * p = get_extra ? get_extra(cpu) : nullptr; p && *p; ++p) {
        if (strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) {
            return *p;
        }
    }
    return nullptr;
}

static void check_extra_buft_refused() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    int n_tested = 0;
    for (ggml_backend_buffer_type_t * p = get_extra ? get_extra(cpu) : nullptr; p && *p; ++p) {
        ggml_init_params ip = { ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true };
        ggml_context * ctx = ggml_init(ip);
        ggml_tensor * as  = ggml_new_tensor_3d(ctx, GGML_TYPE_Q4_0, 256, 64, 4);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, *p);
        if (!buf) { ggml_free(ctx); continue; }
        ggml_init_params ip2 = { ggml_tensor_overhead() * 16, nullptr, true };
        ggml_context * ctx2 = ggml_init(ip2);
        ggml_tensor * b   = ggml_new_tensor_3d(ctx2, GGML_TYPE_F32, 256, 1, 2);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx2, GGML_TYPE_I32, 2, 2);
        ggml_tensor * r0 = ggml_mul_mat_id(ctx2, as, b, ids);
        ggml_tensor * r1 = ggml_mul_mat_id(ctx2, as, b, ids);
        ggml_mul_mat_id_set_flags(r1, GGML_MUL_MAT_ID_FLAG_SKIP_NEG);
        if (ggml_backend_dev_supports_op(cpu, r0)) {
            n_tested++;
            if (*p == repack_buft()) { // implements the flag (patch 0002)
                CHECK(ggml_backend_dev_supports_op(cpu, r1), "CPU device refuses a flagged MUL_MAT_ID in %s", ggml_backend_buft_name(*p));
            } else {
                CHECK(!ggml_backend_dev_supports_op(cpu, r1), "CPU device accepts a flagged MUL_MAT_ID in extra buffer %s", ggml_backend_buft_name(*p));
            }
        }
        ggml_backend_buffer_free(buf);
        ggml_free(ctx2);
        ggml_free(ctx);
    }
    printf("extra buffer types checked: %d\n", n_tested);
}

int main() {
    // repack's per-tensor debug line, thousands of times, would bury the failures
    ggml_log_set([](ggml_log_level level, const char * text, void *) {
        if (level != GGML_LOG_LEVEL_DEBUG) { fputs(text, stderr); }
    }, nullptr);
    ggml_cpu_init();
    uint32_t seed = 1;
    const ggml_type types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K };
    for (ggml_type type : types) {
        const int64_t K = type == GGML_TYPE_Q4_K ? 256 : 64;
        for (int nth : { 1, 2, 3 }) {
            for (double p : { 0.0, 0.3, 0.7, 1.0 }) {
                for (bool bcast : { true, false }) {
                    // per expert: bit-identical rows for every type and path
                    run_case(type, K, 48, 8, 2, 1,  bcast, p, false, nth, seed++);   // decode
                    run_case(type, K, 48, 8, 4, 7,  bcast, p, false, nth, seed++);   // small batch
                    run_case(type, K, 96, 4, 2, 40, bcast, p, false, nth, seed++);   // >= 8 rows per expert (tiled for K-quants)
                    // per row: the vec_dot path is per-row, so still bit-identical; the tiled path
                    // (K-quants, >= 8 rows per expert) depends on the expert's row count: not covered
                    if (type != GGML_TYPE_Q4_K) {
                        run_case(type, K, 48, 8, 4, 7,  bcast, p, true, nth, seed++);
                        run_case(type, K, 96, 4, 2, 40, bcast, p, true, nth, seed++);
                    }
                }
            }
        }
    }
    if (ggml_backend_buffer_type_t rb = repack_buft()) {
        int n_types = 0;
        for (ggml_type type : { GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_IQ4_NL, GGML_TYPE_MXFP4 }) {
            const int64_t K = type == GGML_TYPE_Q4_K ? 256 : 64;
            bool repacked = false;
            for (int nth : { 1, 2, 3 }) {
                for (double p : { 0.0, 0.3, 0.7, 1.0 }) {
                    for (bool bcast : { true, false }) {
                        repacked = run_case(type, K, 48, 8, 2, 1,  bcast, p, false, nth, seed++, rb) || repacked;
                        repacked = run_case(type, K, 48, 8, 4, 7,  bcast, p, false, nth, seed++, rb) || repacked;
                        repacked = run_case(type, K, 96, 4, 2, 40, bcast, p, false, nth, seed++, rb) || repacked;
                    }
                }
            }
            n_types += repacked ? 1 : 0;
        }
        printf("repacked types checked: %d\n", n_types);
    }
    check_extra_buft_refused();
    printf("%d checks, %d failures\n", g_checks, g_fail);
    return g_fail == 0 ? 0 : 1;
}
