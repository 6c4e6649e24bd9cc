"""The converter's block-scale search in C (pyklei_ext/ops/pk_weight_search.c) against its numpy
definition (pyklei.formats.qsi4c32._quantize_blocks_numpy), byte for byte: same int values, same
bf16 scale bits, on blocks chosen to make candidates tie, with and without importance weights,
for qsi4c32's and qsi6c32's ranges. A file converted where the extension is built is the file
converted where it is not."""
from __future__ import annotations

import numpy as np
import pytest

from pyklei import _ext
from pyklei.formats import _native, qsi4c32, qsi6c32
from pyklei.formats.qsi4c32 import QMAX, QMIN, SEARCH_DIVISORS, _quantize_blocks_numpy

RANGES = [(QMIN, QMAX, SEARCH_DIVISORS), (qsi6c32.QMIN, qsi6c32.QMAX, qsi6c32.SEARCH_DIVISORS)]


def blocks(seed: int, n: int, bl: int = 32) -> np.ndarray:
    """Gaussian, heavy-tailed, tiny, all-zero, on-grid (exact ties between candidates) and
    single-outlier blocks, float32 [n, bl]."""
    rng = np.random.default_rng(seed)
    kinds = [
        rng.standard_normal((n, bl)),
        rng.standard_t(2, (n, bl)),
        rng.standard_normal((n, bl)) * 1e-30,
        np.zeros((n, bl)),
        rng.integers(-8, 8, (n, bl)) * 0.25,
        np.where(rng.random((n, bl)) < 0.05, 40.0, rng.standard_normal((n, bl)) * 0.1),
    ]
    return np.concatenate(kinds).astype(np.float32)


def both(xb, wb, search, qmin, qmax, divisors):
    divisors = np.asarray(divisors if search else [-qmin], np.float32)
    ref = _quantize_blocks_numpy(xb, search, wb, qmin, qmax, divisors)
    got = _ext.weight_search_blocks(xb, wb, search, divisors, qmin, qmax)
    return ref, got


@pytest.mark.parametrize("qmin,qmax,divisors", RANGES, ids=["q4", "q6"])
@pytest.mark.parametrize("search", [True, False])
@pytest.mark.parametrize("weights", ["none", "shared", "cycled", "per-block"])
def test_c_search_is_the_numpy_search_byte_for_byte(qmin, qmax, divisors, search, weights):
    xb = blocks(1, 200)
    rng = np.random.default_rng(2)
    wb = {"none": None,
          "shared": rng.random((1, 32)).astype(np.float32) + 1e-3,
          "cycled": rng.random((4, 32)).astype(np.float32) + 1e-3,     # 1200 blocks = 300 x 4
          "per-block": rng.random(xb.shape).astype(np.float32) + 1e-3}[weights]
    (q_ref, b_ref), (q, b) = both(xb, wb, search, qmin, qmax, divisors)
    assert q.dtype == np.int8 and b.dtype == np.uint16
    np.testing.assert_array_equal(b, b_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert q.min() >= qmin and q.max() <= qmax


def test_block_lengths_other_than_32():
    for bl in (64, 256):    # qsi4c32's other block sizes; 256 runs the pairwise halves
        xb = blocks(3, 20, bl)
        (q_ref, b_ref), (q, b) = both(xb, None, True, QMIN, QMAX, SEARCH_DIVISORS)
        np.testing.assert_array_equal(b, b_ref)
        np.testing.assert_array_equal(q, q_ref)


def test_quantize_rows_is_the_same_with_and_without_the_extension(monkeypatch):
    """The whole quantizer, threads over row ranges included (a weight of several chunks)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((640, 2048)).astype(np.float32)     # > 1 M values: two chunks
    imp = rng.random(2048).astype(np.float32)
    fast = [qsi4c32.quantize_qsi4c32(w), qsi4c32.quantize_qsi4c32(w, importance=imp),
            qsi6c32.quantize_qsi6c32(w[:64])]
    monkeypatch.setattr(_native, "search_blocks", lambda: None)
    slow = [qsi4c32.quantize_qsi4c32(w), qsi4c32.quantize_qsi4c32(w, importance=imp),
            qsi6c32.quantize_qsi6c32(w[:64])]
    for (qs, sc), (qs_ref, sc_ref) in zip(fast, slow):
        np.testing.assert_array_equal(sc, sc_ref)
        np.testing.assert_array_equal(qs, qs_ref)


def test_choose_block_scales_the_same_with_and_without_the_extension(monkeypatch):
    xb = blocks(5, 30)
    imp = np.random.default_rng(6).random(32).astype(np.float32)
    fast = [qsi4c32.choose_block_scales(xb), qsi4c32.choose_block_scales(xb, imp)]
    monkeypatch.setattr(_native, "search_blocks", lambda: None)
    slow = [qsi4c32.choose_block_scales(xb), qsi4c32.choose_block_scales(xb, imp)]
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)


def test_bad_arguments_are_refused():
    x = np.zeros((4, 32), np.float32)
    d = np.array([8.0], np.float32)
    with pytest.raises(ValueError, match="block length"):
        _ext.weight_search_blocks(np.zeros((4, 2000), np.float32), None, True, d, QMIN, QMAX)
    with pytest.raises(ValueError, match="divisors"):
        _ext.weight_search_blocks(x, None, True, np.zeros(0, np.float32), QMIN, QMAX)
    with pytest.raises(ValueError, match="cycle"):
        _ext.weight_search_blocks(x, np.ones((3, 32), np.float32), True, d, QMIN, QMAX)
