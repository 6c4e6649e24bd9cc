"""pyklei's converters: Hugging Face Llama checkpoints or llama.cpp GGUF files -> one
self-contained pyklei GGUF (qsi4c32 weights). See docs/FORMAT.md, section "Converter".

    from pyklei.converters import convert
    result = convert("SmolLM2-135M-Instruct/", "smollm2.gguf")
    print(result.summary())
"""
from __future__ import annotations

from pathlib import Path

from .core import DEFAULT_EMBEDDING_BITS, ConversionResult, write_model
from .errors import ConversionError

__all__ = ["ConversionError", "ConversionResult", "convert", "DEFAULT_EMBEDDING_BITS"]


def convert(hf_dir, out_path, group_size: int = 32,
            embedding_bits: int = DEFAULT_EMBEDDING_BITS, keep=None, name: str | None = None,
            force: bool = False, progress: bool = False, imatrix=None,
            norm_weighting: bool = False) -> ConversionResult:
    """Convert a Hugging Face LlamaForCausalLM directory, or a llama.cpp GGUF file of a llama
    model, into a pyklei GGUF at out_path (written atomically).

    group_size: qsi4c32 block length (32, 64, 128, 256).
    embedding_bits: 4 (qsi4c32), 6 (qsi6c32, default), 8 (qsi8cx) or 16 (f16) for token_embd.weight and,
        if the model is untied, output.weight.
    keep: ["PATTERN=FMT", ...] or {PATTERN: FMT}: fnmatch patterns over GGUF (or HF) tensor
        names; FMT a format name or alias (q4, q6, q8, f16, bf16, f32; qsi4c32, ...); the first
        matching pattern wins.
    imatrix: importance per input channel ({GGUF name: float [K]} or an .npz path from
        `pyklei imatrix`): each qsi4c32 block's scale minimises the importance-weighted error.
    norm_weighting: without a measured imatrix for a weight, weigh the error of each input
        channel of q/k/v, gate/up and the lm_head by the squared gain of the RMSNorm before
        it (data-free; see core.norm_gain_importance). Default False: plain squared error.
    Raises ConversionError (a ValueError) for bad input; no output file is left behind then.
    """
    src_path = Path(hf_dir)
    out_path = Path(out_path)
    if not src_path.exists():
        raise ConversionError(f"missing input: {src_path} does not exist")
    if out_path.exists() and not force:
        raise ConversionError(f"{out_path} exists; pass force=True (--force) to overwrite it")
    if out_path.exists() and src_path.resolve() == out_path.resolve():
        raise ConversionError("the output path is the input file")
    if src_path.is_file():
        from .llamacpp_gguf import gguf_source
        src = gguf_source(src_path, name)
    else:
        from .hf_llama import hf_source
        src = hf_source(src_path, name)
    try:
        return write_model(src, out_path, group_size=group_size, embedding_bits=embedding_bits,
                           keep=keep, name=name, force=force, progress=progress, imatrix=imatrix,
                           norm_weighting=norm_weighting)
    finally:
        if src.close:
            src.close()
