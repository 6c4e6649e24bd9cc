"""bfloat16 <-> float32, as raw uint16 bit patterns (numpy has no bf16 dtype)."""
import numpy as np


def f32_to_bf16(x) -> np.ndarray:
    """Round float32 to bfloat16 bits, round-to-nearest-even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Add 0x7FFF plus the lowest kept bit, then truncate: ties go to the even pattern.
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (u >> 16) | 0x0040, rounded)
    return out.astype(np.uint16)


def bf16_to_f32(b) -> np.ndarray:
    """Exact widening of bfloat16 bits to float32."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
