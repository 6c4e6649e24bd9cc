# cython: language_level=3, boundscheck=False, wraparound=False
"""pyklei._ext: the Python face of the C layers (pyklei_ext/contract, ops, isa, model).

Kernels run with the GIL released on a persistent thread pool owned by an `Ops` object.
"""
from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t, uint32_t

import numpy as np

# One extension module, built from this file and its includes, by concern:
#   _ext_matmul.pxi   formats, kernels and their dispatch, activation quantizers, QWeight, Ops
#   _ext_llama.pxi    the C ops' and the Llama forward pass's declarations; LlamaRuntime
#   _ext_nn.pxi       the C ops' entry points for tests: rotation, f16 reader, q8 KV rows,
#                     attention
#   _ext_convert.pxi  the converter's block-scale search (pyklei.formats.qsi4c32)
include "_ext_matmul.pxi"
include "_ext_llama.pxi"
include "_ext_nn.pxi"
include "_ext_convert.pxi"
