"""A chat or text completion run to its end, without HTTP: what the server's non-streamed
replies and the batch job (pyklei.batch) share, so that one body gets the same reply from both.

    streams = submit(engine, req, tokenizer.eos_ids, cache_partition=(tenant, req.cache_salt))
    reply = WholeReply(req)
    for i, stream in enumerate(streams):     # the server feeds it from its event loop instead
        for r in stream:
            reply.add(i, r)
    body = reply.body(openai_api.new_id(req.kind), model_id, tokenizer)

`req` is an openai_api.Request (openai_api.parse checked it); a stream that raises
RequestFailedError failed alone: `generation_failed` is its answer, OpenAI's 500.
"""
from __future__ import annotations

from . import openai_api as api


def submit(engine, req: api.Request, eos_ids, cache_partition=None) -> list:
    """Queues the request's choices on a pyklei.runtime.engine.Engine: its RequestStreams, one
    per choice (best_of: every candidate). Raises what Engine.submit_requests raises."""
    return engine.submit_requests(req.generations(eos_ids),
                                  prompt_logprobs=req.echo and req.logprobs is not None,
                                  cache_partition=cache_partition)


def generation_failed(e: Exception) -> api.APIError:
    """A request whose own sampling or decoding failed (RequestFailedError): OpenAI's 500."""
    return api.APIError(str(e), status=500, type="server_error", code="generation_failed")


class WholeReply:
    """The GenerationResponses of a request's choices, gathered into OpenAI's whole reply."""

    def __init__(self, req: api.Request):
        self.req = req
        n = len(req.params)
        self.parts: list[list[str]] = [[] for _ in range(n)]
        self.lasts = [None] * n
        # best_of ranks the candidates by their log-probabilities, so they are kept for it too
        self.lps = None if req.logprobs is None and not req.best_of else [[] for _ in range(n)]
        self.prompt_lps = None

    def add(self, i: int, r) -> None:
        """Response r (a GenerationResponse) of choice i."""
        self.parts[i].append(r.text)
        self.lasts[i] = r
        if self.lps is not None:
            self.lps[i] += r.logprobs or []
        self.prompt_lps = self.prompt_lps or r.prompt_logprobs

    def body(self, rid: str, model_id: str, tokenizer) -> dict:
        """OpenAI's chat.completion or text_completion object: best_of keeps the n best
        choices; the usage counts every choice generated."""
        req, texts, lasts, lps = self.req, ["".join(p) for p in self.parts], self.lasts, self.lps
        if req.best_of:
            keep = api.best_choices(req, lps)
            lasts, texts = [lasts[i] for i in keep], [texts[i] for i in keep]
            lps = None if req.logprobs is None else [lps[i] for i in keep]
        out = api.completion(req, rid, model_id, texts, lasts, lps, api.Logprobs(tokenizer),
                             self.prompt_lps)
        out["usage"] = api.usage(self.lasts)
        return out
