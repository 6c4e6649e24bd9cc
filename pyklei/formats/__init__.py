"""The format layer: weight and activation formats, their numpy references, GGUF I/O.

Both the converters and the runtime stand on this layer; neither imports the other.
docs/FORMAT.md is the byte-level specification these modules implement; registry.py
describes each weight format once for the converter, the reader, the loader and `info`;
gguf_keys.py holds every GGUF key string.
"""
from .bf16 import bf16_to_f32, f32_to_bf16
from .qai8dx import dequantize_qai8dx, dequantize_qai8dx2, quantize_qai8dx, quantize_qai8dx2
from .qsi4c32 import (
    QSI4C32_BLOCK_SIZES,
    dequantize_qsi4c32,
    pack_nibbles,
    quantize_qsi4c32,
    unpack_nibbles,
)
from .qsi6c32 import dequantize_qsi6c32, quantize_qsi6c32
from .qsi8cx import dequantize_qsi8cx, quantize_qsi8cx
from .qsi8d32 import dequantize_qsi8d32, quantize_qsi8d32
from .registry import WEIGHT_FORMATS, WeightFormat, weight_format

__all__ = [
    "QSI4C32_BLOCK_SIZES",
    "WEIGHT_FORMATS",
    "WeightFormat",
    "bf16_to_f32",
    "dequantize_qai8dx",
    "dequantize_qai8dx2",
    "dequantize_qsi4c32",
    "dequantize_qsi6c32",
    "dequantize_qsi8cx",
    "dequantize_qsi8d32",
    "f32_to_bf16",
    "pack_nibbles",
    "quantize_qai8dx",
    "quantize_qai8dx2",
    "quantize_qsi4c32",
    "quantize_qsi6c32",
    "quantize_qsi8cx",
    "quantize_qsi8d32",
    "unpack_nibbles",
    "weight_format",
]
