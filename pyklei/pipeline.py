"""Jobs that span the converter and the runtime (the top floor, beside the CLI).

    convert_calibrated("SmolLM2-135M-Instruct/", "smollm2.gguf")

1. converts the checkpoint to an 8-bit draft (every linear weight qsi8cx) in a temporary dir;
2. runs the draft over calibration text and measures each linear layer's input activations
   (pyklei.imatrix);
3. converts the checkpoint to qsi4c32 with that importance matrix.

    convert_gptq("SmolLM2-135M-Instruct/", "smollm2.gguf")

tokenizes the calibration text with the checkpoint's own tokenizer (pyklei.tokenizer, built
from the metadata the converter would write) and converts with GPTQ over those tokens
(pyklei/converters/gptq.py; the converter runs its own numpy forward pass, no draft file).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from .converters import ConversionError, convert, resolve_source
from .imatrix import collect_imatrix_from_text, default_calibration_text


def convert_calibrated(src, out, calibration_text: str | None = None, n_tokens: int = 8192,
                       progress: bool = True, log=None, **convert_kw):
    """Two-pass conversion with an importance matrix; returns the ConversionResult of pass 2.
    convert_kw go to pyklei.converters.convert (group_size, embedding_bits, keep, name, force)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(out)
    if out.exists() and not convert_kw.get("force"):
        raise ConversionError(f"{out} exists; pass force=True (--force) to overwrite it")
    src = resolve_source(src, convert_kw.pop("revision", None), convert_kw.pop("filename", None))
    text = calibration_text if calibration_text is not None else default_calibration_text()
    parent = out.parent if out.parent.exists() else None
    with tempfile.TemporaryDirectory(dir=parent, prefix=".pyklei-calibrate-") as tmp:
        draft = Path(tmp) / "draft-q8.gguf"
        log("pass 1/2: 8-bit draft for calibration")
        convert(src, draft, keep=["*=q8"], embedding_bits=8, progress=progress)
        imatrix, n_used = collect_imatrix_from_text(draft, text, n_ctx=512, max_tokens=n_tokens)
        log(f"pass 2/2: converting with the importance of {n_used} calibration tokens")
        return convert(src, out, imatrix=imatrix, progress=progress, **convert_kw)


def calibration_tokens(src, text: str, n_tokens: int, seq_len: int = 512) -> list[int]:
    """n_tokens token ids of `text` (tokenized as the model at `src` does), as n_tokens //
    seq_len windows of seq_len spread evenly over the text (all of it when shorter)."""
    from .converters import open_source
    from .tokenizer import Tokenizer

    source = open_source(src)
    try:
        tok = Tokenizer.from_metadata({k: v for k, v, *_ in source.kv}, path=str(src))
    finally:
        if source.close:
            source.close()
    ids = tok.encode(text, parse_special=False)
    n_win = max(1, n_tokens // seq_len)
    if len(ids) <= n_win * seq_len:
        return ids
    starts = np.linspace(0, len(ids) - seq_len, n_win).astype(int)
    return [t for s in starts for t in ids[s:s + seq_len]]


def convert_gptq(src, out, calibration_text: str | None = None, n_tokens: int = 8192,
                 seq_len: int = 512, progress: bool = True, log=None, gptq_options=None,
                 **convert_kw):
    """Conversion whose qsi4c32 weights GPTQ chooses over n_tokens tokens of the calibration
    text (default: pyklei.imatrix.default_calibration_text()); returns the ConversionResult.
    gptq_options: extra fields of converters.calibration_forward.GPTQOptions (damp, ...)."""
    from .converters.calibration_forward import GPTQOptions

    log = log or (lambda msg: print(msg, file=sys.stderr))
    if Path(out).exists() and not convert_kw.get("force"):   # before a download, a tokenization
        raise ConversionError(f"{out} exists; pass force=True (--force) to overwrite it")
    # a hub id is resolved once here: the tokenizer and the converter read the same files
    src = resolve_source(src, convert_kw.pop("revision", None), convert_kw.pop("filename", None))
    text = calibration_text if calibration_text is not None else default_calibration_text()
    ids = calibration_tokens(src, text, n_tokens, seq_len)
    opts = GPTQOptions(ids, seq_len=seq_len, log=log if progress else None, **(gptq_options or {}))
    result = convert(src, out, gptq=opts, progress=progress, **convert_kw)
    if convert_kw.get("rotate"):          # the method the ladder's measurements are of
        from .converters.recipes import expected_quality
        result.notes.append(expected_quality(result.block_linear_bits()))
    return result
