"""GPTQ (pyklei/converters/gptq.py) and its calibration forward pass
(pyklei/converters/calibration_forward.py).

Tolerances: the numpy forward pass against transformers fp32 on the same float weights agrees to
float32 rounding (max |logit diff| <= 1e-4; measured 9e-6). Against pyklei's C runtime it is
compared on an all-qsi8cx file whose dequantized weights the numpy pass uses, so what differs is
the runtime's int8 activation quantization (qai8dx2): max <= 0.15, mean <= 0.02 on logits of
magnitude ~4 (measured 0.06 / 0.01); a wrong RoPE pairing or norm moves logits by O(1).
"""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from pyklei.converters import ConversionError, convert
from pyklei.converters import gptq as G
from pyklei.converters.calibration_forward import (GPTQOptions, LayerCalibrator, float_forward,
                                                   gptq_source, rmsnorm)
from pyklei.converters.core import source_hparams, write_model
from pyklei.converters.hf_llama import hf_source
from pyklei.formats import bf16_to_f32, dequantize_qsi8cx, f32_to_bf16, quantize_qsi8cx
from pyklei.formats import gguf_keys as K
from pyklei.formats.model_file import read_model

from gptq_checks import assert_gptq_beats_rounding  # tests/fixtures/, on sys.path via conftest


def _output_error(w, wq, x):
    return np.linalg.norm(x @ (w - wq).T) / np.linalg.norm(x @ w.T)


def _correlated(rng, t, k):
    """[t, k] inputs with correlated channels of very different scales (as activations are)."""
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    x = rng.standard_normal((t, k)).astype(np.float32) @ mix
    x += 0.3 * rng.standard_normal((t, k)).astype(np.float32)
    return x * np.exp(rng.standard_normal(k)).astype(np.float32)


def test_inverse_cholesky_factor():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((600, 700)).astype(np.float32)
    h = a @ a.T + 60 * np.eye(600, dtype=np.float32)
    u = G.inverse_cholesky_upper(h.copy())
    assert np.array_equal(u, np.triu(u))
    inv = np.linalg.inv(h.astype(np.float64))
    assert np.abs(u.T.astype(np.float64) @ u - inv).max() <= 1e-5 * np.abs(inv).max()
    g = G.accumulate_gram(None, a.T.copy())
    assert np.allclose(g, a @ a.T, rtol=1e-5, atol=1e-3 * np.abs(g).max())


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rounding_on_correlated_inputs(act_order):
    rng = np.random.default_rng(0)
    k, n = 256, 96
    x = _correlated(rng, 1024, k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    h = G.accumulate_gram(None, x)
    q, bits = G.gptq_quantize(w.copy(), h.copy(), 32, act_order=act_order)
    assert q.dtype == np.int8 and q.min() >= -8 and q.max() <= 7
    assert bits.dtype == np.uint16 and bits.shape == (n, k // 32)
    s = bf16_to_f32(bits)
    assert np.array_equal(f32_to_bf16(s), bits) and (s >= 0).all()     # bf16-exact scales
    wq = G.dequantize(q, bits)
    assert np.array_equal(wq, np.repeat(s, 32, axis=1) * q)
    rq, rbits = G.rtn_quantize(w, 32)
    e_gptq, e_rtn = _output_error(w, wq, x), _output_error(w, G.dequantize(rq, rbits), x)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)
    # what is stored is what the format decodes
    qs, sc = G.pack(q, bits)
    from pyklei.formats import dequantize_qsi4c32
    assert np.array_equal(dequantize_qsi4c32(qs, sc), wq)


def test_gptq_on_the_6bit_grid_beats_its_rounding():
    """qsi6c32's grid: values in [-32, 31], stored arrays the format decodes, and a lower
    output error than the format's own rounding (the ladder's 6-bit tensors)."""
    from pyklei.formats.qsi6c32 import dequantize_qsi6c32, quantize_qsi6c32
    rng = np.random.default_rng(5)
    k, n = 256, 64
    x = _correlated(rng, 1024, k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    grid = G.GRIDS["qsi6c32"]
    q, bits = G.gptq_quantize(w.copy(), G.accumulate_gram(None, x), 32, grid=grid)
    assert q.min() >= -32 and q.max() <= 31 and q.min() < -8    # the whole 6-bit range is used
    wq = G.dequantize(q, bits)
    qs, sc = G.pack(q, bits, grid)
    assert np.array_equal(dequantize_qsi6c32(qs, sc), wq)
    e_rtn = _output_error(w, dequantize_qsi6c32(*quantize_qsi6c32(w)), x)
    assert _output_error(w, wq, x) < 0.8 * e_rtn


def test_rtn_quantize_is_the_converters_rounding():
    from pyklei.formats import quantize_qsi4c32, unpack_nibbles
    w = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    qs, sc = quantize_qsi4c32(w)
    q, bits = G.rtn_quantize(w)
    assert np.array_equal(bits, sc) and np.array_equal(q, unpack_nibbles(qs))


def _q8_source(src):
    """src whose linears read back as their qsi8cx round trip and the embedding as f16, i.e.
    the weights an all-q8 file with --embedding-bits 16 holds."""
    def stored(t):
        if t.kind == "linear":
            return dataclasses.replace(t, read=lambda r0, r1, t=t: dequantize_qsi8cx(
                *quantize_qsi8cx(t.read(0, t.shape[0])))[r0:r1])
        if t.kind == "embedding":
            return dataclasses.replace(t, read=lambda r0, r1, t=t: np.asarray(
                t.read(r0, r1)).astype(np.float16).astype(np.float32))
        return t
    return dataclasses.replace(src, tensors=[stored(t) for t in src.tensors])


def _numpy_logits(src, toks, lm_head):
    x = float_forward(src, toks, seq_len=len(toks))
    by = {t.name: t for t in src.tensors}
    g = by[K.OUTPUT_NORM].read(0, by[K.OUTPUT_NORM].shape[0])
    return rmsnorm(x, g, source_hparams(src).rms_eps) @ lm_head.T


def test_calibration_forward_matches_transformers(tiny64):
    import torch
    from transformers import AutoModelForCausalLM
    hf, _ = tiny64
    src = hf_source(hf)
    toks = np.random.default_rng(0).integers(3, 500, size=300)
    emb = next(t for t in src.tensors if t.name == K.TOKEN_EMBD)
    ours = _numpy_logits(src, toks, emb.read(0, emb.shape[0]))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(toks[None])).logits[0].numpy()
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.usefixtures("f32_attention")        # the numpy forward's attention is f32
def test_calibration_forward_matches_the_c_runtime(tiny64, tmp_path):
    from pyklei.runtime.model import Model
    hf, _ = tiny64
    path = tmp_path / "q8.gguf"
    convert(hf, path, keep=["*=q8"], embedding_bits=16)
    src = _q8_source(hf_source(hf))
    toks = np.random.default_rng(0).integers(3, 500, size=300)
    emb = next(t for t in src.tensors if t.name == K.TOKEN_EMBD)
    lm = dequantize_qsi8cx(*quantize_qsi8cx(emb.read(0, emb.shape[0])))   # as the loader does
    ours = _numpy_logits(src, toks, lm)
    with Model(path, n_threads=2, n_ctx=512) as m:
        ref = m.logits(list(toks))
    d = np.abs(ours - ref)
    assert d.max() <= 0.15 and d.mean() <= 0.02, (d.max(), d.mean())


def test_gptq_beats_rounding_on_a_tiny_models_activations(tiny64):
    hf, _ = tiny64
    src = hf_source(hf)
    toks = np.random.default_rng(3).integers(3, 500, size=1024)
    cal = LayerCalibrator(src, GPTQOptions(toks, seq_len=256), 32)
    seen = {}
    real = cal._gptq

    def record(i, part, h):
        seen[part] = (cal._read(cal.by_name[K.blk(i, part)]), h.copy())
        return real(i, part, h)
    cal._gptq = record
    cal._run_layer(0)
    cal._run_layer(1)          # layer 1's inputs come through layer 0's GPTQ weights
    for part, (w, h) in seen.items():
        assert_gptq_beats_rounding(w, h, part)


def test_written_file_holds_what_gptq_chose(tiny64, tmp_path):
    hf, _ = tiny64
    src = hf_source(hf)
    toks = np.random.default_rng(4).integers(3, 500, size=600)
    gsrc = gptq_source(src, GPTQOptions(toks, seq_len=300), 32)
    cal = gsrc.calibrator
    chosen = {}
    real = cal._gptq

    def record(i, part, h):
        out = real(i, part, h)
        if K.blk(i, part) in cal.done:
            chosen[K.blk(i, part)] = cal.done[K.blk(i, part)]
        return out
    cal._gptq = record
    path = tmp_path / "gptq.gguf"
    res = write_model(gsrc, path, progress=False,
                      keep=["blk.1.ffn_down.weight=q8", "blk.0.attn_v.weight=q6"])
    assert any("GPTQ on 600 calibration tokens" in n for n in res.notes)
    assert "GPTQ" in res.summary()
    mf = read_model(path)
    # 8 bits: rounded by the writer (GPTQ chooses the 4- and 6-bit grids only)
    assert mf.tensor("blk.1.ffn_down.weight").format == "qsi8cx"
    assert len(chosen) == 13 and "blk.1.ffn_down.weight" not in chosen
    for name, (qs, sc) in chosen.items():
        t = mf.tensor(name)
        assert t.format == ("qsi6c32" if name == "blk.0.attn_v.weight" else "qsi4c32")
        assert np.array_equal(np.asarray(t.qs).view(np.uint8), qs)
        assert np.array_equal(np.asarray(t.scales).view(np.uint16), sc)
    # the method is recorded; a default conversion has no such key
    from pyklei.text.tokenizer import read_gguf_metadata
    assert read_gguf_metadata(path)[K.KEY_WEIGHT_METHOD] == "gptq"
    plain = convert(hf, tmp_path / "plain.gguf")
    assert K.KEY_WEIGHT_METHOD not in read_gguf_metadata(plain.path)
    import pyklei
    with pyklei.load(path, n_ctx=64) as llm:
        assert np.isfinite(llm.logits([5, 6, 7])).all()


def test_too_few_calibration_tokens_is_a_clear_error(tiny64, tmp_path):
    hf, _ = tiny64
    with pytest.raises(ConversionError, match="at least 256 calibration tokens, got 40"):
        convert(hf, tmp_path / "x.gguf", gptq=GPTQOptions(list(range(3, 43))))
    with pytest.raises(ConversionError, match="token ids must lie in"):
        convert(hf, tmp_path / "x.gguf", gptq=GPTQOptions([9999] * 300))
    assert not (tmp_path / "x.gguf").exists()


def _cli_gptq(hf, tmp_path, out, n_words: int, n_tokens: int) -> list[str]:
    """`pyklei convert HF -o OUT --gptq TEXT --calib-tokens N` over a text of n_words words."""
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} the of and" for i in range(n_words)))
    return [sys.executable, "-m", "pyklei", "convert", str(hf), "-o", str(out), "--gptq", str(text),
            "--calib-tokens", str(n_tokens)]


def test_cli_convert_gptq(tiny64, tmp_path):
    hf, _ = tiny64
    out = tmp_path / "cli.gguf"
    r = subprocess.run(_cli_gptq(hf, tmp_path, out, 2000, 512) + ["--no-progress"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "weights: GPTQ on 512 calibration tokens" in r.stdout
    r = subprocess.run([sys.executable, "-m", "pyklei", "info", str(out)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "gptq" in r.stdout, r.stdout


def test_cli_convert_gptq_progress_is_one_bar(tiny64, tmp_path):
    """With progress, stderr holds one tqdm bar and nothing else: GPTQ's set-up and per-layer
    status are the bar's postfix, not lines printed into it."""
    import json
    import re

    hf, _ = tiny64
    n_layer = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    r = subprocess.run(_cli_gptq(hf, tmp_path, tmp_path / "bar.gguf", 2000, 512),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    frames = [f for f in re.split(r"[\r\n]", r.stderr) if f.strip()]
    assert frames and all(f.startswith("converting:") for f in frames), r.stderr
    assert len({re.search(r"\| *\d+/(\d+) \[", f).group(1) for f in frames}) == 1   # one bar
    assert re.search(r"\| *0/\d+ .*GPTQ set-up: 512 calibration tokens", r.stderr), r.stderr
    for i in range(1, n_layer + 1):
        assert f"GPTQ layer {i}/{n_layer}" in r.stderr, r.stderr
    assert f"GPTQ: {n_layer} layers in " in frames[-1]
    assert "GPTQ layer" not in r.stdout


def test_calibration_forward_of_a_rotated_source(tiny64):
    """A rotated source (pyklei/converters/rotation.py) computes the same function: its stream
    is the unrotated one times Q_r, which needs the online down_proj transform (ffn_down_input)."""
    from pyklei.converters.rotation import rotate_source
    from pyklei.formats.rotation import make_rotation
    hf, _ = tiny64
    src = hf_source(hf)
    toks = np.random.default_rng(5).integers(3, 500, size=256)
    x = float_forward(src, toks, seq_len=256)
    rot = rotate_source(src, seed=3)
    assert rot.ffn_down_input is not None
    xr = float_forward(rot, toks, seq_len=256)
    q_r = make_rotation(x.shape[1], np.random.default_rng(3))       # rotate_source's first draw
    assert np.abs(xr - q_r.apply(x)).max() <= 1e-4 * np.abs(x).max()


@pytest.mark.slow
def test_cli_gptq_sigterm_leaves_no_file(tiny64, tmp_path):
    import signal
    hf, _ = tiny64
    p = subprocess.Popen(_cli_gptq(hf, tmp_path, tmp_path / "killed.gguf", 60000, 100000),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:                      # the first layer is done: the writer is open
        if "GPTQ layer 1/" in line:
            break
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert list(tmp_path.glob("*.gguf*")) == []
