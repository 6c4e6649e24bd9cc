"""Attention over the KV cache (pyklei_ext/ops/pk_nn.c) through pyklei._ext.attend_group:
  (a) the C reference (pk_attend_group_reference) against a float64 numpy evaluation, for an
      f32 cache and an f16 one;
  (b) the fast paths (GQA groups of 1-4 and by fours, head sizes 64 and 128; others fall back
      to the reference) are bit-identical to the reference: the f32 cache, and the f16 cache
      read by every f16 -> f32 conversion this CPU runs (scalar, avx2, avx512vnni, neon);
  (c) several rows of one sequence at once (pk_attend_rows, as a prefill chunk runs them; the
      f16 cache then converted once for all the rows) equal each row alone, bit for bit;
  (d) PYKLEI_KERNEL forces the conversion and the PYKLEI_LOG=kernels line names it.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyklei import _ext
from pyklei._ext import KernelError

F16_ISAS = ("scalar", "avx2", "avx512vnni", "neon")
SHAPES = [(g, hd, n) for g in (1, 3, 4, 5, 8) for hd in (64, 128, 96) for n in (1, 16, 17, 300)]


def _case(group, hd, n_pos, dtype, seed):
    rng = np.random.default_rng(seed)
    mag = 1.0 + 3.0 * rng.random()                       # up to peaked softmaxes
    q = (rng.standard_normal((group, hd)) * mag).astype(np.float32)
    k = (rng.standard_normal((n_pos, hd)) * mag).astype(dtype)
    v = rng.standard_normal((n_pos, hd)).astype(dtype)
    return q, k, v


def _numpy_attention(q, k, v):
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q64 @ k64.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v64


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("group,hd,n_pos", SHAPES[::3])
def test_reference_against_numpy(group, hd, n_pos, dtype):
    q, k, v = _case(group, hd, n_pos, dtype, seed=group * 1000 + hd + n_pos)
    got = _ext.attend_group(q, k, v, impl="reference")
    # float32 scores reach |s| ~ 50 here: their rounding (~ 2^-24 |s| sqrt(hd)) moves the
    # weights by ~1e-5 relative; an error in the order of operations would be far larger
    np.testing.assert_allclose(got, _numpy_attention(q, k, v), rtol=0, atol=5e-5)


@pytest.mark.parametrize("group,hd,n_pos", SHAPES)
def test_every_path_bit_identical_to_reference(group, hd, n_pos):
    seed = 7 + group * 1000 + hd + n_pos
    q, k, v = _case(group, hd, n_pos, np.float32, seed)
    assert np.array_equal(_ext.attend_group(q, k, v), _ext.attend_group(q, k, v, impl="reference"))
    q, k, v = _case(group, hd, n_pos, np.float16, seed)
    want = _ext.attend_group(q, k, v, impl="reference")
    ran = []
    for isa in F16_ISAS:
        try:
            got = _ext.attend_group(q, k, v, impl=isa)
        except KernelError:
            continue                                      # not this CPU
        assert np.array_equal(got, want), isa
        ran.append(isa)
    assert "scalar" in ran and _ext.f16_reader_isa() in ran
    assert np.array_equal(_ext.attend_group(q, k, v), want)   # the default conversion


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 11])
@pytest.mark.parametrize("group,hd", [(3, 64), (4, 128), (8, 64), (5, 96)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rows_equal_each_row_alone(rows, group, hd, dtype):
    rng = np.random.default_rng(rows * 100 + group + hd)
    n = 300                                               # more than one span of the f16 path
    _, k, v = _case(group, hd, n, dtype, seed=rows + hd)
    q = rng.standard_normal((rows, group, hd)).astype(np.float32) * 2
    for n_pos in (np.arange(n - rows + 1, n + 1), rng.integers(1, n + 1, rows)):   # prefill; any
        want = np.stack([_ext.attend_group(q[r], k[:n_pos[r]], v[:n_pos[r]], impl="reference")
                         for r in range(rows)])
        for isa in F16_ISAS if dtype == np.float16 else (None,):
            try:
                got = _ext.attend_group(q, k, v, impl=isa, n_pos=n_pos)
            except KernelError:
                continue                                  # not this CPU
            assert np.array_equal(got, want), (isa, list(n_pos))


def test_pyklei_kernel_forces_the_f16_reader_and_the_log_says_which():
    from kernel_log import check_forced_choice

    check_forced_choice("from pyklei import _ext; print(_ext.f16_reader_isa())",
                        _ext.f16_reader_isa(), "f16 KV cache read with f16_to_f32_{}")


def test_bad_arguments():
    q = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError):
        _ext.attend_group(q, np.zeros((3, 64), np.float32), np.zeros((3, 64), np.float16))
    with pytest.raises(ValueError):
        _ext.attend_group(q, np.zeros((3, 32), np.float32), np.zeros((3, 32), np.float32))
    with pytest.raises(KernelError):
        _ext.attend_group(q, np.zeros((3, 64), np.float16), np.zeros((3, 64), np.float16), impl="no_such_isa")
