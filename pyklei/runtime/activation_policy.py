"""Which activation scheme a model runs with: a runtime choice made from a fact of the file.

    choose_activations(read_model("model.gguf"))          # "qai8dx" on a rotated file

The file says whether it is rotated (ModelFile.rotated); what to do about it is the runtime's
policy, and lives here, not in the format layer. Model, `pyklei info` and `pyklei bench` ask it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..formats.model_file import ModelFile

# what a caller may request: "auto", or a scheme of pyklei._ext.ACTIVATIONS (docs/FORMAT.md):
# qai8dx (one int8 plane per row), qai8dx2 (two planes), qsi8d32 (a scale per block of 32)
ACTIVATIONS = ("auto", "qai8dx2", "qai8dx", "qsi8d32")


def choose_activations(file: ModelFile, requested: str = "auto") -> str:
    """The activation scheme to run `file` with: `requested`, or for "auto" one int8 plane
    (qai8dx) on a rotated file and two (qai8dx2) on any other. One plane halves the integer
    work of prefill; what it costs in KL divergence on rotated and unrotated files is measured
    in docs/QUALITY.md, "Activations" (imported files are unrotated). qsi8d32 (a scale per block
    of 32) is selectable, not chosen by "auto" until it is measured to recover two planes'
    accuracy on every test bed (docs/QUALITY.md, "A scale per block of 32")."""
    if requested not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "qai8dx" if file.rotated else "qai8dx2"
