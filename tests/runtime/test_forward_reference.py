"""The C forward pass against a numpy transcription of the same math on the same quantized
weights (int8 activation quantization included), so any difference is the C code's.

Tolerance: the float32 summation order differs, which is ~1e-6 on logits of magnitude ~5,
but a difference that moves one activation across an int8 rounding boundary changes that
value by one quantization step and the logits by up to ~0.05 from then on. So: max |diff|
<= 0.1 and mean |diff| <= 0.02 (typically 2e-6 and 2e-7). The transformers comparisons live
in test_vs_transformers.py."""
import numpy as np
import pytest

from pyklei import _ext
from pyklei.formats import (dequantize_qai8dx, dequantize_qsi4c32, dequantize_qsi6c32,
                            quantize_qai8dx, quantize_qsi4c32, quantize_qsi6c32)


def _q4(rng, n, k):
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    qs, s = quantize_qsi4c32(w)
    return qs, s, dequantize_qsi4c32(qs, s)


def _qmm(x, w):
    q, s, z = quantize_qai8dx(x)
    return dequantize_qai8dx(q, s, z) @ w.T


def _q8_0(x):
    """x [..., hd] rounded as a q8 KV cache holds it, in numpy (llama.cpp's q8_0 rule)."""
    g = x.reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(g * np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)), -127, 127)
    return (q * d).reshape(x.shape).astype(np.float32)


def _rms(x, w, eps):
    ms = (x.astype(np.float64) ** 2).mean(-1, keepdims=True)
    return x / np.sqrt(ms + eps).astype(np.float32) * w


class TinyModel:
    def __init__(self, seed=0, V=300, D=128, L=2, H=4, KV=2, HD=32, F=256, rope_freqs=None,
                 emb_format="qsi4c32", rope_factors=None):
        rng = np.random.default_rng(seed)
        self.dims = V, D, L, H, KV, HD, F
        self.rope_freqs = rope_freqs
        self.rope_factors = rope_factors or [1.0] * L    # per layer: linear RoPE scaling
        self.emb_format = emb_format
        self.emb_qs, self.emb_s, self.emb = _q4(rng, V, D)
        if emb_format == "qsi6c32":   # the tied embedding / lm_head at 6 bits
            self.emb_qs, self.emb_s = quantize_qsi6c32(self.emb)
            self.emb = dequantize_qsi6c32(self.emb_qs, self.emb_s)
        shapes = dict(wq=(H * HD, D), wk=(KV * HD, D), wv=(KV * HD, D), wo=(D, H * HD),
                      w_gate=(F, D), w_up=(F, D), w_down=(D, F))
        self.layers = []
        for _ in range(L):
            layer = {name: _q4(rng, n, k) for name, (n, k) in shapes.items()}
            layer["attn_norm"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
            layer["ffn_norm"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
            self.layers.append(layer)
        self.out_norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    def runtime(self, n_threads=2, n_ctx=64, n_batch=8, kv_cache="f32"):
        V, D, L, H, KV, HD, F = self.dims
        ops = _ext.Ops(n_threads)
        layers = []
        for layer, factor in zip(self.layers, self.rope_factors):
            d = {k: v for k, v in layer.items() if k.endswith("norm")}
            if factor != 1.0:
                d["rope_factor"] = factor
            for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                qs, s, _ = layer[name]
                d[name] = _ext.QWeight("qsi4c32", qs, s, 32)
            layers.append(d)
        hp = dict(n_vocab=V, n_embd=D, n_layer=L, n_head=H, n_head_kv=KV, head_dim=HD, n_ff=F,
                  rms_eps=1e-5, rope_theta=10000.0, n_ctx=n_ctx, n_batch=n_batch, kv_cache=kv_cache)
        lm_head = _ext.QWeight(self.emb_format, self.emb_qs, self.emb_s, 32)
        return _ext.LlamaRuntime(ops, hp, (self.emb_format, self.emb_qs, self.emb_s, 32), lm_head,
                                 self.out_norm, self.rope_freqs, layers)

    def forward(self, toks, kv_cache="f32"):
        V, D, L, H, KV, HD, F = self.dims
        T = len(toks)
        x = self.emb[toks].copy()
        inv = (1.0 / 10000.0 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
        if self.rope_freqs is not None:
            inv = inv / self.rope_freqs

        def rope(v, factor):  # llama.cpp "normal" RoPE: adjacent pairs
            ang = np.arange(T)[:, None].astype(np.float32) * (inv / np.float32(factor))[None]
            c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
            out = np.empty_like(v)
            a, b = v[..., 0::2], v[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
            return out

        for r, factor in zip(self.layers, self.rope_factors):
            xn = _rms(x, r["attn_norm"], 1e-5)
            q = rope(_qmm(xn, r["wq"][2]).reshape(T, H, HD), factor)
            k = rope(_qmm(xn, r["wk"][2]).reshape(T, KV, HD), factor)
            v = _qmm(xn, r["wv"][2]).reshape(T, KV, HD)
            if kv_cache == "f16":   # the cache stores K (after RoPE) and V rounded to f16
                k, v = (a.astype(np.float16).astype(np.float32) for a in (k, v))
            elif kv_cache == "bf16":   # or to bf16 (nearest even)
                k, v = ((_ext.kv_bf16_round(a).astype(np.uint32) << 16).view(np.float32) for a in (k, v))
            elif kv_cache == "q8":  # or as int8 with an f16 scale per 32 values of a head
                k, v = (_q8_0(a) for a in (k, v))
            att = np.zeros((T, H, HD), np.float32)
            for h in range(H):
                sc = q[:, h] @ k[:, h // (H // KV)].T / np.sqrt(HD)
                sc[np.triu_indices(T, 1)] = -np.inf
                p = np.exp(sc - sc.max(-1, keepdims=True))
                att[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // (H // KV)]
            x = x + _qmm(att.reshape(T, -1), r["wo"][2])
            xn = _rms(x, r["ffn_norm"], 1e-5)
            g, u = _qmm(xn, r["w_gate"][2]), _qmm(xn, r["w_up"][2])
            x = x + _qmm(g / (1 + np.exp(-g)) * u, r["w_down"][2])
        return _qmm(_rms(x, self.out_norm, 1e-5), self.emb)


@pytest.mark.usefixtures("f32_attention")      # the reference's attention is f32
@pytest.mark.parametrize("emb_format", ["qsi4c32", "qsi6c32"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kv_cache", ["f32", "f16", "q8", "bf16"])
def test_prefill_decode_match_numpy(n_threads, kv_cache, emb_format):
    m = TinyModel(seed=n_threads, emb_format=emb_format)
    toks = np.random.default_rng(5).integers(0, 300, 20)
    ref = m.forward(toks, kv_cache=kv_cache)
    rt = m.runtime(n_threads=n_threads, kv_cache=kv_cache)
    close(rt.forward(toks, 0, all_logits=True), ref)
    close(rt.forward(toks[:12], 0), ref[11])
    for t in range(12, 20):                     # cached decode continues the prefill
        last = rt.forward(toks[t:t + 1], t)
    close(last, ref[19])


def close(out, ref):
    d = np.abs(out - ref)
    assert d.max() <= 0.1 and d.mean() <= 0.02, (d.max(), d.mean())


def test_rope_frequency_factors():
    factors = np.linspace(1, 8, 16).astype(np.float32)
    m = TinyModel(seed=3, rope_freqs=factors)
    toks = np.random.default_rng(6).integers(0, 300, 30)
    rt = m.runtime(n_ctx=32)
    close(rt.forward(toks, 0, all_logits=True), m.forward(toks))


def test_linear_rope_scaling_per_layer():
    """Gemma 3 4B+'s linear scaling on some layers only (rope_factor: the layer's frequencies
    divided by it), with llama3-style divisors on top: each layer turns by its own angles. A
    runtime that scaled every layer or none is far from the reference (checked, not assumed)."""
    factors = np.linspace(1, 2, 16).astype(np.float32)
    m = TinyModel(seed=4, L=3, rope_freqs=factors, rope_factors=[1.0, 8.0, 1.0])
    toks = np.random.default_rng(7).integers(0, 300, 30)
    ref = m.forward(toks)
    close(m.runtime(n_ctx=32).forward(toks, 0, all_logits=True), ref)
    for wrong in ([1.0, 1.0, 1.0], [8.0, 8.0, 8.0]):
        m.rope_factors = wrong
        assert np.abs(m.forward(toks) - ref).max() > 0.5, wrong


def test_bad_positions_and_tokens():
    rt = TinyModel().runtime(n_ctx=16)
    with pytest.raises(ValueError, match="exceed the context of 16"):
        rt.forward(np.arange(10), 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt.forward([300], 0)
    with pytest.raises(ValueError, match="no tokens"):
        rt.forward([], 0)
    assert rt.forward([1, 2], 0).shape == (300,)   # still usable after the errors


def test_q8_cache_needs_head_size_multiple_of_32():
    with pytest.raises(ValueError, match="q8 KV cache needs a head size that is a multiple of 32, not 16"):
        TinyModel(HD=16, D=64).runtime(kv_cache="q8")
    with pytest.raises(ValueError, match="kv_cache must be one of f32, f16, q8, bf16"):
        TinyModel().runtime(kv_cache="q4")
