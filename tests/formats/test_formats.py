"""The numpy references of docs/FORMAT.md: exact bytes on hand-made cases, round-trip bounds."""
import numpy as np
import pytest

from pyklei.formats import (
    bf16_to_f32, dequantize_qai8dx, dequantize_qsi4c32, dequantize_qsi8cx, f32_to_bf16,
    pack_nibbles, quantize_qai8dx, quantize_qsi4c32, quantize_qsi8cx, unpack_nibbles,
)
from pyklei.formats.qsi4c32 import SEARCH_DIVISORS


def test_bf16_rounding_exact_bits():
    x = np.array([1.0, -2.0, 1.00390625, 1.01171875, 3.4e38, np.inf, 0.0, -0.0], np.float32)
    # 1 + 2^-8 is a tie between 1.0 and 1.0078125: even mantissa (1.0) wins.
    # 1 + 3*2^-8 is a tie between 1.0078125 and 1.015625: even (1.015625) wins.
    assert f32_to_bf16(x).tolist() == [0x3F80, 0xC000, 0x3F80, 0x3F82, 0x7F80, 0x7F80, 0x0000, 0x8000]
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]
    assert bf16_to_f32(np.array([0x3F80, 0xC040], np.uint16)).tolist() == [1.0, -3.0]


def test_nibble_order_hand_made():
    q = np.repeat(np.arange(-8, 8), 2).reshape(1, 32).astype(np.int8)  # -8,-8,-7,-7,...,7,7
    packed = pack_nibbles(q)
    # byte j: low nibble = element j, high nibble = element 16 + j (two's complement)
    assert packed.tobytes().hex() == "080819192a2a3b3b4c4c5d5d6e6e7f7f"
    assert np.array_equal(unpack_nibbles(packed), q)
    # second chunk of a 64-element row lands in bytes 16..31
    q2 = np.zeros((1, 64), np.int8)
    q2[0, 32] = -1
    q2[0, 48] = 3
    assert pack_nibbles(q2)[0, 16] == 0x3F


def test_qsi4c32_exact_bytes_block_of_ones():
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 16], w[0, 1] = -8.0, 7.0, 1.0
    qs, s = quantize_qsi4c32(w, bl=32)
    assert s.tolist() == [[0x3F80]]          # scale 1.0 represents the block exactly
    assert qs[0, 0] == 0x78 and qs[0, 1] == 0x01 and not qs[0, 2:].any()
    assert np.array_equal(dequantize_qsi4c32(qs, s), w)


@pytest.mark.parametrize("bl", [32, 64, 128, 256])
def test_qsi4c32_round_trip_bound(bl):
    rng = np.random.default_rng(bl)
    w = (rng.standard_normal((37, 512)) * rng.uniform(0.01, 3, (37, 1))).astype(np.float32)
    w[3, :bl] = 0.0                                     # an all-zero block
    qs, s = quantize_qsi4c32(w, bl=bl)
    d = dequantize_qsi4c32(qs, s)
    scale = np.repeat(bf16_to_f32(s), bl, axis=1)
    q = unpack_nibbles(qs).astype(np.float32)
    inner = (q > -8) & (q < 7)                          # not clipped: error within half a step
    assert np.all(np.abs(w - d)[inner] <= scale[inner] / 2 * (1 + 1e-6))
    assert not d[3, :bl].any()
    # the searched scale is never worse per block than the plain absmax/8 rule
    qs0, s0 = quantize_qsi4c32(w, bl=bl, search=False)
    e = np.square(w - d).reshape(37, -1, bl).sum(-1)
    e0 = np.square(w - dequantize_qsi4c32(qs0, s0)).reshape(37, -1, bl).sum(-1)
    assert np.all(e <= e0 * (1 + 1e-6))
    assert e.sum() < 0.97 * e0.sum()


def test_qsi4c32_shape_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_qsi4c32(np.zeros((2, 48), np.float32), bl=32)
    with pytest.raises(ValueError, match="block size"):
        quantize_qsi4c32(np.zeros((2, 64), np.float32), bl=48)
    with pytest.raises(ValueError, match="NaN"):
        quantize_qsi4c32(np.full((1, 32), np.nan, np.float32))


def test_search_divisors_cover_both_extremes():
    assert 7.0 in SEARCH_DIVISORS and 8.0 in SEARCH_DIVISORS


def test_qsi8cx_round_trip():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((9, 100)).astype(np.float32)
    w[2] = 0
    q, s = quantize_qsi8cx(w)
    assert s[2] == 0 and not q[2].any()
    assert np.abs(q).max() == 127
    assert np.all(np.abs(dequantize_qsi8cx(q, s) - w) <= s[:, None] / 2 * (1 + 1e-6))


def test_qai8dx_hand_made_and_bound():
    x = np.array([[0.0, 0.0, 0.0], [-1.0, 0.0, 1.0], [0.0, 2.0, 4.0]], np.float32)
    q, s, zp = quantize_qai8dx(x)
    assert s.tolist()[0] == 1.0 and zp[0] == -128 and q[0].tolist() == [-128] * 3
    # [-1, 1]: scale 2/255, zero at rint(-128 + 127.5) = 0 (half to even) -> q = [-128, 0, 128->127]
    assert zp[1] == 0 and q[1].tolist() == [-128, 0, 127]
    # [0, 4]: zp = -128; 2.0 * 255/4 = 127.5 rounds to 128 (even) -> 0; 4.0 -> 255 -> 127
    assert zp[2] == -128 and q[2].tolist() == [-128, 0, 127]
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((8, 333)) * 5 + rng.standard_normal((8, 1))).astype(np.float32)
    q, s, zp = quantize_qai8dx(x)
    err = np.abs(dequantize_qai8dx(q, s, zp) - x)
    assert np.all(err <= s[:, None] * 0.5001 + 1e-7)


def test_qai8dx2_c_matches_numpy_and_beats_one_plane():
    from pyklei import _ext
    from pyklei.formats import dequantize_qai8dx2, quantize_qai8dx2
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 576)) * np.where(rng.random(576) < 0.01, 500, 1)).astype(np.float32)
    ref = quantize_qai8dx2(x)
    for a, b in zip(_ext.quantize_qai8dx2(x), ref):
        assert np.array_equal(a, b)
    e2 = np.abs(dequantize_qai8dx2(*ref) - x).max()
    q, s, z = quantize_qai8dx(x)
    e1 = np.abs(dequantize_qai8dx(q, s, z) - x).max()
    assert e2 < e1 / 100


def test_importance_weighting_lowers_the_weighted_error():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    imp = np.exp(rng.standard_normal(256) * 2).astype(np.float32)     # a few channels dominate
    plain = dequantize_qsi4c32(*quantize_qsi4c32(w))
    weighted = dequantize_qsi4c32(*quantize_qsi4c32(w, importance=imp))
    werr = lambda d: float((np.square(w - d) * imp).sum())
    assert werr(weighted) < 0.9 * werr(plain)
    with pytest.raises(ValueError, match="importance"):
        quantize_qsi4c32(w, importance=np.ones(10))


def test_qsi6c32_hand_made_bytes():
    from pyklei.formats.qsi6c32 import pack_q6, unpack_q6
    q = np.full((1, 32), -32, np.int8)               # u = q + 32 = 0 everywhere ...
    q[0, 0], q[0, 1], q[0, 8], q[0, 16], q[0, 24] = -32, 31, 0, -1, 16   # u = 0, 63, 32, 31, 48
    packed = pack_q6(q)
    # bytes 0..15: low 4 bits of u, element j low nibble / element 16+j high nibble;
    # bytes 16..23: byte 16+j = top 2 bits of elements j, j+8, j+16, j+24 (bits 0-1 ... 6-7)
    assert packed.tobytes().hex() == "f00f" + "00" * 14 + "d803" + "00" * 6
    assert np.array_equal(unpack_q6(packed), q)
    q2 = np.random.default_rng(1).integers(-32, 32, (3, 96)).astype(np.int8)
    assert np.array_equal(unpack_q6(pack_q6(q2)), q2)
    with pytest.raises(ValueError, match=r"\[-32, 31\]"):
        pack_q6(np.full((1, 32), 32, np.int8))


def test_qsi6c32_round_trip_bound():
    from pyklei.formats import dequantize_qsi6c32, quantize_qsi6c32
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((40, 256)) * rng.uniform(0.01, 2, (40, 1))).astype(np.float32)
    qs, s = quantize_qsi6c32(w)
    assert qs.shape == (40, 192) and s.shape == (40, 8)
    d = dequantize_qsi6c32(qs, s)
    sf = bf16_to_f32(s).repeat(32, axis=1)
    q = np.rint(d / np.where(sf > 0, sf, 1))
    inside = (q > -32) & (q < 31)                  # not clipped: within half a step
    assert np.all(np.abs(w - d)[inside] <= sf[inside] / 2 * (1 + 1e-6))
    # the search never does worse than absmax / 32 per block, and 6 bits beat 4 bits clearly
    qs0, s0 = quantize_qsi6c32(w, search=False)
    e = lambda a: ((a - w) ** 2).reshape(40, 8, 32).sum(-1)
    assert np.all(e(d) <= e(dequantize_qsi6c32(qs0, s0)) * (1 + 1e-6))
    q4 = dequantize_qsi4c32(*quantize_qsi4c32(w, 32))
    assert e(d).sum() < 0.1 * e(q4).sum()


# ---- the format registry ---------------------------------------------------------------------

def test_registry_describes_what_each_format_stores():
    from pyklei.formats.registry import WEIGHT_FORMATS, weight_format
    x = np.random.default_rng(5).standard_normal((6, 256)).astype(np.float32)
    for f in WEIGHT_FORMATS.values():
        for bl in (f.block_sizes or (32,)):
            arrays = f.quantize(x, bl, None)
            stored = f.stored(x.shape, bl)
            assert [a.shape for a in arrays] == [s.shape for s in stored], f.name
            assert [a.nbytes for a in arrays] == [s.nbytes for s in stored], f.name
            if f.quantized:
                assert f.block_length_of(256, arrays[1].shape) == f.block_length(256, bl)
            err = np.abs(f.dequantize(*arrays) - x).max() / np.abs(x).max()
            assert err < {"qsi4c32": 0.2, "qsi6c32": 0.05, "qsi8cx": 0.01}.get(f.name, 0.01), f.name
        assert weight_format(f.alias) is f and weight_format(f.name.upper()) is f
    with pytest.raises(ValueError, match="unknown format 'q3'; use one of q4, q6, q8"):
        weight_format("q3")


def test_registry_ids_match_the_kernels():
    """pk_format ids in pyklei_ext (the kernels) and c_id in the registry are one numbering."""
    from pyklei.formats.registry import WEIGHT_FORMATS
    from pyklei.runtime.kernels import _ext
    quantized = {n: f.c_id for n, f in WEIGHT_FORMATS.items() if f.quantized}
    assert {n: _ext.FORMATS[n] for n in quantized} == quantized
