"""qai8dx: dynamic asymmetric int8 quantization of activations, one (scale, zero point) per row.

Reference for the C activation quantizer (pk_quantize_qai8dx), which must produce the same
bytes: all arithmetic is float32, rounding is round-half-to-even (C `lrintf`, numpy `rint`).

    rmin = min(0, min(x)), rmax = max(0, max(x))
    scale = (rmax - rmin) / 255            (1.0 when rmax == rmin)
    inv   = 255 / (rmax - rmin)            (1.0 when rmax == rmin)
    zp    = clamp(rint(-128 - rmin * inv), -128, 127)
    q     = clamp(rint(x * inv) + zp, -128, 127)
    x ~= scale * (q - zp)
Including 0 in the range makes 0.0 exactly representable (q == zp).

qai8dx2 adds a second plane: the residual r = x - scale * (q - zp) (float32, in that order)
is quantized the same way, and x ~= plane1 + plane2. With both planes an activation row has
about 16 bits of resolution, which keeps models with outlier channels (SmolLM2's inputs
to down_proj reach 1000x their mean magnitude) as exact as float; see docs/FORMAT.md.
"""
import numpy as np


def quantize_qai8dx(x):
    """x: float32 [M, K] -> (q int8 [M, K], scale float32 [M], zero_point int32 [M])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"qai8dx expects a 2-D [M, K] array, got shape {x.shape}")
    rmin = np.minimum(x.min(axis=1), np.float32(0)).astype(np.float32)
    rmax = np.maximum(x.max(axis=1), np.float32(0)).astype(np.float32)
    rng = (rmax - rmin).astype(np.float32)
    flat = rng == 0
    safe = np.where(flat, np.float32(1), rng).astype(np.float32)
    inv = np.where(flat, np.float32(1), np.float32(255) / safe).astype(np.float32)
    scale = np.where(flat, np.float32(1), safe / np.float32(255)).astype(np.float32)
    zp = np.clip(np.rint(np.float32(-128) - rmin * inv), -128, 127).astype(np.int32)
    q = np.rint(x * inv[:, None]).astype(np.int32) + zp[:, None]
    q = np.clip(q, -128, 127).astype(np.int8)
    return q, scale, zp


def dequantize_qai8dx(q, scale, zero_point):
    q = np.asarray(q, dtype=np.int32)
    return (np.asarray(scale, np.float32)[:, None]
            * (q - np.asarray(zero_point, np.int32)[:, None]).astype(np.float32))


def quantize_qai8dx2(x):
    """float32 [M, K] -> (q int8 [2M, K], scale [2M], zp [2M]): rows 2i / 2i+1 are plane 1
    and the residual plane of row i."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q1, s1, z1 = quantize_qai8dx(x)
    r = x - s1[:, None] * (q1.astype(np.int32) - z1[:, None]).astype(np.float32)
    q2, s2, z2 = quantize_qai8dx(r)
    m, k = x.shape
    q = np.empty((2 * m, k), np.int8)
    q[0::2], q[1::2] = q1, q2
    s = np.empty(2 * m, np.float32)
    s[0::2], s[1::2] = s1, s2
    z = np.empty(2 * m, np.int32)
    z[0::2], z[1::2] = z1, z2
    return q, s, z


def dequantize_qai8dx2(q, scale, zero_point):
    d = dequantize_qai8dx(q, scale, zero_point)
    return d[0::2] + d[1::2]
