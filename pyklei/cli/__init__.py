"""The `pyklei` command line: convert, generate, chat, serve, route, batch, bench, info, perplexity,
imatrix.

    pyklei convert SmolLM2-135M-Instruct/ -o smollm2.gguf
    pyklei generate smollm2.gguf -p "The capital of France is" -n 32 --stats
    pyklei chat smollm2.gguf --system "You are terse."
    pyklei serve smollm2.gguf --port 8000 --parallel 8
    pyklei batch smollm2.gguf requests.jsonl -o results.jsonl
    pyklei bench smollm2.gguf -p 64,128,512 -n 128 --threads 1,2 --price-per-hour 0.05
    pyklei info smollm2.gguf
    pyklei perplexity smollm2.gguf -f wiki.test.raw --ctx-size 512

User mistakes (a missing file, a file that is not a pyklei GGUF, a bad option value) end
with one line on stderr, "pyklei COMMAND: error: ...", and exit code 2; anything else
unexpected exits with 1 (add --debug for the traceback). Ctrl-C exits with 130, except in
the chat REPL, where it only stops the reply being written. A closed pipe on stdout
(`| head`) ends quietly with 141, as a shell reports for `cat`. docs/CLI.md has the details.

Layout: this file assembles the parser and holds main(), the one place that turns exceptions
into exit codes; _common.py has the argparse plumbing and the option groups; each command is a
module with its arguments beside it (add_parser) and its run(args). The work itself is in the
library: pyklei.chat, pyklei.bench, pyklei.info, pyklei.calibration, pyklei.perplexity.
"""
from __future__ import annotations

import argparse
import os
import sys

from . import batch, bench, chat, convert, generate, imatrix, info, perplexity, route, serve
from ._common import (EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USER, PROG, CLIError,
                      _add_debug, _Parser)

__all__ = ["CLIError", "build_parser", "main"]

COMMANDS = (convert, generate, chat, serve, route, batch, bench, info, perplexity, imatrix)   # in --help's order

EPILOG = """\
examples:
  pyklei convert SmolLM2-135M-Instruct/ -o smollm2.gguf
  pyklei generate smollm2.gguf -p "The capital of France is" -n 32 --stats
  pyklei generate smollm2.gguf --chat -p "Name three colours." --temperature 0
  pyklei chat smollm2.gguf --system "You are a terse assistant."
  pyklei serve smollm2.gguf --port 8000 --parallel 8
  pyklei route http://127.0.0.1:8001 http://127.0.0.1:8002 --port 8080
  pyklei batch smollm2.gguf requests.jsonl -o results.jsonl
  pyklei bench smollm2.gguf -p 64,128,512 -n 128 --threads 1,2 --price-per-hour 0.05
  pyklei info smollm2.gguf
  pyklei perplexity smollm2.gguf -f wiki.test.raw --ctx-size 512

'pyklei COMMAND --help' describes a command. User mistakes exit with code 2 and a one-line
message; --debug shows the traceback of any error."""


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                description="4-bit Llama inference on CPUs (KleidiAI-style int4 kernels, GGUF files).",
                epilog=EPILOG)
    _add_debug(p)
    p.add_argument("--version", action="version", version=f"pyklei {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
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
