"""Every matmul kernel against the scalar kernel and the numpy reference (docs/KERNELS.md).

For each kernel in pyklei._ext.kernels() (kernels this CPU cannot run are skipped, naming the
missing feature), on odd and aligned shapes (N not a multiple of any tile, K from 32 to 8192,
M from 1 to 67) and block sizes 32/64/128/256:
  (a) exact integer cases: activation scale 1, zp 0 (and zp != 0), weight scales 1.0 -> the
      result is an integer below 2**24 (or rounded once, qsi8cx) and must be equal;
  (b) random cases: within the bound of `tolerance()` (stated there);
  (c) the output window: nothing outside [M rows x N cols] of a larger buffer changes;
  (d) dispatch forcing through PYKLEI_KERNEL / PYKLEI_LOG=kernels in a subprocess;
  (e) the C qai8dx quantizer is byte-exact with the numpy reference;
  (f) the dispatch table's self-check: a kernel broken on purpose (PYKLEI_TEST_BREAK_KERNEL)
      is dropped with a warning and the model's logits are the scalar kernel's. The hook is
      in test builds only (PYKLEI_TEST_HOOKS=1 python setup.py build_ext --inplace; scripts/
      test.sh builds so): elsewhere these tests skip, or fail under PYKLEI_REQUIRE_TEST_HOOKS=1.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from paths import ROOT, SEED
from quantizer_impls import quant_params
from pyklei import _ext
from pyklei.formats import (
    bf16_to_f32,
    dequantize_qsi4c32,
    f32_to_bf16,
    pack_nibbles,
    quantize_qai8dx,
    quantize_qai8dx2,
    quantize_qsi4c32,
    quantize_qsi6c32,
    quantize_qsi8cx,
    unpack_nibbles,
)
from pyklei.formats.qsi6c32 import dequantize_qsi6c32, pack_q6

KERNELS = _ext.kernels()
FEATURES = set(_ext.cpu_features())
# the CPU feature (as pk_cpu_features_string names it) each ISA tag needs
ISA_FEATURE = {"scalar": None, "avx2": "avx2", "avxvnni": "avxvnni", "avx512vnni": "avx512vnni",
               "avxvnni_evex": "avx512vnni", "amx": "amx_int8", "neon": "neon", "dotprod": "dotprod",
               "i8mm": "i8mm"}
SCALAR = {k["format"]: k["name"] for k in KERNELS if k["isa"] == "scalar"}
U = 2.0 ** -24   # float32 unit roundoff


def kernel_params(*fmts):
    """pytest params of every kernel of the formats: the kernel name (one format) or
    (format, kernel name)."""
    out = []
    for k in KERNELS:
        if k["format"] not in fmts:
            continue
        need = ISA_FEATURE.get(k["isa"], k["isa"])
        marks = [] if k["supported"] else [pytest.mark.skip(
            reason=f"{k['name']}: this CPU lacks {need} (has: {' '.join(sorted(FEATURES)) or 'baseline'})")]
        values = (k["name"],) if len(fmts) == 1 else (k["format"], k["name"])
        out.append(pytest.param(*values, marks=marks, id=k["name"]))
    return out


# (M, N, K, bl): N in {1, 3, 5, 17, 33, 67, 96}, K 32..8192, M incl. 1, 2, 3, 4, 5, 16, 33, 67
SHAPES = [
    (1, 1, 32, 32), (1, 3, 64, 64), (2, 17, 96, 32), (3, 67, 128, 128), (4, 96, 256, 256),
    (5, 33, 576, 32), (16, 96, 576, 64), (33, 17, 1536, 128), (67, 67, 2048, 256),
    (1, 67, 8192, 32), (16, 17, 8192, 64), (67, 5, 160, 32), (1, 96, 4096, 128), (33, 1, 32, 32),
    (7, 40, 768, 256), (67, 96, 1024, 32),
]
# qsi8cx has no block constraint on K: add 0/1/3/5/17 to exercise every tail
Q8_K_EXTRA = [0, 1, 3, 5, 17]


def shape_id(s):
    return "M%d-N%d-K%d-bl%d" % s


_cache = {}


def make_case(fmt, idx, kind):
    """Deterministic weights and activations for SHAPES[idx]; kind: 'random' | 'exact' | 'exact_zp'."""
    key = (fmt, idx, kind)
    if key in _cache:
        return _cache[key]
    m, n, k, bl = SHAPES[idx]
    rng = np.random.default_rng(1000 * idx + {"random": 1, "exact": 2, "exact_zp": 3}[kind] + (7 if fmt == "qsi8cx" else 0))
    if fmt == "qsi8cx":
        k += Q8_K_EXTRA[idx % len(Q8_K_EXTRA)]
        qw = rng.integers(-127, 128, (n, k)).astype(np.int8)
        ws = np.ones(n, np.float32) if kind != "random" else rng.uniform(1e-3, 0.05, n).astype(np.float32)
        w = _ext.QWeight(fmt, qw, ws)
        wdeq = qw.astype(np.float64) * ws.astype(np.float64)[:, None]
    else:
        q6 = fmt == "qsi6c32"
        bl = 32 if q6 else bl
        qw = rng.integers(-32, 32, (n, k)).astype(np.int8) if q6 else rng.integers(-8, 8, (n, k)).astype(np.int8)
        qs = pack_q6(qw) if q6 else pack_nibbles(qw)
        if kind == "random":
            sc = f32_to_bf16(rng.uniform(1e-3, 0.1, (n, k // bl)).astype(np.float32))
        else:
            sc = np.full((n, k // bl), 0x3F80, np.uint16)   # bf16 1.0
        w = _ext.QWeight(fmt, qs, sc, bl)
        wdeq = (dequantize_qsi6c32 if q6 else dequantize_qsi4c32)(qs, sc).astype(np.float64)
    qa = rng.integers(-128, 128, (m, k)).astype(np.int8)
    if kind == "random":
        scale = rng.uniform(1e-3, 0.1, m).astype(np.float32)
        zp = rng.integers(-128, 128, m).astype(np.int32)
    else:
        scale = np.ones(m, np.float32)
        zp = np.zeros(m, np.int32) if kind == "exact" else rng.integers(-128, 128, m).astype(np.int32)
    case = dict(m=m, n=n, k=k, bl=bl, w=w, wdeq=wdeq, qw=qw, qa=qa, scale=scale, zp=zp)
    _cache[key] = case
    return case


def reference(case):
    """float64: scale[m] * sum_k (q[m,k] - zp[m]) * W[n,k], W the dequantized weight."""
    a = case["qa"].astype(np.float64) - case["zp"][:, None]
    return case["scale"].astype(np.float64)[:, None] * (a @ case["wdeq"].T)


def tolerance(case):
    """Bound on |y - y_ref| for the random cases.

    Kernels compute exact int32 block dots; float32 enters at the per-block scaling and the
    sum over blocks, in any order and with or without the +128 activation offset (the GEMV
    kernels fold it into the zero point: zp + 128, R). With T the sum of the magnitudes of
    all terms any of these evaluations forms,
        T[m, n] = scale[m] * sum_k (|q[m,k]| + |zp[m]| + 256) * |W[n,k]|,
    a float32 sum of at most nb + 24 roundings (nb = K/bl block terms, lane reductions,
    the zero-point term and the final products) is within (nb + 24) * u * T, u = 2**-24
    (the classical gamma_n bound, linear in the number of roundings)."""
    nb = case["k"] // case["bl"] if case["w"].format != "qsi8cx" else 1
    a = np.abs(case["qa"].astype(np.float64)) + np.abs(case["zp"])[:, None] + 256
    t = case["scale"].astype(np.float64)[:, None] * (a @ np.abs(case["wdeq"]).T)
    return (nb + 24) * U * t


def run(ops, case, kernel):
    return ops.matmul_lhs(case["w"], case["qa"], case["scale"], case["zp"], kernel=kernel)


@pytest.fixture(scope="module")
def ops():
    return _ext.Ops(2)


# ---- (a) exact integer cases ---------------------------------------------------------------

@pytest.mark.parametrize("idx", range(len(SHAPES)), ids=[shape_id(s) for s in SHAPES])
@pytest.mark.parametrize("kind", ["exact", "exact_zp"])
@pytest.mark.parametrize("fmt,kernel", kernel_params("qsi4c32", "qsi6c32"))
def test_block_formats_exact(ops, fmt, kernel, kind, idx):
    if fmt == "qsi6c32" and SHAPES[idx][2] > 1024:
        pytest.skip("qsi6c32 partial sums are exact integers in float32 only up to K = 1024")
    c = make_case(fmt, idx, kind)
    # all partial sums are integers below 2**24: qsi4c32 |q_a + 128| * 8 * K <= 255 * 8 * 8192;
    # qsi6c32 (u = q + 32 <= 63) 255 * 63 * 1024: every kernel is exact
    want = ((c["qa"].astype(np.int64) - c["zp"][:, None]) @ c["qw"].astype(np.int64).T).astype(np.float32)
    got = run(ops, c, kernel)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("idx", range(len(SHAPES)), ids=[shape_id(s) for s in SHAPES])
@pytest.mark.parametrize("kind", ["exact", "exact_zp"])
@pytest.mark.parametrize("kernel", kernel_params("qsi8cx"))
def test_qsi8cx_exact(ops, kernel, kind, idx):
    c = make_case("qsi8cx", idx, kind)
    # int32 dot minus zp * isum, converted once (round to nearest even, like numpy's cast)
    d = (c["qa"].astype(np.int64) - c["zp"][:, None]) @ c["qw"].astype(np.int64).T
    got = run(ops, c, kernel)
    np.testing.assert_array_equal(got, d.astype(np.float32))


# ---- (b) random cases ----------------------------------------------------------------------

@pytest.mark.parametrize("idx", range(len(SHAPES)), ids=[shape_id(s) for s in SHAPES])
@pytest.mark.parametrize("fmt,kernel", kernel_params("qsi4c32", "qsi6c32"))
def test_block_formats_random(ops, fmt, kernel, idx):
    c = make_case(fmt, idx, "random")
    got = run(ops, c, kernel).astype(np.float64)
    ref = reference(c)
    tol = tolerance(c)
    assert np.all(np.abs(got - ref) <= tol), f"max excess {np.max(np.abs(got - ref) - tol)}"
    scal = run(ops, c, SCALAR[fmt]).astype(np.float64)
    assert np.all(np.abs(got - scal) <= 2 * tol)


@pytest.mark.parametrize("idx", range(len(SHAPES)), ids=[shape_id(s) for s in SHAPES])
@pytest.mark.parametrize("kernel", kernel_params("qsi8cx"))
def test_qsi8cx_random(ops, kernel, idx):
    c = make_case("qsi8cx", idx, "random")
    got = run(ops, c, kernel)
    # exact int32 dot, then (scale * s) * float(d): three roundings -> within 4u |ref|;
    # and the same float expression as the scalar kernel -> bit-exact with it
    ref = reference(c)
    assert np.all(np.abs(got - ref) <= 4 * U * np.abs(ref) + 1e-30)
    np.testing.assert_array_equal(got, run(ops, c, SCALAR["qsi8cx"]))


@pytest.mark.parametrize("m,n,k,bl", [(1, 67, 576, 32), (5, 96, 1536, 64), (67, 33, 2048, 128),
                                      (16, 17, 512, 256)])
@pytest.mark.parametrize("kernel", kernel_params("qsi4c32"))
def test_qsi4c32_float_path(ops, kernel, m, n, k, bl):
    """f32 activations through the C quantizer: same as numpy quantize + reference."""
    rng = np.random.default_rng(m * n + k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    qw = rng.integers(-8, 8, (n, k)).astype(np.int8)
    qs, sc = pack_nibbles(qw), f32_to_bf16(rng.uniform(1e-3, 0.1, (n, k // bl)).astype(np.float32))
    w = _ext.QWeight("qsi4c32", qs, sc, bl)
    qa, scale, zp = quantize_qai8dx(x)
    c = dict(m=m, n=n, k=k, bl=bl, w=w, wdeq=dequantize_qsi4c32(qs, sc).astype(np.float64), qa=qa,
             scale=scale, zp=zp)
    got = ops.matmul(w, x, kernel=kernel).astype(np.float64)
    assert np.all(np.abs(got - reference(c)) <= tolerance(c))


# ---- (c) the output window and the clamp ----------------------------------------------------

@pytest.mark.parametrize("fmt", ["qsi4c32", "qsi6c32", "qsi8cx"])
@pytest.mark.parametrize("idx", [0, 2, 5, 11, 15], ids=[shape_id(SHAPES[i]) for i in [0, 2, 5, 11, 15]])
def test_output_window(ops, fmt, idx):
    c = make_case(fmt, idx, "random")
    m, n = c["m"], c["n"]
    for k in KERNELS:
        if k["format"] != fmt or not k["supported"]:
            continue
        want = run(ops, c, k["name"])
        big = np.full((m + 5, n + 37), 1234.5, np.float32)
        ops.matmul_lhs_into(c["w"], c["qa"], c["scale"], c["zp"], big, 2, 19, kernel=k["name"])
        inside = np.zeros(big.shape, bool)
        inside[2:2 + m, 19:19 + n] = True
        assert np.all(big[~inside] == np.float32(1234.5)), k["name"]
        np.testing.assert_array_equal(big[2:2 + m, 19:19 + n], want, err_msg=k["name"])
        # clamp: same values, clipped
        lo, hi = np.percentile(want, 25), np.percentile(want, 75)
        big2 = np.zeros((m, n), np.float32)
        ops.matmul_lhs_into(c["w"], c["qa"], c["scale"], c["zp"], big2, 0, 0, kernel=k["name"],
                            clamp=(lo, hi))
        np.testing.assert_array_equal(big2, np.clip(want, np.float32(lo), np.float32(hi)),
                                      err_msg=k["name"])


def test_weight_repacking_accounted():
    """A weight owns its row sums plus one shared repacked copy when a usable kernel repacks
    (docs/FORMAT.md: qsi4c32 p16 = panels of 16 rows, 8K bytes each, then 16 bf16 scales per
    panel and block)."""
    n, k = 66, 288   # 5 panels, the last one 2 rows
    qw = np.zeros((n, k), np.int8)
    w = _ext.QWeight("qsi4c32", pack_nibbles(qw), np.full((n, k // 32), 0x3F80, np.uint16), 32)
    repacks = any(kk["repacks_weights"] and kk["supported"] and kk["format"] == "qsi4c32" for kk in KERNELS)
    panels = (n + 15) // 16
    p16 = panels * 8 * k + 2 * 16 * panels * (k // 32)
    assert w.owned_bytes == 4 * n + (p16 if repacks else 0)
    assert w.reads_canonical == (not repacks)


# ---- (d) dispatch, forcing and logging -------------------------------------------------------

def test_dispatch_rule():
    """The table picks the highest-priority supported kernel with m_min <= M."""
    for fmt in ("qsi4c32", "qsi8cx"):
        usable = [k for k in KERNELS if k["format"] == fmt and k["supported"]]
        for m in (1, 2, 3, 4, 5, 16, 33, 128):
            cands = [k for k in usable if k["m_min"] <= m]
            best = max(cands, key=lambda k: k["priority"])
            assert _ext.selected_kernel(fmt, m) == best["name"], (fmt, m)


def _run_forced(env_kernel, code):
    env = dict(os.environ, PYKLEI_KERNEL=env_kernel, PYKLEI_LOG="kernels")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=ROOT)


FORCE_CODE = """
import numpy as np
from pyklei import _ext
from pyklei.formats import pack_nibbles
w = _ext.QWeight("qsi4c32", pack_nibbles(np.ones((8, 64), np.int8)), np.full((8, 2), 0x3F80, np.uint16), 32)
y = _ext.Ops(1).matmul(w, np.ones((M, 64), np.float32))
print(_ext.selected_kernel("qsi4c32", M))
"""


@pytest.mark.parametrize("isa", sorted({k["isa"] for k in KERNELS}))
def test_forcing(isa):
    ks = [k for k in KERNELS if k["isa"] == isa and k["format"] == "qsi4c32"]
    if not ks:
        pytest.skip(f"no qsi4c32 kernel for {isa}")
    if not ks[0]["supported"]:
        r = _run_forced(isa, FORCE_CODE.replace("M", "1"))
        assert r.returncode != 0 and "this CPU cannot run" in r.stderr, r.stderr
        return
    for m in (1, 64):
        r = _run_forced(isa, FORCE_CODE.replace("M", str(m)))
        assert r.returncode == 0, r.stderr
        name = r.stdout.strip()
        assert name in {k["name"] for k in ks}
        assert f"pyklei: matmul qsi4c32 m={m} n=8 k=64 -> {name}" in r.stderr, r.stderr
        assert "pyklei: CPU features:" in r.stderr


def test_forcing_by_name_and_unknown():
    k = next(k for k in KERNELS if k["supported"] and k["format"] == "qsi4c32" and k["isa"] != "scalar")
    r = _run_forced(k["name"], FORCE_CODE.replace("M", "64"))
    assert r.returncode == 0 and r.stdout.strip() == k["name"], r.stderr
    r = _run_forced("no_such_kernel", FORCE_CODE.replace("M", "1"))
    assert r.returncode != 0 and "no kernel or ISA named 'no_such_kernel'" in r.stderr


def test_kernel_argument_errors(ops):
    c = make_case("qsi4c32", 0, "random")
    with pytest.raises(_ext.KernelError, match="no kernel named"):
        run(ops, c, "qai8dx_qsi4c32_bogus")
    with pytest.raises(_ext.KernelError, match="qsi8cx weights, not qsi4c32"):
        run(ops, c, SCALAR["qsi8cx"])
    for k in KERNELS:
        if not k["supported"]:
            with pytest.raises(_ext.KernelError, match="cannot run"):
                run(ops, c, k["name"])


# ---- (e) the C activation quantizer ----------------------------------------------------------

def quantizer_rows():
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(4096) * 3, np.zeros(64), -np.abs(rng.standard_normal(100)) - 0.1,
            np.abs(rng.standard_normal(100)) + 1, np.array([1e20, -3e19, 0.5, 7.0]),
            np.array([3.5]), np.array([-2.0]), np.array([0.0]), rng.standard_normal(15),
            rng.standard_normal(17), rng.standard_normal(31), rng.standard_normal(33) - 5,
            np.array([0.5, 1.5, 2.5, -0.5, 255.0, 127.5, -127.5]),     # ties at inv == 1
            rng.standard_normal(2048) * 1e-38,                             # subnormal range
            np.concatenate([rng.standard_normal(1000), [1e4]]),           # one outlier
            np.full(33, -7.25), np.linspace(-1, 3, 577)]
    return [r.astype(np.float32) for r in rows]


@pytest.mark.parametrize("impl", quant_params())
@pytest.mark.parametrize("i", range(len(quantizer_rows())))
def test_quantizer_byte_exact(i, impl):
    x = quantizer_rows()[i][None, :]
    with np.errstate(all="ignore"):
        q0, s0, z0 = quantize_qai8dx(x)
    q1, s1, z1 = _ext.quantize_qai8dx(x, impl)
    np.testing.assert_array_equal(q1, q0)
    np.testing.assert_array_equal(s1.view(np.uint32), s0.view(np.uint32))
    np.testing.assert_array_equal(z1, z0)


@pytest.mark.parametrize("impl", quant_params())
def test_quantizer_many_rows(impl):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((67, 1000)) * rng.uniform(1e-3, 1e3, (67, 1))).astype(np.float32)
    x[3] = 0
    x[5] = -np.abs(x[5])
    x[7, :] = np.float32(1.5) * np.arange(1000, dtype=np.float32) / np.float32(999) * 170  # many ties
    q0, s0, z0 = quantize_qai8dx(x)
    q1, s1, z1 = _ext.quantize_qai8dx(x, impl)
    np.testing.assert_array_equal(q1, q0)
    np.testing.assert_array_equal(s1, s0)
    np.testing.assert_array_equal(z1, z0)


def test_reference_helpers_consistent():
    """Sanity of the test's own reference: unpack(pack(q)) and bf16 1.0."""
    q = np.random.default_rng(1).integers(-8, 8, (3, 64)).astype(np.int8)
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(q)), q)
    assert bf16_to_f32(np.array([0x3F80], np.uint16))[0] == 1.0


# ---- (f) the self-check of the dispatch table ------------------------------------------------

SEED_MODEL = str(SEED)
TEST_ENV = ("PYKLEI_KERNEL", "PYKLEI_LOG", "PYKLEI_TEST_BREAK_KERNEL")


def _run_env(env, code, *args):
    """`code` in a fresh interpreter (the table is built once per process) with `env` set and
    the other pyklei switches cleared."""
    full = {k: v for k, v in os.environ.items() if k not in TEST_ENV}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=full, capture_output=True,
                          text=True, cwd=ROOT)


def _warning(name, stderr):
    """max |diff| of the self-check warning naming kernel `name`, or None."""
    m = re.search(rf"^pyklei: warning: kernel {re.escape(name)} failed its self-check against the scalar "
                  r"kernel \(.*max \|diff\| (\S+) at .*; using the next best$", stderr, re.M)
    return float(m.group(1)) if m else None


def _require_test_hook():
    """Skips (fails under PYKLEI_REQUIRE_TEST_HOOKS=1) unless pyklei._ext is a test build: one
    linked with tests/kernels/c/pk_testhook.c, whose hook the dispatcher refers to weakly (NULL, and
    PYKLEI_TEST_BREAK_KERNEL without effect, in a plain build)."""
    import ctypes
    try:
        ctypes.CDLL(_ext.__file__).pk_test_hook_kernels_to_check
        return
    except AttributeError:
        pass
    msg = (f"{_ext.__file__} has no test hook: rebuild it with PYKLEI_TEST_HOOKS=1 python setup.py "
           "build_ext --inplace --force (scripts/test.sh does)")
    if os.environ.get("PYKLEI_REQUIRE_TEST_HOOKS") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def _gemv():
    """The kernel the table picks here for qsi4c32 at m = 1 (skips where that is the scalar one)."""
    name = _ext.selected_kernel("qsi4c32", 1)
    if name == SCALAR["qsi4c32"]:
        pytest.skip("the dispatch picks the scalar kernel here: no SIMD kernel to check")
    return name


MODEL_CODE = """
import sys
import numpy as np
from pyklei import _ext
from pyklei.runtime.model import Model
m = Model(sys.argv[1], n_threads=1, n_ctx=64)
steps = [m.eval([1])] + [m.step(t) for t in (5, 9, 200, 33)]   # decode: 2 rows (qai8dx2) a matmul
prefill = m.logits([1, 5, 9, 200, 33])                          # prefill: 10 rows
np.savez(sys.argv[2], steps=np.stack(steps), prefill=prefill)
print(_ext.selected_kernel("qsi4c32", 1), _ext.selected_kernel("qsi4c32", 2))
"""


def test_selfcheck_drops_broken_kernel(tmp_path):
    """The decode kernel, broken on purpose (every output + 1 + |output|), fails the self-check:
    a warning names it, the table takes the next best kernel, and the model's logits equal those
    of a run on the scalar kernels."""
    _require_test_hook()
    name = _gemv()
    assert _ext.selected_kernel("qsi4c32", 2) == name   # the model's decode matmuls would use it
    broken = _run_env({"PYKLEI_TEST_BREAK_KERNEL": name}, MODEL_CODE, SEED_MODEL, tmp_path / "broken.npz")
    assert broken.returncode == 0, broken.stderr
    diff = _warning(name, broken.stderr)
    assert diff is not None, broken.stderr
    # the self-check saw the corruption itself (tests/kernels/c/test_matmul.c also runs the broken copy
    # directly), so passing here is not vacuous: it would have been used for every decode step
    assert diff >= 0.9, broken.stderr
    assert name not in broken.stdout.split()
    scalar = _run_env({"PYKLEI_KERNEL": "scalar"}, MODEL_CODE, SEED_MODEL, tmp_path / "scalar.npz")
    assert scalar.returncode == 0 and "warning" not in scalar.stderr, scalar.stderr
    got, want = np.load(tmp_path / "broken.npz"), np.load(tmp_path / "scalar.npz")
    for key in ("steps", "prefill"):
        # kernels differ from the scalar one only in float32 summation order: K <= 128 here, a
        # few blocks per dot; the broken kernel would be off by more than 1 per matmul output
        tol = 1e-4 * float(np.abs(want[key]).max())
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=tol, err_msg=key)


def test_selfcheck_forced_broken_kernel_leaves_scalar():
    """PYKLEI_KERNEL forcing only the broken kernel: it is dropped all the same, and the scalar
    kernel takes every qsi4c32 call."""
    _require_test_hook()
    name = _gemv()
    r = _run_env({"PYKLEI_KERNEL": name, "PYKLEI_TEST_BREAK_KERNEL": name},
                 "from pyklei import _ext\n"
                 "print(_ext.selected_kernel('qsi4c32', 1), _ext.selected_kernel('qsi4c32', 64))")
    assert r.returncode == 0, r.stderr
    assert _warning(name, r.stderr) is not None, r.stderr
    assert r.stdout.split() == [SCALAR["qsi4c32"]] * 2


SELECTED_CODE = """
from pyklei import _ext
print(" ".join(_ext.selected_kernel(f, m) for f in ("qsi4c32", "qsi6c32", "qsi8cx")
               for m in (1, 2, 3, 4, 6, 8, 16, 64)))
"""


def test_selfcheck_logs_passed_kernels():
    """PYKLEI_LOG=kernels: one line lists the kernels that passed, among them every SIMD kernel
    the table picks; no warning on this CPU."""
    r = _run_env({"PYKLEI_LOG": "kernels"}, SELECTED_CODE)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    lines = re.findall(r"^pyklei: self-check passed \(([0-9.]+) ms\): (.*)$", r.stderr, re.M)
    assert len(lines) == 1, r.stderr
    chosen = set(r.stdout.split()) - set(SCALAR.values())
    if chosen:
        assert chosen <= set(lines[0][1].split(", ")), r.stderr
    else:
        assert lines[0][1] == "no SIMD kernel in the table"


# ---- (g) one row, any M: decode equals prefill bit for bit ----------------------------------

@pytest.mark.parametrize("fmt", ["qsi4c32", "qsi6c32", "qsi8cx"])
@pytest.mark.parametrize("activations", ["qai8dx", "qai8dx2"])
def test_row_result_independent_of_m(fmt, activations):
    """A row's output must not depend on how many rows share the call: the runtime computes a
    prompt's last token in a prefill (GEMM) and, after prefix reuse, alone (GEMV); seeded
    sampling must give the same text both ways. Holds where the dispatch picks the AVX-512
    p16/p4 kernels (one micro-kernel for all M); the AVX2 and Arm GEMV and GEMM still round
    differently."""
    packed = {k["name"] for k in KERNELS if k["repacks_weights"]}
    if _ext.selected_kernel(fmt, 1) not in packed or _ext.selected_kernel(fmt, 64) not in packed:
        pytest.skip("the dispatch's GEMV and GEMM here are separate kernels")
    rng = np.random.default_rng(7)
    n, k = 100, 576
    wf = rng.standard_normal((n, k)).astype(np.float32)
    if fmt in ("qsi4c32", "qsi6c32"):
        qs, sc = (quantize_qsi4c32(wf, 32) if fmt == "qsi4c32" else quantize_qsi6c32(wf))
        w = _ext.QWeight(fmt, qs, sc, 32)
    else:
        qs, sc = quantize_qsi8cx(wf)
        w = _ext.QWeight("qsi8cx", qs, sc)
    x = rng.standard_normal((40, k)).astype(np.float32)
    x[:, 3] *= 50.0   # an outlier channel, as in real activations
    ops = _ext.Ops(2, activations)
    full = ops.matmul(w, x)
    for m in (1, 2, 3, 5, 7, 13):
        np.testing.assert_array_equal(ops.matmul(w, x[-m:]), full[-m:], err_msg=f"m={m}")


@pytest.mark.parametrize("fmt", ["qsi4c32", "qsi6c32"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
def test_two_plane_sum_in_kernel(m, fmt):
    """qai8dx2 through the dispatch (kernels with run_pairs sum the planes themselves) equals,
    bit for bit, the two plane products computed as plain rows and added in float32."""
    rng = np.random.default_rng(m)
    n, k = 70, 320
    wf = rng.standard_normal((n, k)).astype(np.float32)
    qs, sc = quantize_qsi4c32(wf, 32) if fmt == "qsi4c32" else quantize_qsi6c32(wf)
    w = _ext.QWeight(fmt, qs, sc, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 80.0
    q, s, z = quantize_qai8dx2(x)
    planes = _ext.Ops(2, "qai8dx").matmul_lhs(w, q, s, z)
    np.testing.assert_array_equal(_ext.Ops(2, "qai8dx2").matmul(w, x), planes[0::2] + planes[1::2])
