"""qsi4c32: signed int4 weights, one bf16 scale per block of `bl` elements along K.

The numpy reference for the format in docs/FORMAT.md (the C kernels and the converter are
tested against it). A weight W of shape [N, K] (N output rows, K inputs) is two arrays:

    qs     uint8  [N, K/2]    two's-complement int4, two per byte
    scales uint16 [N, K/bl]   bfloat16 bits

Nibble order is fixed per 32-element chunk, whatever bl is: byte j (0..15) of chunk c holds
element 32c+j in its low nibble and element 32c+16+j in its high nibble. Low nibbles of 16
consecutive bytes are then 16 consecutive elements, which is what SIMD unpacking wants.

    W[n, k] ~= bf16_to_f32(scales[n, k // bl]) * q[n, k],   q in [-8, 7]
"""
from __future__ import annotations

import numpy as np

from . import _native
from .bf16 import bf16_to_f32, f32_to_bf16

QSI4C32_BLOCK_SIZES = (32, 64, 128, 256)
QMIN, QMAX = -8, 7

# Divisors t for the candidate scales s = absmax / t of the error search. t = 8 maps a
# negative extreme exactly onto -8; t = 7 maps a positive one onto +7; the values between
# and around trade clipping of the extreme against resolution for the rest of the block.
SEARCH_DIVISORS = np.arange(6.0, 8.5001, 0.125, dtype=np.float32)
_ROWS_PER_CHUNK_ELEMS = 1 << 20  # bounds the temporary memory of the search


def check_shape(n: int, k: int, bl: int) -> None:
    if bl not in QSI4C32_BLOCK_SIZES:
        raise ValueError(f"qsi4c32 block size must be one of {QSI4C32_BLOCK_SIZES}, got {bl}")
    if k % bl != 0:
        raise ValueError(
            f"qsi4c32 needs K divisible by the block size: K={k} is not a multiple of {bl}; "
            f"choose a block size that divides {k} or keep this tensor at 8 bits / f16")
    if n <= 0 or k <= 0:
        raise ValueError(f"qsi4c32 needs a non-empty [N, K] matrix, got [{n}, {k}]")


def pack_nibbles(q) -> np.ndarray:
    """int8 [N, K] in [-8, 7] -> uint8 [N, K/2] in the qsi4c32 chunk nibble order."""
    q = np.asarray(q)
    n, k = q.shape
    if k % 32:
        raise ValueError(f"K={k} is not a multiple of 32")
    if q.size and (q.min() < QMIN or q.max() > QMAX):
        raise ValueError("int4 values must lie in [-8, 7]")
    nib = (q.astype(np.int8).view(np.uint8) & 0x0F).reshape(n, k // 32, 2, 16)
    return (nib[:, :, 0, :] | (nib[:, :, 1, :] << 4)).reshape(n, k // 2).astype(np.uint8)


def unpack_nibbles(qs) -> np.ndarray:
    """uint8 [N, K/2] -> int8 [N, K] (sign-extended int4)."""
    qs = np.asarray(qs, dtype=np.uint8)
    n, half = qs.shape
    b = qs.reshape(n, half // 16, 1, 16)
    nib = np.concatenate([b & 0x0F, b >> 4], axis=2).reshape(n, half * 2)
    return ((nib.astype(np.int8) ^ 8) - 8).astype(np.int8)  # sign-extend 4 -> 8 bits


def _quantize_blocks(xb: np.ndarray, search: bool, wb: np.ndarray | None = None,
                     qmin: int = QMIN, qmax: int = QMAX, divisors=SEARCH_DIVISORS):
    """xb: float32 [B, bl] -> (q int8 [B, bl], scale bits uint16 [B]), q in [qmin, qmax].
    wb: optional importance [P, bl] weighting the squared error, block b by row b % P (P
    divides B). divisors: the candidate scales absmax / t (search=False: absmax / -qmin only).
    The extension's C search when it is built (byte-identical, threads over row ranges:
    _native.search_blocks), else the numpy reference below."""
    divisors = np.asarray(divisors if search else [-qmin], dtype=np.float32)
    native = _native.search_blocks()
    if native is not None:
        return native(xb, wb, search, divisors, qmin, qmax)
    return _quantize_blocks_numpy(xb, search, wb, qmin, qmax, divisors)


def _quantize_blocks_numpy(xb: np.ndarray, search: bool, wb: np.ndarray | None,
                           qmin: int, qmax: int, divisors: np.ndarray):
    """The definition of the search (the C one is checked byte for byte against it)."""
    if wb is not None:      # [P, bl] cycling over the blocks -> a row per block
        wb = wb.reshape(-1, xb.shape[1])
        wb = np.tile(wb, (xb.shape[0] // wb.shape[0], 1))
    def err_of(d):
        e = np.square(d)
        return (e if wb is None else e * wb).sum(axis=1, dtype=np.float32)

    amax = np.abs(xb).max(axis=1)
    best_err = np.full(xb.shape[0], np.inf, dtype=np.float32)
    best_bits = np.zeros(xb.shape[0], dtype=np.uint16)
    for t in divisors:
        bits = f32_to_bf16(amax / np.float32(t))
        s = bf16_to_f32(bits)
        q = _round_to_int4(xb, s, qmin, qmax)
        err = err_of(xb - s[:, None] * q)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_bits = np.where(better, bits, best_bits)
    if search:
        # One least-squares refit of the scale for the chosen rounding: s* = <x,q>/<q,q>.
        s = bf16_to_f32(best_bits)
        q = _round_to_int4(xb, s, qmin, qmax).astype(np.float32)
        wq = q if wb is None else q * wb
        qq = (wq * q).sum(axis=1)
        fit = np.where(qq > 0, (xb * wq).sum(axis=1) / np.where(qq > 0, qq, 1), 0).astype(np.float32)
        bits = f32_to_bf16(np.abs(fit))
        s2 = bf16_to_f32(bits)
        err = err_of(xb - s2[:, None] * _round_to_int4(xb, s2, qmin, qmax))
        best_bits = np.where(err < best_err, bits, best_bits)
    s = bf16_to_f32(best_bits)
    return _round_to_int4(xb, s, qmin, qmax), best_bits


def choose_block_scales(xb, importance=None, divisors=SEARCH_DIVISORS, qmin: int = QMIN,
                        qmax: int = QMAX) -> np.ndarray:
    """The scale search of quantize_qsi4c32 on its own: float32 blocks [B, bl] -> bf16 scale
    bits uint16 [B]. importance: None or float [bl] / [B, bl] >= 0 weighting each element's
    squared error (normalised as in quantize_rows). Rounding with these scales
    (round half to even, clamp to [-8, 7]) gives what quantize_qsi4c32 would store; GPTQ
    (pyklei/converters/gptq.py) calls it for each group as its quantization reaches the group.
    divisors: the candidates absmax / t searched (default SEARCH_DIVISORS). qmin, qmax: the
    integer range (qsi6c32 shares this search with [-32, 31] and its own divisors)."""
    xb = np.asarray(xb, dtype=np.float32)
    wb = None
    if importance is not None:
        imp = np.asarray(importance, dtype=np.float32)
        mean = imp.mean(axis=-1, keepdims=True)
        wb = np.where(mean > 0, imp / np.where(mean > 0, mean, 1), 1).astype(np.float32) + np.float32(1e-3)
    return _quantize_blocks(xb, True, None if wb is None else wb.reshape(-1, xb.shape[-1]), qmin, qmax,
                            np.asarray(divisors, np.float32))[1]


def _round_to_int4(xb, s, qmin: int = QMIN, qmax: int = QMAX):
    safe = np.where(s > 0, s, np.float32(1))
    q = np.rint(xb / safe[:, None])
    q = np.where((s > 0)[:, None], q, 0)
    return np.clip(q, qmin, qmax).astype(np.int8)


def quantize_qsi4c32(w, bl: int = 32, search: bool = True, importance=None):
    """float [N, K] -> (qs uint8 [N, K/2], scales uint16 bf16 [N, K/bl]).

    Each block's scale is chosen to minimise that block's squared error: candidates
    absmax/t for t in SEARCH_DIVISORS, each rounded to bf16 first (so the error is that of
    the stored scale), then one least-squares refit. With search=False the scale is
    absmax/8 (bf16-rounded). Values are rounded half-to-even and clamped to [-8, 7].
    importance: optional float [K] >= 0, e.g. the mean squared activation of each input
    channel; the search then minimises the importance-weighted error, which is the error of
    the layer's output rather than of its weights (llama.cpp's "imatrix" idea).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"qsi4c32 expects a 2-D [N, K] weight, got shape {w.shape}")
    n, k = w.shape
    check_shape(n, k, bl)
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or Inf values; cannot quantize")
    return quantize_rows(w, bl, search, importance, pack_nibbles, k // 2)


def quantize_rows(w, bl: int, search: bool, importance, pack, row_bytes: int,
                  qmin: int = QMIN, qmax: int = QMAX, divisors=SEARCH_DIVISORS):
    """The block-scale quantizers' shared part (qsi4c32, qsi6c32): float32 [N, K] (checked) ->
    (pack(q) uint8 [N, row_bytes], scales uint16 [N, K/bl]), a bounded number of rows at a time.
    importance: None or float [K] >= 0 (normalised to mean 1, plus 1e-3 so that no channel is
    ignored entirely)."""
    n, k = w.shape
    qs = np.empty((n, row_bytes), dtype=np.uint8)
    scales = np.empty((n, k // bl), dtype=np.uint16)
    wb = None
    if importance is not None:
        imp = np.asarray(importance, dtype=np.float32).reshape(-1)
        if imp.shape[0] != k or not np.isfinite(imp).all() or (imp < 0).any():
            raise ValueError(f"importance must be {k} finite values >= 0, got shape {imp.shape}")
        imp = imp / imp.mean() if imp.mean() > 0 else np.ones_like(imp)
        wb = imp + np.float32(1e-3)
    wb = None if wb is None else wb.reshape(k // bl, bl)     # cycles over each row's blocks
    rows = max(1, _ROWS_PER_CHUNK_ELEMS // k)

    def chunk(r0: int) -> None:
        r1 = min(n, r0 + rows)
        q, bits = _quantize_blocks(w[r0:r1].reshape(-1, bl), search, wb, qmin, qmax, divisors)
        qs[r0:r1] = pack(q.reshape(r1 - r0, k))
        scales[r0:r1] = bits.reshape(r1 - r0, k // bl)

    _native.each_chunk(chunk, range(0, n, rows))
    return qs, scales


def dequantize_qsi4c32(qs, scales) -> np.ndarray:
    """(qs [N, K/2], scales [N, K/bl]) -> float32 [N, K]."""
    q = unpack_nibbles(qs)
    n, k = q.shape
    nb = np.asarray(scales).shape[1]
    if k % nb:
        raise ValueError(f"scales shape {np.asarray(scales).shape} does not fit K={k}")
    s = bf16_to_f32(scales)
    return (q.reshape(n, nb, k // nb).astype(np.float32) * s[:, :, None]).reshape(n, k)
