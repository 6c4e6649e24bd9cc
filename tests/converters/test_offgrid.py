"""SmolLM2's off-grid twin (tests/fixtures/models.make_offgrid_twin; issue 15's second test bed): the
same function in float32, weights off SmolLM2's 4-bit grid."""
from __future__ import annotations

import numpy as np
import pytest

from models import smollm2_hf_dir, smollm2_offgrid_dir

from pyklei.converters.safetensors_mmap import SafetensorsModel

TEXT = "The capital of France is Paris. The river that runs through it is the Seine, and"


def _q4_grid_residual(w: np.ndarray) -> float:
    """How far rows of 32 sit from an asymmetric 16-level grid (Q4_1's): the mean distance to
    the nearest level, in units of the level step. 0 on the grid, ~0.25 for random values."""
    b = w.reshape(-1, 32).astype(np.float64)
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    step = np.where(hi > lo, (hi - lo) / 15, 1.0)
    t = (b - lo) / step
    return float(np.abs(t - np.rint(t)).mean())


@pytest.mark.parametrize("sigma", [0.5])
def test_offgrid_twin_is_the_same_function_off_the_grid(sigma):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, twin = smollm2_hf_dir(), smollm2_offgrid_dir(sigma)
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(TEXT, return_tensors="pt").input_ids
    logits = []
    for d in (src, twin):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(ids).logits[0].numpy())
        del model
    a, b = logits
    assert np.abs(a - b).max() < 1e-3 * np.abs(a).max(), np.abs(a - b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()
    name = "model.layers.3.mlp.down_proj.weight"
    r0, r1 = (_q4_grid_residual(SafetensorsModel(d).read(name)) for d in (src, twin))
    print(f"\ngrid residual: SmolLM2 {r0:.3f}, off-grid twin {r1:.3f}; max |dlogit| "
          f"{np.abs(a - b).max():.2e}")
    assert r0 < 0.05 < 0.15 < r1
