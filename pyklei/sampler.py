"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

    sample = make_sampler(temperature=0.7, top_p=0.9, seed=1)
    token = sample(logits)                  # logits: float32 [n_vocab]

Filters apply in llama.cpp's usual order: repetition penalty (a logits processor), top-k,
top-p, min-p, then temperature and a draw. temperature == 0 is greedy (argmax); the same
seed gives the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    repetition_window: int = 64
    seed: int | None = None

    def __post_init__(self):
        # Types first: a string or None would otherwise fail inside numpy, far from the call.
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float),
                           ("min_p", float), ("repetition_penalty", float),
                           ("repetition_window", int), ("seed", int)):
            v = getattr(self, name)
            if name == "seed" and v is None:
                continue
            ok = (int, np.integer) if kind is int else (int, float, np.integer, np.floating)
            if isinstance(v, bool) or not isinstance(v, ok):
                raise TypeError(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                                f"got {v!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repetition_window < 0:
            raise ValueError(f"repetition_window must be >= 0, got {self.repetition_window}")


def apply_repetition_penalty(logits: np.ndarray, history: Sequence[int], penalty: float,
                             window: int) -> np.ndarray:
    """CTRL-style penalty on tokens seen in the last `window` tokens: positive logits are
    divided by `penalty`, negative ones multiplied (as llama.cpp and transformers do)."""
    if penalty == 1.0 or not len(history) or window == 0:
        return logits
    ids = np.unique(np.asarray(history[-window:], dtype=np.int64))
    out = logits.copy()
    v = out[ids]
    out[ids] = np.where(v > 0, v / penalty, v * penalty)
    return out


def make_sampler(temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, seed: int | None = None) -> Callable[[np.ndarray], int]:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if p.temperature == 0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(p.seed)

    def sample(logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float32)
        # candidates: the top_k logits (all when 0), sorted descending
        if 0 < p.top_k < logits.shape[0]:
            idx = np.argpartition(-logits, p.top_k - 1)[:p.top_k]
        else:
            idx = np.arange(logits.shape[0])
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        z = logits[idx].astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        keep = len(idx)
        if p.top_p < 1.0:   # smallest prefix whose mass reaches top_p
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0:     # drop tokens below min_p times the best one's probability
            keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        idx, z = idx[:keep], z[:keep]
        w = np.exp((z - z[0]) / p.temperature)
        return int(idx[rng.choice(keep, p=w / w.sum())])

    return sample
