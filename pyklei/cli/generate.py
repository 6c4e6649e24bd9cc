"""`pyklei generate`: continue a prompt (or, with --chat, answer it as a user message) and
stream the text to stdout; --stats adds speed and memory on stderr."""
from __future__ import annotations

import sys

from ._common import (EXIT_INTERRUPTED, PROG, CLIError, _add_chat_template_option, _add_command,
                      _add_constraint_options, _add_model_options, _add_sampling_options,
                      _add_speculative_options, _chat_template_kwargs, _check_constraint,
                      _constraint, _load, _read_text, _sampling, _speculative)


def add_parser(sub):
    g = _add_command(
        sub, "generate", "continue a prompt, streaming the text",
        "Continue PROMPT (or the text of FILE) and stream the new text to stdout. With --chat "
        "the prompt is a user message rendered with the model's chat template.",
        "examples:\n"
        "  pyklei generate m.gguf -p 'Once upon a time' -n 64 --seed 1\n"
        "  pyklei generate m.gguf --chat -p 'What is 2+2?' --temperature 0 --stats\n"
        "  pyklei generate m.gguf -p 'List: 1.' --stop '4.' --top-k 0 --min-p 0.1\n"
        "  pyklei generate m.gguf --chat -p 'A person as JSON' --json-schema person.json\n"
        "  pyklei generate m.gguf --chat -f quote_this.txt --lookup --temperature 0 --stats")
    g.add_argument("model", metavar="MODEL", help="pyklei .gguf file (see `pyklei convert`)")
    g.add_argument("-p", "--prompt", metavar="TEXT", help="the prompt")
    g.add_argument("-f", "--file", help="read the prompt from this UTF-8 file")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the chat template as a user message")
    g.add_argument("--system", metavar="TEXT", help="system prompt (with --chat)")
    _add_chat_template_option(g)
    g.add_argument("--no-bos", action="store_true",
                   help="do not add BOS even if the model's tokenizer asks for it")
    g.add_argument("--stats", action="store_true",
                   help="print time to first token, prefill/decode tok/s, tokens and peak RSS "
                        "to stderr")
    _add_sampling_options(g)
    _add_constraint_options(g)
    sp = _add_speculative_options(g)
    sp.add_argument("--prediction", metavar="FILE",
                    help="the text the reply is expected to be (e.g. the file an edit "
                         "rewrites): drafts come from it, the reply is the same (OpenAI's "
                         "predicted outputs)")
    _add_model_options(g)
    g.set_defaults(func=run)
    return g


def _stats_text(r, load_seconds: float | None = None) -> str:
    cached = r.prompt_tokens - r.prompt_eval_tokens
    lines = [
        f"prompt:     {r.prompt_tokens} tokens"
        + (f" ({cached} from the cache, {r.prompt_eval_tokens} run)" if cached else "")
        + f", {r.prompt_tps:.1f} tok/s prefill",
        f"generated:  {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s decode"
        + (f" (finish: {r.finish_reason})" if r.finish_reason else "")
        + (f"; drafted {r.drafted_tokens}, accepted {r.accepted_tokens}" if r.drafted_tokens
           else ""),
        f"time to first token: {r.time_to_first_token * 1e3:.0f} ms; peak RSS: {r.peak_rss_mb:.0f} MB"
        + (f"; load: {load_seconds:.2f} s" if load_seconds is not None else ""),
    ]
    return "\n".join(lines)


def run(args) -> int:
    from ..runtime.request import token_budget

    if args.prompt is None and args.file is None:
        raise CLIError("give a prompt with -p PROMPT or -f FILE")
    if args.prompt is not None and args.file is not None:
        raise CLIError("give either -p PROMPT or -f FILE, not both")
    if args.system is not None and not args.chat:
        raise CLIError("--system needs --chat")
    if args.chat_template_kwargs is not None and not args.chat:
        raise CLIError("--chat-template-kwargs needs --chat")
    prompt = args.prompt if args.prompt is not None else _read_text(args.file, "prompt")
    if not prompt:
        raise CLIError("the prompt is empty")
    prediction = _read_text(args.prediction, "prediction") if args.prediction else None
    constrain = _constraint(args)
    template_kwargs = _chat_template_kwargs(args)      # a bad one fails before the model loads
    llm = _load(args)
    _check_constraint(llm, constrain)
    tok = llm.tokenizer
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      **template_kwargs)
    else:
        ids = tok.encode(prompt, add_bos=False if args.no_bos else None, parse_special=True)
    max_tokens = token_budget(llm.n_ctx, len(ids), args.max_tokens)
    out = sys.stdout
    last, wrote, interrupted = None, "", False
    it = llm.generate(ids, max_tokens=max_tokens, stream=True, stop=args.stop, **constrain,
                      speculative=_speculative(args), prediction=prediction, **_sampling(args))
    try:
        for r in it:
            if r.text:
                out.write(r.text)
                out.flush()
                wrote = r.text
            last = r
    except KeyboardInterrupt:
        interrupted = True
    if wrote and not wrote.endswith("\n") or interrupted:
        out.write("\n")
    out.flush()
    if interrupted:
        print(f"{PROG} generate: interrupted", file=sys.stderr)
    if args.stats and last is not None:
        print(_stats_text(last, llm.model.load_seconds), file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else 0
