"""Importance matrices: the mean squared activation of every linear layer's input channels,
measured by running a model over calibration text.

    imat = collect_imatrix(Model("draft.gguf"), tokens)     # {GGUF tensor name: float32 [K]}
    save_imatrix("imatrix.npz", imat, n_tokens)
    pyklei.converters.convert(hf_dir, "model.gguf", imatrix="imatrix.npz")

Weighting each block's quantization error by these numbers minimises the error of the layer's
output instead of its weights (the idea behind llama.cpp's imatrix). The statistics come from
the C forward pass (pk_llama_stats), so any pyklei model can measure them; an 8-bit draft of
the checkpoint (`--keep '*=q8'`) keeps the measurement close to the float model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

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


def collect_imatrix(model, tokens: Sequence[int], n_ctx: int = 512,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Runs `tokens` through `model` (pyklei.model.Model) in windows of n_ctx tokens and
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


def collect_imatrix_from_text(model_path, text: str, n_ctx: int = 512,
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
