"""qsi8d32: dynamic symmetric int8 quantization of activations, one scale per block of 32 along K
(KleidiAI's qsi8d32, the activation side of llama.cpp's Q8_0 dot products).

Reference for the C quantizer (pk_quantize_qsi8d32_row), which must produce the same bytes:
float32 arithmetic, round half to even (C `rintf`, numpy `rint`). Per block of 32 values:

    amax  = max |x|
    scale = amax / 127
    inv   = 127 / amax                      (0 when amax == 0)
    q     = rint(x * inv)                   in [-127, 127]
    x ~= scale * q

Against qai8dx (one scale per row) a block's scale follows the block's own range, so an outlier
channel coarsens only its block of 32, not the whole row; the kernels fold the block scale into
the multiply they already do per weight block (docs/KERNELS.md, docs/QUALITY.md).
"""
import numpy as np

QSI8D32_BLOCK = 32


def quantize_qsi8d32(x):
    """x: float32 [M, K], K a multiple of 32 -> (q int8 [M, K], scale float32 [M, K/32])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0 or x.shape[1] % QSI8D32_BLOCK:
        raise ValueError(f"qsi8d32 expects a 2-D [M, K] array with K a positive multiple of 32, got shape {x.shape}")
    m, k = x.shape
    xb = x.reshape(m, k // QSI8D32_BLOCK, QSI8D32_BLOCK)
    amax = np.abs(xb).max(axis=2).astype(np.float32)
    scale = (amax / np.float32(127)).astype(np.float32)
    zero = amax == 0
    inv = np.where(zero, np.float32(0), np.float32(127) / np.where(zero, np.float32(1), amax)).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8).reshape(m, k)
    return q, scale


def dequantize_qsi8d32(q, scale):
    q = np.asarray(q, dtype=np.int8)
    m, k = q.shape
    s = np.asarray(scale, np.float32)
    return (q.reshape(m, k // QSI8D32_BLOCK, QSI8D32_BLOCK).astype(np.float32) * s[:, :, None]).reshape(m, k)
