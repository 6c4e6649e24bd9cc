"""What the Responses and Messages APIs share: one reply's engine output as typed pieces (for
replies that are lists of parts: the Responses API's output items, the Messages API's content
blocks), the sampling fields they pass on, their token budget field, the stop sequence that
ended a reply.

    async for piece in pieces(req, gen):     # req: openai_api.Request, gen: app._Generation
        piece.kind   # "start" (prefill done: piece.last has the prompt counts), "reasoning",
                     # "text", "calls" (piece.calls, OpenAI's shape, whole) or "end" (piece.last)

A thinking model's reply is split by req.reasoning (pyklei.text.reasoning) and its content read
for tool calls by req.calls (pyklei.text.tool_calls.CallParser), as chat completions' stream
does: content goes out as soon as it cannot become a call; a call goes out whole, once the reply
has ended and the parser has read it. Text pieces concatenated are the reply's content; a
streamed and a whole reply are built from the same pieces, so they agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..runtime.sampler import MAX_TOKENS, SAMPLING_OPTIONS
from .openai_api import APIError

SAMPLING_FIELDS = tuple(o.name for o in SAMPLING_OPTIONS if o is not MAX_TOKENS)


def sampling_fields(body: dict) -> dict:
    """The body's sampling fields (temperature, top_p, top_k, seed and pyklei's others) under
    their own names, for openai_api.parse to check."""
    return {k: body[k] for k in SAMPLING_FIELDS if k in body}


@dataclass
class Piece:
    kind: str                    # "start", "reasoning", "text", "calls" or "end"
    text: str = ""
    calls: list = field(default_factory=list)
    last: object = None          # "start" and "end": the GenerationResponse


class ReplySplitter:
    """The incremental split of one choice's GenerationResponses into Pieces."""

    def __init__(self, req):
        self.thinker = req.reasoning.parser() if req.reasoning is not None else None
        self.parser = req.calls
        self.held = "" if req.calls is not None else None   # None: nothing can be a call now
        self.started = False

    def feed(self, r) -> list[Piece]:
        out = []
        if not self.started:
            self.started = True
            out.append(Piece("start", last=r))
        text, ended = r.text, r.finish_reason is not None
        if self.thinker is not None:
            thought, text = self.thinker.feed(text)
            if ended:
                more_t, more_c = self.thinker.finish()
                thought, text = thought + more_t, text + more_c
            if thought:
                out.append(Piece("reasoning", thought))
        if self.held is not None:
            self.held += text
            if ended:
                content, calls = self.parser.parse(self.held)
                self.held = None
                text = content or ""
                if calls:
                    if text:
                        out.append(Piece("text", text))
                    out.append(Piece("calls", calls=calls))
                    text = ""
            else:
                text, self.held = self.parser.split_stream(self.held)
        if text:
            out.append(Piece("text", text))
        if ended:
            out.append(Piece("end", last=r))
        return out


def positive_int(body: dict, name: str, required: bool = False) -> int | None:
    """A token budget field of these APIs: an integer of at least 1 (chat completions' -1, "the
    rest of the context", is not one of theirs); None when absent and not required."""
    v = body.get(name)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise APIError(f"'{name}' {'is required and ' if required else ''}must be an integer of "
                       f"at least 1, got {v!r}", name)
    return v


async def pieces(req, gen):
    """The Pieces of the request's one choice (gen: app._Generation, whose next() raises a
    failed generation's error)."""
    split = ReplySplitter(req)
    while (item := await gen.next()) is not None:
        for p in split.feed(item[1]):
            yield p


def stop_sequence(last, stops, tokenizer, constrained: bool, text: str) -> str | None:
    """Which of `stops` ended a reply whose emitted text is `text`, or None (it ended by EOS, a
    complete constraint, the budget, or no stop was given). The engine cuts the reply before
    the stop; the stop ends inside the last token's piece, so the text, the stop and that
    piece's start line up."""
    if (last.finish_reason != "stop" or not stops or constrained or last.token is None
            or last.token in tokenizer.eos_ids):
        return None
    piece = tokenizer.token_to_piece(last.token).decode("utf-8", "replace")
    for s in stops:
        joined = text + s
        if any(joined.endswith(piece[:k]) for k in range(1, len(piece) + 1)):
            return s
    return stops[0]
