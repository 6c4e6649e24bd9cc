"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

    sample = make_sampler(temperature=0.7, top_p=0.9, seed=1)
    token = sample(logits)                  # logits: float32 [n_vocab]

Filters apply in llama.cpp's usual order: repetition penalty (a logits processor), top-k,
top-p, min-p, then temperature and a draw. temperature == 0 is greedy (argmax); the same
seed gives the same tokens. A Sampler also gives the distribution it draws from (probs), and
speculative_choice is speculative sampling's acceptance rule over two such distributions.

SAMPLING_OPTIONS is the one schema of the generation options (max_tokens and SamplingParams'
fields; pyklei.runtime.options.Option records): type, default, range, CLI flags and help.
SamplingParams checks itself with it, the CLI makes its sampling flags from it, pyklei.server
checks requests with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np

from .options import Option


# ---- the schema: one entry per option, read by SamplingParams, the CLI and the server ----------

SAMPLING_OPTIONS: tuple[Option, ...] = (
    # max_tokens is pyklei.runtime.request.token_budget's: callers pick their own default
    # (LLM.generate 256, chat 512, `pyklei generate` 128).
    Option("max_tokens", int, 256, ("-n", "--max-tokens"), "N", "token count",
                   "tokens to generate at most",
                   "default %(default)s; -1: until the context is full", lo=-1, optional=True,
                   note=" (None or -1: until the context is full)"),
    Option("temperature", float, 0.8, ("--temperature", "--temp"), "T", "temperature",
                   "randomness; 0 is greedy, always the most likely token", lo=0),
    Option("top_k", int, 40, ("--top-k",), "K", "top-k",
                   "sample from the K most likely tokens; 0 disables it", lo=0,
                   note=" (0 disables it)"),
    Option("top_p", float, 0.95, ("--top-p",), "P", "top-p",
                   "nucleus sampling threshold in (0, 1]; 1 disables it", lo=0, hi=1,
                   lo_open=True),
    Option("min_p", float, 0.05, ("--min-p",), "P", "min-p",
                   "drop tokens less likely than P x the most likely one; 0 disables it",
                   lo=0, hi=1, hi_open=True),
    # Bounded so that a penalised logit stays finite: |logit| x 100 cannot overflow float32 for
    # any logit a model produces (a penalty of 1e-39 made +inf, then NaN probabilities).
    Option("repetition_penalty", float, 1.0, ("--repeat-penalty",), "X", "repeat penalty",
                   "penalty on recently seen tokens, in [0.01, 100]; 1 disables it",
                   lo=0.01, hi=100),
    Option("repetition_window", int, 64, ("--repeat-last-n",), "N", "window",
                   "tokens the repeat penalty looks back over", lo=0),
    # OpenAI's penalties and range; llama.cpp's --presence-penalty / --frequency-penalty.
    Option("presence_penalty", float, 0.0, ("--presence-penalty",), "X", "presence penalty",
                   "subtract X from the logit of every token already generated; 0 disables it",
                   lo=-2, hi=2),
    Option("frequency_penalty", float, 0.0, ("--frequency-penalty",), "X",
                   "frequency penalty", "subtract X times its count so far from the logit of "
                   "every token already generated; 0 disables it", lo=-2, hi=2),
    # -1 is "random", as in llama.cpp and llama-cpp-python; numpy takes seeds below 2**64.
    Option("seed", int, None, ("--seed",), "N", "seed",
                   "random seed, for repeatable sampling; -1: random", "default: random",
                   lo=-1, hi=2**64 - 1, optional=True, note=" (None or -1: random)"),
)
OPTION = {o.name: o for o in SAMPLING_OPTIONS}
MAX_TOKENS = OPTION["max_tokens"]


def _default(name):
    return OPTION[name].default


@dataclass(frozen=True)
class SamplingParams:
    """The sampling options of SAMPLING_OPTIONS (all but max_tokens), checked when made."""
    temperature: float = _default("temperature")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    min_p: float = _default("min_p")
    repetition_penalty: float = _default("repetition_penalty")
    repetition_window: int = _default("repetition_window")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    seed: int | None = _default("seed")
    # token id -> bias added to its logit, in [-100, 100]; -100 bans the token (OpenAI's
    # logit_bias). A mapping is accepted and kept as sorted (id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        opts = [OPTION[f.name] for f in fields(self) if f.name in OPTION]
        # Types first: a string or None would otherwise fail inside numpy, far from the call.
        for o in opts:
            o.check_type(getattr(self, o.name))
        for o in opts:
            o.check_range(getattr(self, o.name))
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))


LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_TOKENS = 1024      # entries at most (OpenAI allows 300)


def check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, or the TypeError / ValueError naming what is
    wrong. Keys may be ints or decimal strings (JSON object keys are strings)."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    if len(items) > LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias has {len(items)} entries; at most {LOGIT_BIAS_TOKENS}")
    out = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"logit_bias must map token ids to numbers, got {item!r}")
        k, v = item
        if isinstance(k, str) and k.isdigit() and len(k) <= 10:
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise TypeError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"logit_bias[{k}] must be a number, got {v!r}")
        try:
            finite = math.isfinite(v)
        except OverflowError:
            finite = False
        if not finite or abs(v) > LOGIT_BIAS_MAX:
            raise ValueError(f"logit_bias[{k}] must be in [-100, 100], got {v}")
        out[int(k)] = float(v)
    return tuple(sorted(out.items()))


def apply_logit_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """Adds each bias to its token's logit; a bias of -100 bans the token (-inf), so that it can
    never be sampled, as OpenAI documents. Ids beyond the vocabulary are the caller's to refuse."""
    if not bias:
        return logits
    ids = np.fromiter((k for k, _ in bias), np.int64, len(bias))
    add = np.fromiter((v for _, v in bias), np.float32, len(bias))
    out = logits.copy()
    out[ids] = np.where(add <= -LOGIT_BIAS_MAX, -np.inf, out[ids] + add)
    return out


def apply_presence_frequency(logits: np.ndarray, counts: dict[int, int], presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's penalties: logit[j] -= counts[j] * frequency + (counts[j] > 0) * presence, where
    counts are the tokens generated so far (the prompt is not counted)."""
    if not counts or (presence == 0 and frequency == 0):
        return logits
    ids = np.fromiter(counts.keys(), np.int64, len(counts))
    c = np.fromiter(counts.values(), np.float32, len(counts))
    out = logits.copy()
    out[ids] -= c * np.float32(frequency) + np.float32(presence)
    return out


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


class NonFiniteLogitsError(ValueError):
    """The logits to sample from hold NaN or +inf, or nothing above -inf: there is no
    distribution to draw from. Raised for the one request whose logits they are."""


def check_logits(logits: np.ndarray) -> None:
    """NonFiniteLogitsError unless the largest logit is finite. One reduction: max() is NaN when
    any logit is NaN, +inf when one is +inf, -inf when every token is banned (-inf is a ban,
    as a logit bias or a grammar mask writes it)."""
    top = float(np.max(logits))
    if not math.isfinite(top):
        what = ("NaN" if math.isnan(top) else "+inf" if top > 0
                else "no token that is not banned (every logit is -inf)")
        raise NonFiniteLogitsError(f"the logits hold {what}: cannot sample a token")


class Sampler:
    """Draws a token from logits: greedy (temperature 0: argmax) or from the distribution
    probs() gives (top-k, top-p, min-p, then temperature), with the seeded generator `rng`.
    The same seed gives the same tokens. probs() is for speculative sampling
    (pyklei.runtime.speculative), which needs the distribution a draw comes from, not only the draw."""

    def __init__(self, params: "SamplingParams"):
        self.params = params
        self.greedy = params.temperature == 0
        self.rng = None if self.greedy else np.random.default_rng(
            None if params.seed == -1 else params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            token = int(np.argmax(logits))
            if not math.isfinite(logits[token]):    # NaN is its own argmax; +inf, all -inf
                check_logits(logits)
            return token
        idx, w = self._candidates(logits)
        return int(idx[self.rng.choice(len(idx), p=w)])

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """float64 [n_vocab]: the probability that __call__ draws each token (one-hot at the
        argmax when greedy)."""
        out = np.zeros(np.shape(logits)[-1], np.float64)
        if self.greedy:
            out[self(logits)] = 1.0
        else:
            idx, w = self._candidates(logits)
            out[idx] = w
        return out

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The token ids that may be drawn and their probabilities (summing to 1)."""
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        check_logits(logits)
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
        return idx, w / w.sum()


def make_sampler(temperature: float = _default("temperature"), top_k: int = _default("top_k"),
                 top_p: float = _default("top_p"), min_p: float = _default("min_p"),
                 seed: int | None = None) -> Sampler:
    return Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, seed=seed))


def speculative_choice(p: np.ndarray, q: np.ndarray, token: int,
                       rng: np.random.Generator) -> int:
    """Speculative sampling's rule for one drafted position (Leviathan et al. 2023, Chen et al.
    2023): `token` was drawn from the draft's distribution q; the target's is p (both
    [n_vocab], the distributions the samplers actually draw from). Keeps `token` with
    probability min(1, p[token] / q[token]); otherwise draws from the normalised residual
    max(0, p - q). The token returned is distributed exactly as p, whatever q is; it differs
    from `token` only when the draft was rejected (the residual is 0 where q >= p)."""
    if rng.random() * q[token] < p[token]:
        return int(token)
    residual = np.maximum(p - q, 0.0)
    ids = np.flatnonzero(residual)
    if ids.size == 0:
        # p == q up to rounding: a rejection then has probability ~1e-16, and p is the answer
        ids, residual = np.flatnonzero(p), p
    w = residual[ids]
    return int(ids[rng.choice(ids.size, p=w / w.sum())])
