"""Perplexity of a model over a token sequence, llama.cpp style: windows of n_ctx tokens
advanced by `stride`; in each window only the tokens past the overlap are scored (the first
window scores all but its first token), so every token is predicted with up to n_ctx of context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass
class PerplexityResult:
    ppl: float
    nll: float              # mean negative log-likelihood (nats per token)
    tokens_scored: int
    windows: int


def log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) for each row: logits float [n, V], targets int [n]."""
    z = logits.astype(np.float64)
    mx = z.max(axis=1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(z - mx).sum(axis=1))
    return z[np.arange(len(targets)), targets] - lse


def perplexity(logits_fn: Callable[[Sequence[int]], np.ndarray], tokens: Sequence[int],
               n_ctx: int, stride: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """logits_fn(window) -> float [len(window), V] logits at every position of the window."""
    tokens = list(tokens)
    stride = stride or n_ctx // 2
    if n_ctx < 2 or not 0 < stride <= n_ctx:
        raise ValueError(f"need n_ctx >= 2 and 0 < stride <= n_ctx (got {n_ctx}, {stride})")
    if len(tokens) < 2:
        raise ValueError("need at least 2 tokens to measure perplexity")
    total, count, windows = 0.0, 0, 0
    starts = list(range(0, max(1, len(tokens) - n_ctx + stride), stride))
    scored_until = 0          # tokens [0, scored_until) have been predicted already
    for i, s in enumerate(starts):
        window = tokens[s:s + n_ctx]
        if len(window) < 2:
            break
        logits = logits_fn(window)
        first = max(1, scored_until - s)          # window positions whose token we score
        lp = log_softmax_at(logits[first - 1:len(window) - 1], np.asarray(window[first:]))
        total -= float(lp.sum())
        count += len(lp)
        windows += 1
        scored_until = s + len(window)
        if progress:
            progress(i + 1, len(starts))
        if scored_until >= len(tokens):
            break
    nll = total / count
    return PerplexityResult(ppl=math.exp(nll), nll=nll, tokens_scored=count, windows=windows)
