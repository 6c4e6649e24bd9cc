"""`pyklei convert`: a Hugging Face checkpoint or llama.cpp GGUF -> a pyklei GGUF.

By default the model is rotated and its 4-bit weights are chosen by GPTQ over calibration
text (pyklei.calibration.convert_gptq; docs/QUALITY.md has the measurements behind that choice);
--no-calibrate is the data-free path (plain per-block rounding, pyklei.converters.convert),
--calibrate the older importance-matrix method (pyklei.calibration.convert_calibrated)."""
from __future__ import annotations

import sys

from ._common import CLIError, _add_debug, _Formatter, _read_text

HELP = "convert a Hugging Face Llama checkpoint or a llama.cpp GGUF into a pyklei GGUF"


def add_parser(sub):
    from ..converters.calibration_forward import DEFAULT_CALIBRATION_TOKENS, DEFAULT_SEQ_LEN

    c = sub.add_parser("convert", help=HELP, description=HELP + ".")
    _configure(c)
    c.formatter_class = _Formatter
    c.add_argument("--gptq", nargs="?", const="default", default=None, metavar="TEXT_FILE",
                   help="calibration text of the default method, GPTQ (error-compensating "
                        "rounding over the Hessian of each layer's inputs, run through the model "
                        "in numpy); default: Python's Language Reference")
    c.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS, metavar="N",
                   help=f"calibration tokens for GPTQ, as windows of {DEFAULT_SEQ_LEN} "
                        "(default %(default)s)")
    c.add_argument("--no-rotate", action="store_true",
                   help="GPTQ without rotating the model first (worse: docs/QUALITY.md)")
    c.add_argument("--no-calibrate", action="store_true",
                   help="data-free conversion: plain per-block rounding, no calibration text "
                        "(a few times faster, several times the KL divergence; add --rotate "
                        "to rotate anyway)")
    c.add_argument("--calibrate", nargs="?", const="default", default=None, metavar="TEXT_FILE",
                   help="the older method instead of GPTQ: an importance matrix measured by an "
                        "8-bit draft over TEXT_FILE (default: Python's Language Reference) "
                        "weighs each block's rounding error; unrotated")
    c.set_defaults(func=run)
    _add_debug(c)
    return c


def _configure(p) -> None:
    p.add_argument("input", metavar="HF_DIR_OR_GGUF",
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, "
                        "tokenizer files), a llama.cpp .gguf file of a llama model, or a Hugging "
                        "Face Hub id org/name (downloaded into the hub's cache; HF_TOKEN for "
                        "gated models, HF_HUB_OFFLINE=1 to use the cache only)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="output file")
    p.add_argument("--revision", metavar="REV",
                   help="with a hub id: the branch, tag or commit to download (default: main)")
    p.add_argument("--file", dest="hub_file", metavar="NAME.gguf",
                   help="with a hub id: convert this GGUF file of the repo instead of its "
                        "safetensors checkpoint")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128, 256),
                   help="qsi4c32 block length along K (default 32: 4.5 bits per weight)")
    p.add_argument("--embedding-bits", type=int, default=_default_embedding_bits(),
                   choices=(4, 6, 8, 16),
                   help="precision of token_embd (the tied lm_head) and output.weight: "
                        "4 = qsi4c32, 6 = qsi6c32, 8 = qsi8cx, 16 = f16 (default %(default)s)")
    p.add_argument("--keep", action="append", default=[], metavar="PATTERN=FMT",
                   help=f"store tensors whose GGUF or HF name matches the glob PATTERN in FMT "
                        f"({', '.join(f.alias for f in _weight_formats())}), e.g. "
                        f"'blk.*.ffn_down.weight=q8'; repeatable, the first matching pattern wins")
    p.add_argument("--imatrix", metavar="FILE.npz",
                   help="importance matrix from `pyklei imatrix` (mean squared activation per "
                        "input channel): 4-bit scales then minimise the layer's output error")
    p.add_argument("--norm-weighting", action="store_true",
                   help="4-bit / 6-bit scales weigh each input channel of q/k/v, gate/up and the "
                        "lm_head by the squared gain of the RMSNorm before it (data-free; small "
                        "gain, see docs/FORMAT.md); default: plain squared error")
    p.add_argument("--rotate", action="store_true",
                   help="with --no-calibrate: rotate the model before rounding (residual "
                        "stream, value heads, down_proj input; QuaRot-style, exact in real "
                        "arithmetic, the runtime applies the online part). The default method "
                        "rotates already; rotation without GPTQ is worse than neither on the "
                        "measured models (docs/QUALITY.md)")
    ladder = p.add_mutually_exclusive_group()
    ladder.add_argument("--recipe", choices=_recipes(), default=None,
                        help="size/quality recipe: which block linears are stored at 6 bits "
                             "(qsi6c32): " + "; ".join(f"{n}: {r.about}" for n, r in
                                                        _recipes().items()))
    ladder.add_argument("--bits", type=float, default=None, metavar="B",
                        help="target bits per weight of the block linears (4.5 to 6.5 at "
                             "group 32): " + ", then ".join(_promotion_order()[:3]) + ", ... "
                             "(the measured order) go to 6 bits layer by layer while the "
                             "average stays within B (pyklei/converters/recipes.py, "
                             "docs/QUALITY.md)")
    p.add_argument("--name", help="general.name of the model (default: the input's name)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _default_embedding_bits() -> int:
    from ..converters import DEFAULT_EMBEDDING_BITS
    return DEFAULT_EMBEDDING_BITS


def _promotion_order():
    from ..converters.recipes import PROMOTION_ORDER
    return PROMOTION_ORDER


def _recipes():
    from ..converters.recipes import RECIPES
    return RECIPES


def _weight_formats():
    from ..formats.registry import WEIGHT_FORMATS
    return WEIGHT_FORMATS.values()


def run(args) -> int:
    data_free = args.no_calibrate or args.imatrix or getattr(args, "norm_weighting", False)
    if args.calibrate is not None or data_free:
        for flag, given in (("--gptq", args.gptq is not None), ("--no-rotate", args.no_rotate)):
            if given:
                raise CLIError(f"{flag} belongs to the default GPTQ method; it cannot go with "
                               f"--no-calibrate, --calibrate, --imatrix or --norm-weighting")
    if args.calibrate is None and not data_free:
        if args.rotate:
            raise CLIError("the default method rotates already; --rotate goes with --no-calibrate")
        return _run_gptq(args)
    if args.calibrate is None:
        return _run_convert(args)
    if args.rotate:
        raise CLIError("--calibrate measures an unrotated draft; it cannot go with --rotate")
    if args.imatrix:
        raise CLIError("give either --calibrate or --imatrix, not both")
    from ..converters import ConversionError
    from ..calibration import convert_calibrated

    text = None if args.calibrate == "default" else _read_text(args.calibrate, "text")
    try:
        result = convert_calibrated(args.input, args.output, text, progress=not args.no_progress,
                                    group_size=args.group_size, embedding_bits=args.embedding_bits,
                                    keep=args.keep, name=args.name, force=args.force,
                                    revision=args.revision, filename=args.hub_file)
    except ConversionError as e:
        raise CLIError(str(e)) from None
    print(result.summary())
    return 0


def _run_gptq(args) -> int:
    if args.calib_tokens < 1:
        raise CLIError(f"--calib-tokens must be positive, got {args.calib_tokens}")
    from ..calibration import convert_gptq

    text = None if args.gptq in (None, "default") else _read_text(args.gptq, "text")
    return _guarded(lambda: convert_gptq(
        args.input, args.output, text, n_tokens=args.calib_tokens, progress=not args.no_progress,
        group_size=args.group_size, embedding_bits=args.embedding_bits, keep=args.keep,
        name=args.name, force=args.force, rotate=not args.no_rotate,
        recipe=getattr(args, "recipe", None), bits=getattr(args, "bits", None),
        revision=args.revision, filename=args.hub_file))


def _run_convert(args) -> int:
    from ..converters import convert

    return _guarded(lambda: convert(
        args.input, args.output, group_size=args.group_size, embedding_bits=args.embedding_bits,
        keep=args.keep, name=args.name, force=args.force, progress=not args.no_progress,
        imatrix=getattr(args, "imatrix", None),
        norm_weighting=getattr(args, "norm_weighting", False),
        rotate=getattr(args, "rotate", False), recipe=getattr(args, "recipe", None),
        bits=getattr(args, "bits", None), revision=args.revision, filename=args.hub_file))


def _guarded(job) -> int:
    """Runs a conversion job and prints its summary; SIGTERM and Ctrl-C leave no output
    behind (the writer removes its temporary file on KeyboardInterrupt)."""
    import signal

    from ..converters import ConversionError

    def _term(signum, frame):  # turn SIGTERM into KeyboardInterrupt: the temp file is removed
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not in the main thread
        old = None
    try:
        result = job()
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
