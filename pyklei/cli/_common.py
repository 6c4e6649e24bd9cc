"""What every command of the CLI shares: exit codes, the argparse plumbing (one-line usage
errors, the help formatter, typed option values), the model and sampling option groups, and
model loading, text files and progress bars."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from contextlib import contextmanager
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


def _add_debug(p) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of errors")


def _add_command(sub, name, help, description, epilog=None):
    """A subcommand's parser: our help formatter and --debug."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=_Formatter)
    _add_debug(p)
    return p


def _int_at_least(lo: int, what: str = "value", hi: int | None = None):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: expected an integer") from None
        if hi is not None and not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"invalid {what} {s!r}: must be in [{lo}, {hi}]")
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


# ---- option groups --------------------------------------------------------------------------

def _add_model_options(p, ctx_help=None, threads=True):
    """The flags of pyklei.runtime.options.MODEL_OPTIONS that have flags (--ctx-size with this command's
    help when given; --threads left out when the command has its own)."""
    from ..runtime.options import MODEL_OPTIONS

    g = p.add_argument_group("model")
    for o in MODEL_OPTIONS:
        if not o.flags or (o.name == "n_threads" and not threads):
            continue
        _add_option(g, o, dest=_DEST.get(o.name, o.name),
                    help=ctx_help if o.name == "n_ctx" and ctx_help else None)
    return g


def _add_option(g, o, dest=None, help=None):
    """The flag of one pyklei.runtime.options.Option: its type and range, default and help;
    argparse stores the value under `dest` (default: the option's name)."""
    kw = dict(choices=o.choices) if o.choices else dict(type=_option_type(o), metavar=o.metavar)
    g.add_argument(*o.flags, dest=dest or o.name, default=o.default,
                   help=help or f"{o.help} ({o.default_help})", **kw)


# the attribute names the commands read (args.threads, args.ctx_size, args.batch_size)
_DEST = {"n_threads": "threads", "n_ctx": "ctx_size", "n_batch": "batch_size"}


def _option_type(o):
    """The argparse type of a pyklei.runtime.options.Option: its range, the CLI's messages."""
    if o.kind is int:
        return int if o.lo is None else _int_at_least(int(o.lo), o.what,
                                                      None if o.hi is None else int(o.hi))
    return _float_in(o.lo, o.hi, o.lo_open, o.hi_open, what=o.what)


def _add_sampling_options(p, max_tokens=128, n_help=None):
    """The flags of pyklei.runtime.sampler.SAMPLING_OPTIONS (max_tokens with this command's default and
    help), then --stop."""
    from ..runtime.sampler import SAMPLING_OPTIONS

    g = p.add_argument_group("sampling")
    for o in SAMPLING_OPTIONS:
        default, text = o.default, o.help
        if o.name == "max_tokens":
            default, text = max_tokens, n_help or text
        g.add_argument(*o.flags, dest=o.name, type=_option_type(o), default=default,
                       metavar=o.metavar, help=f"{text} ({o.default_help})")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (not printed); repeatable")
    return g


def _add_chat_template_option(p, kwargs: bool = True):
    p.add_argument("--chat-template", metavar="FILE|JINJA",
                   help="a Jinja chat template (a file, or the template's own text) used in place "
                        "of the model file's: a base model's file (Gemma 3 270M's) has none")
    if kwargs:
        p.add_argument("--chat-template-kwargs", metavar="JSON",
                       help='more variables for the chat template, e.g. \'{"enable_thinking": false}\' '
                            "(Qwen3: no thinking part)")


def _chat_template_kwargs(args) -> dict:
    """--chat-template-kwargs as a checked dict (pyklei.text.chat_template.check_template_kwargs)."""
    import json

    from ..text.chat_template import check_template_kwargs

    v = getattr(args, "chat_template_kwargs", None)
    if v is None:
        return {}
    try:
        return check_template_kwargs(json.loads(v))
    except json.JSONDecodeError as e:
        raise CLIError(f"--chat-template-kwargs is not JSON: {e}") from None
    except (TypeError, ValueError) as e:
        raise CLIError(f"--chat-template-kwargs: {e}") from None


def _chat_template(args) -> str | None:
    """The text of --chat-template: a file's, or the argument itself when it is Jinja."""
    v = getattr(args, "chat_template", None)
    if v is None:
        return None
    if Path(v).is_file():
        return _read_text(v, "chat template")
    if "{{" in v or "{%" in v:
        return v
    raise CLIError(f"no such chat template file: {v}")


def _add_constraint_options(p):
    """--json-schema, --grammar, --regex: the reply follows one of them (pyklei.runtime.grammar)."""
    g = p.add_argument_group("constrained output (needs llguidance: pip install llguidance)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE|JSON",
                   help="the reply is JSON valid under this JSON schema (a file, or the schema "
                        "itself); '{}' or '{\"type\": \"object\"}' for any JSON object")
    x.add_argument("--grammar", metavar="FILE",
                   help="the reply follows this grammar file (Lark, or llama.cpp's GBNF)")
    x.add_argument("--regex", metavar="RE", help="the reply matches this regular expression")
    return g


def _add_speculative_options(p):
    """--lookup, --draft-model FILE: speculative decoding (pyklei.runtime.speculative)."""
    g = p.add_argument_group("speculative decoding (the same text, in fewer passes where the "
                             "drafts hold; with a draft model and sampling, the same "
                             "distribution; not with a constraint)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--lookup", action="store_true",
                   help="draft tokens from n-grams of the prompt and the reply so far (faster "
                        "where the reply quotes its input; off by itself where it does not pay)")
    x.add_argument("--draft-model", metavar="FILE",
                   help="draft tokens with this smaller pyklei model of the same vocabulary, "
                        "loaded with the same model options")
    return g


def _speculative(args):
    """The LLM.generate speculative keyword of --lookup / --draft-model (the draft model
    loaded here)."""
    if getattr(args, "lookup", False):
        return "lookup"
    if getattr(args, "draft_model", None):
        return _load(args, model=args.draft_model, n_seq=1)
    return None


def _constraint(args) -> dict:
    """The LLM.generate constraint keywords of --json-schema / --grammar / --regex (files read
    here); {} when none is given."""
    import json

    if getattr(args, "json_schema", None) is not None:
        v = args.json_schema
        if not v.lstrip().startswith(("{", "[")) and not v.strip() in ("true", "false"):
            v = _read_text(v, "JSON schema")
        try:
            return {"json_schema": json.loads(v)}
        except json.JSONDecodeError as e:
            raise CLIError(f"--json-schema: not JSON ({e})") from None
    if getattr(args, "grammar", None) is not None:
        return {"grammar": _read_text(args.grammar, "grammar")}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    return {}


def _check_constraint(llm, constrain: dict) -> None:
    """Compiles the constraint once, so that a bad schema or a missing llguidance is a
    one-line error before any text is written."""
    if not constrain:
        return
    try:
        from ..runtime.grammar import constraint
        constraint(llm.tokenizer, **constrain)
    except ImportError as e:
        raise CLIError(str(e)) from None


def _sampling(args) -> dict:
    """The SamplingParams keywords of parsed sampling options."""
    from ..runtime.sampler import SAMPLING_OPTIONS, MAX_TOKENS

    return {o.name: getattr(args, o.name) for o in SAMPLING_OPTIONS if o is not MAX_TOKENS}


# ---- models, files, output ------------------------------------------------------------------

def _model_path(path: str, pyklei_only: bool = True) -> Path:
    """The model file a command runs: a local path, or `org/name:file.gguf` on the Hugging Face
    Hub, fetched into its cache (pyklei.hub; a HubError is a one-line error), there a pyklei
    file unless not pyklei_only (`info` describes any GGUF)."""
    from ..formats.model_file import check_model_path, is_model_file
    from ..hub import model_file
    return check_model_path(model_file(path, is_model=is_model_file if pyklei_only else None))


def _load(args, n_ctx: int | None = None, n_threads: int | None = None, model: str | None = None,
          **kw):
    """The model of args.model (or `model`) with the model options; kw: more pyklei.load
    keywords."""
    from ..llm import load

    if model is None and getattr(args, "chat_template", None) is not None:
        kw.setdefault("chat_template", _chat_template(args))     # not the draft model's
    return load(_model_path(model or args.model), **_load_kwargs(args, n_ctx, n_threads), **kw)


def _load_kwargs(args, n_ctx: int | None = None, n_threads: int | None = None) -> dict:
    """pyklei.load's keywords of the model options (for a load elsewhere: a Ray actor's)."""
    return dict(n_threads=n_threads or args.threads, n_ctx=n_ctx or args.ctx_size,
                n_batch=args.batch_size, kv_cache=args.kv_cache, activations=args.activations)


def _read_text(path: str, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"no such {what} file: {path}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CLIError(f"{path} is not UTF-8 text") from None


@contextmanager
def _progress_bar(args, desc: str, unit: str, leave: bool = True):
    """A tqdm bar on stderr (shown when stderr is a terminal, never with --no-progress); yields
    progress(i, n, stage=None): i of n done, stage shown beside the bar."""
    from tqdm import tqdm

    off = True if getattr(args, "no_progress", False) else None   # None: tqdm decides
    bar = tqdm(total=None, desc=desc, unit=unit, disable=off, file=sys.stderr, leave=leave)

    def progress(i, n, stage=None):
        bar.total = n
        if stage:
            bar.set_postfix_str(stage)
        bar.update(i - bar.n)

    try:
        yield progress
    finally:
        bar.close()


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _print_report(args, report: dict, as_text) -> int:
    """A command's report: as JSON with --json, else as_text(report); exit code 0."""
    if args.json:
        _print_json(report)
    else:
        print(as_text(report))
    return 0
