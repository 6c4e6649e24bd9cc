"""`pyklei imatrix`: pyklei.calibration.collect_imatrix_from_text over calibration text, saved as
.npz for `pyklei convert --imatrix`."""
from __future__ import annotations

from ._common import (_add_command, _add_model_options, _int_at_least, _model_path,
                      _progress_bar, _read_text)


def add_parser(sub):
    from ..converters.calibration_forward import DEFAULT_CALIBRATION_TOKENS, DEFAULT_SEQ_LEN

    im = _add_command(
        sub, "imatrix", "measure an importance matrix for `convert --imatrix`",
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
                    default=DEFAULT_CALIBRATION_TOKENS, metavar="N",
                    help="calibration tokens at most (default %(default)s)")
    im.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_options(im, ctx_help=f"window size in tokens (default {DEFAULT_SEQ_LEN})")
    im.set_defaults(func=run)
    return im


def run(args) -> int:
    from ..calibration import collect_imatrix_from_text, default_calibration_text, save_imatrix
    from ..converters.calibration_forward import DEFAULT_SEQ_LEN

    text = _read_text(args.file, "text") if args.file else default_calibration_text()
    path = _model_path(args.model)
    with _progress_bar(args, "imatrix", "window") as progress:
        imat, n = collect_imatrix_from_text(path, text, n_ctx=args.ctx_size or DEFAULT_SEQ_LEN,
                                            max_tokens=args.max_tokens_eval,
                                            n_threads=args.threads, progress=progress)
    save_imatrix(args.output, imat, n)
    print(f"wrote {args.output}: {len(imat)} tensors, {n} calibration tokens")
    return 0
