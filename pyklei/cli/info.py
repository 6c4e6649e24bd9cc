"""`pyklei info`: pyklei.info.model_info (gguf_info for a llama.cpp GGUF), as text or --json."""
from __future__ import annotations

from ..runtime.activation_policy import ACTIVATIONS
from ._common import _add_command, _int_at_least, _model_path, _print_report


def add_parser(sub):
    i = _add_command(
        sub, "info", "show a model's metadata, tensor formats and kernels",
        "Show the model's metadata, its tensors by format (count, bytes, bits per weight), "
        "the CPU's features, and which kernel each weight shape runs on this CPU for decode "
        "and prefill. A GGUF that is not a pyklei file (llama.cpp's) is described too: "
        "metadata, tensor types, vocabulary, and the `pyklei convert` line that converts it.")
    i.add_argument("model", metavar="MODEL", help="pyklei .gguf file, or another GGUF (llama.cpp's)")
    i.add_argument("--activations", choices=ACTIVATIONS, default="auto",
                   help="activation scheme the kernel table assumes (qai8dx2: 2 rows per token; "
                        "default %(default)s: one plane per row on a rotated file, a scale per block "
                        "of 32 on any other, see docs/QUALITY.md)")
    i.add_argument("-b", "--batch-size", type=_int_at_least(1, "batch size"), default=256, metavar="N",
                   help="prefill chunk (tokens) the kernel table assumes (default %(default)s)")
    i.add_argument("--json", action="store_true", help="print the information as JSON")
    i.set_defaults(func=run)
    return i


def run(args) -> int:
    from ..info import info_text, model_info

    info = model_info(_model_path(args.model, pyklei_only=False), activations=args.activations,
                      batch_size=args.batch_size)
    return _print_report(args, info, info_text)
