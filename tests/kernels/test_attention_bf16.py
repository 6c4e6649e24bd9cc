"""Attention over an f16, q8 or bf16 cache in bf16 (pk_kv_head.dot_bf16: ops/pk_attention_bf16.c,
isa/attention_x86_avx512bf16.h) through pyklei.attend(..., bf16=True) (a bf16 cache
holds the values in the pairs' order the kernels read, contract/pk_kv.h):
  (a) the C reference's bf16 arithmetic against a float64 numpy evaluation of the same
      roundings (q * scale, K, V and the weights to bf16), for every cache type it reads;
  (b) the AVX-512 BF16 kernels bit-identical to that reference (every compiled shape, by fours,
      odd lengths, several chunks), where the CPU has them (elsewhere the reference runs);
  (c) several rows of one sequence at once equal each row alone, bit for bit (odd and uneven
      lengths: a vector's odd last position inside a span another row goes on through);
  (d) PYKLEI_ATTENTION picks the arithmetic and the PYKLEI_LOG=kernels line says which;
  (e) the bf16 cache's rounding (pk_kv_bf16_round) is vcvtneps2bf16's.
The forward pass with it: tests/runtime/test_attention_bf16_model.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from test_attention import SHAPES, _case, _numpy_attention, _rows, _values, attend, window_case, window_rows

from pyklei import _ext

RUNS = _ext.attention_bf16_runs()


def _bf16(x):
    """x rounded to bf16 as vcvtneps2bf16 rounds (nearest even, f32 subnormals to zero), float64."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    r = np.where((u & 0x7F800000) == 0, u & 0x80000000, r).astype(np.uint32)
    return r.view(np.float32).astype(np.float64)


def _numpy_bf16(q, k, v):
    scale = np.float32(1.0) / np.sqrt(np.float32(q.shape[1]))
    qb = _bf16(q.astype(np.float32) * scale)
    kb, vb = _bf16(_values(k).astype(np.float32)), _bf16(_values(v).astype(np.float32))
    s = qb @ kb.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    return _bf16(p) @ vb


@pytest.mark.parametrize("cache", ["f16", "q8", "bf16"])
@pytest.mark.parametrize("group,hd,n_pos", [(3, 64, 1), (3, 64, 17), (4, 128, 300), (1, 96, 33)])
def test_bf16_reference_against_numpy(group, hd, n_pos, cache):
    q, k, v = _case(group, hd, n_pos, cache, seed=11 + n_pos)
    got = attend(q, k, v, impl="reference", bf16=True)
    # the same roundings in float64: what is left is f32's (~1e-6) and the weights' bf16
    # rounding of a float64 softmax against the f32 one (a weight's last bit): ~1e-3 of V
    np.testing.assert_allclose(got, _numpy_bf16(q, k, v), rtol=0, atol=4e-3)
    f32 = attend(q, k, v, impl="reference")
    if n_pos > 1 or cache != "bf16":   # (one bf16 position's output is its V row either way)
        assert not np.array_equal(got, f32)               # bf16 is on


@pytest.mark.parametrize("group,hd,n_pos", SHAPES[::2] + [(2, 256, 513), (4, 256, 1100)])
def test_bf16_kernels_bit_identical_to_reference(group, hd, n_pos):
    for cache in ("f16", "q8", "bf16"):
        q, k, v = _case(group, hd, n_pos, cache, seed=5 + group * 1000 + hd + n_pos)
        want = attend(q, k, v, impl="reference", bf16=True)
        assert np.array_equal(attend(q, k, v, bf16=True), want), cache


@pytest.mark.parametrize("rows", [2, 7, 11])
@pytest.mark.parametrize("group,hd", [(3, 64), (4, 128), (8, 64), (2, 256)])
@pytest.mark.parametrize("cache", ["f16", "q8", "bf16"])
def test_bf16_rows_equal_each_row_alone(rows, group, hd, cache):
    rng = np.random.default_rng(rows * 100 + group + hd)
    n = 1100
    _, k, v = _case(group, hd, n, cache, seed=rows + hd)
    q = rng.standard_normal((rows, group, hd)).astype(np.float32) * 2
    for n_pos in (np.arange(n - rows + 1, n + 1), rng.integers(1, n + 1, rows), np.full(rows, 301) - np.arange(rows)):
        want = np.stack([attend(q[r], _rows(k, n_pos[r]), _rows(v, n_pos[r]), bf16=True)
                         for r in range(rows)])
        assert np.array_equal(attend(q, k, v, n_pos=n_pos, bf16=True), want), list(n_pos)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("group,hd,window,ring", [(4, 256, 37, 512), (4, 256, 500, 1024), (3, 64, 129, 0),
                                                  (4, 64, 700, 0)])
@pytest.mark.parametrize("cache", ["f16", "q8", "bf16"])
def test_bf16_window_rows_equal_each_row_alone(rows, group, hd, window, ring, cache):
    """Sliding windows in bf16: a partial from inside a chunk (a window's first) runs in f32,
    one from a chunk's start in bf16 (pk_attention.c's attend_span), so a batch of rows equals
    each row alone bit for bit, and both stay near the f32 attention of the window."""
    q, k, v, lo, hi, n = window_case(rows, group, hd, window, ring, cache)
    alone = [attend(q[r:r + 1], k, v, n_pos=hi[r:r + 1], lo=lo[r:r + 1], ring=ring, bf16=True)[0]
             for r in range(rows)]
    for r in range(rows):
        kw, vw = window_rows(k, lo[r], hi[r], n), window_rows(v, lo[r], hi[r], n)
        # against f32 attention of the window: bf16's roundings of q, K, V and the weights move
        # the output by up to ~4e-2 here (as they move bf16 attention over the window's rows as
        # a cache of their own); a wrong position or window moves it by about the values
        np.testing.assert_allclose(alone[r], _numpy_attention(q[r], kw, vw), rtol=0, atol=6e-2)
    got = attend(q, k, v, n_pos=hi, lo=lo, ring=ring, bf16=True)
    assert np.array_equal(got, np.stack(alone)), rows
    if not ring:   # a window from 0 is the whole row, all of it in bf16
        assert np.array_equal(attend(q, k, v, n_pos=hi, lo=np.zeros(rows, np.int32), bf16=True),
                              attend(q, k, v, n_pos=hi, bf16=True))


@pytest.mark.parametrize("group,hd", [(3, 64), (4, 256)])
@pytest.mark.parametrize("cache", ["f16", "q8", "bf16"])
def test_bf16_window_from_a_chunk_start_is_bf16_over_its_rows(group, hd, cache):
    """A window that starts on a chunk's first position is read in bf16 throughout: bit for bit
    the bf16 attention over the window's rows as a cache of their own (the same chunks)."""
    q, k, v = _case(group, hd, 1100, cache, seed=21 + hd)
    lo, hi = 512, 1100
    got = attend(q[None], k, v, n_pos=[hi], lo=[lo], bf16=True)[0]
    own = attend(q, window_rows(k, lo, hi, hi), window_rows(v, lo, hi, hi), bf16=True)
    assert np.array_equal(got, own)


def test_bf16_cache_rounds_as_vcvtneps2bf16():
    """Nearest even (ties both ways), f32 subnormals to a signed zero, NaN quiet, inf kept."""
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(4000) * np.logspace(-40, 38, 4000),
                        np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1e-39, -1e-39, np.inf, -np.inf,
                                  0.0, -0.0, 3.4e38])]).astype(np.float32)
    got = _ext.kv_bf16_round(x)
    assert got.dtype == np.uint16 and got.shape == x.shape
    want = _bf16(x).astype(np.float32).view(np.uint32) >> 16
    finite = np.isfinite(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert list(got[[-10, -9, -8, -7, -6]]) == [0x3F80, 0x3F82, 0xBF80, 0x0000, 0x8000]
    assert list(got[[-5, -4]]) == [0x7F80, 0xFF80]
    nan = _ext.kv_bf16_round(np.array([np.nan, -np.nan], np.float32))
    assert ((nan & 0x7FC0) == 0x7FC0).all()


def _pick(env_value):
    env = {k: v for k, v in os.environ.items() if k != "PYKLEI_ATTENTION"}
    env["PYKLEI_LOG"] = "kernels"
    if env_value is not None:
        env["PYKLEI_ATTENTION"] = env_value
    code = ("from pyklei import _ext; print(*(_ext.attention_bf16_pick(t) for t in "
            "('f16', 'q8', 'f32')))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_pyklei_attention_picks_the_arithmetic_and_the_log_says_which():
    out = _pick("bf16")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(RUNS), str(RUNS), "False"]     # an f32 cache stays f32
    assert ("attention dot products in bf16 (avx512bf16)" if RUNS else "bf16 asked; no AVX-512 BF16") in out.stderr
    out = _pick("f32")
    assert out.returncode == 0 and out.stdout.split() == ["False", "False", "False"], out.stderr
    assert "attention dot products in f32" in out.stderr
    # the default (docs/KERNELS.md): bf16 for the f16 cache where it runs, f32 for q8
    out = _pick(None)
    assert out.returncode == 0 and out.stdout.split() == [str(RUNS), "False", "False"], out.stderr
    assert ("attention dot products in bf16 (avx512bf16)" if RUNS else
            "attention dot products in f32 (no AVX-512 BF16 here)") in out.stderr
    assert "bf16 asked" not in out.stderr
    out = _pick("fp8")
    assert out.returncode != 0 and "PYKLEI_ATTENTION=fp8: expected bf16 or f32" in out.stderr
