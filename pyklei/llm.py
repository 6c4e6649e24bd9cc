"""The user-facing API: a model, its tokenizer and its chat template, from one GGUF file.

    import pyklei
    llm = pyklei.load("smollm2.gguf", n_threads=2, n_ctx=2048)
    for r in llm.generate("The capital of France is", max_tokens=32, temperature=0.0, stream=True):
        print(r.text, end="", flush=True)
    reply = llm.chat([{"role": "user", "content": "Name three colours."}])
    logits = llm.logits(token_ids)          # numpy, one row per position
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from .generate import GenerationResponse, stream_generate
from .model import Model
from .sampler import SamplingParams
from .tokenizer import Tokenizer

_SAMPLING = {f.name for f in dataclasses.fields(SamplingParams)}


class LLM:
    def __init__(self, path, n_threads: int | None = None, n_ctx: int | None = None,
                 n_batch: int = 256, kv_cache: str = "f32", activations: str = "qai8dx2"):
        self.model = Model(path, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_batch,
                           kv_cache=kv_cache, activations=activations)
        self.tokenizer = Tokenizer.from_gguf(path)
        if self.tokenizer.vocab_size != self.model.vocab_size:
            raise ValueError(f"{path}: tokenizer has {self.tokenizer.vocab_size} tokens, the model "
                             f"{self.model.vocab_size}")
        self.eos_ids = sorted(set(self.tokenizer.eos_ids) | set(self.model.file.eos_token_ids))

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=parse_special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), n_vocab]: the logits at every position."""
        return self.model.logits(token_ids)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, stream: bool = False,
                 stop: str | Sequence[str] = (), add_bos: bool | None = None,
                 **sampling) -> GenerationResponse | Iterator[GenerationResponse]:
        """Continue `prompt` (text, or token ids). With stream=True, yields one response per
        step (its .text is the new text); else returns one response with the whole text.
        Sampling keywords: temperature, top_k, top_p, min_p, repetition_penalty,
        repetition_window, seed."""
        unknown = set(sampling) - _SAMPLING
        if unknown:
            raise TypeError(f"unknown argument(s) {', '.join(sorted(unknown))}; sampling options "
                            f"are {', '.join(sorted(_SAMPLING))}")
        params = SamplingParams(**sampling)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            ids = self.tokenizer.encode(prompt, add_bos=add_bos, parse_special=True)
        else:
            ids = list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if bad:
                raise ValueError(f"token ids must be integers, got {bad[0]!r}")
            ids = [int(t) for t in ids]
        stops = [stop] if isinstance(stop, str) else list(stop)
        it = stream_generate(self.model, self.tokenizer, ids, max_tokens, params, stops, self.eos_ids)
        if stream:
            return it
        return _collect(it)

    def chat(self, messages: Sequence[dict], max_tokens: int = 512, stream: bool = False,
             stop: str | Sequence[str] = (), **sampling):
        """Reply to a conversation rendered with the model's own chat template. The KV cache
        keeps the conversation so far: a new turn runs only its new tokens."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_bos=False, parse_special=True)
        return self.generate(ids, max_tokens=max_tokens, stream=stream, stop=stop, **sampling)


def _collect(it: Iterator[GenerationResponse]) -> GenerationResponse:
    parts, last = [], None
    for r in it:
        parts.append(r.text)
        last = r
    return dataclasses.replace(last, text="".join(parts))


def load(path, n_threads: int | None = None, n_ctx: int | None = None, **kw) -> LLM:
    """Load a pyklei GGUF model (convert Hugging Face or llama.cpp files with `pyklei convert`)."""
    return LLM(path, n_threads=n_threads, n_ctx=n_ctx, **kw)
