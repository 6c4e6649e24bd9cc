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
    """The activation scheme to run `file` with: `requested`, or for "auto" one int8 plane per
    row (qai8dx) on a rotated file and a scale per block of 32 (qsi8d32) on any other.

    Rotation spreads the residual stream's outlier channels, so one scale per row loses little
    there; an unrotated file (Gemma's, an import, --no-rotate) keeps its outliers, which one
    scale per row crushes. A scale per block of 32 confines an outlier to its block at one
    plane's cost, where two planes (qai8dx2, ~16-bit) would double prefill's integer work: on
    the unrotated files measured it recovers 67-83% of two planes' KL-divergence gain at one
    plane's prefill speed (docs/QUALITY.md, "A scale per block of 32"). On rotated files it
    recovers about half of that gain (41-58% per text over 4096 tokens) for 0-6% of prefill:
    at the threshold issue 45 set for a default, so they keep qai8dx."""
    if requested not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "qai8dx" if file.rotated else "qsi8d32"
