"""Calibration: a model measured over calibration text, and the conversions that use it.

It stands above both the converters and the runtime (the converters never import the runtime):
an importance matrix is measured by running the C forward pass, and a calibrated conversion runs
the converter around that measurement.

Importance matrices: the mean squared activation of every linear layer's input channels.

    imat = collect_imatrix(Model("draft.gguf"), tokens)     # {GGUF tensor name: float32 [K]}
    save_imatrix("imatrix.npz", imat, n_tokens)
    pyklei.converters.convert(hf_dir, "model.gguf", imatrix="imatrix.npz")

Weighting each block's quantization error by these numbers minimises the error of the layer's
output instead of its weights (the idea behind llama.cpp's imatrix). The statistics come from
the C forward pass (pk_llama_stats), so any pyklei model can measure them; an 8-bit draft of
the checkpoint (`--keep '*=q8'`) keeps the measurement close to the float model.

Calibrated conversions:

    convert_calibrated("SmolLM2-135M-Instruct/", "smollm2.gguf")

1. converts the checkpoint to an 8-bit draft (every linear weight qsi8cx) in a temporary dir;
2. runs the draft over calibration text and measures each linear layer's input activations
   (collect_imatrix_from_text);
3. converts the checkpoint to qsi4c32 with that importance matrix.

    convert_gptq("SmolLM2-135M-Instruct/", "smollm2.gguf")

tokenizes the calibration text with the checkpoint's own tokenizer (pyklei.text.tokenizer, built
from the metadata the converter would write) and converts with GPTQ over those tokens
(pyklei/converters/gptq.py; the converter runs its own numpy forward pass, no draft file).

How much text, in windows of how many tokens: DEFAULT_CALIBRATION_TOKENS and DEFAULT_SEQ_LEN
(pyklei.converters.calibration_forward), the defaults of every calibrated path.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .converters import ConversionError, convert, resolve_source
from .converters.calibration_forward import DEFAULT_CALIBRATION_TOKENS, DEFAULT_SEQ_LEN
from .formats.llama_tensors import BY_PART, TOKEN_EMBD, for_each_tensor

# Python's own Language Reference ships with every CPython (pydoc_data): real English prose.
# These topics are the evaluation text of the tests and benchmarks and are never calibrated on.
EVAL_TOPICS = ("types", "specialnames", "execmodel", "compound")


def default_calibration_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(v for k, v in sorted(topics.items()) if k not in EVAL_TOPICS)


def evaluation_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in EVAL_TOPICS)


def collect_imatrix(model, tokens: Sequence[int], n_ctx: int = DEFAULT_SEQ_LEN,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Runs `tokens` through `model` (pyklei.runtime.model.Model) in windows of n_ctx tokens and
    returns {GGUF tensor name: mean of x^2 over all rows, per input channel}."""
    tokens = list(tokens)
    n_ctx = min(n_ctx, model.n_ctx)
    if len(tokens) < 2:
        raise ValueError("need calibration text of at least 2 tokens")
    rt = model.runtime
    rt.collect_stats(True)
    try:
        starts = range(0, len(tokens), n_ctx)
        for i, s in enumerate(starts):
            model.logits(tokens[s:s + n_ctx])
            if progress:
                progress(i + 1, len(starts))
        sections, rows, lm_rows = rt.stats_sections()
    finally:
        rt.collect_stats(False)
        model.reset()
    hp = model.hparams
    out: dict[str, np.ndarray] = {}
    # each linear's statistics are those of the activation it reads (the table's `input`, the
    # C layout's section names); the lm_head's are token_embd's when tied
    for name, spec, layer in for_each_tensor(hp):
        if spec.input is None:
            continue
        if layer is None:
            out[name] = (sections[spec.input][0] / max(lm_rows, 1)).astype(np.float32)
        else:
            out[name] = (sections[spec.input][layer] / rows).astype(np.float32)
    if hp.tied:
        lm_in = BY_PART["output"].input
        out[TOKEN_EMBD] = (sections[lm_in][0] / max(lm_rows, 1)).astype(np.float32)
    return out


def save_imatrix(path, imatrix: dict[str, np.ndarray], n_tokens: int) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".part.npz")
    np.savez(tmp, _tokens=np.array(n_tokens), **imatrix)
    tmp.replace(path)


def collect_imatrix_from_text(model_path, text: str, n_ctx: int = DEFAULT_SEQ_LEN,
                              max_tokens: int | None = None, n_threads: int | None = None,
                              progress: Callable[[int, int], None] | None = None
                              ) -> tuple[dict[str, np.ndarray], int]:
    """Loads the model at model_path, tokenizes `text` (its first max_tokens tokens, all when
    None) and runs collect_imatrix over it. -> (imatrix, calibration tokens used)."""
    from .llm import LLM

    llm = LLM(model_path, n_threads=n_threads, n_ctx=n_ctx)
    ids = llm.tokenizer.encode(text, parse_special=False)
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the calibration text has fewer than 2 tokens")
    return collect_imatrix(llm.model, ids, n_ctx=n_ctx, progress=progress), len(ids)


# ---- calibrated conversions ------------------------------------------------------------------


def convert_calibrated(src, out, calibration_text: str | None = None,
                       n_tokens: int = DEFAULT_CALIBRATION_TOKENS, progress: bool = True,
                       log=None, **convert_kw):
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
        imatrix, n_used = collect_imatrix_from_text(draft, text, n_ctx=DEFAULT_SEQ_LEN,
                                                    max_tokens=n_tokens)
        log(f"pass 2/2: converting with the importance of {n_used} calibration tokens")
        return convert(src, out, imatrix=imatrix, progress=progress, **convert_kw)


def calibration_tokens(src, text: str, n_tokens: int, seq_len: int = DEFAULT_SEQ_LEN) -> list[int]:
    """n_tokens token ids of `text` (tokenized as the model at `src` does), as n_tokens //
    seq_len windows of seq_len spread evenly over the text (all of it when shorter)."""
    from .converters import open_source
    from .text.tokenizer import Tokenizer

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


def convert_gptq(src, out, calibration_text: str | None = None,
                 n_tokens: int = DEFAULT_CALIBRATION_TOKENS, seq_len: int = DEFAULT_SEQ_LEN,
                 progress: bool = True, log=None, gptq_options=None, **convert_kw):
    """Conversion whose qsi4c32 weights GPTQ chooses over n_tokens tokens of the calibration
    text (default: default_calibration_text()); returns the ConversionResult.
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
