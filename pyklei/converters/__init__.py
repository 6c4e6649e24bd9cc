"""pyklei's converters: Hugging Face checkpoints or llama.cpp GGUF files -> one
self-contained pyklei GGUF (qsi4c32 weights). See docs/FORMAT.md, section "Converter".

    from pyklei.converters import convert
    result = convert("SmolLM2-135M-Instruct/", "smollm2.gguf")
    print(result.summary())
"""
from __future__ import annotations

import os
from pathlib import Path

from .core import DEFAULT_EMBEDDING_BITS, ConversionResult, write_model
from .errors import ConversionError

__all__ = ["ConversionError", "ConversionResult", "convert", "open_source", "resolve_source",
           "DEFAULT_EMBEDDING_BITS"]


def resolve_source(src, revision: str | None = None, filename: str | None = None) -> Path:
    """The local checkpoint directory or GGUF file that `src` names: the path itself when it
    exists; a Hugging Face Hub id (`org/name`) is downloaded into the hub cache (pyklei.hub):
    its safetensors checkpoint, or with filename one GGUF file of the repo. revision: a branch,
    tag or commit of the repo."""
    from pyklei.hub import HubError, checkpoint_dir, hub_file, is_repo_id

    path = Path(src)
    if path.exists():
        if revision is not None or filename is not None:
            raise ConversionError(f"{src} is a local path; a revision or file names part of a "
                                  f"Hugging Face repository (org/name)")
        return path
    if not is_repo_id(src):
        raise ConversionError(f"missing input: {path} does not exist")
    if filename is not None and not filename.endswith(".gguf"):
        raise ConversionError(f"the file of a hub repository to convert must be a .gguf file, "
                              f"got {filename!r}")
    try:
        if filename is not None:
            return hub_file(os.fspath(src), filename, revision)
        return checkpoint_dir(os.fspath(src), revision)
    except HubError as e:
        raise ConversionError(str(e)) from None


def open_source(path, name: str | None = None):
    """A core.ModelSource of a llama.cpp GGUF file or a Hugging Face checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"missing input: {path} does not exist")
    if path.is_file():
        from .llamacpp_gguf import gguf_source
        return gguf_source(path, name)
    from .hf_llama import hf_source
    return hf_source(path, name)


def convert(hf_dir, out_path, group_size: int = 32,
            embedding_bits: int = DEFAULT_EMBEDDING_BITS, keep=None, name: str | None = None,
            force: bool = False, progress: bool = False, imatrix=None,
            norm_weighting: bool = False, rotate: bool = False,
            gptq=None, recipe: str | None = None, bits: float | None = None,
            revision: str | None = None, filename: str | None = None) -> ConversionResult:
    """Convert a Hugging Face checkpoint directory of a family pyklei runs
    (pyklei.formats.families.supported()), or a llama.cpp GGUF file, into a pyklei GGUF at
    out_path (written atomically). hf_dir may also be a Hugging Face Hub id, `org/name`
    (resolve_source: downloaded into the hub cache; revision, and filename for a GGUF repo's
    file).

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
    rotate: rotate the model first (rotation.py: residual stream, value heads and
        down_proj's input, QuaRot-style), so that 4-bit weights and int8 activations lose less.
    gptq: a calibration_forward.GPTQOptions (its calibration tokens, ...): the block linears'
        qsi4c32 (and qsi6c32) weights are chosen by GPTQ over those tokens (gptq.py)
        instead of plain rounding; None (default): plain rounding.
    recipe: a named size/quality recipe (recipes.py: q4, q4m, q6): which block
        linears are stored at 6 bits. bits: instead, a target for the block linears' average
        bits per weight; the most sensitive kinds go to 6 bits while it fits. The user's keep
        rules come first either way.
    Raises ConversionError (a ValueError) for bad input; no output file is left behind then.
    """
    out_path = Path(out_path)
    if out_path.exists() and not force:   # before any download
        raise ConversionError(f"{out_path} exists; pass force=True (--force) to overwrite it")
    src_path = resolve_source(hf_dir, revision, filename)
    if out_path.exists() and src_path.resolve() == out_path.resolve():
        raise ConversionError("the output path is the input file")
    if recipe is not None and bits is not None:
        raise ConversionError("give either a recipe or a bits target, not both")
    src = open_source(src_path, name)
    keep = _ladder_keep(src, keep, recipe, bits, group_size)
    if rotate:
        from .rotation import rotate_source
        src = rotate_source(src)
    try:
        if gptq is not None:
            from .calibration_forward import gptq_source
            src = gptq_source(src, gptq, group_size)
        return write_model(src, out_path, group_size=group_size, embedding_bits=embedding_bits,
                           keep=keep, name=name, force=force, progress=progress, imatrix=imatrix,
                           norm_weighting=norm_weighting)
    finally:
        if src.close:
            src.close()


def _ladder_keep(src, keep, recipe, bits, group_size):
    """The user's --keep rules, then the ones of a recipe or a --bits target."""
    from pyklei.formats.llama_tensors import layer_of

    from .core import parse_keep
    from .recipes import bits_keep, recipe_keep
    if recipe is None and bits is None:
        return keep
    extra = recipe_keep(recipe) if recipe is not None else bits_keep(
        float(bits), {t.name: t.shape for t in src.tensors
                      if t.kind == "linear" and layer_of(t.name) is not None}, group_size)
    return parse_keep(keep) + extra
