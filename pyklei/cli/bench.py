"""`pyklei bench`: pyklei.bench.run_bench with a progress bar; a table or --json."""
from __future__ import annotations

from ._common import (_add_command, _add_model_options, _float_in, _int_at_least, _int_list,
                      _print_report, _progress_bar)


def add_parser(sub):
    b = _add_command(
        sub, "bench", "measure prefill and decode speed, memory and cost",
        "Measure prefill speed (tok/s) and time to first token for each prompt length, "
        "decode speed, load time and peak RSS, for each thread count; the median of "
        "--repeats runs. Prompts are random ordinary tokens; decode is greedy from an "
        "empty context. With --price-per-hour, the cost per million tokens of the "
        "machine: price / 3600 / (tok/s) x 1e6.",
        "examples:\n"
        "  pyklei bench m.gguf\n"
        "  pyklei bench m.gguf -p 64,512 -n 64 --threads 1,2 --price-per-hour 0.04 --json\n"
        "  pyklei bench m.gguf -p 512 -n 64 -d 4096 --kv-cache q8")
    b.add_argument("model", metavar="MODEL", help="pyklei .gguf file")
    b.add_argument("-p", "--prompt-lengths", type=_int_list(1, "prompt length"),
                   default=[64, 128, 512], metavar="N[,N...]",
                   help="prompt lengths to prefill (default 64,128,512)")
    b.add_argument("-n", "--n-gen", type=_int_at_least(0, "token count"), default=128,
                   metavar="N", help="tokens to decode (default %(default)s; 0 skips decode)")
    b.add_argument("-d", "--depth", type=_int_at_least(0, "depth"), default=0, metavar="N",
                   help="tokens already in the context when each test starts (prefilled "
                        "untimed; llama-bench's -d) (default %(default)s)")
    b.add_argument("--threads", "-t", type=_int_list(1, "thread count"), default=None,
                   metavar="T[,T...]", help="thread counts to measure (default: the physical cores)")
    b.add_argument("-r", "--repeats", type=_int_at_least(1, "repeat count"), default=3, metavar="N",
                   help="runs per test; the median is reported (default %(default)s)")
    b.add_argument("--price-per-hour", type=_float_in(0, None, what="price"), default=None,
                   metavar="USD", help="machine price in USD per hour, for $ per million tokens")
    b.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the random prompt tokens (default %(default)s)")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_options(b, ctx_help="context size (default: the longest test)", threads=False)
    b.set_defaults(func=run)
    return b


def run(args) -> int:
    from ..bench import bench_text, run_bench

    with _progress_bar(args, "bench", "run", leave=False) as progress:
        report = run_bench(args.model, args.prompt_lengths, args.n_gen, args.threads,
                           args.repeats, args.seed, args.price_per_hour, args.ctx_size,
                           args.batch_size, args.kv_cache, args.activations, progress=progress,
                           depth=args.depth)
    return _print_report(args, report, bench_text)
