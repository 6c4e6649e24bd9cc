"""qsi8d32 activations (a scale per block of 32 along K): the C quantizer against the numpy
reference byte for byte; every kernel's run_d32 against the float64 product of the same
integers (exact on integer data, within the float32 rounding bound on random data); the
matmul layer's scheme choice (qsi8cx weights and kernels without run_d32 stay on qai8dx), the
kernel log line naming the contract that ran, and decode == prefill row for row."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pyklei import _ext
from pyklei.formats import (dequantize_qsi4c32, dequantize_qsi8d32, f32_to_bf16, pack_nibbles, quantize_qai8dx,
                            quantize_qsi4c32, quantize_qsi6c32, quantize_qsi8cx, quantize_qsi8d32)
from pyklei.formats.qsi6c32 import dequantize_qsi6c32, pack_q6
from quantizer_impls import quant_params

KERNELS = _ext.kernels()
U = 2.0 ** -24


def d32_kernels():
    """pytest params (format, kernel) of every kernel that takes qsi8d32 activations."""
    out = []
    for k in KERNELS:
        if not k["takes_qsi8d32"]:
            continue
        marks = [] if k["supported"] else [pytest.mark.skip(reason=f"{k['name']}: this CPU cannot run it")]
        out.append(pytest.param(k["format"], k["name"], marks=marks, id=k["name"]))
    return out


# ---- the quantizer ---------------------------------------------------------------------------

def quantizer_rows():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 576)).astype(np.float32)
    x[0, 96:128] = 0.0                              # an all-zero block: scale 0, q 0
    x[1, 7] = 900.0                                 # an outlier coarsens its own block only
    x[2] = np.float32(127 / 2) * np.sign(x[2])      # exact halves after scaling: round half to even
    x[2, ::32] = 127.0
    x[3] *= 1e-30                                   # tiny (subnormal products)
    x[4, 64:96] = -3.0                              # a constant block: q = -127
    return x


@pytest.mark.parametrize("impl", quant_params())
def test_quantizer_byte_exact(impl):
    x = quantizer_rows()
    q, s, bsum = _ext.quantize_qsi8d32(x, impl)
    q_ref, s_ref = quantize_qsi8d32(x)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    np.testing.assert_array_equal(bsum, q_ref.reshape(len(x), -1, 32).astype(np.int32).sum(-1))
    assert q.min() >= -127 and q.max() <= 127
    assert (s[0, 3] == 0) and not q[0, 96:128].any()
    assert (q[4, 64:96] == -127).all()


@pytest.mark.parametrize("impl", quant_params())
def test_quantizer_many_rows(impl):
    """Rows of every scale (each block's own), negative zeros, ties at every step, and a block
    whose largest magnitude is its last element (the SIMD max reductions against the loop)."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((41, 1536)) * rng.uniform(1e-4, 1e4, (41, 1))).astype(np.float32)
    x[3] = -0.0
    x[5, ::7] *= 300.0
    x[7] = np.float32(0.5) * np.arange(1536, dtype=np.float32) % 255 - 127   # halves: ties
    x[9, 31::32] = 1e3
    q, s, bsum = _ext.quantize_qsi8d32(x, impl)
    q_ref, s_ref = quantize_qsi8d32(x)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    np.testing.assert_array_equal(bsum, q_ref.reshape(41, -1, 32).astype(np.int32).sum(-1))


def test_quantizer_unknown_impl():
    with pytest.raises(_ext.KernelError, match="not available"):
        _ext.quantize_qsi8d32(np.ones((1, 32), np.float32), "no_such_isa")


def test_quantizer_block_error_bound_and_outlier():
    """|x - dequant| <= scale/2 per block; an outlier leaves the other blocks as fine as they
    were (per-row qai8dx coarsens the whole row)."""
    x = quantizer_rows()[:2]
    q, s = quantize_qsi8d32(x)
    err = np.abs(dequantize_qsi8d32(q, s) - x).reshape(2, -1, 32)
    assert (err <= s[:, :, None] / 2 * (1 + 1e-6)).all()
    x1 = x[1:2].copy()
    q1, s1 = quantize_qsi8d32(x1)
    rest = np.abs(dequantize_qsi8d32(q1, s1) - x1)[0, 32:].max()
    qr, sr, zr = quantize_qai8dx(x1)
    assert rest < sr[0] / 50


def test_quantizer_rejects_ragged_k():
    with pytest.raises(ValueError, match="multiple of 32"):
        _ext.quantize_qsi8d32(np.ones((1, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_qsi8d32(np.ones((1, 40), np.float32))


# ---- run_d32 against the float64 reference --------------------------------------------------

# (M, N, K, bl): M 1..67 (GEMV and GEMM tiles and their tails), N ragged, bl 32..256 (a weight
# block spanning several activation blocks)
SHAPES = [(1, 1, 32, 32), (2, 17, 96, 32), (3, 67, 128, 128), (5, 33, 576, 32), (9, 40, 768, 256),
          (16, 96, 576, 64), (33, 17, 1536, 32), (67, 67, 256, 32)]


def make_case(fmt, m, n, k, bl, exact, seed):
    rng = np.random.default_rng(seed)
    q6 = fmt == "qsi6c32"
    bl = 32 if q6 else bl
    qw = rng.integers(-32, 32, (n, k)).astype(np.int8) if q6 else rng.integers(-8, 8, (n, k)).astype(np.int8)
    qs = pack_q6(qw) if q6 else pack_nibbles(qw)
    if exact:
        sc = np.full((n, k // bl), 0x3F80, np.uint16)   # bf16 1.0
        bscale = np.ones((m, k // 32), np.float32)
    else:
        sc = f32_to_bf16(rng.uniform(1e-3, 0.1, (n, k // bl)).astype(np.float32))
        bscale = rng.uniform(1e-3, 0.1, (m, k // 32)).astype(np.float32)
    w = _ext.QWeight(fmt, qs, sc, bl)
    wdeq = (dequantize_qsi6c32 if q6 else dequantize_qsi4c32)(qs, sc).astype(np.float64)
    qa = rng.integers(-127, 128, (m, k)).astype(np.int8)
    a = (qa.reshape(m, -1, 32).astype(np.float64) * bscale[:, :, None]).reshape(m, k)
    ref = a @ wdeq.T
    # float32 enters at each block's scale product, the fma and the sum over blocks
    t = np.abs(a) @ np.abs(wdeq).T
    tol = (k // 32 + 8) * U * t
    return w, qa, bscale, ref, tol


@pytest.fixture(scope="module")
def ops():
    return _ext.Ops(2)


@pytest.mark.parametrize("shape", SHAPES, ids=["M%d-N%d-K%d-bl%d" % s for s in SHAPES])
@pytest.mark.parametrize("fmt,kernel", d32_kernels())
def test_run_d32_exact(ops, fmt, kernel, shape):
    w, qa, bscale, ref, _ = make_case(fmt, *shape, exact=True, seed=sum(shape))
    np.testing.assert_array_equal(ops.matmul_lhs_d32(w, qa, bscale, kernel=kernel), ref.astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES, ids=["M%d-N%d-K%d-bl%d" % s for s in SHAPES])
@pytest.mark.parametrize("fmt,kernel", d32_kernels())
def test_run_d32_random(ops, fmt, kernel, shape):
    w, qa, bscale, ref, tol = make_case(fmt, *shape, exact=False, seed=7 + sum(shape))
    got = ops.matmul_lhs_d32(w, qa, bscale, kernel=kernel).astype(np.float64)
    assert (np.abs(got - ref) <= tol).all(), np.abs(got - ref).max() / tol.max()


def test_kernels_that_take_qsi8d32():
    """Every block format's scalar reference takes qsi8d32; qsi8cx kernels never do (per-row
    weights: that matmul stays on qai8dx). A kernel without run_d32 refuses such activations
    rather than reading them as qai8dx."""
    by_name = {k["name"]: k for k in KERNELS}
    assert by_name["qai8dx_qsi4c32_1x1_scalar"]["takes_qsi8d32"]
    assert by_name["qai8dx_qsi6c32_1x1_scalar"]["takes_qsi8d32"]
    assert not any(k["takes_qsi8d32"] for k in KERNELS if k["format"] == "qsi8cx")
    refusing = [k for k in KERNELS if k["supported"] and k["format"] != "qsi8cx" and not k["takes_qsi8d32"]]
    if not refusing:
        pytest.skip("every block-format kernel this CPU runs takes qsi8d32")
    w, qa, bscale, _, _ = make_case(refusing[0]["format"], 2, 8, 64, 32, exact=True, seed=1)
    with pytest.raises(_ext.KernelError, match="qsi8d32"):
        _ext.Ops(1).matmul_lhs_d32(w, qa, bscale, kernel=refusing[0]["name"])


# ---- the matmul layer ------------------------------------------------------------------------

def weight(fmt, n, k, rng):
    wf = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "qsi8cx":
        return _ext.QWeight("qsi8cx", *quantize_qsi8cx(wf)), wf
    qs, sc = quantize_qsi4c32(wf, 32) if fmt == "qsi4c32" else quantize_qsi6c32(wf)
    return _ext.QWeight(fmt, qs, sc, 32), wf


@pytest.mark.parametrize("fmt", ["qsi4c32", "qsi6c32"])
def test_ops_qsi8d32_quantizes_then_runs_d32(fmt):
    """Ops(activations='qsi8d32').matmul == the dispatched kernel's run_d32 on the C quantizer's
    bytes, bit for bit; and closer to the float product than one qai8dx plane on rows with an
    outlier channel."""
    rng = np.random.default_rng(11)
    w, wf = weight(fmt, 70, 576, rng)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    x[:, 3] *= 60.0
    y = _ext.Ops(2, "qsi8d32").matmul(w, x)
    q, s, _ = _ext.quantize_qsi8d32(x)
    np.testing.assert_array_equal(y, _ext.Ops(1).matmul_lhs_d32(w, q, s))
    wq = _ext.Ops(2, "qai8dx2").matmul(w, x)   # ~16-bit activations: the weight's own product
    e_d32 = np.abs(y - wq).mean()
    e_dx = np.abs(_ext.Ops(2, "qai8dx").matmul(w, x) - wq).mean()
    assert e_d32 < e_dx / 2, (e_d32, e_dx)


def test_ops_qsi8d32_keeps_qai8dx_for_qsi8cx():
    rng = np.random.default_rng(12)
    w, _ = weight("qsi8cx", 40, 100, rng)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    np.testing.assert_array_equal(_ext.Ops(1, "qsi8d32").matmul(w, x), _ext.Ops(1, "qai8dx").matmul(w, x))


def test_ops_activation_names():
    assert _ext.Ops(1, "qsi8d32").activations == "qsi8d32"
    with pytest.raises(ValueError, match="qsi8d32"):
        _ext.Ops(1, "q8_0")


@pytest.mark.parametrize("fmt", ["qsi4c32", "qsi6c32"])
def test_row_result_independent_of_m(fmt):
    """Decode equals prefill row for row where one micro-kernel serves every M (AVX-512 p16)."""
    packed = {k["name"] for k in KERNELS if k["repacks_weights"] and k["takes_qsi8d32"]}
    if _ext.selected_kernel(fmt, 1) not in packed or _ext.selected_kernel(fmt, 64) not in packed:
        pytest.skip("the dispatch's GEMV and GEMM here are separate kernels")
    rng = np.random.default_rng(5)
    w, _ = weight(fmt, 100, 576, rng)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    ops = _ext.Ops(2, "qsi8d32")
    full = ops.matmul(w, x)
    for m in (1, 2, 3, 7, 13):
        np.testing.assert_array_equal(ops.matmul(w, x[-m:]), full[-m:], err_msg=f"m={m}")


def test_kernel_log_names_the_contract():
    code = ("import numpy as np; from pyklei import _ext; from pyklei.formats import quantize_qsi4c32;"
            "w = _ext.QWeight('qsi4c32', *quantize_qsi4c32(np.ones((16, 64), np.float32), 32), 32);"
            "x = np.ones((1, 64), np.float32); _ext.Ops(1, 'qsi8d32').matmul(w, x); _ext.Ops(1, 'qai8dx').matmul(w, x)")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYKLEI_LOG": "kernels"},
                       capture_output=True, text=True, check=True)
    lines = [ln for ln in r.stderr.splitlines() if "matmul qsi4c32 m=1 n=16 k=64" in ln]
    from pyklei.runtime.kernels import selected_kernel_for
    chosen = _ext.selected_kernel("qsi4c32", 1)
    d32 = selected_kernel_for("qsi4c32", 1, "qsi8d32")     # what `pyklei info` / bench report
    if d32 == chosen:   # the kernel takes no qsi8d32: the call ran qai8dx, one line for both
        assert len(lines) == 1 and lines[0].endswith("-> " + chosen), lines
        return
    assert len(lines) == 2, r.stderr
    assert d32 == "qsi8d32" + chosen[chosen.index("_"):]
    assert lines[0].endswith("-> " + d32), lines
    assert lines[1].endswith("-> " + chosen), lines
