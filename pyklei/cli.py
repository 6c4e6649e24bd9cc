"""The `pyklei` command line: convert, generate, chat, bench, info, perplexity.

    pyklei convert SmolLM2-135M-Instruct/ -o smollm2.gguf
    pyklei generate smollm2.gguf -p "The capital of France is" -n 32 --stats
    pyklei chat smollm2.gguf --system "You are terse."
    pyklei bench smollm2.gguf -p 64,128,512 -n 128 --threads 1,2 --price-per-hour 0.05
    pyklei info smollm2.gguf
    pyklei perplexity smollm2.gguf -f wiki.test.raw --ctx-size 512

User mistakes (a missing file, a file that is not a pyklei GGUF, a bad option value) end
with one line on stderr, "pyklei COMMAND: error: ...", and exit code 2; anything else
unexpected exits with 1 (add --debug for the traceback). Ctrl-C exits with 130, except in
the chat REPL, where it only stops the reply being written. A closed pipe on stdout
(`| head`) ends quietly with 141, as a shell reports for `cat`. docs/CLI.md has the details.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

PROG = "pyklei"
EXIT_USER = 2          # bad input or options
EXIT_INTERNAL = 1      # a bug or an environment problem
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away


class CLIError(Exception):
    """A user mistake: reported as one line, exit code 2."""


# ---- argparse plumbing ----------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message):
        self.exit(EXIT_USER, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _Formatter(argparse.HelpFormatter):
    """Wraps description paragraphs to the terminal, but keeps indented lines (examples, command
    lists) as written."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=min(100, _term_width()))

    def _fill_text(self, text, width, indent):
        import textwrap

        out = []
        for para in text.split("\n\n"):
            if any(line.startswith(" ") for line in para.splitlines()) or para.endswith(":"):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent, break_on_hyphens=False,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


def _term_width() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError):
        return 100


def _int_at_least(lo: int, what: str = "value"):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: expected an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: must be >= {lo}")
        return v
    conv.__name__ = what
    return conv


def _float_in(lo: float | None, hi: float | None, lo_open=False, hi_open=False, what="value"):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: expected a number") from None
        bad = not math.isfinite(v)
        if lo is not None:
            bad |= v <= lo if lo_open else v < lo
        if hi is not None:
            bad |= v >= hi if hi_open else v > hi
        if bad:
            rng = (("(" if lo_open else "[") + ("-inf" if lo is None else f"{lo:g}") + ", "
                   + ("inf" if hi is None else f"{hi:g}") + (")" if hi_open or hi is None else "]"))
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: must be in {rng}")
        return v
    conv.__name__ = what
    return conv


def _int_list(lo: int, what: str):
    one = _int_at_least(lo, what)

    def conv(s: str) -> list[int]:
        parts = [p for p in s.replace(" ", "").split(",") if p]
        if not parts:
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: expected a comma-separated list")
        return [one(p) for p in parts]
    conv.__name__ = what
    return conv


def _add_model_options(p, ctx_help="context size in tokens (default: the model's, at most 4096)",
                       threads=True):
    g = p.add_argument_group("model")
    if threads:
        g.add_argument("-t", "--threads", type=_int_at_least(1, "thread count"), default=None, metavar="N",
                       help="threads (default: the physical cores this process may use)")
    g.add_argument("-c", "--ctx-size", type=_int_at_least(2, "context size"), default=None, metavar="N",
                   help=ctx_help)
    g.add_argument("-b", "--batch-size", type=_int_at_least(1, "batch size"), default=256, metavar="N",
                   help="prompt tokens per forward pass (prefill chunk; default %(default)s)")
    g.add_argument("--kv-cache", choices=("f32", "f16"), default="f32", help="KV cache precision (default %(default)s)")
    g.add_argument("--activations", choices=("qai8dx2", "qai8dx"), default="qai8dx2",
                   help="activation quantization: qai8dx2 (two int8 planes, accurate) or qai8dx "
                        "(one plane, KleidiAI's scheme: faster prefill, less accurate); default %(default)s")
    return g


def _add_sampling_options(p, max_tokens=128, n_help="tokens to generate at most"):
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=_int_at_least(-1, "token count"), default=max_tokens,
                   metavar="N", help=n_help + " (default %(default)s; -1: until the context is full)")
    g.add_argument("--temperature", "--temp", type=_float_in(0, None, what="temperature"),
                   default=0.8, metavar="T",
                   help="randomness; 0 is greedy, always the most likely token (default %(default)s)")
    g.add_argument("--top-k", type=_int_at_least(0, "top-k"), default=40, metavar="K",
                   help="sample from the K most likely tokens; 0 disables it (default %(default)s)")
    g.add_argument("--top-p", type=_float_in(0, 1, lo_open=True, what="top-p"), default=0.95, metavar="P",
                   help="nucleus sampling threshold in (0, 1]; 1 disables it (default %(default)s)")
    g.add_argument("--min-p", type=_float_in(0, 1, hi_open=True, what="min-p"), default=0.05, metavar="P",
                   help="drop tokens less likely than P x the most likely one; 0 disables it "
                        "(default %(default)s)")
    g.add_argument("--repeat-penalty", type=_float_in(0, None, lo_open=True, what="repeat penalty"),
                   default=1.0, metavar="X",
                   help="penalty on recently seen tokens; 1 disables it (default %(default)s)")
    g.add_argument("--repeat-last-n", type=_int_at_least(0, "window"), default=64, metavar="N",
                   help="tokens the repeat penalty looks back over (default %(default)s)")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="random seed, for repeatable sampling (default: random)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (not printed); repeatable")
    return g


def _sampling(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                repetition_window=args.repeat_last_n, seed=args.seed)


def _progress_disabled(args) -> bool | None:
    # None lets tqdm decide: a bar only when stderr is a terminal.
    return True if getattr(args, "no_progress", False) else None


# ---- models ---------------------------------------------------------------------------------

def _model_path(path: str) -> Path:
    from .formats.model_file import check_model_path
    return check_model_path(path)


def _load(args, n_ctx: int | None = None, n_threads: int | None = None):
    from .llm import load

    return load(_model_path(args.model), n_threads=n_threads or args.threads,
                n_ctx=n_ctx or args.ctx_size, n_batch=args.batch_size, kv_cache=args.kv_cache,
                activations=args.activations)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _stats_text(r, load_seconds: float | None = None) -> str:
    cached = r.prompt_tokens - r.prompt_eval_tokens
    lines = [
        f"prompt:     {r.prompt_tokens} tokens"
        + (f" ({cached} from the cache, {r.prompt_eval_tokens} run)" if cached else "")
        + f", {r.prompt_tps:.1f} tok/s prefill",
        f"generated:  {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s decode"
        + (f" (finish: {r.finish_reason})" if r.finish_reason else ""),
        f"time to first token: {r.time_to_first_token * 1e3:.0f} ms; peak RSS: {r.peak_rss_mb:.0f} MB"
        + (f"; load: {load_seconds:.2f} s" if load_seconds is not None else ""),
    ]
    return "\n".join(lines)


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


# ---- generate -------------------------------------------------------------------------------

def _read_text(path: str, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"no such {what} file: {path}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CLIError(f"{path} is not UTF-8 text") from None


def cmd_generate(args) -> int:
    from .generate import token_budget

    if args.prompt is None and args.file is None:
        raise CLIError("give a prompt with -p PROMPT or -f FILE")
    if args.prompt is not None and args.file is not None:
        raise CLIError("give either -p PROMPT or -f FILE, not both")
    if args.system is not None and not args.chat:
        raise CLIError("--system needs --chat")
    prompt = args.prompt if args.prompt is not None else _read_text(args.file, "prompt")
    if not prompt:
        raise CLIError("the prompt is empty")
    llm = _load(args)
    tok = llm.tokenizer
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": prompt})
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok.encode(prompt, add_bos=False if args.no_bos else None, parse_special=True)
    max_tokens = token_budget(llm.n_ctx, len(ids), args.max_tokens)
    out = sys.stdout
    last, wrote, interrupted = None, "", False
    it = llm.generate(ids, max_tokens=max_tokens, stream=True, stop=args.stop, **_sampling(args))
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


# ---- chat -----------------------------------------------------------------------------------

CHAT_HELP = """\
commands:
  /help           this help
  /stats          speed and memory of the last reply, context in use
  /reset          forget the conversation (keeps the system prompt)
  /system [TEXT]  show, or set (and reset the conversation with) a system prompt
  /exit           leave (or Ctrl-D)
Ctrl-C stops a reply; what was written of it stays in the conversation.
End a line with \\ to continue the message on the next line."""


class ChatSession:
    """A conversation kept within the context: the oldest turns go first when it would overflow.

    history holds user/assistant messages; the system prompt (if any) is always kept. Before a
    turn, turns are dropped oldest first until prompt + max_tokens fits n_ctx; if the newest
    message alone leaves less room than max_tokens, the reply gets what is left.
    """

    MIN_REPLY = 16   # tokens: below this room a message is refused as too long

    def __init__(self, llm, system: str | None = None, max_tokens: int = 512, sampling=None,
                 stop=()):
        self.llm = llm
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = dict(sampling or {})
        self.stop = list(stop)
        self.history: list[dict] = []
        self.last = None            # GenerationResponse of the last reply
        self.turns = 0

    def _messages(self, extra: list[dict]) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history + extra

    def _ids(self, extra):
        return self.llm.tokenizer.apply_chat_template(self._messages(extra),
                                                      add_generation_prompt=True, tokenize=True)

    def prepare(self, user_text: str):
        """-> (prompt ids, max new tokens, turns dropped). Raises CLIError if it cannot fit."""
        n_ctx = self.llm.n_ctx
        user = [{"role": "user", "content": user_text}]
        want = self.max_tokens if self.max_tokens >= 0 else n_ctx // 2
        dropped = 0
        while True:
            ids = self._ids(user)
            if len(ids) + want <= n_ctx or not self.history:
                break
            # drop the oldest turn: a user message and the reply that followed it
            k = 2 if len(self.history) > 1 and self.history[1]["role"] == "assistant" else 1
            del self.history[:k]
            dropped += 1
        room = n_ctx - len(ids)
        if room < min(self.MIN_REPLY, want):
            raise CLIError(f"the message is too long: {len(ids)} tokens with the chat template, "
                           f"the context holds {n_ctx} (raise --ctx-size)")
        return ids, min(want, room) if self.max_tokens >= 0 else room, dropped

    def reply(self, user_text: str, write):
        """Streams the reply through write(text). Returns (text, interrupted, dropped turns)."""
        ids, max_new, dropped = self.prepare(user_text)
        parts, interrupted = [], False
        it = self.llm.generate(ids, max_tokens=max_new, stream=True, stop=self.stop,
                               **self.sampling)
        try:
            for r in it:
                if r.text:
                    parts.append(r.text)
                    write(r.text)
                self.last = r
        except KeyboardInterrupt:
            interrupted = True
            it.close()
        text = "".join(parts)
        if text.strip() or not interrupted:
            self.history.append({"role": "user", "content": user_text})
            self.history.append({"role": "assistant", "content": text})
            self.turns += 1
        return text, interrupted, dropped

    def reset(self):
        self.history.clear()
        self.llm.model.reset()
        self.last = None

    def stats_text(self) -> str:
        from .generate import peak_rss_mb

        used = len(self.llm.model.cached_tokens)
        lines = []
        r = self.last
        if r is None:
            lines.append("no reply yet")
        else:
            cached = r.prompt_tokens - r.prompt_eval_tokens
            lines.append(f"last reply: {r.generation_tokens} tokens at {r.generation_tps:.1f} tok/s; "
                         f"time to first token {r.time_to_first_token * 1e3:.0f} ms")
            lines.append(f"last prompt: {r.prompt_tokens} tokens, {cached} reused from the cache, "
                         f"{r.prompt_eval_tokens} run at {r.prompt_tps:.1f} tok/s")
        lines.append(f"context: {used} of {self.llm.n_ctx} tokens in use; "
                     f"{_n(len(self.history) // 2, 'turn')} in the history")
        lines.append(f"peak RSS: {peak_rss_mb():.0f} MB; threads: {self.llm.model.n_threads}; "
                     f"model load: {self.llm.model.load_seconds:.2f} s")
        return "\n".join(lines)


def _read_message(prompt="> ", more="... "):
    """One message from the user (a trailing backslash continues it). None on EOF."""
    lines = []
    while True:
        try:
            line = input(prompt if not lines else more)
        except EOFError:
            if lines:
                return "\n".join(lines)
            return None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def cmd_chat(args) -> int:
    llm = _load(args)
    if not llm.tokenizer.chat_template:
        raise CLIError(f"{args.model} has no chat template; use `pyklei generate` instead")
    session = ChatSession(llm, system=args.system, max_tokens=args.max_tokens,
                          sampling=_sampling(args), stop=args.stop)
    session.prepare("hello")  # renders the template once: template errors show up now
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    out = sys.stdout
    name = llm.model.file.metadata.get("general.name") or Path(args.model).stem
    print(f"pyklei chat: {name} ({llm.n_ctx}-token context, {_n(llm.model.n_threads, 'thread')}). "
          f"/help for commands, Ctrl-C stops a reply, Ctrl-D or /exit leaves.", file=out)
    out.flush()

    def write(text):
        out.write(text)
        out.flush()

    while True:
        try:
            msg = _read_message()
        except KeyboardInterrupt:      # Ctrl-C at the prompt: a fresh prompt, like a shell
            print(file=out)
            continue
        if msg is None:                # Ctrl-D
            print(file=out)
            return 0
        cmd = msg.strip()
        if not cmd:
            continue
        if cmd.startswith("/"):
            word, _, rest = cmd.partition(" ")
            if word in ("/exit", "/quit", "/bye"):
                return 0
            if word in ("/help", "/?"):
                print(CHAT_HELP, file=out)
            elif word == "/reset":
                session.reset()
                print("(conversation reset)", file=out)
            elif word == "/stats":
                print(session.stats_text(), file=out)
            elif word == "/system":
                if rest.strip():
                    session.system = rest.strip()
                    session.reset()
                    print("(system prompt set; conversation reset)", file=out)
                else:
                    print(f"system prompt: {session.system or '(none: the template default)'}",
                          file=out)
            else:
                print(f"unknown command {word}; /help lists the commands", file=out)
            out.flush()
            continue
        try:
            text, interrupted, dropped = session.reply(msg, write)
        except CLIError as e:
            print(f"error: {e}", file=out)
            continue
        if interrupted:
            write("\n[stopped]\n")
        elif not text.endswith("\n"):
            write("\n")
        if dropped:
            print(f"[dropped the oldest {_n(dropped, 'turn')} to stay within the {llm.n_ctx}-token "
                  f"context]", file=out)
        out.flush()


# ---- bench ----------------------------------------------------------------------------------

def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _cost(price_per_hour, tps):
    if price_per_hour is None or not tps or not math.isfinite(tps):
        return None
    return price_per_hour / 3600.0 / tps * 1e6


def cmd_bench(args) -> int:
    import gc

    import numpy as np
    from tqdm import tqdm

    from .generate import peak_rss_mb
    from .kernels import cpu_features, selected_kernel

    path = _model_path(args.model)
    lengths = args.prompt_lengths
    n_gen = args.n_gen
    n_ctx = args.ctx_size or max(max(lengths, default=1), n_gen + 1, 16)
    if max(lengths, default=0) > n_ctx or n_gen + 1 > n_ctx:
        raise CLIError(f"--ctx-size {n_ctx} is smaller than the longest test "
                       f"({max(max(lengths, default=0), n_gen + 1)} tokens)")
    if not lengths and n_gen == 0:
        raise CLIError("nothing to measure: give -p lengths or -n > 0")
    size = path.stat().st_size
    runs_per_thread = 1 + args.repeats * (len(lengths) + (1 if n_gen else 0))
    from .model import physical_cores
    thread_counts = args.threads or [physical_cores()]
    bar = tqdm(total=runs_per_thread * len(thread_counts), desc="bench", unit="run",
               disable=_progress_disabled(args), file=sys.stderr, leave=False)
    report = {"model": str(path), "name": None, "file_bytes": size, "params": None,
              "activations": args.activations, "kv_cache": args.kv_cache,
              "batch_size": args.batch_size, "ctx_size": n_ctx, "repeats": args.repeats,
              "price_per_hour_usd": args.price_per_hour, "cpu_features": cpu_features(),
              "kernels": {}, "cpu_count": os.cpu_count(),
              "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "results": []}
    planes = 2 if args.activations == "qai8dx2" else 1
    for th in thread_counts:
        bar.set_postfix_str(f"{th} thread(s): load")
        t0 = time.perf_counter()
        llm = _load(args, n_ctx=n_ctx, n_threads=th)
        load_s = time.perf_counter() - t0
        model = llm.model
        if report["params"] is None:
            report["params"] = sum(math.prod(t.shape) for t in model.file.tensors.values())
            report["name"] = model.file.metadata.get("general.name")
            report["kernels"] = {
                "decode": {f: selected_kernel(f, planes) for f in ("qsi4c32", "qsi6c32", "qsi8cx")},
                "prefill": {f: selected_kernel(f, planes * args.batch_size)
                            for f in ("qsi4c32", "qsi6c32", "qsi8cx")}}
        rng = np.random.default_rng(args.seed)
        normal = np.nonzero(np.asarray(llm.tokenizer.token_types) == 1)[0]
        pool = normal if normal.size else np.arange(model.vocab_size)

        def tokens(n):
            return [int(t) for t in rng.choice(pool, n)]

        model.reset()
        model.eval(tokens(min(8, n_ctx)))       # warm-up: touch the weights once
        bar.update(1)
        res = {"threads": th, "load_s": load_s, "prefill": [], "decode": None}
        for p in lengths:
            bar.set_postfix_str(f"{th} thread(s): prefill {p}")
            times = []
            for _ in range(args.repeats):
                toks = tokens(p)
                model.reset()
                t = time.perf_counter()
                logits = model.eval(toks)
                int(np.argmax(logits))           # the first token (greedy)
                times.append(time.perf_counter() - t)
                bar.update(1)
            dt = _median(times)
            tps = p / dt
            res["prefill"].append({"tokens": p, "tok_s": tps, "ttft_s": dt,
                                   "usd_per_mtok": _cost(args.price_per_hour, tps),
                                   "samples_s": times})
        if n_gen:
            bar.set_postfix_str(f"{th} thread(s): decode {n_gen}")
            times = []
            for _ in range(args.repeats):
                model.reset()
                logits = model.eval(tokens(1))
                t = time.perf_counter()
                for _ in range(n_gen):
                    logits = model.step(int(np.argmax(logits)))
                times.append(time.perf_counter() - t)
                bar.update(1)
            dt = _median(times)
            tps = n_gen / dt
            res["decode"] = {"tokens": n_gen, "tok_s": tps, "ms_per_token": dt / n_gen * 1e3,
                             "usd_per_mtok": _cost(args.price_per_hour, tps), "samples_s": times}
        res["state_bytes"] = model.state_bytes
        res["peak_rss_mb"] = peak_rss_mb()
        report["results"].append(res)
        del llm, model
        gc.collect()
    bar.close()
    report["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_bench_table(report))
    return 0


def _bench_table(rep) -> str:
    price = rep["price_per_hour_usd"]
    head = (f"model: {rep['name'] or Path(rep['model']).name}  {_mb(rep['file_bytes'])}, "
            f"{rep['params'] / 1e6:.1f} M params; activations {rep['activations']}, "
            f"KV {rep['kv_cache']}, batch {rep['batch_size']}, ctx {rep['ctx_size']}")
    kd, kp = rep["kernels"]["decode"]["qsi4c32"], rep["kernels"]["prefill"]["qsi4c32"]
    cpu = (f"cpu: {' '.join(rep['cpu_features']) or 'baseline'} ({rep['cpu_count']} logical CPUs"
           + (f", 1-min load average {rep['loadavg'][0]:.1f} at the start" if rep.get("loadavg") else "")
           + (f", {rep['loadavg_end'][0]:.1f} at the end" if rep.get("loadavg_end") else "") + ")")
    kern = f"kernels (qsi4c32): decode {kd}, prefill {kp}"
    cols = ["threads", "test", "tok/s", "TTFT ms", "ms/token"]
    if price is not None:
        cols.append("$/M tokens")
    cols += ["load s", "peak RSS MB"]
    rows = []
    for r in rep["results"]:
        first = True
        for p in r["prefill"]:
            row = [str(r["threads"]), f"prefill {p['tokens']}", f"{p['tok_s']:.1f}",
                   f"{p['ttft_s'] * 1e3:.0f}", f"{p['ttft_s'] / p['tokens'] * 1e3:.2f}"]
            if price is not None:
                row.append(f"{p['usd_per_mtok']:.4f}")
            row += [f"{r['load_s']:.2f}" if first else "", f"{r['peak_rss_mb']:.0f}" if first else ""]
            rows.append(row)
            first = False
        d = r["decode"]
        if d:
            row = [str(r["threads"]), f"decode {d['tokens']}", f"{d['tok_s']:.1f}", "-",
                   f"{d['ms_per_token']:.2f}"]
            if price is not None:
                row.append(f"{d['usd_per_mtok']:.4f}")
            row += [f"{r['load_s']:.2f}" if first else "", f"{r['peak_rss_mb']:.0f}" if first else ""]
            rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]

    def fmt(row):
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(row, widths))).rstrip()

    lines = [head, cpu, kern, "", fmt(cols), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    notes = [f"median of {_n(rep['repeats'], 'run')}; TTFT = prefill of the prompt + the first "
             f"(greedy) token; decode from an empty context, sampling excluded"]
    if price is not None:
        notes.append(f"cost at ${price:g}/hour for the whole machine: $/M tokens = "
                     f"price / 3600 / (tok/s) x 1e6")
    return "\n".join(lines + [""] + notes)


# ---- info -----------------------------------------------------------------------------------

_PARTS = (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o"),
          ("ffn_gate", "gate"), ("ffn_up", "up"), ("ffn_down", "down"))


def _tensor_bytes(t) -> int:
    return sum(a.nbytes for a in (t.data, t.qs, t.scales) if a is not None)


def model_info(path, activations="qai8dx2", batch_size=256) -> dict:
    """Everything `pyklei info` prints, as a dict (reads the file only; loads no runtime)."""
    from .formats import gguf_keys as K
    from .formats.model_file import read_model
    from .kernels import available_kernels, cpu_features, selected_kernel

    mf = read_model(path)
    hp, md = mf.hparams, mf.metadata
    fmts: dict[str, dict] = {}
    for t in mf.tensors.values():
        f = fmts.setdefault(t.format, {"tensors": 0, "params": 0, "bytes": 0})
        f["tensors"] += 1
        f["params"] += math.prod(t.shape)
        f["bytes"] += _tensor_bytes(t)
    for f in fmts.values():
        f["bits_per_weight"] = 8 * f["bytes"] / f["params"] if f["params"] else 0.0
    n_params = sum(f["params"] for f in fmts.values())
    n_bytes = sum(f["bytes"] for f in fmts.values())

    planes = 2 if activations == "qai8dx2" else 1
    m_dec, m_pre = planes, planes * batch_size
    shapes: dict[tuple, dict] = {}
    for i in range(hp.n_layer):
        for part, short in _PARTS:
            t = mf.layer(i, part)
            key = (short, t.shape, t.format)
            s = shapes.setdefault(key, {"weight": short, "n": t.shape[0], "k": t.shape[1],
                                        "format": t.format, "layers": 0})
            s["layers"] += 1
    out = mf.output
    rows = list(shapes.values())
    rows.append({"weight": "lm_head" + (" (tied)" if hp.tied else ""), "n": out.shape[0],
                 "k": out.shape[1], "format": out.format, "layers": 1})
    for r in rows:
        f = r["format"] if r["format"] in K.PACKED_FORMATS else "qsi8cx"  # f16/f32 lm_head -> qsi8cx at load
        if f != r["format"]:
            r["runtime_format"] = f
        r["decode_kernel"] = selected_kernel(f, m_dec)
        # only the last position's logits are computed after a prompt: lm_head runs at m = planes
        r["prefill_kernel"] = selected_kernel(f, m_dec if r["weight"].startswith("lm_head") else m_pre)

    tmpl = md.get("tokenizer.chat_template")
    return {
        "path": str(path),
        "file_bytes": Path(path).stat().st_size,
        "name": md.get(K.GENERAL_NAME),
        "architecture": md.get(K.GENERAL_ARCHITECTURE),
        "pyklei_format_version": md.get(K.KEY_FORMAT_VERSION),
        "converted_from": md.get(K.KEY_SOURCE),
        "params": n_params,
        "tensor_bytes": n_bytes,
        "bits_per_weight": 8 * n_bytes / n_params if n_params else 0.0,
        "qsi4c32_block_size": hp.block_size,
        "hparams": {"context_length": hp.context_length, "n_layer": hp.n_layer,
                    "n_embd": hp.n_embd, "n_ff": hp.n_ff, "n_head": hp.n_head,
                    "n_head_kv": hp.n_head_kv, "head_dim": hp.head_dim,
                    "rope_theta": hp.rope_theta, "rope_scaling": md.get(K.ROPE_SCALING_TYPE),
                    "rms_eps": hp.rms_eps, "tied_embeddings": hp.tied},
        "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
                      "vocab_size": hp.vocab_size, "bos_id": md.get("tokenizer.ggml.bos_token_id"),
                      "eos_ids": mf.eos_token_ids,
                      "add_bos": md.get("tokenizer.ggml.add_bos_token")},
        "chat_template": bool(tmpl),
        "formats": fmts,
        "cpu_features": cpu_features(),
        "kernels_available": [k["name"] for k in available_kernels() if k["priority"] >= 0],
        "activations": activations,
        "m_decode": m_dec,
        "m_prefill": m_pre,
        "layers": rows,
    }


def _info_text(info: dict) -> str:
    hp, tk = info["hparams"], info["tokenizer"]
    tok_kind = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}.get(tk["model"], tk["model"])
    src = f", converted from {info['converted_from']}" if info["converted_from"] else ""
    L = [
        f"file           {info['path']} ({_mb(info['file_bytes'])})",
        f"name           {info['name'] or '-'}",
        f"architecture   {info['architecture']} (pyklei format {info['pyklei_format_version']}{src})",
        f"parameters     {info['params'] / 1e6:.1f} M, {info['bits_per_weight']:.2f} bits per "
        f"weight overall",
        f"context        {hp['context_length']} tokens",
        f"shape          {hp['n_layer']} layers, embedding {hp['n_embd']}, feed-forward {hp['n_ff']}, "
        f"heads {hp['n_head']} (kv {hp['n_head_kv']}), head dim {hp['head_dim']}",
        f"rope           theta {hp['rope_theta']:g}" + (f", {hp['rope_scaling']} scaling"
                                                        if hp["rope_scaling"] else "")
        + f"; tied embeddings: {'yes' if hp['tied_embeddings'] else 'no'}",
        f"vocab          {tk['vocab_size']} tokens, {tok_kind}"
        + (f" (pre-tokenizer {tk['pre']})" if tk["pre"] else "")
        + f"; BOS {tk['bos_id']}, EOS {tk['eos_ids']}",
        f"chat template  {'yes' if info['chat_template'] else 'no'}",
        "",
        "tensors by format",
    ]
    rows = [["format", "tensors", "params", "bytes", "bits/weight"]]
    for f, v in sorted(info["formats"].items(), key=lambda kv: -kv[1]["bytes"]):
        label = f + (f" (group {info['qsi4c32_block_size']})" if f == "qsi4c32" else "")
        rows.append([label, str(v["tensors"]), f"{v['params']:,}", _mb(v["bytes"]),
                     f"{v['bits_per_weight']:.2f}"])
    rows.append(["total", str(sum(v["tensors"] for v in info["formats"].values())),
                 f"{info['params']:,}", _mb(info["tensor_bytes"]), f"{info['bits_per_weight']:.2f}"])
    L += _table(rows, indent=2)
    L += ["", f"cpu features   {' '.join(info['cpu_features']) or '(baseline only)'}",
          *_wrap("kernels        ", ", ".join(info["kernels_available"])), "",
          *_wrap("", f"kernel per weight on this CPU ({info['activations']} activations: decode "
                     f"runs m={info['m_decode']} rows, prefill m={info['m_prefill']} for a full "
                     f"chunk of {info['m_prefill'] // info['m_decode']} tokens; lm_head runs on "
                     f"the last position only)")]
    rows = [["weight", "N x K", "format", "layers", f"decode (m={info['m_decode']})",
             f"prefill (m={info['m_prefill']})"]]
    for r in info["layers"]:
        fmt = r["format"] + (f" -> {r['runtime_format']}" if "runtime_format" in r else "")
        rows.append([r["weight"], f"{r['n']} x {r['k']}", fmt, str(r["layers"]),
                     r["decode_kernel"], r["prefill_kernel"]])
    L += _table(rows, indent=2)
    return "\n".join(L)


def _wrap(label: str, text: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, initial_indent=label, subsequent_indent=" " * len(label),
                         break_on_hyphens=False)


def _table(rows, indent=0) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    pad = " " * indent
    return [pad + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def cmd_info(args) -> int:
    path = _model_path(args.model)
    info = model_info(path, activations=args.activations, batch_size=args.batch_size)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_info_text(info))
    return 0


# ---- perplexity -----------------------------------------------------------------------------

def cmd_perplexity(args) -> int:
    from tqdm import tqdm

    from .perplexity import perplexity

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
    bar = tqdm(total=None, desc="perplexity", unit="window", disable=_progress_disabled(args),
               file=sys.stderr)

    def progress(i, n):
        bar.total = n
        bar.update(i - bar.n)

    t0 = time.perf_counter()
    try:
        res = perplexity(llm.logits, ids, n_ctx=ctx, stride=stride, progress=progress)
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    if args.json:
        json.dump({"file": args.file, "ppl": res.ppl, "nll": res.nll, "tokens": len(ids),
                   "tokens_scored": res.tokens_scored, "windows": res.windows, "ctx_size": ctx,
                   "stride": stride, "seconds": dt}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"perplexity: {res.ppl:.4f}")
        print(f"  {res.tokens_scored} of {len(ids)} tokens scored in {_n(res.windows, 'window')} of "
              f"{ctx} (stride {stride}); mean NLL {res.nll:.4f} nats/token; {dt:.1f} s")
    return 0


# ---- imatrix and calibrated conversion -------------------------------------------------------

def _collect(model_path, text: str, ctx: int, max_tokens: int | None, threads, progress_off):
    from tqdm import tqdm

    from .imatrix import collect_imatrix
    from .llm import LLM

    llm = LLM(model_path, n_threads=threads, n_ctx=ctx)
    ids = llm.tokenizer.encode(text, parse_special=False)
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise CLIError("the calibration text has fewer than 2 tokens")
    bar = tqdm(total=None, desc="imatrix", unit="window", disable=progress_off, file=sys.stderr)

    def progress(i, n):
        bar.total = n
        bar.update(i - bar.n)

    try:
        return collect_imatrix(llm.model, ids, n_ctx=ctx, progress=progress), len(ids)
    finally:
        bar.close()


def cmd_imatrix(args) -> int:
    from .imatrix import default_calibration_text, save_imatrix

    text = _read_text(args.file, "text") if args.file else default_calibration_text()
    imat, n = _collect(_model_path(args.model), text, args.ctx_size or 512, args.max_tokens_eval,
                       getattr(args, "threads", None), _progress_disabled(args))
    save_imatrix(args.output, imat, n)
    print(f"wrote {args.output}: {len(imat)} tensors, {n} calibration tokens")
    return 0


def cmd_convert(args) -> int:
    """`pyklei convert`, with --calibrate: an 8-bit draft, its imatrix, then the real conversion."""
    from .converters.cli import run_convert
    if args.calibrate is None:
        return run_convert(args)
    if args.imatrix:
        raise CLIError("give either --calibrate or --imatrix, not both")
    from .converters import ConversionError
    from .pipeline import convert_calibrated

    text = None if args.calibrate == "default" else _read_text(args.calibrate, "text")
    try:
        result = convert_calibrated(args.input, args.output, text, progress=not args.no_progress,
                                    group_size=args.group_size, embedding_bits=args.embedding_bits,
                                    keep=args.keep, name=args.name, force=args.force)
    except ConversionError as e:
        raise CLIError(str(e)) from None
    print(result.summary())
    return 0


# ---- the parser -----------------------------------------------------------------------------

EPILOG = """\
examples:
  pyklei convert SmolLM2-135M-Instruct/ -o smollm2.gguf
  pyklei generate smollm2.gguf -p "The capital of France is" -n 32 --stats
  pyklei generate smollm2.gguf --chat -p "Name three colours." --temperature 0
  pyklei chat smollm2.gguf --system "You are a terse assistant."
  pyklei bench smollm2.gguf -p 64,128,512 -n 128 --threads 1,2 --price-per-hour 0.05
  pyklei info smollm2.gguf
  pyklei perplexity smollm2.gguf -f wiki.test.raw --ctx-size 512

'pyklei COMMAND --help' describes a command. User mistakes exit with code 2 and a one-line
message; --debug shows the traceback of any error."""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of errors")

    p = _Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="4-bit Llama inference on CPUs (KleidiAI-style int4 kernels, GGUF files).",
                epilog=EPILOG, parents=[common])
    p.add_argument("--version", action="version", version=f"pyklei {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    # convert (the converter's own parser, made in its package)
    from .converters.cli import add_convert_parser
    c = add_convert_parser(sub)
    c.formatter_class = _Formatter
    c.add_argument("--calibrate", nargs="?", const="default", default=None, metavar="TEXT_FILE",
                   help="measure an importance matrix first (an 8-bit draft run over TEXT_FILE, "
                        "default: Python's Language Reference) and quantize with it; better "
                        "4-bit quality for about twice the conversion time")
    c.set_defaults(func=cmd_convert)
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of errors")

    def add(name, help, description, epilog=None):
        return sub.add_parser(name, help=help, description=description, epilog=epilog,
                              formatter_class=_Formatter, parents=[common])

    g = add("generate", "continue a prompt, streaming the text",
            "Continue PROMPT (or the text of FILE) and stream the new text to stdout. With --chat "
            "the prompt is a user message rendered with the model's chat template.",
            "examples:\n"
            "  pyklei generate m.gguf -p 'Once upon a time' -n 64 --seed 1\n"
            "  pyklei generate m.gguf --chat -p 'What is 2+2?' --temperature 0 --stats\n"
            "  pyklei generate m.gguf -p 'List: 1.' --stop '4.' --top-k 0 --min-p 0.1")
    g.add_argument("model", metavar="MODEL", help="pyklei .gguf file (see `pyklei convert`)")
    g.add_argument("-p", "--prompt", metavar="TEXT", help="the prompt")
    g.add_argument("-f", "--file", help="read the prompt from this UTF-8 file")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the chat template as a user message")
    g.add_argument("--system", metavar="TEXT", help="system prompt (with --chat)")
    g.add_argument("--no-bos", action="store_true",
                   help="do not add BOS even if the model's tokenizer asks for it")
    g.add_argument("--stats", action="store_true",
                   help="print time to first token, prefill/decode tok/s, tokens and peak RSS "
                        "to stderr")
    _add_sampling_options(g)
    _add_model_options(g)
    g.set_defaults(func=cmd_generate)

    ch = add("chat", "interactive chat in the terminal",
             "Chat with the model in the terminal; replies stream as they are written.\n\n"
             + CHAT_HELP + "\n\n"
             "The conversation stays in the context window: when the next turn would not fit "
             "(prompt + --max-tokens > --ctx-size), the oldest turns are dropped, oldest first "
             "(the system prompt is kept), and a note says so. The KV cache keeps the "
             "conversation, so a turn only runs its new tokens (except after turns are dropped).")
    ch.add_argument("model", metavar="MODEL", help="pyklei .gguf file with a chat template")
    ch.add_argument("--system", metavar="TEXT", help="system prompt (default: the chat template's own, if any)")
    _add_sampling_options(ch, max_tokens=512, n_help="reply length at most, in tokens")
    _add_model_options(ch)
    ch.set_defaults(func=cmd_chat)

    b = add("bench", "measure prefill and decode speed, memory and cost",
            "Measure prefill speed (tok/s) and time to first token for each prompt length, "
            "decode speed, load time and peak RSS, for each thread count; the median of "
            "--repeats runs. Prompts are random ordinary tokens; decode is greedy from an "
            "empty context. With --price-per-hour, the cost per million tokens of the "
            "machine: price / 3600 / (tok/s) x 1e6.",
            "examples:\n"
            "  pyklei bench m.gguf\n"
            "  pyklei bench m.gguf -p 64,512 -n 64 --threads 1,2 --price-per-hour 0.04 --json")
    b.add_argument("model", metavar="MODEL", help="pyklei .gguf file")
    b.add_argument("-p", "--prompt-lengths", type=_int_list(1, "prompt length"),
                   default=[64, 128, 512], metavar="N[,N...]",
                   help="prompt lengths to prefill (default 64,128,512)")
    b.add_argument("-n", "--n-gen", type=_int_at_least(0, "token count"), default=128,
                   metavar="N", help="tokens to decode (default %(default)s; 0 skips decode)")
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
    b.set_defaults(func=cmd_bench)

    i = add("info", "show a model's metadata, tensor formats and kernels",
            "Show the model's metadata, its tensors by format (count, bytes, bits per weight), "
            "the CPU's features, and which kernel each weight shape runs on this CPU for decode "
            "and prefill.")
    i.add_argument("model", metavar="MODEL", help="pyklei .gguf file")
    i.add_argument("--activations", choices=("qai8dx2", "qai8dx"), default="qai8dx2",
                   help="activation scheme the kernel table assumes (qai8dx2: 2 rows per token; "
                        "default %(default)s)")
    i.add_argument("-b", "--batch-size", type=_int_at_least(1, "batch size"), default=256, metavar="N",
                   help="prefill chunk (tokens) the kernel table assumes (default %(default)s)")
    i.add_argument("--json", action="store_true", help="print the information as JSON")
    i.set_defaults(func=cmd_info)

    pp = add("perplexity", "measure perplexity over a text file",
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
    pp.set_defaults(func=cmd_perplexity)

    im = add("imatrix", "measure an importance matrix for `convert --imatrix`",
             "Run MODEL over calibration text and write the mean squared activation of every "
             "linear layer's input channels (.npz). `pyklei convert --imatrix FILE` then picks "
             "each 4-bit scale to minimise the layer's output error. Measure on an 8-bit "
             "conversion (`--keep '*=q8'`) of the same checkpoint.",
             "example:\n  pyklei convert hf/ -o draft.gguf --keep '*=q8'\n"
             "  pyklei imatrix draft.gguf -o imatrix.npz\n"
             "  pyklei convert hf/ -o model.gguf --imatrix imatrix.npz")
    im.add_argument("model", metavar="MODEL", help="pyklei .gguf file")
    im.add_argument("-o", "--output", required=True, metavar="FILE.npz", help="output file")
    im.add_argument("-f", "--file", help="calibration text (default: Python's Language Reference, "
                                         "without the topics the benchmarks evaluate on)")
    im.add_argument("--max-tokens", dest="max_tokens_eval", type=_int_at_least(2, "token count"),
                    default=8192, metavar="N", help="calibration tokens at most (default %(default)s)")
    im.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_options(im, ctx_help="window size in tokens (default 512)")
    im.set_defaults(func=cmd_imatrix)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USER
    prog = f"{PROG} {args.command}"
    debug = getattr(args, "debug", False)
    try:
        rc = args.func(args)
        sys.stdout.flush()
        return rc or 0
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly with the status a shell reports for a
        # command killed by SIGPIPE, as `cat` or llama.cpp's tools give. stdout goes to
        # /dev/null so that the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (CLIError, ValueError, OSError) as e:
        if debug:
            raise
        msg = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename and e.strerror:
            msg = f"{e.filename}: {e.strerror}"
        print(f"{prog}: error: {' '.join(msg.split())}", file=sys.stderr)
        return EXIT_USER
    except Exception as e:
        if debug:
            raise
        print(f"{prog}: error: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              f"(run with --debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
