"""qsi8cx: symmetric int8 weights with one float32 scale per output row (channel).

For tensors a user keeps at 8 bits (embeddings, lm_head):
    qs     int8    [N, K]
    scales float32 [N]      scale = absmax(row) / 127 (0 for an all-zero row)
    W[n, k] ~= scales[n] * qs[n, k],  qs = clamp(rint(W / scale), -127, 127)
"""
import numpy as np


def quantize_qsi8cx(w):
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"qsi8cx expects a 2-D [N, K] weight, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or Inf values; cannot quantize")
    scale = (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_qsi8cx(qs, scales):
    return np.asarray(qs, np.int8).astype(np.float32) * np.asarray(scales, np.float32)[:, None]
