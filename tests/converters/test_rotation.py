"""Rotations (pyklei.formats.rotation, pyklei/converters/rotation.py, ops/pk_rotate.c).

- The numpy transform against the dense matrix it stands for, every size shape we support
  (power of two, odd factors 3, 7, 9, 11, 43): |x Q - apply(x)| <= 2e-6 for |x| ~ 1.
- The C transform (one scalar path: the compiler vectorises the butterflies; no ISA variants)
  against numpy: <= 2e-6.
- Folding is exact: Hugging Face's forward pass on a rotated file's float32 weights (plus the
  two online rotations as hooks) equals the original checkpoint: max |dlogit| <= 2e-4 on logits
  of std ~1 (float32 summation order; measured ~2e-5), tied and untied.
- pyklei's C forward pass on a rotated file agrees with that reference as on an unrotated one
  (qsi8cx weights: max |dlogit| <= 0.05, top-1 100%).
- Bad rotation metadata in a file is a ModelFileError that names it.
"""
import dataclasses

import os

import numpy as np
import pytest

from hf_reference import add_rotation_hooks, dequantized_hf_model, hf_logits
from pyklei.formats import gguf_keys as K
from pyklei.formats.model_file import ModelFileError, read_model
from pyklei.formats.rotation import check_rotation, make_rotation, split_size

SIZES = [1, 2, 12, 64, 576, 1536, 2048, 3072, 5632, 11008, 14336]
TOKENS = [5, 17, 99, 3, 250, 7, 42, 42, 1, 300, 12, 77, 8, 190, 64, 33]


@pytest.mark.parametrize("n", SIZES)
def test_numpy_rotation_is_the_dense_orthogonal_matrix(n):
    rng = np.random.default_rng(n)
    r = make_rotation(n, rng)
    m, p = split_size(n)
    assert (r.m, r.p) == (m, p) and m * p == n and p & (p - 1) == 0 and m % 2 == 1
    x = rng.standard_normal((3, n)).astype(np.float32)
    if n <= 3072:
        q = r.dense()
        assert np.abs(q @ q.T - np.eye(n)).max() < 1e-6
        assert np.abs(r.apply(x) - x @ q).max() < 2e-6
        assert np.abs(r.apply_t(x) - x @ q.T).max() < 2e-6
    assert np.abs(r.apply_t(r.apply(x)) - x).max() < 2e-6
    # incoherence: a one-hot row (an outlier channel) spreads over every output channel
    spread = np.abs(r.apply(np.eye(n, dtype=np.float32)[:1]))
    assert spread.max() <= 3.5 / np.sqrt(n) + 1e-6


@pytest.mark.parametrize("n", SIZES)
def test_c_rotation_matches_numpy(n):
    from pyklei import _ext
    rng = np.random.default_rng(100 + n)
    r = make_rotation(n, rng)
    x = rng.standard_normal((4, n)).astype(np.float32)
    assert np.abs(_ext.rotate_rows(r.signs, r.mix, x) - r.apply(x)).max() < 2e-6
    assert np.abs(_ext.rotate_rows(r.signs, r.mix, x, True) - r.apply_t(x)).max() < 2e-6


FWHT_ISAS = ("scalar", "avx2", "avx512vnni", "neon")


@pytest.mark.parametrize("n", [8, 16, 576, 1536, 8192, 14336])
def test_every_fwht_this_cpu_runs_is_bit_exact_with_scalar(n):
    from pyklei import _ext
    from pyklei._ext import KernelError
    rng = np.random.default_rng(200 + n)
    r = make_rotation(n, rng)
    x = rng.standard_normal((3, n)).astype(np.float32)
    ran = []
    for tr in (False, True):
        want = _ext.rotate_rows(r.signs, r.mix, x, tr, impl="scalar")
        for isa in FWHT_ISAS[1:]:
            try:
                got = _ext.rotate_rows(r.signs, r.mix, x, tr, impl=isa)
            except KernelError:
                continue                                 # not this CPU
            assert np.array_equal(got, want), (isa, tr)
            ran.append(isa)
    assert _ext.rotation_fwht_isa() in ran + ["scalar"]  # the default is one of them


def test_pyklei_kernel_forces_the_fwht_and_the_log_says_which():
    from kernel_log import check_forced_choice
    from pyklei import _ext

    check_forced_choice("from pyklei import _ext; print(_ext.rotation_fwht_isa())",
                        _ext.rotation_fwht_isa(), "rotation of 64 (1 x 64): fwht_{}")


def test_unsupported_and_bad_rotations_are_errors():
    from pyklei import _ext
    with pytest.raises(ValueError, match="odd factor 65"):
        make_rotation(65 * 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="odd factor 65"):
        _ext.rotate_rows(np.ones(65 * 4), np.eye(65), np.zeros((1, 65 * 4)))
    r = make_rotation(12, np.random.default_rng(0))
    with pytest.raises(ValueError, match="not orthogonal"):
        check_rotation("x", 12, r.signs, r.mix * 1.01)
    with pytest.raises(ValueError, match="-1 or \\+1"):
        check_rotation("x", 12, r.signs * 0.5, r.mix)
    with pytest.raises(ValueError, match="needs \\[3, 3\\]"):
        check_rotation("x", 12, r.signs, np.eye(4, dtype=np.float32))


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_hf(request, tmp_path_factory):
    from models import make_tiny_llama
    d = tmp_path_factory.mktemp("rot")
    # 192 = 3 x 64 hidden and 384 = 3 x 128 ffn: the odd-factor path of both online rotations
    return make_tiny_llama(d / "hf", head_dim=64, tied=request.param, seed=7, hidden_size=192,
                           n_head=3, n_head_kv=1, intermediate_size=384, vocab_size=512)


def _convert(hf, out, **kw):
    from pyklei.converters import convert
    convert(hf, out, force=True, **kw)
    return out


def test_rotated_float_weights_compute_the_same_function(tiny_hf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    f = _convert(tiny_hf, tmp_path / "rot-f32.gguf", rotate=True, keep=["*=f32"])
    mf = read_model(f)
    assert mf.metadata[K.KEY_ROTATION] == "residual,value_heads,ffn_down"
    assert set(mf.rotations) == ({"ffn_down", "output"} if mf.hparams.tied else {"ffn_down"})
    orig = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    ref = hf_logits(orig, TOKENS)
    rot = hf_logits(add_rotation_hooks(dequantized_hf_model(f, tiny_hf), f), TOKENS)
    assert np.abs(rot - ref).max() <= 2e-4 * max(1.0, ref.std())
    # and the weights really changed: the residual rotation moved the embedding
    emb = mf.tensor(K.TOKEN_EMBD).dequantize()
    w = orig.model.embed_tokens.weight.detach().numpy()
    assert np.abs(emb - w).max() > 0.1 * np.abs(w).max()


def test_runtime_on_a_rotated_file_matches_the_reference(tiny_hf, tmp_path):
    import pyklei
    f = _convert(tiny_hf, tmp_path / "rot-q8.gguf", rotate=True, keep=["*=q8"], embedding_bits=8)
    ref = hf_logits(add_rotation_hooks(dequantized_hf_model(f, tiny_hf), f), TOKENS)
    # two planes: the bound checks the rotations, not one plane's coarser activations (the
    # default on a rotated file; its cost is measured in docs/QUALITY.md)
    with pyklei.load(f, n_threads=2, n_ctx=64, activations="qai8dx2") as llm:
        out = llm.logits(TOKENS)
    assert np.abs(out - ref).max() <= 0.05
    assert (out.argmax(-1) == ref.argmax(-1)).mean() == 1.0


def _rotated_source(hf, tamper):
    from pyklei.converters.hf_llama import hf_source
    from pyklei.converters.rotation import rotate_source
    src = rotate_source(hf_source(hf))
    return tamper(src)


@pytest.mark.parametrize("case,message", [
    ("bad_kind", "expected a comma list"),
    ("not_orthogonal", "not orthogonal"),
    ("missing_tensor", "lacks tensor 'rot.ffn_down.mix'"),
    ("no_key", "unexpected tensor 'rot.ffn_down.signs'"),
])
def test_bad_rotation_metadata_is_a_clear_error(tiny_hf, tmp_path, case, message):
    from pyklei.converters.core import write_model

    def tamper(src):
        if case == "bad_kind":
            src.kv = [(k, "residual,sideways" if k == K.KEY_ROTATION else v, t, s)
                      for k, v, t, s in src.kv]
        elif case == "not_orthogonal":
            src.tensors = [dataclasses.replace(t, read=lambda r0, r1, t=t: 1.5 * t.read(r0, r1))
                           if t.name == K.rot_mix(K.ROT_FFN_DOWN) else t for t in src.tensors]
        elif case == "missing_tensor":
            src.tensors = [t for t in src.tensors if t.name != K.rot_mix(K.ROT_FFN_DOWN)]
        elif case == "no_key":
            src.kv = [kv for kv in src.kv if kv[0] != K.KEY_ROTATION]
        return src

    out = tmp_path / f"{case}.gguf"
    write_model(_rotated_source(tiny_hf, tamper), out, progress=False)
    with pytest.raises(ModelFileError, match=message):
        read_model(out)
