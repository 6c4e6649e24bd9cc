"""Attention over the KV cache (pyklei_ext/ops/pk_attention.c) through pyklei._ext.attend_group:
  (a) the C reference (pk_attend_group_reference) against a float64 numpy evaluation, for an
      f32 cache, an f16 one, a q8 one and a bf16 one (of the values each holds);
  (b) the fast paths (GQA groups of 1-4 and by fours, head sizes 64 and 128; others fall back
      to the reference) are bit-identical to the reference: the f32 cache, and the f16 and q8
      caches read by every f16 -> f32 conversion this CPU runs (scalar, avx2, avx512vnni, neon),
      and the bf16 cache (its pairs' order, contract/pk_kv.h) read in f32;
  (c) several rows of one sequence at once (pk_attend_rows, as a prefill chunk runs them; a
      converted cache then converted once for all the rows) equal each row alone, bit for bit;
  (c') sliding windows (pk_attend_rows_window, Gemma 3's local layers): rows of one sequence,
      each over its own window from anywhere in a K block, of a linear cache or of a ring whose
      wrap the rows straddle: within float rounding of numpy, each row of the batch equal to
      itself alone bit for bit, and a window from 0 equal to the whole row;
  (d) PYKLEI_KERNEL forces the conversion and the PYKLEI_LOG=kernels line names it;
  (e) the q8 cache's rows (pk_kv_q8_row): llama.cpp's q8_0 rule, an f16 scale per 32 values.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyklei import _ext
from pyklei._ext import KernelError

F16_ISAS = ("scalar", "avx2", "avx512vnni", "neon")
# 1100 positions: three chunks of PK_ATTEND_CHUNK (512), the last one partial
SHAPES = [(g, hd, n) for g in (1, 3, 4, 5, 8) for hd in (64, 128, 96) for n in (1, 16, 17, 300, 1100)]


class Bf16Rows(np.ndarray):
    """Rows as a bf16 cache holds them: float32 values on bf16's grid (attend passes
    cache="bf16", and the extension lays them out in the cache's pair order)."""


def bf16_rows(x):
    bits = _ext.kv_bf16_round(np.asarray(x, np.float32)).astype(np.uint32) << 16
    return bits.view(np.float32).view(Bf16Rows)


def attend(q, k, v, **kw):
    """_ext.attend_group, with a bf16 cache's rows (Bf16Rows) passed as one."""
    if isinstance(k, Bf16Rows):
        k, v, kw["cache"] = np.asarray(k), np.asarray(v), "bf16"
    return _ext.attend_group(q, k, v, **kw)


def converts_f16(cache):
    """Whether a cache of this type is read through the f16 conversion (impl= picks which)."""
    return cache in ("f16", "q8")


def _case(group, hd, n_pos, cache, seed):
    """q, and k, v as a cache of type cache ("f32", "f16", "q8", "bf16") holds them."""
    rng = np.random.default_rng(seed)
    mag = 1.0 + 3.0 * rng.random()                       # up to peaked softmaxes
    q = (rng.standard_normal((group, hd)) * mag).astype(np.float32)
    k = (rng.standard_normal((n_pos, hd)) * mag).astype(np.float32)
    v = rng.standard_normal((n_pos, hd)).astype(np.float32)
    if cache == "q8":
        return q, _ext.kv_q8_rows(k), _ext.kv_q8_rows(v)
    if cache == "bf16":
        return q, bf16_rows(k), bf16_rows(v)
    return (q, k, v) if cache == "f32" else (q, k.astype(np.float16), v.astype(np.float16))


def _values(kv):
    """The values a cache holds, as float64: a q8 pair is int8 times its group's scale."""
    if isinstance(kv, tuple):
        q8, scales = kv
        return q8.astype(np.float64) * np.repeat(scales.astype(np.float64), 32, axis=1)
    return np.asarray(kv, np.float64)


def _rows(kv, n):
    return tuple(a[:n] for a in kv) if isinstance(kv, tuple) else kv[:n]


def _numpy_attention(q, k, v):
    q64, k64, v64 = np.asarray(q, np.float64), _values(k), _values(v)
    s = q64 @ k64.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v64


@pytest.mark.parametrize("cache", ["f32", "f16", "q8", "bf16"])
@pytest.mark.parametrize("group,hd,n_pos", SHAPES[::3])
def test_reference_against_numpy(group, hd, n_pos, cache):
    q, k, v = _case(group, hd, n_pos, cache, seed=group * 1000 + hd + n_pos)
    got = attend(q, k, v, impl="reference")
    # float32 scores reach |s| ~ 50 here: their rounding (~ 2^-24 |s| sqrt(hd)) moves the
    # weights by ~1e-5 relative; an error in the order of operations would be far larger
    np.testing.assert_allclose(got, _numpy_attention(q, k, v), rtol=0, atol=5e-5)


@pytest.mark.parametrize("group,hd,n_pos", SHAPES)
def test_every_path_bit_identical_to_reference(group, hd, n_pos):
    seed = 7 + group * 1000 + hd + n_pos
    q, k, v = _case(group, hd, n_pos, "f32", seed)
    assert np.array_equal(attend(q, k, v), attend(q, k, v, impl="reference"))
    q, k, v = _case(group, hd, n_pos, "bf16", seed)
    assert np.array_equal(attend(q, k, v), attend(q, k, v, impl="reference"))
    for cache in ("f16", "q8"):
        q, k, v = _case(group, hd, n_pos, cache, seed)
        want = attend(q, k, v, impl="reference")
        ran = []
        for isa in F16_ISAS:
            try:
                got = attend(q, k, v, impl=isa)
            except KernelError:
                continue                                  # not this CPU
            assert np.array_equal(got, want), (cache, isa)
            ran.append(isa)
        assert "scalar" in ran and _ext.f16_reader_isa() in ran
        assert np.array_equal(attend(q, k, v), want)   # the default conversion


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 11])
@pytest.mark.parametrize("group,hd", [(3, 64), (4, 128), (8, 64), (5, 96)])
@pytest.mark.parametrize("cache", ["f32", "f16", "q8", "bf16"])
def test_rows_equal_each_row_alone(rows, group, hd, cache):
    rng = np.random.default_rng(rows * 100 + group + hd)
    n = 1100                                              # spans of the converted path; chunks
    _, k, v = _case(group, hd, n, cache, seed=rows + hd)
    q = rng.standard_normal((rows, group, hd)).astype(np.float32) * 2
    for n_pos in (np.arange(n - rows + 1, n + 1), rng.integers(1, n + 1, rows)):   # prefill; any
        want = np.stack([attend(q[r], _rows(k, n_pos[r]), _rows(v, n_pos[r]), impl="reference")
                         for r in range(rows)])
        for isa in F16_ISAS if converts_f16(cache) else (None,):
            try:
                got = attend(q, k, v, impl=isa, n_pos=n_pos)
            except KernelError:
                continue                                  # not this CPU
            assert np.array_equal(got, want), (isa, list(n_pos))


def window_case(rows, group, hd, window, ring, cache):
    """rows query rows at consecutive positions ending just past the ring's wrap (or the
    cache's end), each over its window: q, k, v, lo, hi and the cache's length."""
    rng = np.random.default_rng(rows * 100 + group + hd + window)
    n = ring or 1100
    _, k, v = _case(group, hd, n, cache, seed=rows + hd + window)
    q = rng.standard_normal((rows, group, hd)).astype(np.float32) * 2
    hi = np.arange(n + rows // 2 - rows, n + rows // 2) + 1 if ring else np.arange(n - rows, n) + 1
    return q, k, v, np.maximum(hi - window, 0), hi, n


def window_rows(kv, lo, hi, n):
    """The cache rows of the window [lo, hi), in order (a ring's wrapped)."""
    at = np.arange(lo, hi) % n
    return tuple(a[at] for a in kv) if isinstance(kv, tuple) else kv[at]


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("group,hd,window,ring", [(4, 256, 37, 512), (4, 256, 500, 1024), (3, 64, 129, 0),
                                                  (5, 96, 9, 512)])
@pytest.mark.parametrize("cache", ["f32", "f16", "q8", "bf16"])
def test_window_rows_equal_each_row_alone(rows, group, hd, window, ring, cache):
    q, k, v, lo, hi, n = window_case(rows, group, hd, window, ring, cache)
    alone = [attend(q[r:r + 1], k, v, n_pos=hi[r:r + 1], lo=lo[r:r + 1], ring=ring)[0]
             for r in range(rows)]
    for r in range(rows):
        kw, vw = window_rows(k, lo[r], hi[r], n), window_rows(v, lo[r], hi[r], n)
        np.testing.assert_allclose(alone[r], _numpy_attention(q[r], kw, vw), rtol=0, atol=5e-5)
    for isa in F16_ISAS if converts_f16(cache) else (None,):
        try:
            got = attend(q, k, v, impl=isa, n_pos=hi, lo=lo, ring=ring)
        except KernelError:
            continue                                      # not this CPU
        assert np.array_equal(got, np.stack(alone)), (isa, rows)
    if not ring:                                          # a window from 0 is the whole row
        assert np.array_equal(attend(q, k, v, n_pos=hi, lo=np.zeros(rows, np.int32)),
                              attend(q, k, v, n_pos=hi))


def test_pyklei_kernel_forces_the_f16_reader_and_the_log_says_which():
    from kernel_log import check_forced_choice

    check_forced_choice("from pyklei import _ext; print(_ext.f16_reader_isa())",
                        _ext.f16_reader_isa(), "f16 KV cache read with f16_to_f32_{}")


def test_q8_rows_follow_q8_0():
    """An f16 scale per 32 values, max |x| / 127 rounded to f16; each value the nearest step of
    it (within half a step), in [-127, 127]; a group of zeros has scale 0."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((50, 128)) * np.logspace(-3, 3, 50)[:, None]).astype(np.float32)
    x[7, 32:64] = 0.0                                      # an all-zero group
    x[9, 5] = 1e4                                          # an outlier: its group's scale only
    q, scales = _ext.kv_q8_rows(x)
    groups = x.reshape(50, 4, 32)
    np.testing.assert_array_equal(scales, (np.abs(groups).max(axis=2) / np.float32(127)).astype(np.float16))
    d = np.repeat(scales.astype(np.float64), 32, axis=1)
    assert np.abs(q).max() <= 127 and (q[7, 32:64] == 0).all()
    assert (np.abs(q * d - x) <= 0.5 * d * (1 + 1e-3)).all()
    assert np.abs(q[9, :32]).max() == 127 and np.abs(q[9, 32:]).max() >= 100
    with pytest.raises(ValueError, match="multiple of 32"):
        _ext.kv_q8_rows(np.zeros((2, 48), np.float32))


def test_bad_arguments():
    q = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError):
        _ext.attend_group(q, np.zeros((3, 64), np.float32), np.zeros((3, 64), np.float16))
    with pytest.raises(ValueError):
        _ext.attend_group(q, np.zeros((3, 32), np.float32), np.zeros((3, 32), np.float32))
    with pytest.raises(KernelError):
        _ext.attend_group(q, np.zeros((3, 64), np.float16), np.zeros((3, 64), np.float16), impl="no_such_isa")
    k, n1 = np.zeros((512, 64), np.float32), np.array([600], np.int32)
    with pytest.raises(ValueError, match="lo must"):
        _ext.attend_group(q, k, k, n_pos=[5], lo=[5])
    with pytest.raises(ValueError, match="ring 500"):
        _ext.attend_group(q, k[:500], k[:500], n_pos=[600], lo=[300], ring=500)
    with pytest.raises(ValueError, match="ring 512"):
        _ext.attend_group(q, k, k, n_pos=n1, lo=[0], ring=512)   # a window longer than the ring
    with pytest.raises(ValueError, match="reference"):
        _ext.attend_group(q, k, k, n_pos=[5], lo=[1], impl="reference")
    k8 = (np.zeros((3, 64), np.int8), np.ones((3, 2), np.float16))
    with pytest.raises(ValueError, match="q8"):
        _ext.attend_group(q, k8, np.zeros((3, 64), np.float16))
    with pytest.raises(ValueError, match="bf16"):
        _ext.attend_group(q, k.astype(np.float16), k.astype(np.float16), cache="bf16")
    with pytest.raises(ValueError, match="cache="):
        _ext.attend_group(q, k, k, cache="bf8")
    odd = np.zeros((3, 63), np.float32)
    with pytest.raises(ValueError, match="head size 63 is odd"):
        _ext.attend_group(np.zeros((2, 63), np.float32), odd, odd, cache="bf16")
    with pytest.raises(ValueError, match="q8 shapes"):
        _ext.attend_group(q, k8, (np.zeros((3, 64), np.int8), np.ones((3, 3), np.float16)))
