"""The weight formats of a pyklei file, each described once.

    fmt = WEIGHT_FORMATS["qsi4c32"]        # or weight_format("q4"), the converter's short name
    fmt.stored(n, k, bl)                   # the GGUF tensors it is stored as: qs, then scales
    qs, scales = fmt.quantize(x, bl)       # numpy reference (docs/FORMAT.md)

The converter, the model-file reader, the model loader, `pyklei info` and the imatrix code
consult this table rather than branching on format names; docs/FORMAT.md specifies the bytes,
pyklei_ext/contract/pk_format.h gives the kernels the same formats (`c_id`; tests check the two
agree). A quantized format is stored as two GGUF tensors: NAME (the packed values, GGUF I8)
and NAME.scales, and the key pyklei.format.NAME names the format. A plain format (f32, f16,
bf16) is one tensor of its own GGUF type and has no key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .bf16 import bf16_to_f32, f32_to_bf16
from .qsi4c32 import QSI4C32_BLOCK_SIZES, dequantize_qsi4c32, quantize_qsi4c32
from .qsi6c32 import dequantize_qsi6c32, quantize_qsi6c32
from .qsi8cx import dequantize_qsi8cx, quantize_qsi8cx

# GGUF tensor type ids (the GGUF specification's ggml_type) of the tensors pyklei writes.
GGML_F32, GGML_F16, GGML_I8, GGML_BF16 = 0, 1, 24, 30
GGML_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_I8: "I8", GGML_BF16: "BF16"}
GGML_NUMPY = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_I8: np.int8, GGML_BF16: np.uint16}


@dataclass(frozen=True)
class Stored:
    """One GGUF tensor of a stored weight: numpy shape, GGUF type, numpy dtype of its data."""
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def dtype(self):
        return GGML_NUMPY[self.ggml_type]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class WeightFormat:
    name: str                     # the value of pyklei.format.<tensor>; the kernels' name
    alias: str                    # the converter's short name (--keep PATTERN=q4)
    c_id: int | None              # pk_format (pyklei_ext/contract/pk_format.h); None: plain
    ggml_type: int                # GGUF type of the values tensor (I8 for quantized formats)
    block_sizes: tuple[int, ...]  # block lengths along K it allows; () : none (per row / plain)
    quantize: Callable            # (x f32 [n, k], bl, importance) -> the stored arrays
    dequantize: Callable          # (*stored arrays) -> f32 [n, k]
    qs_cols: Callable[[int], int] | None = None        # quantized: bytes per row, from K
    scales_shape: Callable | None = None               # quantized: (n, k, bl) -> shape
    scales_type: int | None = None                     # quantized: GGUF type of .scales
    qs_dtype: type = np.uint8                          # quantized: numpy view of the I8 bytes

    @property
    def quantized(self) -> bool:
        return self.c_id is not None

    def check(self, k: int, bl: int) -> str | None:
        """Why a [*, K] weight cannot be stored in this format at group size bl, or None."""
        bl = self.block_length(k, bl)
        if self.block_sizes and bl not in self.block_sizes:
            return f"{self.name} block size {bl} is not one of {self.block_sizes}"
        if self.block_sizes and k % bl:
            return f"{self.name} needs K divisible by {bl}, K={k}"
        return None

    def block_length(self, k: int, bl: int) -> int:
        """The block length a weight of this format uses when the file's group size is bl:
        a fixed size (qsi6c32: 32), the whole row (qsi8cx), or bl (qsi4c32)."""
        if not self.block_sizes:
            return k
        return self.block_sizes[0] if len(self.block_sizes) == 1 else bl

    def stored(self, shape: tuple[int, ...], bl: int) -> list[Stored]:
        """The GGUF tensors of a weight of this (numpy) shape: [values] or [qs, scales]."""
        if not self.quantized:
            return [Stored(tuple(shape), self.ggml_type)]
        n, k = shape
        return [Stored((n, self.qs_cols(k)), GGML_I8),
                Stored(self.scales_shape(n, k, self.block_length(k, bl)), self.scales_type)]

    def block_length_of(self, k: int, scales_shape: tuple[int, ...]) -> int | None:
        """The block length that a stored .scales tensor of this shape implies for rows of K,
        or None when it implies no valid one."""
        if not self.block_sizes:
            return k if len(scales_shape) == 1 else None
        nb = scales_shape[-1] if len(scales_shape) == 2 else 0
        if nb <= 0 or k % nb or (k // nb) not in self.block_sizes:
            return None
        return k // nb


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("qsi4c32", "q4", 0, GGML_I8, QSI4C32_BLOCK_SIZES,
                 quantize=lambda x, bl, imp: quantize_qsi4c32(x, bl, importance=imp),
                 dequantize=dequantize_qsi4c32,
                 qs_cols=lambda k: k // 2, scales_shape=lambda n, k, bl: (n, k // bl),
                 scales_type=GGML_BF16),
    WeightFormat("qsi6c32", "q6", 2, GGML_I8, (32,),
                 quantize=lambda x, bl, imp: quantize_qsi6c32(x, importance=imp),
                 dequantize=dequantize_qsi6c32,
                 qs_cols=lambda k: k // 32 * 24, scales_shape=lambda n, k, bl: (n, k // 32),
                 scales_type=GGML_BF16),
    WeightFormat("qsi8cx", "q8", 1, GGML_I8, (),
                 quantize=lambda x, bl, imp: quantize_qsi8cx(x),
                 dequantize=dequantize_qsi8cx,
                 qs_cols=lambda k: k, scales_shape=lambda n, k, bl: (n,),
                 scales_type=GGML_F32, qs_dtype=np.int8),
    WeightFormat("f16", "f16", None, GGML_F16, (),
                 quantize=lambda x, bl, imp: (np.asarray(x, np.float32).astype(np.float16),),
                 dequantize=lambda h: np.asarray(h).astype(np.float32)),
    WeightFormat("bf16", "bf16", None, GGML_BF16, (),
                 quantize=lambda x, bl, imp: (f32_to_bf16(x),),
                 dequantize=bf16_to_f32),
    WeightFormat("f32", "f32", None, GGML_F32, (),
                 quantize=lambda x, bl, imp: (np.asarray(x, np.float32),),
                 dequantize=lambda x: np.asarray(x, np.float32).copy()),
)}

QUANTIZED = tuple(n for n, f in WEIGHT_FORMATS.items() if f.quantized)
PLAIN_BY_GGML = {f.ggml_type: f for f in WEIGHT_FORMATS.values() if not f.quantized}

# Other spellings users type for a format (--keep), beside its name and alias.
_SPELLINGS = {"4": "qsi4c32", "6": "qsi6c32", "8": "qsi8cx", "q8_0": "qsi8cx", "16": "f16"}


def weight_format(spelling: str) -> WeightFormat:
    """The format named by its name ("qsi4c32"), alias ("q4") or a bit count ("4");
    ValueError naming the choices otherwise."""
    s = str(spelling).strip().lower()
    s = _SPELLINGS.get(s, s)
    for f in WEIGHT_FORMATS.values():
        if s in (f.name, f.alias):
            return f
    raise ValueError(f"unknown format {spelling!r}; use one of "
                     f"{', '.join(f.alias for f in WEIGHT_FORMATS.values())}")
