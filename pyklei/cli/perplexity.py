"""`pyklei perplexity`: pyklei.perplexity over the text of a file, windows of --ctx-size."""
from __future__ import annotations

import time

from .._report import plural
from ._common import (CLIError, _add_command, _add_model_options, _int_at_least, _load,
                      _print_json, _progress_bar, _read_text)


def add_parser(sub):
    pp = _add_command(
        sub, "perplexity", "measure perplexity over a text file",
        "Perplexity of the model over the text of FILE: windows of --ctx-size tokens moved "
        "by --stride; each token is scored once, with up to --ctx-size tokens of context.",
        "example:\n  pyklei perplexity m.gguf -f wiki.test.raw --ctx-size 512 --stride 256")
    pp.add_argument("model", metavar="MODEL", help="pyklei .gguf file")
    pp.add_argument("-f", "--file", required=True, help="UTF-8 text file")
    pp.add_argument("--stride", type=_int_at_least(1, "stride"), default=None, metavar="N",
                    help="window step in tokens (default: half the context)")
    pp.add_argument("--max-tokens", dest="max_tokens_eval", type=_int_at_least(2, "token count"),
                    default=None, metavar="N", help="score only the first N tokens of the file")
    pp.add_argument("--json", action="store_true", help="print the result as JSON")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_options(pp, ctx_help="window size in tokens (default 512)")
    pp.set_defaults(func=run)
    return pp


def run(args) -> int:
    from ..perplexity import perplexity

    text = _read_text(args.file, "text")
    ctx = args.ctx_size or 512
    stride = args.stride or ctx // 2
    if stride > ctx:
        raise CLIError(f"--stride {stride} is larger than --ctx-size {ctx}")
    llm = _load(args, n_ctx=ctx)
    ids = llm.tokenizer.encode(text, parse_special=False)
    if args.max_tokens_eval:
        ids = ids[:args.max_tokens_eval]
    if len(ids) < 2:
        raise CLIError(f"{args.file} has {len(ids)} token(s); perplexity needs at least 2")
    t0 = time.perf_counter()
    with _progress_bar(args, "perplexity", "window") as progress:
        res = perplexity(llm.logits, ids, n_ctx=ctx, stride=stride, progress=progress)
    dt = time.perf_counter() - t0
    if args.json:
        _print_json({"file": args.file, "ppl": res.ppl, "nll": res.nll, "tokens": len(ids),
                     "tokens_scored": res.tokens_scored, "windows": res.windows, "ctx_size": ctx,
                     "stride": stride, "seconds": dt})
    else:
        print(f"perplexity: {res.ppl:.4f}")
        print(f"  {res.tokens_scored} of {len(ids)} tokens scored in {plural(res.windows, 'window')} of "
              f"{ctx} (stride {stride}); mean NLL {res.nll:.4f} nats/token; {dt:.1f} s")
    return 0
