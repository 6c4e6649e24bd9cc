"""`pyklei convert`: the converter's own parser (pyklei.converters.cli), plus --calibrate: an
8-bit draft, its importance matrix, then the real conversion (pyklei.pipeline)."""
from __future__ import annotations

from ._common import CLIError, _add_debug, _Formatter, _read_text


def add_parser(sub):
    from ..converters.cli import add_convert_parser

    c = add_convert_parser(sub)
    c.formatter_class = _Formatter
    c.add_argument("--calibrate", nargs="?", const="default", default=None, metavar="TEXT_FILE",
                   help="measure an importance matrix first (an 8-bit draft run over TEXT_FILE, "
                        "default: Python's Language Reference) and quantize with it; better "
                        "4-bit quality for about twice the conversion time")
    c.set_defaults(func=run)
    _add_debug(c)
    return c


def run(args) -> int:
    from ..converters.cli import run_convert
    if args.calibrate is None:
        return run_convert(args)
    if args.imatrix:
        raise CLIError("give either --calibrate or --imatrix, not both")
    from ..converters import ConversionError
    from ..pipeline import convert_calibrated

    text = None if args.calibrate == "default" else _read_text(args.calibrate, "text")
    try:
        result = convert_calibrated(args.input, args.output, text, progress=not args.no_progress,
                                    group_size=args.group_size, embedding_bits=args.embedding_bits,
                                    keep=args.keep, name=args.name, force=args.force)
    except ConversionError as e:
        raise CLIError(str(e)) from None
    print(result.summary())
    return 0
