# cython: language_level=3, boundscheck=False, wraparound=False
"""pyklei._ext: the Python face of the C kernel layer (pyklei_ext/ops, pyklei_ext/isa).

Kernels run with the GIL released on a persistent thread pool owned by an `Ops` object.
"""
from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t, uint32_t

import numpy as np

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
    ctypedef struct pk_kernel:
        const char *name
        const char *isa
        pk_format fmt
        uint32_t features
        int priority
        int m_min
        int n_step
        void *rhs_pack
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
    void pk_ctx_set_act_planes(pk_ctx *ctx, int planes)
    int pk_ctx_act_planes(const pk_ctx *ctx)
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
        if activations not in ("qai8dx", "qai8dx2"):
            raise ValueError(f"activations must be 'qai8dx' or 'qai8dx2', got {activations!r}")
        _init()
        self.ctx = pk_ctx_create(n_threads)
        if self.ctx == NULL:
            raise KernelError(_last_error())
        pk_ctx_set_act_planes(self.ctx, 2 if activations == "qai8dx2" else 1)

    @property
    def activations(self):
        """'qai8dx' (one int8 plane per row) or 'qai8dx2' (plus a residual plane)."""
        return "qai8dx2" if pk_ctx_act_planes(self.ctx) == 2 else "qai8dx"

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
        cdef const pk_kernel *kern = _kernel(kernel)
        cdef int rc
        with nogil:
            rc = pk_matmul_lhs(self.ctx, &w.rhs, &lhs, &out[row0, col0], out.shape[1], lo, hi, kern)
        if rc != 0:
            raise KernelError(_last_error())
        return out


# ---- the Llama forward pass (pyklei_ext/model) ---------------------------------------------

cdef extern from "ops/pk_nn.h":
    ctypedef struct pk_tensor:
        pk_format type
        int n, k, bl
        const void *data
        const void *scales
    ctypedef void (*pk_f16_to_f32_fn)(size_t n, const uint16_t *x, float *out) noexcept nogil
    pk_f16_to_f32_fn pk_f16_to_f32_pick(const char **isa)
    pk_f16_to_f32_fn pk_f16_to_f32_for_isa(const char *isa)
    ctypedef enum pk_kv_type:
        PK_KV_F32, PK_KV_F16, PK_KV_Q8
    ctypedef struct pk_kv_head:
        pk_kv_type type
        const void *k
        const void *v
        const uint16_t *k_scale
        const uint16_t *v_scale
        pk_f16_to_f32_fn f16
    void pk_kv_q8_row(int hd, const float *x, int8_t *out, uint16_t *scale) nogil
    void pk_attend_group(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                         float *scores, size_t ld_scores, float *out) nogil
    void pk_attend_group_reference(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv,
                                   float scale, float *scores, size_t ld_scores, float *out) nogil
    void pk_attend_rows(int rows, const int *n_pos, int group, int hd, const float *q, size_t ldq,
                        const pk_kv_head *kv, float scale, float *scores, size_t ld_scores, float *out,
                        size_t ldo) nogil
    int PK_KV_BLOCK
    int PK_KV_Q8_GROUP
    int PK_ATTEND_ROWS

cdef extern from "model/pk_llama.h":
    ctypedef struct pk_llama_hparams:
        int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff
        float rms_eps, rope_theta
        int n_ctx, n_batch, kv_type, n_seq
    ctypedef struct pk_llama_layer:
        const float *attn_norm
        const float *ffn_norm
        const pk_rhs *wq
        const pk_rhs *wk
        const pk_rhs *wv
        const pk_rhs *wo
        const pk_rhs *w_gate
        const pk_rhs *w_up
        const pk_rhs *w_down
    ctypedef struct pk_rotation:
        int n, m, p
        const char *fwht_isa
    int pk_rotation_init(pk_rotation *r, int n, const float *signs, const float *mix)
    int pk_rotation_use(pk_rotation *r, const char *isa)
    void pk_rotate_row(const pk_rotation *r, int transpose, float *x, float *scratch) nogil
    ctypedef struct pk_llama_weights:
        pk_tensor tok_embd
        const pk_rhs *lm_head
        const float *output_norm
        const float *rope_freqs
        const pk_llama_layer *layers
        pk_rotation rot_ffn_down
        pk_rotation rot_output
    ctypedef struct pk_llama:
        pass
    pk_llama *pk_llama_create(const pk_llama_hparams *hp, const pk_llama_weights *w, pk_ctx *ctx)
    void pk_llama_destroy(pk_llama *model)
    size_t pk_llama_state_bytes(const pk_llama *model)
    int pk_llama_forward(pk_llama *model, const int32_t *tokens, int n, int pos0, float *logits,
                         int all_logits, volatile int *interrupt) nogil
    int pk_llama_forward_batch(pk_llama *model, int n, const int32_t *tokens, const int32_t *seq,
                               const int32_t *pos, int n_out, const int32_t *out_rows, float *logits,
                               volatile int *interrupt) nogil
    int pk_llama_kv_copy(pk_llama *model, int src, int dst, int n) nogil
    ctypedef enum pk_llama_stat:
        PK_LLAMA_STAT_LM_HEAD_IN
        PK_LLAMA_STATS
    const char *const pk_llama_stat_names[]
    size_t pk_llama_stat_section(const pk_llama_hparams *hp, int l, pk_llama_stat s, size_t *len)
    int pk_llama_stats_enable(pk_llama *model, int on)
    const double *pk_llama_stats(const pk_llama *model, size_t *len, long *rows, long *lm_rows)
    void pk_llama_profile_enable(pk_llama *model, int on)
    int pk_llama_profile(const pk_llama *model, const char *const **names, const double **seconds, long *calls)

from libc.stdlib cimport calloc, free

cdef const float *_f32_ptr(object arr, list keep, Py_ssize_t n, str what) except NULL:
    cdef const float[::1] v = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    if v.shape[0] != n:
        raise ValueError(f"{what} has {v.shape[0]} values, expected {n}")
    keep.append(v)
    return &v[0]


# The fields of pk_llama_layer (model/pk_llama.h) a layer dict gives LlamaRuntime: the norms'
# gains (f32 [n_embd]), then the linears (QWeight). Model fills them by the `field` column of the
# tensor table (pyklei/formats/llama_tensors.py); tests/test_llama_tensors.py checks the two agree.
LAYER_NORM_FIELDS = ("attn_norm", "ffn_norm")
LAYER_LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# The sections of the activation statistics, in the C layout's order (pk_llama.h, pk_llama_stat)
STAT_SECTIONS = tuple(pk_llama_stat_names[i].decode() for i in range(<int>PK_LLAMA_STATS))


cdef class LlamaRuntime:
    """The C forward pass over borrowed weights; owns the KV cache and scratch buffers.

    Not safe to call from two threads at once (the caller serialises)."""
    cdef pk_llama *model
    cdef pk_llama_layer *layers
    cdef list _keep
    cdef readonly Ops ops
    cdef readonly int n_vocab, n_ctx, n_batch, n_seq
    cdef volatile int interrupt
    cdef pk_llama_hparams hp

    def __cinit__(self, Ops ops, dict hp, tuple tok_embd, QWeight lm_head, output_norm,
                  rope_freqs, list layers, dict rotations=None):
        cdef pk_llama_hparams h
        cdef pk_llama_weights w
        cdef int i
        cdef QWeight qw
        cdef const uint8_t[::1] emb_bytes
        self._keep = [ops, lm_head]
        self.ops = ops
        h.n_vocab, h.n_embd, h.n_layer = hp["n_vocab"], hp["n_embd"], hp["n_layer"]
        h.n_head, h.n_head_kv, h.head_dim, h.n_ff = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["n_ff"]
        h.rms_eps, h.rope_theta = hp["rms_eps"], hp["rope_theta"]
        h.n_ctx, h.n_batch = hp["n_ctx"], hp["n_batch"]
        kv_types = {"f32": PK_KV_F32, "f16": PK_KV_F16, "q8": PK_KV_Q8}   # pyklei.options' names
        if hp.get("kv_cache", "f32") not in kv_types:
            raise ValueError(f"kv_cache must be one of {', '.join(kv_types)}, not {hp['kv_cache']!r}")
        h.kv_type = kv_types[hp.get("kv_cache", "f32")]
        h.n_seq = hp.get("n_seq", 1)
        if len(layers) != h.n_layer:
            raise ValueError(f"{len(layers)} layers given, hparams say {h.n_layer}")
        # token embedding table: (dtype name, data array, scales array or None, block size)
        dtype, data, scales, bl = tok_embd
        if dtype not in FORMATS:
            raise ValueError(f"unsupported embedding type {dtype!r}")
        emb_bytes = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._keep.append(emb_bytes)
        w.tok_embd.type = FORMATS[dtype]
        w.tok_embd.n, w.tok_embd.k, w.tok_embd.bl = h.n_vocab, h.n_embd, bl
        w.tok_embd.data = &emb_bytes[0]
        w.tok_embd.scales = NULL
        if scales is not None:
            sc = np.ascontiguousarray(scales).reshape(-1).view(np.uint8)
            self._keep.append(sc)
            emb_bytes = sc
            w.tok_embd.scales = &emb_bytes[0]
        w.lm_head = &lm_head.rhs
        w.output_norm = _f32_ptr(output_norm, self._keep, h.n_embd, "output_norm")
        w.rope_freqs = NULL if rope_freqs is None else _f32_ptr(rope_freqs, self._keep, h.head_dim // 2, "rope_freqs")
        self.layers = <pk_llama_layer *>calloc(h.n_layer, sizeof(pk_llama_layer))
        if self.layers == NULL:
            raise MemoryError()
        for i, L in enumerate(layers):
            if set(L) != set(LAYER_NORM_FIELDS + LAYER_LINEAR_FIELDS):
                raise ValueError(f"layer {i} gives fields {sorted(L)}, pk_llama_layer has "
                                 f"{sorted(LAYER_NORM_FIELDS + LAYER_LINEAR_FIELDS)}")
            self.layers[i].attn_norm = _f32_ptr(L["attn_norm"], self._keep, h.n_embd, f"blk.{i}.attn_norm")
            self.layers[i].ffn_norm = _f32_ptr(L["ffn_norm"], self._keep, h.n_embd, f"blk.{i}.ffn_norm")
            for name in LAYER_LINEAR_FIELDS:
                qw = L[name]
                self._keep.append(qw)
            self.layers[i].wq = &(<QWeight>L["wq"]).rhs
            self.layers[i].wk = &(<QWeight>L["wk"]).rhs
            self.layers[i].wv = &(<QWeight>L["wv"]).rhs
            self.layers[i].wo = &(<QWeight>L["wo"]).rhs
            self.layers[i].w_gate = &(<QWeight>L["w_gate"]).rhs
            self.layers[i].w_up = &(<QWeight>L["w_up"]).rhs
            self.layers[i].w_down = &(<QWeight>L["w_down"]).rhs
        w.layers = self.layers
        # rotations: {"ffn_down" | "output": (signs [n], mix [m, m])}, checked by the loader
        w.rot_ffn_down.n = 0
        w.rot_output.n = 0
        for key, rot in (rotations or {}).items():
            if key not in ("ffn_down", "output"):
                raise ValueError(f"unknown rotation {key!r}")
            signs = np.ascontiguousarray(rot[0], np.float32).reshape(-1)
            n = signs.shape[0]
            mix = np.ascontiguousarray(rot[1], np.float32)
            if mix.ndim != 2 or mix.shape[0] != mix.shape[1] or mix.shape[0] * (n // max(mix.shape[0], 1)) != n:
                raise ValueError(f"rotation {key}: mix of shape {list(mix.shape)} does not fit size {n}")
            if pk_rotation_init(&w.rot_ffn_down if key == "ffn_down" else &w.rot_output, n,
                                _f32_ptr(signs, self._keep, n, f"rotation {key} signs"),
                                _f32_ptr(mix, self._keep, mix.size, f"rotation {key} mix")):
                raise ValueError(_last_error())
        self.model = pk_llama_create(&h, &w, ops.ctx)
        if self.model == NULL:
            raise ValueError(_last_error())
        self.n_vocab, self.n_ctx, self.n_batch, self.n_seq = h.n_vocab, h.n_ctx, h.n_batch, h.n_seq
        self.hp = h

    def __dealloc__(self):
        if self.model != NULL:
            pk_llama_destroy(self.model)
        free(self.layers)

    @property
    def state_bytes(self):
        """Bytes of the KV cache and scratch buffers."""
        return pk_llama_state_bytes(self.model)

    def collect_stats(self, bint on=True):
        """Start (zeroing) or stop accumulating per-channel sums of squares of every linear
        layer's input (for importance-weighted quantization)."""
        if pk_llama_stats_enable(self.model, on) != 0:
            raise MemoryError(_last_error())

    def stats(self):
        """(float64 sums of squares, rows per layer, rows at the lm_head), or None if off.
        Layout per layer: [attn_in n_embd][attn_out n_head*head_dim][ffn_in n_embd][down_in n_ff],
        then [lm_head_in n_embd]."""
        cdef size_t n
        cdef long rows, lm_rows
        cdef const double *p = pk_llama_stats(self.model, &n, &rows, &lm_rows)
        if p == NULL:
            return None
        return np.asarray(<const double[:n]>p).copy(), rows, lm_rows

    def stats_sections(self):
        """({input name: float64 sums of squares [n_layer, width]}, rows per layer, rows at the
        lm_head), or None if off: stats() cut by the C layout (pk_llama_stat_section). Names are
        pk_llama.h's, as the tensor table (pyklei/formats/llama_tensors.py) calls each linear's
        input; "lm_head_in" has one row."""
        got = self.stats()
        if got is None:
            return None
        flat, rows, lm_rows = got
        cdef size_t off, width
        cdef int s, l
        out = {}
        for s in range(PK_LLAMA_STATS):
            layers = 1 if s == PK_LLAMA_STAT_LM_HEAD_IN else self.hp.n_layer
            parts = []
            for l in range(layers):
                off = pk_llama_stat_section(&self.hp, l, <pk_llama_stat>s, &width)
                parts.append(flat[off:off + width])
            out[pk_llama_stat_names[s].decode()] = np.stack(parts)
        return out, rows, lm_rows

    def profile_ops(self, bint on=True):
        """Start (zeroing) or stop timing each operation of the forward pass."""
        pk_llama_profile_enable(self.model, on)

    def op_profile(self):
        """({operation: seconds summed}, forward calls) since profile_ops(True)."""
        cdef const char *const *names
        cdef const double *sec
        cdef long calls
        cdef int n = pk_llama_profile(self.model, &names, &sec, &calls)
        return {names[i].decode(): sec[i] for i in range(n)}, calls

    def request_interrupt(self):
        """Makes a running forward() stop at the next layer boundary (thread-safe)."""
        self.interrupt = 1

    def forward(self, tokens, int pos0, bint all_logits=False):
        """Runs tokens at positions pos0.. and returns float32 logits: [n, n_vocab] when
        all_logits, else [n_vocab] for the last token. Returns None if interrupted."""
        cdef const int32_t[::1] tv = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        cdef int n = tv.shape[0]
        if n == 0:
            raise ValueError("no tokens to evaluate")
        shape = [n, self.n_vocab] if all_logits else [self.n_vocab]
        out = np.empty(shape, np.float32)
        cdef float[::1] ov = out.reshape(-1)
        cdef int rc
        self.interrupt = 0
        with nogil:
            rc = pk_llama_forward(self.model, &tv[0], n, pos0, &ov[0], all_logits, &self.interrupt)
        if rc == 1:
            return None
        if rc != 0:
            raise ValueError(_last_error())
        return out

    def forward_batch(self, tokens, seq, pos, out_rows):
        """Runs row i = (tokens[i], slot seq[i], position pos[i]) for all rows in one pass (the
        rules: pk_llama.h) and returns float32 logits [len(out_rows), n_vocab] for the rows
        out_rows (ascending). Returns None if interrupted."""
        cdef const int32_t[::1] tv = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] sv = np.ascontiguousarray(seq, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] pv = np.ascontiguousarray(pos, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] rv = np.ascontiguousarray(out_rows, dtype=np.int32).reshape(-1)
        cdef int n = tv.shape[0], n_out = rv.shape[0]
        if n == 0:
            raise ValueError("no rows to evaluate")
        if sv.shape[0] != n or pv.shape[0] != n:
            raise ValueError(f"{n} tokens but {sv.shape[0]} sequence ids and {pv.shape[0]} positions")
        out = np.empty((n_out, self.n_vocab), np.float32)
        cdef float[:, ::1] ov = out
        cdef float *optr = &ov[0, 0] if n_out else NULL
        cdef const int32_t *rptr = &rv[0] if n_out else NULL
        cdef int rc
        self.interrupt = 0
        with nogil:
            rc = pk_llama_forward_batch(self.model, n, &tv[0], &sv[0], &pv[0], n_out, rptr, optr,
                                        &self.interrupt)
        if rc == 1:
            return None
        if rc != 0:
            raise ValueError(_last_error())
        return out

    def kv_copy(self, int src, int dst, int n):
        """Copies the K/V of positions [0, n) of slot src into slot dst."""
        if pk_llama_kv_copy(self.model, src, dst, n) != 0:
            raise ValueError(_last_error())

def rotate_rows(signs, mix, x, bint transpose=False, impl=None):
    """x [rows, n] float32 -> x @ Q (or x @ Q^T) by the C rotation (pk_rotate.h); tests.
    impl: the FWHT's ISA tag ("scalar", "avx2", "avx512vnni", "neon"); None: the one the
    forward pass picks (KernelError if this CPU cannot run impl)."""
    cdef pk_rotation r
    cdef list keep = []
    s = np.ascontiguousarray(signs, np.float32).reshape(-1)
    mx = np.ascontiguousarray(mix, np.float32)
    cdef int n = s.shape[0]
    if pk_rotation_init(&r, n, _f32_ptr(s, keep, n, "signs"), _f32_ptr(mx, keep, mx.size, "mix")):
        raise ValueError(_last_error())
    if impl is not None and pk_rotation_use(&r, impl.encode()):
        raise KernelError(_last_error())
    if mx.shape != (r.m, r.m):
        raise ValueError(f"mix has shape {list(mx.shape)}, size {n} needs [{r.m}, {r.m}]")
    cdef float[:, ::1] out = np.array(x, dtype=np.float32, order="C", ndmin=2)
    if out.shape[1] != n:
        raise ValueError(f"rows have {out.shape[1]} values, the rotation {n}")
    cdef float[::1] scratch = np.empty(n, np.float32)
    cdef Py_ssize_t i
    with nogil:
        for i in range(out.shape[0]):
            pk_rotate_row(&r, transpose, &out[i, 0], &scratch[0])
    return np.asarray(out)


def rotation_fwht_isa():
    """The ISA tag of the FWHT the rotations run on this CPU (PYKLEI_KERNEL heeded)."""
    cdef int n = 64
    cdef pk_rotation r
    cdef float[::1] ones = np.ones(n, np.float32)
    cdef float[::1] one = np.ones(1, np.float32)
    if pk_rotation_init(&r, n, &ones[0], &one[0]):
        raise ValueError(_last_error())
    return r.fwht_isa.decode()


def f16_reader_isa():
    """The ISA tag of the conversion an f16 KV cache is read with on this CPU (PYKLEI_KERNEL
    heeded; a PYKLEI_LOG=kernels line names it)."""
    cdef const char *isa = NULL
    pk_f16_to_f32_pick(&isa)
    return isa.decode()


def _position_blocked(a):
    """Rows a [n, m] of K (or a q8 cache's K scales) as the cache holds them (pk_nn.h):
    [ceil(n/16)][m][16], the last block padded with zeros."""
    n, nb = a.shape[0], (a.shape[0] + PK_KV_BLOCK - 1) // PK_KV_BLOCK
    pad = np.zeros((nb * PK_KV_BLOCK, a.shape[1]), a.dtype)
    pad[:n] = a
    return np.ascontiguousarray(pad.reshape(nb, PK_KV_BLOCK, a.shape[1]).transpose(0, 2, 1))


def kv_q8_rows(x):
    """Rows x [n, hd] (hd a multiple of 32) as a q8 KV cache holds them, by pk_kv_q8_row:
    (int8 [n, hd], f16 scales [n, hd // 32]) (tests)."""
    cdef float[:, ::1] xv = np.ascontiguousarray(x, np.float32)
    cdef int n = xv.shape[0], hd = xv.shape[1], r
    if hd % PK_KV_Q8_GROUP:
        raise ValueError(f"head size {hd} is not a multiple of {PK_KV_Q8_GROUP}")
    q = np.empty((n, hd), np.int8)
    sc = np.empty((n, hd // PK_KV_Q8_GROUP), np.float16)
    cdef int8_t[:, ::1] qv = q
    cdef uint16_t[:, ::1] sv = sc.view(np.uint16)
    with nogil:
        for r in range(n):
            pk_kv_q8_row(hd, &xv[r, 0], &qv[r, 0], &sv[r, 0])
    return q, sc


def attend_group(q, k, v, impl=None, n_pos=None):
    """Causal attention of the query heads q [group, hd] that share one K/V head, over the
    cache rows k, v [n, hd] (float32: an f32 cache; float16: an f16 cache; a pair (int8 [n, hd],
    float16 scales [n, hd // 32]) each: a q8 cache, as kv_q8_rows makes it), by pk_attend_group
    with scale 1/sqrt(hd) (tests). q [rows, group, hd] with n_pos (one count per row, each <=
    n): rows of one sequence by pk_attend_rows, row r over positions [0, n_pos[r]). impl:
    "reference" runs pk_attend_group_reference row by row; else, for an f16 or q8 cache, the
    conversion's ISA tag ("scalar", "avx2", "avx512vnni", "neon"; None: the one the forward
    pass picks; KernelError if this CPU cannot run it). -> float32, q's shape"""
    qa = np.asarray(q, np.float32)
    one = qa.ndim == 2
    cdef float[:, :, ::1] qv = np.ascontiguousarray(qa[None] if one else qa)
    cdef pk_kv_type kt
    if isinstance(k, tuple) or isinstance(v, tuple):
        if not (isinstance(k, tuple) and isinstance(v, tuple) and len(k) == len(v) == 2):
            raise ValueError("a q8 cache is given as (int8 values, float16 scales) for both k and v")
        (ka, ks), (va, vs) = [(np.asarray(a), np.asarray(b)) for a, b in (k, v)]
        if ka.dtype != np.int8 or va.dtype != np.int8 or ks.dtype != np.float16 or vs.dtype != np.float16:
            raise ValueError("a q8 cache holds int8 values and float16 scales")
        if ka.ndim != 2 or ka.shape[1] % PK_KV_Q8_GROUP or ks.shape != (ka.shape[0], ka.shape[1] // PK_KV_Q8_GROUP) \
                or vs.shape != ks.shape:
            raise ValueError(f"q8 shapes: values {list(ka.shape)}, scales {list(ks.shape)} and {list(vs.shape)}")
        kt = PK_KV_Q8
    else:
        ka, va = np.asarray(k), np.asarray(v)
        if ka.dtype not in (np.float32, np.float16) or va.dtype != ka.dtype:
            raise ValueError(f"k and v must both be float32 or both float16, got {ka.dtype} and {va.dtype}")
        kt = PK_KV_F16 if ka.dtype == np.float16 else PK_KV_F32
    cdef int rows = qv.shape[0], group = qv.shape[1], hd = qv.shape[2], n = ka.shape[0]
    if ka.ndim != 2 or ka.shape != va.shape or ka.shape[1] != hd or n < 1 or group < 1 or rows < 1:
        raise ValueError(f"shapes: q {list(qa.shape)}, k {list(ka.shape)}, v {list(va.shape)}")
    cdef int[::1] npos = np.full(rows, n, np.int32) if n_pos is None else np.ascontiguousarray(n_pos, np.int32)
    if npos.shape[0] != rows or min(npos) < 1 or max(npos) > n:
        raise ValueError(f"n_pos must hold {rows} counts in [1, {n}]")
    cdef pk_kv_head kv
    cdef const char *tag = NULL
    kv.type = kt
    kv.f16 = NULL
    if kt != PK_KV_F32 and impl != "reference":
        kv.f16 = pk_f16_to_f32_pick(&tag) if impl is None else pk_f16_to_f32_for_isa(impl.encode())
        if kv.f16 == NULL:
            raise KernelError(f"no f16 conversion {impl!r} on this CPU")
    kb, vc = _position_blocked(ka), np.ascontiguousarray(va)
    keep = [kb, vc]
    kv.k_scale = kv.v_scale = NULL
    if kt == PK_KV_Q8:
        keep += [_position_blocked(ks).view(np.uint16), np.ascontiguousarray(vs).view(np.uint16)]
        kv.k_scale = <const uint16_t *><size_t>keep[2].ctypes.data
        kv.v_scale = <const uint16_t *><size_t>keep[3].ctypes.data
    kv.k = <const void *><size_t>kb.ctypes.data
    kv.v = <const void *><size_t>vc.ctypes.data
    cdef float[:, ::1] scores = np.empty((PK_ATTEND_ROWS * group, n), np.float32)
    cdef float[:, :, ::1] out = np.empty((rows, group, hd), np.float32)
    cdef float scale = 1.0 / np.sqrt(np.float32(hd))
    cdef bint ref = impl == "reference"
    cdef int r
    with nogil:
        if ref:
            for r in range(rows):
                pk_attend_group_reference(group, hd, npos[r], &qv[r, 0, 0], &kv, scale, &scores[0, 0], n,
                                          &out[r, 0, 0])
        else:
            pk_attend_rows(rows, &npos[0], group, hd, &qv[0, 0, 0], group * hd, &kv, scale,
                           &scores[0, 0], n, &out[0, 0, 0], group * hd)
    return np.asarray(out)[0] if one else np.asarray(out)
