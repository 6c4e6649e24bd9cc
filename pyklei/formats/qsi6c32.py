"""qsi6c32: signed int6 weights, one bf16 scale per block of 32 elements along K.

For the lm_head / tied embedding: 6.5 bits per weight instead of qsi8cx's 8 (llama.cpp keeps
that tensor at 6 bits too, Q6_K, in its 4-bit files). docs/FORMAT.md has the bytes. A weight
W of shape [N, K] (K a multiple of 32) is two arrays:

    qs     uint8  [N, 3K/4]   24 bytes per chunk of 32 elements
    scales uint16 [N, K/32]   bfloat16 bits

Values q in [-32, 31] are stored as u = q + 32 in [0, 63]. Chunk c (elements 32c..32c+31)
of a row: bytes 0..15 hold the low 4 bits of u in qsi4c32's nibble order (byte j: element j
in the low nibble, element 16+j in the high one); bytes 16..23: byte 16+j holds the top 2
bits of elements j, j+8, j+16, j+24 in bits 0-1, 2-3, 4-5, 6-7.

    W[n, k] ~= bf16_to_f32(scales[n, k // 32]) * q[n, k]
"""
from __future__ import annotations

import numpy as np

from .bf16 import bf16_to_f32
from .qsi4c32 import quantize_rows

QMIN, QMAX = -32, 31
BLOCK = 32
# Candidate scales absmax / t: t = 32 maps a negative extreme onto -32, t = 31 a positive one
# onto +31; around them, clipping of the extreme traded against resolution.
SEARCH_DIVISORS = np.arange(28.0, 34.0001, 0.25, dtype=np.float32)


def pack_q6(q) -> np.ndarray:
    """int8 [N, K] in [-32, 31] -> uint8 [N, 3K/4] in the qsi6c32 chunk order."""
    q = np.asarray(q)
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of 32")
    if q.size and (q.min() < QMIN or q.max() > QMAX):
        raise ValueError("int6 values must lie in [-32, 31]")
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, k // 32, 32)
    lo = u & 0x0F
    nib = lo[:, :, :16] | (lo[:, :, 16:] << 4)                       # [n, c, 16]
    top = (u >> 4).reshape(n, k // 32, 4, 8)                         # elements j + 8i
    hi = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return np.concatenate([nib, hi], axis=2).reshape(n, k // 32 * 24).astype(np.uint8)


def unpack_q6(qs) -> np.ndarray:
    """uint8 [N, 3K/4] -> int8 [N, K] in [-32, 31]."""
    qs = np.asarray(qs, dtype=np.uint8)
    n, row = qs.shape
    if row % 24:
        raise ValueError(f"qsi6c32 rows are whole 24-byte chunks, got {row} bytes")
    c = qs.reshape(n, row // 24, 24)
    lo = np.concatenate([c[:, :, :16] & 0x0F, c[:, :, :16] >> 4], axis=2)          # [n, c, 32]
    h = c[:, :, 16:24]
    top = np.concatenate([(h >> s) & 3 for s in (0, 2, 4, 6)], axis=2)              # j + 8i
    return ((lo | (top << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, row // 24 * 32)


def quantize_qsi6c32(w, search: bool = True, importance=None):
    """float [N, K] -> (qs uint8 [N, 3K/4], scales uint16 bf16 [N, K/32]).

    The scale of each block minimises its (importance-weighted) squared error as in
    quantize_qsi4c32: candidates absmax/t for t in SEARCH_DIVISORS (bf16-rounded), then one
    least-squares refit; values round half to even and clamp to [-32, 31].
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"qsi6c32 expects a 2-D [N, K] weight, got shape {w.shape}")
    n, k = w.shape
    if n <= 0 or k <= 0 or k % BLOCK:
        raise ValueError(f"qsi6c32 needs a non-empty [N, K] matrix with K a multiple of 32, got [{n}, {k}]")
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or Inf values; cannot quantize")
    return quantize_rows(w, BLOCK, search, importance, pack_q6, k // 32 * 24, QMIN, QMAX, SEARCH_DIVISORS)


def dequantize_qsi6c32(qs, scales) -> np.ndarray:
    """(qs [N, 3K/4], scales [N, K/32]) -> float32 [N, K]."""
    q = unpack_q6(qs)
    n, k = q.shape
    s = bf16_to_f32(scales)
    if s.shape != (n, k // BLOCK):
        raise ValueError(f"scales shape {s.shape} does not fit [{n}, {k}] with blocks of 32")
    return (q.reshape(n, k // BLOCK, BLOCK).astype(np.float32) * s[:, :, None]).reshape(n, k)
