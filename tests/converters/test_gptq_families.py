"""GPTQ's calibration forward pass (pyklei/converters/calibration_forward.py) on the model
families beyond Llama, against the C forward pass (pyklei_ext/model/pk_llama.c).

The tiny checkpoints are family twins of a random Llama (tests/fixtures/models.py): the same
weights under another architecture, with the family's extra tensors (random) and every family
hyperparameter of gguf_keys set to a value that changes the logits — the gemma3 twin has q/k
head norms, post norms, GeGLU, sliding windows shorter than the sequence, a layer without RoPE
and one at another base, partial RoPE, embedding and attention scales and logit soft-capping;
the qwen2 twin q/k/v biases. Each is written with 8-bit weights and an 8-bit embedding, and the
numpy pass runs on that file's own dequantized weights, so what differs from the C runtime is
its int8 activation rounding (tolerance as test_gptq.py's: a wrong feature moves the logits by
O(1), which the test also shows for each feature).

The real Gemma 3 270M (llama.cpp's Q4_K_M, ~/.cache/pyklei/gemma3-270m) is converted by GPTQ
on a short calibration text and by plain rounding; GPTQ's KL divergence from the float model on
held-out text must be lower (slow).
"""
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as T

from pyklei.converters import convert
from pyklei.converters.calibration_forward import (GPTQOptions, LayerCalibrator, float_forward,
                                                   rmsnorm)
from pyklei.converters.core import ModelSource, SourceTensor, source_hparams, write_model
from pyklei.converters.hf_llama import hf_source
from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L
from pyklei.formats.families import family
from pyklei.formats.model_file import read_model

from gptq_checks import assert_gptq_beats_rounding  # tests/fixtures/, on sys.path via conftest

GEMMA3_270M = Path.home() / ".cache/pyklei/gemma3-270m/gemma-3-270m-q4_k_m.gguf"
N_TOKENS = 300                      # > every twin's window


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from models import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("fam") / "hf", head_dim=64, n_layer=3,
                           n_head=4, n_head_kv=2, rope_scaling=False, seed=7, init_std=0.08)


def family_twin(src: ModelSource, arch: str, seed: int = 0) -> ModelSource:
    """src (a Llama) as a model of family `arch`: its keys renamed, the family's tensors added
    (random), and the family hyperparameters of TWIN_KEYS[arch] set."""
    hp = source_hparams(src)
    rng = np.random.default_rng(seed)
    kv = [(K.GENERAL_ARCHITECTURE, arch, T.STRING, None)]
    kv += [(K.arch_key(arch, k), v, t, s) for k, v, t, s in src.kv
           if k not in (K.GENERAL_ARCHITECTURE, K.ROPE_DIM)]
    kv += TWIN_KEYS[arch](hp, arch)
    twin = dataclasses.replace(src, kv=kv)
    dims = source_hparams(twin)
    by_name = {t.name: t for t in src.tensors}
    tensors = []
    for name, spec, _ in L.for_each_tensor(dims):
        if name in by_name:
            tensors.append(by_name[name])
            continue
        n = spec.shape(dims)[0]
        a = (0.5 * rng.standard_normal(n) if spec.kind == L.BIAS
             else 1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)
        tensors.append(SourceTensor(name, (n,), spec.kind, lambda r0, r1, a=a: a[r0:r1]))
    return dataclasses.replace(twin, tensors=tensors)


def _gemma3_keys(hp, arch):
    n = hp.n_layer   # 3 layers: a window of 40, one of 100 with no RoPE, a global one at 1e6
    return [(K.arch_key(arch, K.ROPE_DIM), hp.head_dim // 2, T.UINT32, None),
            (K.KEY_LAYER_WINDOW, [40, 100] + [0] * (n - 2), T.ARRAY, T.UINT32),
            (K.KEY_LAYER_ROPE_BASE, [10000.0, 0.0] + [1e6] * (n - 2), T.ARRAY, T.FLOAT32),
            (K.KEY_ACTIVATION, "gelu_tanh", T.STRING, None),
            (K.KEY_EMBEDDING_SCALE, float(np.sqrt(hp.n_embd)), T.FLOAT32, None),
            (K.KEY_ATTENTION_SCALE, 0.2, T.FLOAT32, None),
            (K.KEY_LOGIT_SOFTCAP, 3.0, T.FLOAT32, None)]


TWIN_KEYS = {"gemma3": _gemma3_keys, "qwen2": lambda hp, arch: []}


def file_source(path) -> ModelSource:
    """The float model a pyklei file holds (its dequantized weights) as a converter source."""
    mf = read_model(path)
    kv = [(k, v, *mf.metadata_types[k]) for k, v in mf.metadata.items()]
    tensors = []
    for name, t in mf.tensors.items():
        spec = L.parse_name(name)
        if spec is not None:
            a = np.asarray(t.dequantize(), np.float32)
            tensors.append(SourceTensor(name, a.shape, spec[0].kind, lambda r0, r1, a=a: a[r0:r1]))
    return ModelSource(kv=kv, tensors=tensors, description=str(path))


def numpy_logits(src: ModelSource, toks) -> np.ndarray:
    """Logits of the calibration forward pass over toks (one sequence): final norm, the tied
    lm_head, soft-capping."""
    hp = source_hparams(src)
    by = {t.name: t.read(0, t.shape[0]) for t in src.tensors
          if t.name in (K.OUTPUT_NORM, K.TOKEN_EMBD, K.OUTPUT)}
    x = rmsnorm(float_forward(src, toks, seq_len=len(toks)), by[K.OUTPUT_NORM], hp.rms_eps)
    logits = x @ by.get(K.OUTPUT, by[K.TOKEN_EMBD]).T
    if hp.logit_softcap:
        logits = hp.logit_softcap * np.tanh(logits / hp.logit_softcap)
    return logits


def runtime_logits(path, toks) -> np.ndarray:
    from pyklei.runtime.model import Model
    # two planes, as the bounds assume (auto runs qsi8d32 on these unrotated files)
    with Model(path, n_threads=2, n_ctx=len(toks), activations="qai8dx2") as m:
        return np.asarray(m.logits(list(toks)), np.float64)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kld(ref, got) -> float:
    """KL(ref || got) of the next-token distributions, mean over positions."""
    p, q = log_softmax(ref), log_softmax(got)
    return float((np.exp(p) * (p - q)).sum(-1).mean())


def _without(src: ModelSource, key: str) -> ModelSource:
    """src with one family feature undone: a key dropped, or a family tensor made neutral."""
    if not key.endswith((".weight", ".bias")):
        return dataclasses.replace(src, kv=[e for e in src.kv if not e[0].endswith(key)])

    def neutral(t):
        if not t.name.endswith(key):
            return t
        a = np.zeros if t.kind == L.BIAS else np.ones
        return dataclasses.replace(t, read=lambda r0, r1, n=t.shape[0]: a(n, np.float32)[r0:r1])
    return dataclasses.replace(src, tensors=[neutral(t) for t in src.tensors])


FEATURES = {
    "gemma3": (K.KEY_LAYER_WINDOW, K.KEY_LAYER_ROPE_BASE, K.KEY_ACTIVATION, K.KEY_EMBEDDING_SCALE,
               K.KEY_ATTENTION_SCALE, "rope.dimension_count", "attn_q_norm.weight",
               "attn_k_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight"),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
}


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_calibration_forward_matches_the_c_runtime(tiny_llama, tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_model(family_twin(hf_source(tiny_llama), arch), path, keep=["*=q8"], embedding_bits=8,
                progress=False)
    src = file_source(path)
    assert source_hparams(src).features == family(arch).features
    toks = np.random.default_rng(1).integers(3, 500, size=N_TOKENS)
    ours, ref = numpy_logits(src, toks), runtime_logits(path, toks)
    d = np.abs(ours - ref)
    assert d.max() <= 0.15 and d.mean() <= 0.02, (d.max(), d.mean())
    # every feature matters here: without it the numpy pass is far off the runtime
    for key in FEATURES[arch]:
        off = np.abs(numpy_logits(_without(src, key), toks) - ref).mean()
        assert off > 10 * d.mean() and off > 0.05, (key, off, d.mean())


def test_gptq_beats_rounding_on_a_family_twins_activations(tiny_llama):
    src = family_twin(hf_source(tiny_llama), "gemma3")
    toks = np.random.default_rng(3).integers(3, 500, size=1024)
    cal = LayerCalibrator(src, GPTQOptions(toks, seq_len=256), 32)
    seen = {}
    real = cal._gptq

    def record(i, part, h):
        seen[K.blk(i, part)] = (cal._read(cal.by_name[K.blk(i, part)]), h.copy())
        return real(i, part, h)
    cal._gptq = record
    for i in range(3):
        cal._run_layer(i)
    assert len(seen) == 3 * len(K.BLOCK_LINEARS)
    for name, (w, h) in seen.items():
        assert_gptq_beats_rounding(w, h, name)


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3_270M.is_file(), reason=f"{GEMMA3_270M} not found")
def test_gptq_beats_rounding_on_gemma3_270m(tmp_path):
    from pyklei.calibration import calibration_tokens, default_calibration_text, evaluation_text
    from pyklei.converters import open_source
    from pyklei.text.tokenizer import Tokenizer

    cal = calibration_tokens(GEMMA3_270M, default_calibration_text(), 1024)
    plain = convert(GEMMA3_270M, tmp_path / "plain.gguf").path
    gptq = convert(GEMMA3_270M, tmp_path / "gptq.gguf",
                   gptq=GPTQOptions(cal, seq_len=512)).path
    ids = Tokenizer.from_gguf(plain).encode(evaluation_text(), parse_special=False)[:600]
    src = open_source(GEMMA3_270M)           # the float model of the source file
    try:
        ref = numpy_logits(src, ids)
    finally:
        if src.close:
            src.close()
    k_plain, k_gptq = kld(ref, runtime_logits(plain, ids)), kld(ref, runtime_logits(gptq, ids))
    print(f"Gemma 3 270M, 600 held-out tokens: KLD plain {k_plain:.4f}, GPTQ {k_gptq:.4f}")
    assert k_gptq < 0.8 * k_plain, (k_plain, k_gptq)
