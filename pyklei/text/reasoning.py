"""Reasoning ("thinking") kept apart from the answer: Qwen3's and DeepSeek-R1's ``<think>…</think>``.

    r = reasoning_for(tokenizer, prompt_ids)        # None: this model does not think aloud
    reasoning, content = r.split(reply_text)        # a whole reply
    p = r.parser()                                  # a streamed one
    for piece in stream: reasoning_delta, content_delta = p.feed(piece)
    reasoning_delta, content_delta = p.finish()

Which models: those whose vocabulary has both ``<think>`` and ``</think>`` as tokens (Qwen3 and
its Thinking-2507 releases, QwQ, the DeepSeek-R1 distills); :func:`reasoning_for` is the one
place that decides. Every other model's reply is content, untouched, even when it writes the
words "<think>" as text.

Where the reply starts: a template may open the thinking part itself (Qwen3-Thinking-2507 and
the R1 distills end their generation prompt with ``<think>\\n``), so the reply starts inside it
and has only the closing tag; Qwen3's hybrid template with ``enable_thinking=False`` closes an
empty one in the prompt, so the reply is all content. :func:`reasoning_for` reads this from the
prompt's own tokens: the last one that is not whitespace is ``<think>`` or not.

The split, as llama.cpp's ``--reasoning-format deepseek`` gives it: the text between the tags is
the reasoning, with the newlines around it trimmed; the content is what follows ``</think>``,
its leading whitespace trimmed. A reply that never closes its thinking (cut by max_tokens) is
all reasoning; one that never opens it (and did not start inside it) is all content. A stream
holds back only what may still be a tag or whitespace to trim, so the deltas add up to exactly
the whole-reply split.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["THINK_OPEN", "THINK_CLOSE", "Reasoning", "ReasoningParser", "reasoning_for"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_WS = " \t\r\n"


@dataclass(frozen=True)
class Reasoning:
    """How one reply's reasoning is delimited, and whether it starts inside it."""
    starts_inside: bool = False
    open: str = THINK_OPEN
    close: str = THINK_CLOSE

    def parser(self) -> "ReasoningParser":
        return ReasoningParser(self)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; reasoning None when it has none."""
        p = self.parser()
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return (r1 + r2 if p.reasoned else None), c1 + c2


class ReasoningParser:
    """The incremental split of one reply (module doc). ``feed`` and ``finish`` return
    (reasoning delta, content delta); ``reasoned`` says whether a thinking part was seen."""

    def __init__(self, fmt: Reasoning):
        self.fmt = fmt
        # "start": before the reply's first text (it may open <think> after whitespace);
        # "think": inside the reasoning; "after": just past </think> (whitespace dropped);
        # "content": the answer
        self.state = "think" if fmt.starts_inside else "start"
        self.reasoned = fmt.starts_inside
        self._head = fmt.starts_inside     # leading newlines of the reasoning still to trim
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = [], []
        while self._held:
            if not self._step(reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held: a partial tag is text after all; trailing whitespace of an
        unclosed reasoning is trimmed."""
        held, self._held = self._held, ""
        if self.state == "think":
            return held.rstrip("\n"), ""
        if self.state == "start":
            return "", held
        if self.state == "after":
            return "", held.lstrip(_WS)
        return "", held

    def _step(self, reasoning: list, content: list) -> bool:
        """Consumes what it can of the held text; False when the rest must wait for more."""
        held, fmt = self._held, self.fmt
        if self.state == "content":
            content.append(held)
            self._held = ""
            return True
        if self.state == "start":
            body = held.lstrip(_WS)
            if body.startswith(fmt.open):
                self._held = body[len(fmt.open):]
                self.state, self.reasoned, self._head = "think", True, True
                return True
            if fmt.open.startswith(body):        # whitespace, or a prefix of <think>: wait
                return False
            self.state = "content"
            return True
        if self.state == "after":
            body = held.lstrip(_WS)
            self._held = body
            if body:
                self.state = "content"
            return bool(body)
        # "think"
        if self._head:
            held = held.lstrip("\n")
            self._held = held
            if not held:
                return False
            self._head = False
        end = held.find(fmt.close)
        if end >= 0:
            reasoning.append(held[:end].rstrip("\n"))
            self._held = held[end + len(fmt.close):]
            self.state = "after"
            return True
        # emit all but what may be the start of </think> or newlines that may end the reasoning
        keep = _partial_suffix(held, fmt.close)
        out = held[:len(held) - keep]
        tail = len(out) - len(out.rstrip("\n"))
        out = out[:len(out) - tail]
        if out:
            reasoning.append(out)
        self._held = held[len(out):]
        return False


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def reasoning_for(tokenizer, prompt_ids=()) -> Reasoning | None:
    """The reasoning format of this model's replies (None: it has none): its vocabulary has
    ``<think>`` and ``</think>`` tokens. ``prompt_ids``: the rendered chat prompt, whose last
    token that is not whitespace says whether the reply starts inside the thinking part."""
    open_id, close_id = tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)
    if open_id is None or close_id is None:
        return None
    for t in reversed(list(prompt_ids)):
        if t == open_id:
            return Reasoning(starts_inside=True)
        if tokenizer.token_to_piece(t).strip():
            break
    return Reasoning()
