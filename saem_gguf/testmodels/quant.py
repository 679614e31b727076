"""Quantization of test-model tensors: gguf-py for F16/Q8_0/Q4_0, our own for Q4_K.

gguf-py can dequantize Q4_K but not quantize it; Q4_K is what real Q4_K_M files carry in their
expert tensors, so tests need it. Any (scale, min) choice gives a valid Q4_K block; this one is a
plain per-sub-block min/max fit, checked against gguf-py's dequantizer in the tests.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

TYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_k": QT.Q4_K}
QK_K = 256


def quantize(x: np.ndarray, kind: str) -> tuple[np.ndarray, QT]:
    """Return (data to write, ggml type). Quantized data is uint8 with rows of packed blocks."""
    qt = TYPES[kind]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qt == QT.F32:
        return x, qt
    if qt == QT.F16:
        return x.astype(np.float16), qt
    if qt == QT.Q4_K:
        return quantize_q4_k(x), qt
    return quants.quantize(x, qt), qt


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    shape = x.shape
    if shape[-1] % QK_K:
        raise ValueError(f"Q4_K rows must be a multiple of {QK_K}, got {shape[-1]}")
    blocks = x.reshape(-1, 8, 32).astype(np.float32)  # [nb, sub-block, 32]
    mn = np.minimum(blocks.min(axis=2), 0.0)
    mx = blocks.max(axis=2)
    scale = (mx - mn) / 15.0
    mval = -mn
    d = scale.max(axis=1) / 63.0
    dmin = mval.max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(mval / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        eff_scale = d[:, None] * sc
        eff_min = dmin[:, None] * m
        q = np.where(eff_scale[:, :, None] > 0,
                     np.rint((blocks + eff_min[:, :, None]) / eff_scale[:, :, None]), 0)
    q = q.clip(0, 15).astype(np.uint8)
    packed_scales = np.zeros((blocks.shape[0], 12), np.uint8)
    packed_scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    # 4 chunks of 64 values: low nibbles hold sub-block 2c, high nibbles sub-block 2c+1
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2),
                          packed_scales, qs], axis=1)
    return out.reshape(*shape[:-1], (shape[-1] // QK_K) * 144)
