"""Jobs that span the converter and the runtime (the top floor, beside the CLI).

    convert_calibrated("SmolLM2-135M-Instruct/", "smollm2.gguf")

1. converts the checkpoint to an 8-bit draft (every linear weight qsi8cx) in a temporary dir;
2. runs the draft over calibration text and measures each linear layer's input activations
   (pyklei.imatrix);
3. converts the checkpoint to qsi4c32 with that importance matrix.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from .converters import convert
from .imatrix import collect_imatrix_from_text, default_calibration_text


def convert_calibrated(src, out, calibration_text: str | None = None, n_tokens: int = 8192,
                       progress: bool = True, log=None, **convert_kw):
    """Two-pass conversion with an importance matrix; returns the ConversionResult of pass 2.
    convert_kw go to pyklei.converters.convert (group_size, embedding_bits, keep, name, force)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(out)
    if out.exists() and not convert_kw.get("force"):
        from .converters import ConversionError
        raise ConversionError(f"{out} exists; pass force=True (--force) to overwrite it")
    text = calibration_text if calibration_text is not None else default_calibration_text()
    parent = out.parent if out.parent.exists() else None
    with tempfile.TemporaryDirectory(dir=parent, prefix=".pyklei-calibrate-") as tmp:
        draft = Path(tmp) / "draft-q8.gguf"
        log("pass 1/2: 8-bit draft for calibration")
        convert(src, draft, keep=["*=q8"], embedding_bits=8, progress=progress)
        imatrix, n_used = collect_imatrix_from_text(draft, text, n_ctx=512, max_tokens=n_tokens)
        log(f"pass 2/2: converting with the importance of {n_used} calibration tokens")
        return convert(src, out, imatrix=imatrix, progress=progress, **convert_kw)
