"""`pyklei convert`: argparse wiring for the converter (pyklei/cli.py adds the subcommand)."""
from __future__ import annotations

import argparse
import sys

from pyklei.formats.registry import WEIGHT_FORMATS

from .core import DEFAULT_EMBEDDING_BITS

HELP = "convert a Hugging Face Llama checkpoint or a llama.cpp GGUF into a pyklei GGUF"


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help=HELP, description=HELP + ".")
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="HF_DIR_OR_GGUF",
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, "
                        "tokenizer files) or a llama.cpp .gguf file of a llama model")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="output file")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128, 256),
                   help="qsi4c32 block length along K (default 32: 4.5 bits per weight)")
    p.add_argument("--embedding-bits", type=int, default=DEFAULT_EMBEDDING_BITS,
                   choices=(4, 6, 8, 16),
                   help="precision of token_embd (the tied lm_head) and output.weight: "
                        "4 = qsi4c32, 6 = qsi6c32, 8 = qsi8cx, 16 = f16 (default %(default)s)")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN=FMT",
                   help=f"store tensors whose GGUF or HF name matches the glob PATTERN in FMT "
                        f"({', '.join(f.alias for f in WEIGHT_FORMATS.values())}), e.g. 'blk.*.ffn_down.weight=q8'; repeatable, "
                        f"the first matching pattern wins")
    p.add_argument("--imatrix", metavar="FILE.npz",
                   help="importance matrix from `pyklei imatrix` (mean squared activation per "
                        "input channel): 4-bit scales then minimise the layer's output error")
    p.add_argument("--norm-weighting", action="store_true",
                   help="4-bit / 6-bit scales weigh each input channel of q/k/v, gate/up and the "
                        "lm_head by the squared gain of the RMSNorm before it (data-free; small "
                        "gain, see docs/FORMAT.md); default: plain squared error")
    p.add_argument("--name", help="general.name of the model (default: the input's name)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_convert)


def run_convert(args) -> int:
    from . import convert
    from .errors import ConversionError

    import signal

    def _term(signum, frame):  # turn SIGTERM into KeyboardInterrupt: the temp file is removed
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not in the main thread
        old = None
    try:
        result = convert(args.input, args.output, group_size=args.group_size,
                         embedding_bits=args.embedding_bits, keep=args.keep, name=args.name,
                         force=args.force, progress=not args.no_progress,
                         imatrix=getattr(args, "imatrix", None),
                         norm_weighting=getattr(args, "norm_weighting", False))
    except ConversionError as e:
        print(f"pyklei convert: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pyklei convert: interrupted; no output written", file=sys.stderr)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    print(result.summary())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pyklei convert", description=HELP + ".")
    configure_parser(p)
    args = p.parse_args(argv)
    return run_convert(args)


if __name__ == "__main__":
    sys.exit(main())
