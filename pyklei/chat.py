"""A conversation kept within the model's context: what `pyklei chat` runs, without the terminal.

    session = ChatSession(pyklei.load("smollm2.gguf"), system="You are terse.", max_tokens=256)
    text, interrupted, dropped = session.reply("Name three colours.", write=print)
    print(session.stats_text())

history holds the user/assistant messages; the system prompt (if any) is always kept. Before a
turn, whole turns are dropped, oldest first, until prompt + max_tokens fits the context (with
max_tokens -1, until the prompt takes at most half of it); the reply then gets
pyklei.runtime.request.token_budget(..., trim=True) of what is left. The KV cache keeps the
conversation, so a turn runs only its new tokens (except after turns were dropped).
"""
from __future__ import annotations

from typing import Callable

from ._report import plural


class MessageTooLongError(ValueError):
    """The newest message alone leaves less room than a reply needs."""


class ChatSession:
    MIN_REPLY = 16   # tokens: below this room a message is refused as too long

    def __init__(self, llm, system: str | None = None, max_tokens: int = 512,
                 sampling: dict | None = None, stop=(), constrain: dict | None = None,
                 speculative=None, template_kwargs: dict | None = None):
        from .runtime.sampler import MAX_TOKENS, SamplingParams
        from .runtime.speculative import check_speculative

        self.llm = llm
        self.system = system
        self.max_tokens = MAX_TOKENS.check(max_tokens)
        self.sampling = dict(sampling or {})
        SamplingParams(**self.sampling)     # bad options fail here, not at the first reply
        self.stop = list(stop)
        # every reply follows it: LLM.generate's json_schema / grammar / regex / response_format
        self.constrain = dict(constrain or {})
        self.speculative = check_speculative(speculative, llm.model)   # as LLM.generate's
        # more template variables (checked by the caller: chat_template.check_template_kwargs)
        self.template_kwargs = dict(template_kwargs or {})
        self.history: list[dict] = []
        self.last = None            # GenerationResponse of the last reply
        self.last_reasoning = None  # its reasoning (a thinking model's), apart from its text
        self.turns = 0

    def _ids(self, extra: list[dict]) -> list[int]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return self.llm.tokenizer.apply_chat_template(sys_msg + self.history + extra,
                                                      add_generation_prompt=True, tokenize=True,
                                                      **self.template_kwargs)

    def prepare(self, user_text: str) -> tuple[list[int], int, int]:
        """-> (prompt ids, reply budget, turns dropped). Raises MessageTooLongError if the
        message cannot fit."""
        from .runtime.request import token_budget

        n_ctx = self.llm.n_ctx
        user = [{"role": "user", "content": user_text}]
        until_full = self.max_tokens is None or self.max_tokens == -1
        want = n_ctx // 2 if until_full else self.max_tokens
        dropped = 0
        while True:
            ids = self._ids(user)
            if len(ids) + want <= n_ctx or not self.history:
                break
            # drop the oldest turn: a user message and the reply that followed it
            k = 2 if len(self.history) > 1 and self.history[1]["role"] == "assistant" else 1
            del self.history[:k]
            dropped += 1
        if n_ctx - len(ids) < min(self.MIN_REPLY, want):
            raise MessageTooLongError(
                f"the message is too long: {len(ids)} tokens with the chat template, the "
                f"context holds {n_ctx} (raise --ctx-size)")
        return ids, token_budget(n_ctx, len(ids), self.max_tokens, trim=True), dropped

    def reply(self, user_text: str, write: Callable[[str], object],
              write_reasoning: Callable[[str], object] | None = None) -> tuple[str, bool, int]:
        """Streams the reply through write(text). A thinking model's reasoning
        (pyklei.text.reasoning) goes to write_reasoning(text) instead (dropped without one),
        never into the answer or the history, as the API's reply.reasoning. Ctrl-C
        (KeyboardInterrupt) stops it; what was written stays in the conversation.
        -> (answer text, interrupted, turns dropped)."""
        from .text.reasoning import reasoning_for

        ids, max_new, dropped = self.prepare(user_text)
        thinking = reasoning_for(self.llm.tokenizer, ids)
        split = thinking.parser() if thinking else None
        parts, thought, interrupted = [], [], False

        def emit(reasoning: str, content: str) -> None:
            if reasoning:
                thought.append(reasoning)
                if write_reasoning is not None:
                    write_reasoning(reasoning)
            if content:
                parts.append(content)
                write(content)

        it = self.llm.generate(ids, max_tokens=max_new, stream=True, stop=self.stop,
                               speculative=self.speculative, **self.constrain, **self.sampling)
        try:
            for r in it:
                if r.text:
                    emit(*(split.feed(r.text) if split else ("", r.text)))
                self.last = r
        except KeyboardInterrupt:
            interrupted = True
            it.close()
        if split:
            emit(*split.finish())
        self.last_reasoning = "".join(thought) if split and split.reasoned else None
        text = "".join(parts)
        if text.strip() or not interrupted:
            self.history.append({"role": "user", "content": user_text})
            self.history.append({"role": "assistant", "content": text})
            self.turns += 1
        return text, interrupted, dropped

    def reset(self) -> None:
        """Forgets the conversation (the system prompt stays)."""
        self.history.clear()
        self.llm.model.reset()
        self.last = None

    def stats_text(self) -> str:
        """Speed of the last reply, the context in use, memory: what /stats prints."""
        from .runtime.generate import peak_rss_mb

        used = len(self.llm.model.cached_tokens)
        lines = []
        r = self.last
        if r is None:
            lines.append("no reply yet")
        else:
            cached = r.prompt_tokens - r.prompt_eval_tokens
            lines.append(f"last reply: {r.generation_tokens} tokens at {r.generation_tps:.1f} tok/s; "
                         f"time to first token {r.time_to_first_token * 1e3:.0f} ms")
            if r.drafted_tokens:
                lines.append(f"last reply's drafts: {r.accepted_tokens} of {r.drafted_tokens} "
                             f"drafted tokens accepted")
            lines.append(f"last prompt: {r.prompt_tokens} tokens, {cached} reused from the cache, "
                         f"{r.prompt_eval_tokens} run at {r.prompt_tps:.1f} tok/s")
        lines.append(f"context: {used} of {self.llm.n_ctx} tokens in use; "
                     f"{plural(len(self.history) // 2, 'turn')} in the history")
        lines.append(f"peak RSS: {peak_rss_mb():.0f} MB; threads: {self.llm.model.n_threads}; "
                     f"model load: {self.llm.model.load_seconds:.2f} s")
        return "\n".join(lines)
