"""Sentence embeddings from a decoder model: its final hidden states, pooled and normalised.

    batch = EmbeddingBatch([ids_a, ids_b], pooling="mean")
    while not batch.step(model, slots=[1, 2, 3], max_rows=512):
        pass
    vectors = finish(batch.pooled(), normalize=True, dimensions=None)   # float32 [2, n_embd]

What a vector is: the output of the model's final RMSNorm (Model.hidden_states: what
sentence-transformers and llama.cpp's --embedding take from a decoder model; the lm_head does
not run), pooled over the input's tokens by `pooling`, then cut to `dimensions` (Matryoshka
models) and L2-normalised. Poolings, as llama.cpp names them (gguf_keys.POOLING_TYPES): "mean"
(of every token's row), "last" (the last token's row: decoder embedding models such as
Qwen3-Embedding) and "cls" (the first token's row). A file's own pooling is the one its
checkpoint declared at conversion (a sentence-transformers `1_Pooling/config.json`, or
llama.cpp's `{arch}.pooling_type`); a file that declares none pools by "mean".

Passes: the inputs run in passes of at most max_rows rows over a few KV cache slots, one input
per slot at a time; a long input continues in the next pass at its next position. Each row's
hidden state has the same bits whatever else its pass holds (the runtime's batch contract), and
mean pooling adds the rows in position order (a sequential float64 sum), so an input's vector
is the same, bit for bit, alone or among others, however the passes cut it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..formats.gguf_keys import KEY_ROTATION, POOLING_TYPES

#: The poolings embeddings support (gguf_keys.POOLING_TYPES' names that pool a sequence)
POOLINGS = ("mean", "last", "cls")
DEFAULT_POOLING = "mean"


def check_pooling(pooling) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)} (or None: the model's "
                         f"own), not {pooling!r}")
    return pooling


def model_pooling(hparams) -> str:
    """The pooling the file declares (HParams.pooling), else DEFAULT_POOLING."""
    declared = getattr(hparams, "pooling", None)
    return declared if declared in POOLINGS else DEFAULT_POOLING


def check_embeddable(model) -> None:
    """ValueError when the file's final hidden states are not the checkpoint's: a file whose
    residual stream was rotated with an untied lm_head has the final norm's gain folded into
    the lm_head and the rotation nowhere at run time (pyklei.converters.rotation), so its hidden
    rows are rotated and unscaled. A tied one keeps both (rot.output), and the runtime undoes them."""
    rotated = "residual" in str(model.file.metadata.get(KEY_ROTATION, "")).split(",")
    if rotated and "output" not in model.file.rotations:
        raise ValueError("this file's residual stream is rotated and its lm_head untied, so its "
                         "hidden states are not the model's: embeddings need a file converted "
                         "without rotation (pyklei convert --no-rotate)")


def check_dimensions(dimensions, n_embd: int, field: str = "dimensions") -> int | None:
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)):
        raise TypeError(f"{field} must be an integer, got {dimensions!r}")
    if not 1 <= dimensions <= n_embd:
        raise ValueError(f"{field} must be in [1, {n_embd}] (the model's hidden size), "
                         f"got {dimensions}")
    return int(dimensions)


def input_ids(inputs, encode, vocab_size: int, n_ctx: int,
              field: str = "input") -> tuple[list[list[int]], bool]:
    """(token ids per input, whether `inputs` was one input) of the forms OpenAI's embeddings
    take: a string, a list of strings, a list of token ids (one input) or a list of such lists.
    encode(text) tokenizes. ValueError / TypeError naming `field` for an empty string or
    list, a token id outside [0, vocab_size), a non-integer, or an input over n_ctx tokens."""
    def is_id(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    if isinstance(inputs, str):
        single, items = True, [inputs]
    elif isinstance(inputs, (list, tuple)) and inputs and all(is_id(v) for v in inputs):
        single, items = True, [list(inputs)]
    elif isinstance(inputs, (list, tuple)):
        single, items = False, list(inputs)
    else:
        raise TypeError(f"{field} must be a string, a list of strings, a list of token ids or a "
                        f"list of lists of token ids, not {type(inputs).__name__}")
    if not items:
        raise ValueError(f"{field} is an empty list")
    out = []
    for i, item in enumerate(items):
        where = field if single else f"{field}[{i}]"
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{where} is an empty string")
            ids = encode(item)
        elif isinstance(item, (list, tuple)) and all(is_id(v) for v in item):
            ids = [int(v) for v in item]
            bad = [v for v in ids if not 0 <= v < vocab_size]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab_size})")
        else:
            raise TypeError(f"{where} must be a string or a list of token ids")
        if not ids:
            raise ValueError(f"{where} has no tokens")
        if len(ids) > n_ctx:
            raise ValueError(f"{where} has {len(ids)} tokens, more than the context of {n_ctx}")
        out.append(ids)
    if len({bool(isinstance(x, str)) for x in items}) > 1:
        raise TypeError(f"{field} mixes strings and token id lists")
    return out, single


def finish(pooled: np.ndarray, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """float32 [n, dimensions or n_embd]: pooled rows cut to their first `dimensions` values,
    then (normalize) scaled to unit L2 norm, as Matryoshka models are used."""
    v = np.asarray(pooled, np.float64)
    if dimensions is not None:
        v = v[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        v = v / np.maximum(norms, 1e-12)     # an all-zero row stays zero
    return v.astype(np.float32)


class EmbeddingBatch:
    """The inputs of one embedding request, pooled pass by pass (module doc). `step` runs one
    pass on the given slots (their cached tokens are replaced); `done` once every input ran."""

    def __init__(self, inputs: Sequence[Sequence[int]], pooling: str):
        self.inputs = [list(map(int, x)) for x in inputs]
        if not self.inputs or any(not x for x in self.inputs):
            raise ValueError("every input needs at least one token")
        self.pooling = check_pooling(pooling)
        self._acc: list[np.ndarray | None] = [None] * len(self.inputs)   # float64 [n_embd]
        self._pos = [0] * len(self.inputs)      # tokens of each input run so far
        self._next = 0                          # the next input not yet given a slot
        self._on: dict[int, int] = {}           # slot -> the input it runs
        self.tokens = sum(len(x) for x in self.inputs)

    @property
    def done(self) -> bool:
        return self._next == len(self.inputs) and not self._on

    def step(self, model, slots: Sequence[int], max_rows: int) -> bool:
        """One pass of at most max_rows rows (at least one) over `slots`; True once done."""
        for s in slots:                       # free slots take the next inputs
            if s not in self._on and self._next < len(self.inputs):
                self._on[s] = self._next
                self._next += 1
        tokens, seqs, pos, rows, parts = [], [], [], [], []
        budget = max(1, max_rows)
        for s, i in sorted(self._on.items(), key=lambda kv: kv[1]):
            if budget == 0:
                break
            x, a = self.inputs[i], self._pos[i]
            b = min(len(x), a + budget)
            first_out = len(rows)
            want = {"mean": range(a, b), "last": range(len(x) - 1, len(x)) if b == len(x) else (),
                    "cls": (0,) if a == 0 else ()}[self.pooling]
            rows += [len(tokens) + p - a for p in want]
            tokens += x[a:b]
            seqs += [s] * (b - a)
            pos += range(a, b)
            parts.append((s, i, b, first_out, len(rows)))
            budget -= b - a
        if not tokens:
            return self.done
        hidden = model.hidden_states(np.array(tokens, np.int32), np.array(seqs, np.int32),
                                     np.array(pos, np.int32), np.array(rows, np.int32))
        for s, i, b, r0, r1 in parts:
            got = hidden[r0:r1].astype(np.float64)
            if len(got):
                if self._acc[i] is None:
                    self._acc[i] = np.zeros(got.shape[1])
                # sequential: the same sum however the passes cut the input
                self._acc[i] = np.cumsum(np.vstack([self._acc[i][None], got]), axis=0)[-1]
            self._pos[i] = b
            if b == len(self.inputs[i]):
                del self._on[s]
        return self.done

    def pooled(self) -> np.ndarray:
        """float64 [n_inputs, n_embd]: each input's pooled hidden state (once done)."""
        if not self.done:
            raise RuntimeError("the batch has inputs still to run")
        out = np.stack(self._acc)
        if self.pooling == "mean":
            out /= np.array([len(x) for x in self.inputs], np.float64)[:, None]
        return out


def embed(model, inputs: Sequence[Sequence[int]], pooling: str, slots: Sequence[int],
          max_rows: int, normalize: bool = True, dimensions: int | None = None) -> np.ndarray:
    """float32 [len(inputs), dimensions or n_embd]: the inputs embedded on `slots` of `model`
    (called by one thread that owns those slots meanwhile)."""
    batch = EmbeddingBatch(inputs, pooling)
    while not batch.step(model, slots, max_rows):
        pass
    return finish(batch.pooled(), normalize, dimensions)


__all__ = ["DEFAULT_POOLING", "EmbeddingBatch", "POOLINGS", "POOLING_TYPES", "check_dimensions",
           "check_embeddable", "check_pooling", "embed", "finish", "input_ids", "model_pooling"]
