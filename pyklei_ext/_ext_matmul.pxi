# pyklei._ext (_ext.pyx includes this): formats, kernels and their dispatch, activation
# quantizers, prepared weights (QWeight) and the matmul entry points (Ops).

cdef extern from "contract/pk_cpu.h":
    uint32_t pk_cpu_features()
    const char *pk_cpu_features_string(uint32_t features)

cdef extern from "contract/pk_format.h":
    ctypedef enum pk_format:
        PK_FMT_QUANT_COUNT
        PK_FMT_COUNT
    const char *pk_format_name(int fmt)
    int pk_format_quantized(int fmt)

cdef extern from "ops/pk_matmul.h":
    ctypedef struct pk_lhs:
        int m, k
        const int8_t *q
        size_t ld
        const float *scale
        const int32_t *zp
        const int32_t *bsum32
        const float *bscale
    ctypedef enum pk_act:
        PK_ACT_QAI8DX
        PK_ACT_QAI8DX2
        PK_ACT_QSI8D32
    ctypedef struct pk_kernel:
        const char *name
        const char *isa
        pk_format fmt
        uint32_t features
        int priority
        int m_min
        int n_step
        void *rhs_pack
        void *run_d32
    ctypedef struct pk_rhs:
        pk_format fmt
        int n, k, bl
    ctypedef struct pk_ctx:
        pass
    int pk_kernel_count()
    const pk_kernel *pk_kernel_at(int i)
    const pk_kernel *pk_kernel_by_name(const char *name)
    int pk_kernel_supported(const pk_kernel *kern)
    int pk_dispatch_init()
    const char *pk_last_error()
    const pk_kernel *pk_dispatch_select(pk_format fmt, int m)
    int pk_rhs_prepare(pk_rhs *rhs, pk_format fmt, int n, int k, int bl, const void *qs,
                       const void *scales, const pk_kernel *extra) nogil
    void pk_rhs_release(pk_rhs *rhs)
    size_t pk_rhs_owned_bytes(const pk_rhs *rhs)
    int pk_rhs_needs_canonical(const pk_rhs *rhs)
    void pk_quantize_qai8dx_row(int k, const float *x, int8_t *q, float *scale, int32_t *zp) nogil
    int pk_quantize_qai8dx_row_impl(const char *impl, int k, const float *x, int8_t *q, float *scale,
                                    int32_t *zp) nogil
    void pk_quantize_qai8dx2_row(int k, const float *x, float *r, int8_t *q1, float *s1, int32_t *z1,
                                 int8_t *q2, float *s2, int32_t *z2) nogil
    void pk_quantize_qsi8d32_row(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum) nogil
    int pk_quantize_qsi8d32_row_impl(const char *impl, int k, const float *x, int8_t *q, float *bscale,
                                     int32_t *bsum) nogil
    void pk_ctx_set_activations(pk_ctx *ctx, pk_act act)
    pk_act pk_ctx_activations(const pk_ctx *ctx)
    pk_ctx *pk_ctx_create(int n_threads)
    void pk_ctx_destroy(pk_ctx *ctx)
    int pk_ctx_threads(const pk_ctx *ctx)
    int pk_matmul_f32(pk_ctx *ctx, const pk_rhs *rhs, int m, const float *x, size_t ldx,
                      float *dst, size_t ldd, float clamp_lo, float clamp_hi,
                      const pk_kernel *kern) nogil
    int pk_matmul_lhs(pk_ctx *ctx, const pk_rhs *rhs, const pk_lhs *lhs, float *dst, size_t ldd,
                      float clamp_lo, float clamp_hi, const pk_kernel *kern) nogil

cdef extern from "<math.h>":
    float INFINITY

# Every format of the C layer (contract/pk_format.h), name -> id: the quantized weight formats
# (ids < PK_FMT_QUANT_COUNT, those of pyklei.formats.registry's c_id), then the plain types.
FORMATS = {pk_format_name(i).decode(): i for i in range(PK_FMT_COUNT)}
_FORMAT_NAMES = {i: name for name, i in FORMATS.items()}
QUANTIZED_FORMATS = tuple(n for n, i in FORMATS.items() if pk_format_quantized(i))


class KernelError(RuntimeError):
    """A kernel cannot be used here (unknown name, CPU lacks the feature, bad forcing)."""


cdef str _last_error():
    return pk_last_error().decode("utf-8", "replace")


cdef int _init() except -1:
    if pk_dispatch_init() != 0:
        raise KernelError(_last_error())
    return 0


def cpu_features():
    """The CPU features the kernels may use, e.g. ['avx2', 'avx512vnni']."""
    s = pk_cpu_features_string(pk_cpu_features()).decode()
    return s.split() if s else []


def kernels():
    """Every kernel compiled in, with whether this CPU can run it."""
    out = []
    for i in range(pk_kernel_count()):
        k = pk_kernel_at(i)
        out.append({
            "name": k.name.decode(), "isa": k.isa.decode(), "format": _FORMAT_NAMES[k.fmt],
            "supported": bool(pk_kernel_supported(k)), "priority": k.priority,
            "m_min": k.m_min, "n_step": k.n_step, "repacks_weights": k.rhs_pack != NULL,
            "takes_qsi8d32": k.run_d32 != NULL,
        })
    return out


def selected_kernel(str fmt, int m):
    """Name of the kernel the dispatch table picks for weight format `fmt` and M rows."""
    _init()
    if fmt not in QUANTIZED_FORMATS:   # as before the plain types joined FORMATS
        raise KeyError(fmt)
    cdef const pk_kernel *k = pk_dispatch_select(FORMATS[fmt], m)
    if k == NULL:
        raise KernelError(_last_error())
    return k.name.decode()


cdef const pk_kernel *_kernel(object name) except? NULL:
    if name is None:
        return NULL
    cdef const pk_kernel *k = pk_kernel_by_name(name.encode())
    if k == NULL:
        raise KernelError(f"no kernel named {name!r}")
    if not pk_kernel_supported(k):
        raise KernelError(f"this CPU ({' '.join(cpu_features()) or 'baseline'}) cannot run {name}")
    return k


def quantize_qai8dx(x, impl=None):
    """C activation quantizer: float32 [M, K] -> (q int8 [M, K], scale f32 [M], zp int32 [M]).

    impl (tests): force "scalar", "avx2" or "avx512"; None picks the best for this CPU."""
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, dtype=np.float32)
    cdef Py_ssize_t m = xv.shape[0], k = xv.shape[1], i
    q = np.empty((m, k), np.int8)
    scale = np.empty(m, np.float32)
    zp = np.empty(m, np.int32)
    cdef int8_t[:, ::1] qv = q
    cdef float[::1] sv = scale
    cdef int32_t[::1] zv = zp
    if k == 0:
        raise ValueError("cannot quantize rows of length 0")
    cdef bytes name
    cdef const char *cname
    cdef int rc = 0
    if impl is None:
        with nogil:
            for i in range(m):
                pk_quantize_qai8dx_row(<int>k, &xv[i, 0], &qv[i, 0], &sv[i], &zv[i])
    else:
        name = impl.encode()
        cname = name
        with nogil:
            for i in range(m):
                rc |= pk_quantize_qai8dx_row_impl(cname, <int>k, &xv[i, 0], &qv[i, 0], &sv[i], &zv[i])
        if rc:
            raise KernelError(f"quantizer {impl!r} is not available on this CPU")
    return q, scale, zp


def quantize_qai8dx2(x):
    """C two-plane quantizer: float32 [M, K] -> (q int8 [2M, K], scale [2M], zp [2M])."""
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, dtype=np.float32)
    cdef Py_ssize_t m = xv.shape[0], k = xv.shape[1], i
    if k == 0:
        raise ValueError("cannot quantize rows of length 0")
    q = np.empty((2 * m, k), np.int8)
    scale = np.empty(2 * m, np.float32)
    zp = np.empty(2 * m, np.int32)
    r = np.empty(k, np.float32)
    cdef int8_t[:, ::1] qv = q
    cdef float[::1] sv = scale
    cdef int32_t[::1] zv = zp
    cdef float[::1] rv = r
    with nogil:
        for i in range(m):
            pk_quantize_qai8dx2_row(<int>k, &xv[i, 0], &rv[0], &qv[2 * i, 0], &sv[2 * i], &zv[2 * i],
                                    &qv[2 * i + 1, 0], &sv[2 * i + 1], &zv[2 * i + 1])
    return q, scale, zp


def quantize_qsi8d32(x, impl=None):
    """C block quantizer: float32 [M, K] (K a multiple of 32) -> (q int8 [M, K],
    scale f32 [M, K/32], the block sums of q int32 [M, K/32]); q and scale byte-exact with
    pyklei.formats.quantize_qsi8d32.

    impl (tests): force "scalar", "avx2" or "avx512"; None picks the best for this CPU."""
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, dtype=np.float32)
    cdef Py_ssize_t m = xv.shape[0], k = xv.shape[1], i
    if k == 0 or k % 32:
        raise ValueError(f"qsi8d32 rows must be a positive multiple of 32 long, got K={k}")
    q = np.empty((m, k), np.int8)
    scale = np.empty((m, k // 32), np.float32)
    bsum = np.empty((m, k // 32), np.int32)
    cdef int8_t[:, ::1] qv = q
    cdef float[:, ::1] sv = scale
    cdef int32_t[:, ::1] bv = bsum
    cdef bytes name
    cdef const char *cname
    cdef int rc = 0
    if m == 0:
        return q, scale, bsum
    if impl is None:
        with nogil:
            for i in range(m):
                pk_quantize_qsi8d32_row(<int>k, &xv[i, 0], &qv[i, 0], &sv[i, 0], &bv[i, 0])
    else:
        name = impl.encode()
        cname = name
        with nogil:
            for i in range(m):
                rc |= pk_quantize_qsi8d32_row_impl(cname, <int>k, &xv[i, 0], &qv[i, 0], &sv[i, 0], &bv[i, 0])
        if rc:
            raise KernelError(f"quantizer {impl!r} is not available on this CPU")
    return q, scale, bsum


# The activation schemes of Ops (pk_matmul.h, pk_act), name -> id (not ACTIVATIONS: that name,
# in _ext_llama.pxi, holds the MLP's activation functions).
ACT_SCHEMES = {"qai8dx": PK_ACT_QAI8DX, "qai8dx2": PK_ACT_QAI8DX2, "qsi8d32": PK_ACT_QSI8D32}


# The canonical arrays of each quantized format (docs/FORMAT.md): the scales' dtype, and
# K = row bytes // chunk * k_per_chunk; fixed_bl: the only block size (0: any, the C side
# checks it; -1: one f32 scale per row).
#                  scale dtype  k_per_chunk  chunk  fixed_bl
_QWEIGHT_LAYOUT = {
    "qsi4c32": (np.uint16,   2,           1,     0),     # nibbles [N][K/2], bf16 [N][K/bl]
    "qsi6c32": (np.uint16,   32,          24,    32),    # 24 bytes per 32 k, bf16 [N][K/32]
    "qsi8cx":  (np.float32,  1,           1,     -1),    # int8 [N][K], f32 [N]
}
assert set(_QWEIGHT_LAYOUT) == set(QUANTIZED_FORMATS)


cdef class QWeight:
    """A quantized weight [N, K] prepared for the kernels (arrays borrowed, kept alive here)."""
    cdef pk_rhs rhs
    cdef object _qs, _scales
    cdef readonly str format
    cdef readonly int n, k, block_size

    def __cinit__(self, str fmt, qs, scales, int block_size=32, extra_kernel=None):
        if fmt not in QUANTIZED_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {sorted(QUANTIZED_FORMATS)}")
        _init()
        scale_dtype, k_per_bytes, chunk, fixed_bl = _QWEIGHT_LAYOUT[fmt]
        cdef const uint8_t[:, ::1] qv = (np.ascontiguousarray(qs).view(np.uint8) if fixed_bl == -1
                                         else np.ascontiguousarray(qs, dtype=np.uint8))
        cdef const uint8_t[::1] sv
        cdef int n = qv.shape[0], k
        if qv.shape[1] % chunk:
            raise ValueError(f"{fmt} rows must be whole {chunk}-byte chunks, got {qv.shape[1]} bytes")
        k = qv.shape[1] // chunk * k_per_bytes
        if fixed_bl == -1:        # per-row scale: one block of K
            block_size = k
        elif fixed_bl and block_size != fixed_bl:
            raise ValueError(f"{fmt} block size must be {fixed_bl}, got {block_size}")
        s = np.ascontiguousarray(scales, dtype=scale_dtype)
        if fixed_bl == -1:
            ok = s.ndim == 1 and s.shape[0] == n
        else:
            ok = s.ndim == 2 and s.shape[0] == n and s.shape[1] * block_size == k
        if not ok:
            raise ValueError(f"{fmt} scales shape {tuple(s.shape)} does not match [{n}, {k}] "
                             f"with block size {block_size}")
        sv = s.reshape(-1).view(np.uint8)
        self._scales = s
        self._qs = qv
        cdef const pk_kernel *extra = _kernel(extra_kernel)
        if pk_rhs_prepare(&self.rhs, FORMATS[fmt], n, k, block_size, &qv[0, 0], &sv[0], extra) != 0:
            raise ValueError(_last_error())
        self.format, self.n, self.k, self.block_size = fmt, n, k, block_size

    def __dealloc__(self):
        pk_rhs_release(&self.rhs)

    @property
    def owned_bytes(self):
        """Bytes this weight owns beyond the borrowed arrays (row sums, repacked copies)."""
        return pk_rhs_owned_bytes(&self.rhs)

    @property
    def reads_canonical(self):
        """False when every kernel the dispatch can pick reads a repacked copy: the borrowed
        arrays are then no longer read by matmuls (their pages may be released)."""
        return bool(pk_rhs_needs_canonical(&self.rhs))


cdef class Ops:
    """A thread pool and scratch space for matmuls; one per model (not shared between threads)."""
    cdef pk_ctx *ctx

    def __cinit__(self, int n_threads=1, str activations="qai8dx"):
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        if activations not in ACT_SCHEMES:
            raise ValueError(f"activations must be one of {', '.join(ACT_SCHEMES)}, got {activations!r}")
        _init()
        self.ctx = pk_ctx_create(n_threads)
        if self.ctx == NULL:
            raise KernelError(_last_error())
        pk_ctx_set_activations(self.ctx, ACT_SCHEMES[activations])

    @property
    def activations(self):
        """'qai8dx' (one int8 plane per row), 'qai8dx2' (plus a residual plane) or 'qsi8d32'
        (symmetric int8, a scale per block of 32)."""
        cdef pk_act a = pk_ctx_activations(self.ctx)
        return next(name for name, v in ACT_SCHEMES.items() if v == a)

    def __dealloc__(self):
        if self.ctx != NULL:
            pk_ctx_destroy(self.ctx)

    @property
    def n_threads(self):
        return pk_ctx_threads(self.ctx)

    def matmul(self, QWeight w, x, out=None, clamp=None, kernel=None):
        """y[M, N] = clamp(qai8dx(x[M, K]) @ W^T) in float32."""
        xa = np.ascontiguousarray(x, dtype=np.float32)
        if xa.ndim == 1:
            xa = xa.reshape(1, -1)
        cdef const float[:, ::1] xv = xa
        if xv.shape[1] != w.k:
            raise ValueError(f"x has K={xv.shape[1]}, the weight expects K={w.k}")
        cdef int m = xv.shape[0]
        if out is None:
            out = np.empty((m, w.n), np.float32)
        cdef float[:, ::1] ov = out
        if ov.shape[0] != m or ov.shape[1] != w.n:
            raise ValueError(f"out must have shape ({m}, {w.n})")
        cdef float lo = -INFINITY, hi = INFINITY
        if clamp is not None:
            lo, hi = clamp
        cdef const pk_kernel *kern = _kernel(kernel)
        cdef int rc
        if m == 0:
            return out
        with nogil:
            rc = pk_matmul_f32(self.ctx, &w.rhs, m, &xv[0, 0], xv.shape[1], &ov[0, 0], ov.shape[1],
                               lo, hi, kern)
        if rc != 0:
            raise KernelError(_last_error())
        return out

    def matmul_lhs(self, QWeight w, q, scale, zp, kernel=None):
        """Like matmul, from activations already in qai8dx (q int8 [M, K], scale [M], zp [M])."""
        cdef const int8_t[:, ::1] qv = np.ascontiguousarray(q, dtype=np.int8)
        cdef const float[::1] sv = np.ascontiguousarray(scale, dtype=np.float32)
        cdef const int32_t[::1] zv = np.ascontiguousarray(zp, dtype=np.int32)
        cdef int m = qv.shape[0]
        if qv.shape[1] != w.k or sv.shape[0] != m or zv.shape[0] != m:
            raise ValueError("q must be [M, K] with scale and zp of length M")
        out = np.empty((m, w.n), np.float32)
        cdef float[:, ::1] ov = out
        cdef pk_lhs lhs
        lhs.m, lhs.k, lhs.q, lhs.ld, lhs.scale, lhs.zp = m, w.k, &qv[0, 0], qv.shape[1], &sv[0], &zv[0]
        lhs.bsum32 = NULL   # the kernels sum the rows themselves
        lhs.bscale = NULL   # qai8dx
        cdef const pk_kernel *kern = _kernel(kernel)
        cdef int rc
        if m == 0:
            return out
        with nogil:
            rc = pk_matmul_lhs(self.ctx, &w.rhs, &lhs, &ov[0, 0], ov.shape[1], -INFINITY, INFINITY, kern)
        if rc != 0:
            raise KernelError(_last_error())
        return out

    def matmul_lhs_d32(self, QWeight w, q, bscale, kernel=None):
        """Like matmul, from activations already in qsi8d32 (q int8 [M, K], bscale f32
        [M, K/32]); the kernel must take them (pk_kernel.run_d32), else KernelError."""
        cdef const int8_t[:, ::1] qv = np.ascontiguousarray(q, dtype=np.int8)
        cdef const float[:, ::1] sv = np.ascontiguousarray(bscale, dtype=np.float32)
        cdef int m = qv.shape[0]
        if qv.shape[1] != w.k or w.k % 32 or sv.shape[0] != m or sv.shape[1] != w.k // 32:
            raise ValueError("q must be [M, K] (K a multiple of 32) with bscale [M, K/32]")
        out = np.empty((m, w.n), np.float32)
        cdef float[:, ::1] ov = out
        cdef pk_lhs lhs
        lhs.m, lhs.k, lhs.q, lhs.ld, lhs.scale, lhs.zp = m, w.k, &qv[0, 0], qv.shape[1], NULL, NULL
        lhs.bsum32 = NULL   # the kernels sum the blocks themselves
        lhs.bscale = &sv[0, 0]
        cdef const pk_kernel *kern = _kernel(kernel)
        cdef int rc
        if m == 0:
            return out
        with nogil:
            rc = pk_matmul_lhs(self.ctx, &w.rhs, &lhs, &ov[0, 0], ov.shape[1], -INFINITY, INFINITY, kern)
        if rc != 0:
            raise KernelError(_last_error())
        return out

    def matmul_lhs_into(self, QWeight w, q, scale, zp, float[:, ::1] out, int row0, int col0,
                        kernel=None, clamp=None):
        """Test hook: matmul_lhs writing into out[row0:row0+M, col0:col0+N] of a larger array
        (row stride out.shape[1]), so tests can check that nothing outside is touched."""
        cdef const int8_t[:, ::1] qv = np.ascontiguousarray(q, dtype=np.int8)
        cdef const float[::1] sv = np.ascontiguousarray(scale, dtype=np.float32)
        cdef const int32_t[::1] zv = np.ascontiguousarray(zp, dtype=np.int32)
        cdef int m = qv.shape[0]
        if qv.shape[1] != w.k or sv.shape[0] != m or zv.shape[0] != m:
            raise ValueError("q must be [M, K] with scale and zp of length M")
        if m == 0 or row0 < 0 or col0 < 0 or row0 + m > out.shape[0] or col0 + w.n > out.shape[1]:
            raise ValueError("the [M, N] window does not fit in out")
        cdef float lo = -INFINITY, hi = INFINITY
        if clamp is not None:
            lo, hi = clamp
        cdef pk_lhs lhs
        lhs.m, lhs.k, lhs.q, lhs.ld, lhs.scale, lhs.zp = m, w.k, &qv[0, 0], qv.shape[1], &sv[0], &zv[0]
        lhs.bsum32 = NULL   # the kernels sum the rows themselves
        lhs.bscale = NULL   # qai8dx
        cdef const pk_kernel *kern = _kernel(kernel)
        cdef int rc
        with nogil:
            rc = pk_matmul_lhs(self.ctx, &w.rhs, &lhs, &out[row0, col0], out.shape[1], lo, hi, kern)
        if rc != 0:
            raise KernelError(_last_error())
        return out
