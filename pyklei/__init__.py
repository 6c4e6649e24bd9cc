"""pyklei: 4-bit Llama-family inference on CPUs from Python.

KleidiAI-style int8-activation x int4-weight kernels (qai8dx x qsi4c32) in a llama.cpp-like
GGUF workflow. Layers, top to bottom: API/CLI (llm, cli) -> model runtime (model, generate,
sampler, tokenizer) -> kernel layer (pyklei._ext over pyklei_ext/) -> ISA kernels; the
converters (pyklei.converters) and the runtime share the format layer (pyklei.formats).
"""
__version__ = "0.1.0"

# The API is imported on first use (PEP 562): `import pyklei` and pyklei.formats then work
# without the compiled extension, which only the runtime needs (pyklei._native).
_LAZY = {"LLM": ".llm", "load": ".llm", "Tokenizer": ".tokenizer",
         "available_kernels": ".kernels", "cpu_features": ".kernels"}

__all__ = ["LLM", "Tokenizer", "__version__", "available_kernels", "cpu_features", "load"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pyklei' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
