"""The user-facing API: a model, its tokenizer and its chat template, from one GGUF file.

    import pyklei
    llm = pyklei.load("smollm2.gguf", n_threads=2, n_ctx=2048)
    for r in llm.generate("The capital of France is", max_tokens=32, temperature=0.0, stream=True):
        print(r.text, end="", flush=True)
    reply = llm.chat([{"role": "user", "content": "Name three colours."}])
    logits = llm.logits(token_ids)          # numpy, one row per position
    rs = llm.generate_batch(["Once upon", "The sky is"], max_tokens=32)   # decoded together
    vectors = llm.embed(["a cat", "a dog"])  # pooled hidden states, unit length
    llm.close()                             # or: with pyklei.load(...) as llm:

Arguments are checked as the CLI checks its flags, with the same messages: a bad value is a
ValueError, a value of the wrong type a TypeError, before any work is done.

generate and chat run on KV cache slot 0 with the single-sequence path (pyklei.runtime.generate): a
chat turn reuses the conversation cached there, Ctrl-C stops a prefill, and a generation that
another call overtook raises SequenceLostError. generate_batch runs its prompts on a
pyklei.runtime.engine.Engine over the model's n_seq slots (slot 0 included: a generation paused
meanwhile then raises SequenceLostError), each prompt's text the same as generate's. embed
runs on the slots after slot 0 when the model has several (a conversation cached in slot 0
stays), else on slot 0.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from .formats.model_file import is_model_file
from .hub import model_file
from .runtime.engine import Engine
from .runtime.generate import GenerationResponse, stream_request
from .runtime.model import Model
from .runtime.options import model_default
from .runtime.request import GenerationRequest, make_request
from .runtime.sampler import SamplingParams
from .runtime.speculative import check_speculative
from .text.tokenizer import Tokenizer

_SAMPLING = {f.name for f in dataclasses.fields(SamplingParams)}


class LLM:
    def __init__(self, path, n_threads: int | None = None, n_ctx: int | None = None,
                 n_batch: int = model_default("n_batch"), kv_cache: str = model_default("kv_cache"),
                 activations: str = model_default("activations"),
                 n_seq: int = model_default("n_seq"), chat_template: str | None = None):
        """The model options are pyklei.runtime.options.MODEL_OPTIONS (Model checks them).
        chat_template: a Jinja chat template to use in place of the file's (a base model's
        file, such as Gemma 3 270M's, has none; chat() needs one), checked here."""
        path = model_file(path, is_model=is_model_file)    # org/name:file.gguf: the hub cache's copy
        self.model = Model(path, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_batch,
                           kv_cache=kv_cache, activations=activations, n_seq=n_seq)
        # from the metadata the model already read: a second read would hold a 262k-token
        # vocabulary's lists twice (Gemma 3: 30 MB)
        self.tokenizer = Tokenizer.from_metadata(self.model.file.metadata, path=str(path))
        if self.tokenizer.vocab_size != self.model.vocab_size:
            raise ValueError(f"{path}: tokenizer has {self.tokenizer.vocab_size} tokens, the model "
                             f"{self.model.vocab_size}")
        self.eos_ids = list(self.tokenizer.eos_ids)   # the one end-of-generation rule
        if chat_template is not None:
            from .text.chat_template import compile_template
            if not isinstance(chat_template, str) or not chat_template.strip():
                raise TypeError("chat_template must be the text of a Jinja chat template")
            compile_template(chat_template)     # a syntax error is a ChatTemplateError now
            self.tokenizer.chat_template = chat_template

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    def __repr__(self) -> str:
        m = self.model
        if m.closed:
            return "<pyklei.LLM (closed)>"
        name = m.file.metadata.get("general.name") or m.file.path.name
        return (f"<pyklei.LLM {name!r}: {m.hparams.n_layer} layers, vocab {m.vocab_size}, "
                f"n_ctx={m.n_ctx}, n_threads={m.n_threads}, activations={m.activations}, "
                f"{len(m.cached_tokens)} tokens cached>")

    def reset(self) -> None:
        """Forgets the conversation in the KV cache (the next call runs its whole prompt)."""
        self.model.reset()

    def close(self) -> None:
        """Frees the model's memory (KV cache, weights, file mapping) now; later calls raise."""
        self.model.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=parse_special)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), n_vocab]: the logits at every position."""
        return self.model.logits(token_ids)

    def embed(self, texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
              pooling: str | None = None, normalize: bool = True,
              dimensions: int | None = None) -> list[list[float]]:
        """Embedding vectors, one per input (a single text, or one list of token ids, still
        gives a list of one vector). A vector is the model's final hidden state (the output of
        its last RMSNorm) pooled over the input's tokens (pyklei.runtime.embedding): pooling
        "mean", "last" (the last token: decoder embedding models such as Qwen3-Embedding) or
        "cls" (the first), None for the model's own (the pooling its checkpoint declared at
        conversion, else "mean"); cut to its first `dimensions` values (Matryoshka models; at
        most the hidden size) and, with normalize, scaled to unit L2 norm, so that a dot
        product is the cosine similarity. Texts are tokenized as encode() does (BOS/EOS as the
        file says). Inputs run together in passes of up to n_batch rows, each vector the same
        as alone. An empty text or list, or an input longer than n_ctx, is a ValueError."""
        from .runtime import embedding as E
        m = self.model
        m.check_open()
        pooling = E.model_pooling(m.hparams) if pooling is None else E.check_pooling(pooling)
        dimensions = E.check_dimensions(dimensions, m.hparams.n_embd)
        E.check_embeddable(m)
        ids, _ = E.input_ids(texts, self.tokenizer.encode, m.vocab_size, m.n_ctx, field="texts")
        slots = range(1, m.n_seq) if m.n_seq > 1 else range(1)
        vectors = E.embed(m, ids, pooling, slots, m.runtime.n_batch, normalize=bool(normalize),
                          dimensions=dimensions)
        return vectors.tolist()

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = 256,
                 stream: bool = False, stop: str | Sequence[str] = (),
                 add_bos: bool | None = None, logprobs: int | None = None, *,
                 response_format: dict | None = None, json_schema=None,
                 grammar: str | None = None, regex: str | None = None,
                 speculative=None, prediction: str | Sequence[int] | None = None,
                 **sampling) -> GenerationResponse | Iterator[GenerationResponse]:
        """Continue `prompt` (text, or token ids). With stream=True, yields responses as text
        arrives (each .text is the new text); else returns one response with the whole text.
        max_tokens None (or -1) generates until the context is full; a count that does not fit
        is a ValueError. logprobs: None, or how many alternatives (0-20) to report beside each
        generated token's log-probability (response.logprobs). Sampling keywords: temperature,
        top_k, top_p, min_p, repetition_penalty, repetition_window, presence_penalty,
        frequency_penalty, seed, logit_bias.

        Constrained decoding (at most one; pyklei.runtime.grammar, needs llguidance): json_schema (a
        dict or its JSON text), grammar (Lark or GBNF text), regex, or response_format as
        OpenAI's ({"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema":
        ...}}). The reply follows it and ends ("stop") when it is complete; a schema or grammar
        that does not compile is a ValueError (pyklei.runtime.grammar.GrammarError) naming why.

        speculative="lookup": speculative decoding with prompt lookup (pyklei.runtime.speculative):
        the same tokens as without it, in fewer passes where the reply repeats text of its
        prompt; speculative=pyklei.load(small_model_path): a draft model of the same
        vocabulary drafts instead (greedy: the same tokens; sampling: speculative sampling's
        rule, the model's own distribution but not the tokens a seed gives without it).
        response.drafted_tokens / accepted_tokens count the drafts. prediction: the text the
        reply is expected to be (OpenAI's predicted outputs, e.g. the code an edit rewrites),
        or its token ids: prompt lookup drafts from it first (the same tokens as without it).
        A constrained reply decodes without speculation."""
        constrain = dict(response_format=response_format, json_schema=json_schema,
                         grammar=grammar, regex=regex)
        return self._generate(prompt, max_tokens, stream, stop, add_bos, False, sampling,
                              constrain, logprobs, speculative, prediction)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int | None = 256,
                       stop: str | Sequence[str] = (), add_bos: bool | None = None,
                       logprobs: int | None = None, *,
                       response_format: dict | None = None, json_schema=None,
                       grammar: str | None = None, regex: str | None = None,
                       speculative=None,
                       **sampling) -> list[GenerationResponse]:
        """generate() for many prompts, decoded together (n_seq at a time, in one batch per
        step: the weights stream once for all): one whole response per prompt, in order. The
        options apply to each prompt (the same seed gives each the text generate() gives it;
        a constraint is compiled once, and each prompt follows it on its own).
        speculative="lookup": each prompt drafts by prompt lookup, its drafts checked inside
        the batched steps (pyklei.runtime.engine); a draft model (pyklei.load(small)) drafts for each
        prompt in its own KV cache slot (it needs as many slots, n_seq, as the prompts decoded
        together). Every prompt is checked before any runs."""
        spec = check_speculative(speculative, self.model)
        if isinstance(prompts, str):
            raise TypeError("generate_batch takes a list of prompts; for one prompt use generate()")
        constrain = dict(response_format=response_format, json_schema=json_schema,
                         grammar=grammar, regex=regex)
        first = self._constraint(constrain)
        reqs = [self._request(p, max_tokens, stop, add_bos, False, sampling, logprobs,
                              None if first is None else first if i == 0 else first.fresh(),
                              speculative)
                for i, p in enumerate(prompts)]
        if not reqs:
            return []
        # no prefix cache: the engine lives for this call, its prompts share prefixes in slots
        engine = Engine(self.model, self.tokenizer, n_parallel=min(len(reqs), self.model.n_seq),
                        max_queue=len(reqs), speculative=None if spec == "lookup" else spec,
                        cache_ram=0)
        try:
            streams = [engine.submit_requests([r])[0] for r in reqs]
            return [_collect(iter(s)) for s in streams]
        finally:
            engine.shutdown(cancel=True)

    def _request(self, prompt, max_tokens, stop, add_bos, trim, sampling, logprobs=None,
                 constraint=None, speculative=None, prediction=None) -> GenerationRequest:
        """One generation, checked (pyklei.runtime.request): text prompts are encoded first."""
        self.model.check_open()
        params = _sampling_params(sampling)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            prompt = self.tokenizer.encode(prompt, add_bos=add_bos, parse_special=True)
        return make_request(self.model.n_ctx, self.tokenizer, prompt, max_tokens, params, stop,
                            None, logprobs, constraint, trim,
                            check_speculative(speculative, self.model), prediction)

    def _constraint(self, constrain: dict):
        """The pyklei.runtime.grammar.Constraint of json_schema / grammar / regex / response_format
        (None when none is given), compiled and checked at the call."""
        if all(v is None for v in constrain.values()):
            return None
        from .runtime.grammar import constraint     # llguidance is optional: only a constraint needs it
        return constraint(self.tokenizer, **constrain)

    def _generate(self, prompt, max_tokens, stream, stop, add_bos, trim, sampling, constrain,
                  logprobs=None, speculative=None, prediction=None):
        req = self._request(prompt, max_tokens, stop, add_bos, trim, sampling, logprobs,
                            self._constraint(constrain), speculative, prediction)
        it = stream_request(self.model, self.tokenizer, req)
        if stream:
            return it
        return _collect(it)

    def chat(self, messages: Sequence[dict], max_tokens: int | None = 512, stream: bool = False,
             stop: str | Sequence[str] = (), logprobs: int | None = None, *,
             response_format: dict | None = None, json_schema=None, grammar: str | None = None,
             regex: str | None = None, tools: Sequence[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool = True, speculative=None,
             prediction: str | Sequence[int] | None = None,
             parse_special_in_content: bool = False, chat_template_kwargs: dict | None = None,
             **sampling):
        """Reply to a conversation rendered with the model's own chat template. The KV cache
        keeps the conversation so far: a new turn runs only its new tokens. max_tokens is cut
        to the room the context leaves (the response's max_tokens says what it ran with); a
        conversation that leaves no room at all is a ValueError. The reply's constraint, as in
        generate(): response_format, json_schema, grammar or regex (the schema is not shown to
        the model: say in the messages what to write).

        Tools, as OpenAI's chat API takes them (pyklei.text.tool_calls): `tools` [{"type": "function",
        "function": {"name", "description", "parameters"}}], `tool_choice` "auto" (default
        with tools), "none", "required" or {"type": "function", "function": {"name"}} (those
        two constrain the reply to valid calls in the model's own format, closed within
        max_tokens, never the same call twice; one call of a named function, and one with
        parallel_tool_calls=False), and messages with role "tool" and assistant
        "tool_calls". A whole reply's calls are parsed into response.tool_calls (OpenAI's shape)
        and its text is what is left; a streamed reply is raw text
        (pyklei.text.tool_calls.parse_reply(text, tools, template, messages) parses it). A reply is a
        call only in the model's call format, for a tool offered, and not as a copy of a user
        or tool message; with response_format, json_schema, grammar or regex the reply is
        content (pyklei.text.tool_calls). speculative, prediction: as in generate().

        Message content is text: special-token text in it (``<|im_end|>``, ``<|eot_id|>``) is
        not read as control tokens, so a pasted page or a tool result cannot open a turn.
        parse_special_in_content=True reads it as control tokens (trusted messages only;
        Tokenizer.apply_chat_template).

        chat_template_kwargs: more variables for the template, as OpenAI-compatible servers
        take them, e.g. {"enable_thinking": False} for Qwen3. A thinking model's reasoning
        (pyklei.text.reasoning: <think>...</think>) is response.reasoning, never in
        response.text; streamed, each response carries the new reasoning and the new text."""
        from .text import tool_calls
        from .text.chat_template import check_template_kwargs
        from .text.reasoning import reasoning_for

        template_kwargs = check_template_kwargs(chat_template_kwargs)

        offered = tool_calls.check_tools(list(tools or []))
        choice = tool_calls.check_tool_choice(tool_choice, offered)
        offered = offered if choice != "none" else []
        parser = tool_calls.reply_parser(   # before a forced call's grammar joins these
            offered, self.tokenizer.chat_template, messages, choice,
            constrained=any(v is not None for v in (response_format, json_schema, grammar, regex)))
        if offered and (choice == "required" or isinstance(choice, dict)):
            if any(v is not None for v in (response_format, json_schema, grammar, regex)):
                raise ValueError("a forced tool_choice constrains the reply already; give no "
                                 "response_format, json_schema, grammar or regex with it")
            constrain = dict(tool_calls=tool_calls.forced_calls(
                offered, choice, parallel_tool_calls, self.tokenizer.chat_template))
        else:
            constrain = dict(response_format=response_format, json_schema=json_schema,
                             grammar=grammar, regex=regex)
        if offered or tool_calls.has_tool_turns(messages):
            ids = tool_calls.render(self.tokenizer, messages, offered or None,
                                    parse_special_in_content=parse_special_in_content,
                                    template_kwargs=template_kwargs)
        else:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True,
                parse_special_in_content=parse_special_in_content, **template_kwargs)
        thinking = reasoning_for(self.tokenizer, ids)
        out = self._generate(ids, max_tokens, stream, stop, None, True, sampling, constrain,
                             logprobs, speculative, prediction)
        if stream:
            return out if thinking is None else _split_reasoning(out, thinking)
        if thinking is not None:
            reasoning, content = thinking.split(out.text)
            out = dataclasses.replace(out, text=content, reasoning=reasoning)
        if parser is None:
            return out
        content, calls = parser.parse(out.text)
        if not calls:
            return out
        return dataclasses.replace(out, text=content or "", tool_calls=calls,
                                   finish_reason="tool_calls")


def _sampling_params(sampling: dict) -> SamplingParams:
    unknown = set(sampling) - _SAMPLING
    if unknown:
        raise TypeError(f"unknown argument(s) {', '.join(sorted(unknown))}; sampling options "
                        f"are {', '.join(sorted(_SAMPLING))}")
    return SamplingParams(**sampling)


def _split_reasoning(it: Iterator[GenerationResponse], thinking) -> Iterator[GenerationResponse]:
    """A streamed chat reply with each response's text split into its reasoning and its
    content (pyklei.text.reasoning), held back only while a tag may be forming."""
    p = thinking.parser()
    for r in it:
        reasoning, content = p.feed(r.text)
        if r.finish_reason is not None:
            more_r, more_c = p.finish()
            reasoning, content = reasoning + more_r, content + more_c
        yield dataclasses.replace(r, text=content, reasoning=reasoning or None)


def _collect(it: Iterator[GenerationResponse]) -> GenerationResponse:
    parts, last, lps = [], None, []
    for r in it:
        parts.append(r.text)
        lps += r.logprobs or []
        last = r
    return dataclasses.replace(last, text="".join(parts),
                               logprobs=lps if last.logprobs is not None else None)


def load(path, n_threads: int | None = None, n_ctx: int | None = None, **kw) -> LLM:
    """Load a pyklei GGUF model (convert Hugging Face or llama.cpp files with `pyklei convert`):
    a local path, or `org/name:file.gguf`, a file of a Hugging Face Hub repo (downloaded into
    the hub's cache; pyklei.hub)."""
    return LLM(path, n_threads=n_threads, n_ctx=n_ctx, **kw)
