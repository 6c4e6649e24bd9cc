"""Which KV cache type a model runs with when asked for "auto" (the default): a runtime choice
made from what this CPU's attention reads fastest.

    choose_kv_cache("auto")     # "bf16" on a CPU with AVX-512 BF16, "f16" elsewhere

Model asks it when it is made (so `pyklei bench` and the server do); Model.kv_cache holds
the answer.
"""
from __future__ import annotations

# what a caller may request: "auto", or a type of the cache (docs/CLI.md): f32, f16, bf16, or
# q8 (int8 with an f16 scale per 32 values, as llama.cpp's q8_0)
KV_CACHES = ("auto", "f32", "f16", "bf16", "q8")


def choose_kv_cache(requested: str = "auto") -> str:
    """The KV cache type to run with: `requested`, or for "auto" bf16 where the forward pass
    reads a bf16 cache with bf16 dot products (AVX-512 BF16, and PYKLEI_ATTENTION not f32) and
    f16 elsewhere.

    Both hold a value in 2 bytes. The bf16 kernels read a bf16 cache where it lies, in the
    order they multiply it, and convert an f16 cache first: at depth 4096 SmolLM2 prefills and
    decodes 1.13x faster with it (docs/KERNELS.md, "A bf16 KV cache in the pairs' order"), at a
    KLD against fp32 level with the f16 cache's on the same positions (docs/QUALITY.md). The f32
    path widens f16 with F16C or NEON, and would unpair bf16 values row by row: f16 there."""
    if requested not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {requested!r}")
    if requested != "auto":
        return requested
    from .kernels import load_ext   # here: options.py takes KV_CACHES without the extension
    # quietly: the forward pass logs the same choice (PYKLEI_LOG=kernels) when it is made
    return "bf16" if load_ext().attention_bf16_pick("bf16", log=False) else "f16"
