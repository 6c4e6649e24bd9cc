"""OpenAI's embeddings API over pyklei.runtime.embedding: a request body checked into an
EmbeddingRequest, and the pooled rows made into OpenAI's reply.

    POST /v1/embeddings {"input": "text" | ["text", ...] | [ids] | [[ids], ...],
                         "encoding_format": "float" | "base64", "dimensions": N}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
        "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

"base64" is the vector's little-endian float32 bytes, base64-encoded (what the official client
asks for by default and decodes with numpy's frombuffer). `dimensions` cuts a vector to its
first N values and normalises it again (Matryoshka models); more than the hidden size is a 400.
Vectors are unit length (OpenAI's are); the pooling is the model's own (model_pooling). Every
bad field is a 400 naming it, in openai_api's error shape.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from ..runtime import embedding as E
from .openai_api import APIError

ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingRequest:
    ids: list[list[int]]        # token ids per input
    pooling: str                # pyklei.runtime.embedding.POOLINGS
    dimensions: int | None
    encoding_format: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(x) for x in self.ids)


def parse(body, tokenizer, n_ctx: int, model) -> EmbeddingRequest:
    """Checks an embeddings body (parsed JSON) for `model` (a pyklei.runtime.model.Model) with
    n_ctx tokens of context per input."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if "input" not in body or body["input"] is None:
        raise APIError("'input' is required: a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids", "input")
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODINGS:
        raise APIError(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, not {fmt!r}",
                       "encoding_format")
    try:
        dimensions = E.check_dimensions(body.get("dimensions"), model.hparams.n_embd, "'dimensions'")
    except (TypeError, ValueError) as e:
        raise APIError(str(e), "dimensions") from None
    try:
        E.check_embeddable(model)
    except ValueError as e:
        raise APIError(str(e), "model", code="model_not_embeddable") from None
    try:
        ids, _ = E.input_ids(body["input"], tokenizer.encode, tokenizer.vocab_size, n_ctx,
                             field="'input'")
    except (TypeError, ValueError) as e:
        raise APIError(str(e), "input") from None
    return EmbeddingRequest(ids, E.model_pooling(model.hparams), dimensions, fmt)


def _encoded(v: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(v, "<f4").tobytes()).decode("ascii")
    return v.tolist()


def response(req: EmbeddingRequest, pooled: np.ndarray, model_id: str) -> dict:
    """OpenAI's reply for the request's pooled rows (Engine.embed's result)."""
    vectors = E.finish(pooled, normalize=True, dimensions=req.dimensions)
    n = req.prompt_tokens
    return {"object": "list", "model": model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}
