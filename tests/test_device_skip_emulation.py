"""CPU-side emulation of patch 0007 (CUDA MUL_MAT_ID skips negative ids), for the semantics the CUDA
kernels must produce: the reference is what the CPU kernel computes with GGML_MUL_MAT_ID_FLAG_SKIP_NEG
(patch 0002, tested on the real kernel by test_native_mul_mat_id.py): a row whose id is negative is
all zeros, every other row is W[id] @ x.

The CUDA code itself cannot run here; these tests port its index arithmetic line for line
(``mm_ids_helper`` in mmid.cu, the quantize/scatter reads in quantize.cu, the mmq writes through
ids_dst and the dst memset in mmq.cu, the early-out of mmvq.cu) and check, over random id tables
with skipped entries, that every index the kernels read or write is in bounds and that the result
equals the reference. The same emulation with the stock helper (negative ids counted as "lower
experts") is shown to go wrong, so the check is not vacuous. The device run (bench/device/run.sh,
SAEM_MOE_ZERO_SLOT=0 mode of correctness.json) checks the real kernels against the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest

GARBAGE = 1 << 30  # what an unwritten pool entry may hold


def mm_ids_helper(ids: np.ndarray, n_expert: int, nchannels_y: int, write_inverse: bool,
                  patched: bool = True):
    """mmid.cu mm_ids_helper, one loop iteration per CUDA block (expert); ids is [n_tokens, n_used]."""
    n_tokens, n_used = ids.shape
    n_rows = n_tokens * n_used
    ids_src1 = np.full(n_rows, GARBAGE, np.int64)
    ids_dst = np.full(n_rows, GARBAGE, np.int64)
    bounds = np.full(n_expert + 1, GARBAGE, np.int64)
    sis1 = nchannels_y  # src1 rows per token (1 when broadcast)
    for expert in range(n_expert):
        if patched:
            nex_prev = int(((ids >= 0) & (ids < expert)).sum())
        else:
            nex_prev = int((ids < expert).sum())
        store = [(it, int(np.flatnonzero(ids[it] == expert)[0])) for it in range(n_tokens)
                 if (ids[it] == expert).any()]
        for itc, (it, iex) in enumerate(store):
            ids_dst[nex_prev + itc] = it * n_used + iex
            if write_inverse:
                ids_src1[it * n_used + iex] = nex_prev + itc
            else:
                ids_src1[nex_prev + itc] = it * sis1 + iex % nchannels_y
        bounds[expert] = nex_prev
        if expert == n_expert - 1:
            bounds[n_expert] = nex_prev + len(store)
            if patched and bounds[n_expert] != n_rows:  # the fix-up of unused map entries
                if write_inverse:
                    for i in range(n_rows):
                        if ids[i // n_used, i % n_used] < 0:
                            ids_src1[i] = n_rows - 1
                else:
                    ids_src1[bounds[n_expert]:] = 0
    return ids_src1, ids_dst, bounds


def mmq_mul_mat_id(W: np.ndarray, x: np.ndarray, ids: np.ndarray, patched: bool = True) -> np.ndarray:
    """mmq.cu ggml_cuda_mul_mat_q with ids: W [n_expert, n_out, n_in], x [n_tokens, nchannels_y, n_in]."""
    n_expert = W.shape[0]
    n_tokens, n_used = ids.shape
    nchannels_y = x.shape[1]
    n_rows = n_tokens * n_used
    dedup = nchannels_y == 1 and n_used > 1
    ids_src1, ids_dst, bounds = mm_ids_helper(ids, n_expert, nchannels_y, dedup, patched)
    src_rows = x.reshape(n_tokens * nchannels_y, -1)
    # quantization into the compact buffer (one row per (token, slot)); the kernels read these maps
    compact = np.full((n_rows, x.shape[2]), np.nan)
    if dedup:  # quantize_scatter: a token's row to each of its slots' compact rows
        for it in range(n_tokens):
            for slot in range(n_used):
                target = ids_src1[it * n_used + slot]
                if not 0 <= target < n_rows:
                    raise IndexError(f"scatter writes compact row {target} of {n_rows}")
                compact[target] = src_rows[it]
    else:  # quantize with the forward map: compact row i reads source row ids_src1[i]
        for i in range(n_rows):
            if not 0 <= ids_src1[i] < len(src_rows):
                raise IndexError(f"quantize reads source row {ids_src1[i]} of {len(src_rows)}")
            compact[i] = src_rows[ids_src1[i]]
    dst = np.zeros((n_rows, W.shape[1])) if patched else np.full((n_rows, W.shape[1]), np.nan)
    for z in range(n_expert):  # the kernel: expert z's compact rows, written through ids_dst
        lo, hi = bounds[z], bounds[z + 1]
        if not 0 <= lo <= hi <= n_rows:
            raise IndexError(f"expert {z} bounds [{lo}, {hi}) outside {n_rows} rows")
        for c in range(lo, hi):
            dst[ids_dst[c]] = W[z] @ compact[c]
    return dst.reshape(n_tokens, n_used, -1)


def mmvq_mul_mat_id(W: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """mmvq.cu (mul_mat_vec_q / _moe): one block or warp per (token, slot); a negative id writes 0."""
    n_tokens, n_used = ids.shape
    dst = np.full((n_tokens, n_used, W.shape[1]), np.nan)
    for it in range(n_tokens):
        for slot in range(n_used):
            e = ids[it, slot]
            dst[it, slot] = 0.0 if e < 0 else W[e] @ x[it, slot % x.shape[1]]
    return dst


def reference(W: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The CPU kernel's SKIP_NEG semantics."""
    n_tokens, n_used = ids.shape
    out = np.zeros((n_tokens, n_used, W.shape[1]))
    for it in range(n_tokens):
        for slot in range(n_used):
            if ids[it, slot] >= 0:
                out[it, slot] = W[ids[it, slot]] @ x[it, slot % x.shape[1]]
    return out


def random_case(rng: np.random.Generator, n_tokens: int, n_used: int, n_expert: int, nchannels_y: int,
                p_skip: float):
    ids = np.stack([rng.permutation(n_expert)[:n_used] for _ in range(n_tokens)])
    ids[rng.random(ids.shape) < p_skip] = -1
    W = rng.standard_normal((n_expert, 5, 8))
    x = rng.standard_normal((n_tokens, nchannels_y, 8))
    return W, x, ids


# ubatch sizes the device branch sees: decode (1), mmvq's multi-token kernel, and mmq (9..31)
CASES = [(n_tokens, n_used, n_expert, nch, p)
         for n_tokens in (1, 3, 8, 9, 31) for (n_used, n_expert) in ((2, 8), (8, 128), (6, 16))
         for nch in (1, 0) for p in (0.0, 0.3, 1.0)]


@pytest.mark.parametrize("n_tokens,n_used,n_expert,nch,p_skip", CASES)
def test_patched_paths_equal_the_cpu_semantics(n_tokens, n_used, n_expert, nch, p_skip):
    rng = np.random.default_rng(n_tokens * 1000 + n_used * 10 + n_expert + int(p_skip * 7))
    nchannels_y = 1 if nch == 1 else n_used  # 1: gate/up (broadcast, dedup scatter); n_used: down
    W, x, ids = random_case(rng, n_tokens, n_used, n_expert, nchannels_y, p_skip)
    want = reference(W, x, ids)
    np.testing.assert_array_equal(mmvq_mul_mat_id(W, x, ids), want)
    np.testing.assert_allclose(mmq_mul_mat_id(W, x, ids), want, rtol=0, atol=1e-12)


def test_without_skips_the_patched_helper_is_the_stock_one():
    rng = np.random.default_rng(0)
    for n_tokens, nch in ((5, 1), (12, 8)):
        _, _, ids = random_case(rng, n_tokens, 8, 64, nch, 0.0)
        for inverse in (False, True):
            got = mm_ids_helper(ids, 64, nch, inverse, patched=True)
            stock = mm_ids_helper(ids, 64, nch, inverse, patched=False)
            for a, b in zip(got, stock):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("nch", [1, 8])
def test_the_stock_helper_goes_wrong_on_skipped_ids(nch):
    rng = np.random.default_rng(1)
    W, x, ids = random_case(rng, 9, 8, 32, nch, 0.3)
    with pytest.raises(IndexError):
        mmq_mul_mat_id(W, x, ids, patched=False)
