"""pyklei: 4-bit Llama-family inference on CPUs from Python.

KleidiAI-style int8-activation x int4-weight kernels (qai8dx x qsi4c32) in a llama.cpp-like
GGUF workflow. Layers, top to bottom: API/CLI (llm, cli) -> model runtime (model, generate,
sampler, tokenizer) -> kernel layer (pyklei._ext over pyklei_ext/) -> ISA kernels; the
converters and the runtime share the format layer (pyklei.formats).
"""
__version__ = "0.1.0"

from .kernels import available_kernels, cpu_features  # noqa: E402
from .llm import LLM, load  # noqa: E402
from .tokenizer import Tokenizer  # noqa: E402

__all__ = ["LLM", "Tokenizer", "__version__", "available_kernels", "cpu_features", "load"]
