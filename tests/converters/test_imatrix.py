"""Importance matrices: measured by the C forward pass, used by the converter."""
import subprocess
import sys

import numpy as np
import pytest

from pyklei.converters import ConversionError, convert
from pyklei.formats.model_file import read_model
from pyklei.calibration import collect_imatrix, save_imatrix
from pyklei.runtime.model import Model


def test_stats_are_mean_squares_of_linear_inputs(tiny64, tmp_path):
    hf, gguf = tiny64
    m = Model(gguf, n_threads=1, n_ctx=64)
    imat = collect_imatrix(m, list(range(3, 103)), n_ctx=64)
    hp = m.hparams
    assert len(imat) == 7 * hp.n_layer + 1
    assert imat["blk.0.attn_q.weight"].shape == (hp.n_embd,)
    assert imat["blk.0.attn_output.weight"].shape == (hp.n_head * hp.head_dim,)
    assert imat["blk.1.ffn_down.weight"].shape == (hp.n_ff,)
    assert np.array_equal(imat["blk.0.attn_q.weight"], imat["blk.0.attn_v.weight"])
    assert all(np.isfinite(v).all() and (v >= 0).all() and v.max() > 0 for v in imat.values())
    # the first layer's input: RMSNorm(embedding) * attn_norm, recomputed in numpy
    mf = read_model(gguf)
    emb = mf.tensor("token_embd.weight").dequantize()[np.arange(3, 103)]
    xn = emb / np.sqrt((emb.astype(np.float64) ** 2).mean(1, keepdims=True) + hp.rms_eps)
    xn = xn * mf.layer(0, "attn_norm").data
    np.testing.assert_allclose(imat["blk.0.attn_q.weight"], (xn ** 2).mean(0), rtol=1e-4)
    assert m.cached_tokens == []                     # the model was reset afterwards


def test_converter_uses_and_checks_the_imatrix(tiny64, tmp_path):
    hf, gguf = tiny64
    imat = collect_imatrix(Model(gguf, n_ctx=64), list(range(3, 67)))
    path = tmp_path / "imatrix.npz"
    save_imatrix(path, imat, 64)
    a = convert(hf, tmp_path / "a.gguf")
    b = convert(hf, tmp_path / "b.gguf", imatrix=path)
    qa = read_model(tmp_path / "a.gguf").tensor("blk.0.ffn_down.weight").scales
    qb = read_model(tmp_path / "b.gguf").tensor("blk.0.ffn_down.weight").scales
    assert not np.array_equal(qa, qb)               # the importance changed the chosen scales
    assert a.summary() and b.summary()
    bad = dict(imat, **{"blk.0.ffn_down.weight": np.ones(7, np.float32)})
    with pytest.raises(ConversionError, match="another model"):
        convert(hf, tmp_path / "c.gguf", imatrix=bad)
    assert not (tmp_path / "c.gguf").exists()
    with pytest.raises(ConversionError, match="missing importance"):
        convert(hf, tmp_path / "d.gguf", imatrix=tmp_path / "nope.npz")


def test_cli_imatrix_and_calibrated_convert(tiny64, tmp_path):
    hf, gguf = tiny64
    run = lambda *a: subprocess.run([sys.executable, "-m", "pyklei", *a], capture_output=True,
                                    text=True, timeout=300)
    r = run("imatrix", str(gguf), "-o", str(tmp_path / "im.npz"), "--max-tokens", "200",
            "--no-progress", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert set(np.load(tmp_path / "im.npz").files) >= {"blk.0.attn_q.weight", "_tokens"}
    r = run("convert", str(hf), "-o", str(tmp_path / "cal.gguf"), "--calibrate", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "pass 2/2" in r.stderr and read_model(tmp_path / "cal.gguf").hparams.n_layer == 2
    r = run("convert", str(hf), "-o", str(tmp_path / "x.gguf"), "--imatrix", str(tmp_path / "none.npz"))
    assert r.returncode != 0 and "missing importance" in r.stderr
