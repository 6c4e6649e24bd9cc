# pyklei._ext (_ext.pyx includes this): the C ops of ops/pk_nn.h and ops/pk_rotate.h (declared
# in _ext_llama.pxi) as tests reach them: the rotation, the f16 reader, q8 KV rows, attention.

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


def attention_bf16_runs():
    """Whether this CPU runs the bf16 attention kernels (AVX-512 BF16); elsewhere a bf16 cache
    read runs the reference's arithmetic."""
    return bool(pk_attend_bf16_runs())


def attention_bf16_pick(kv_type="f16", log=True):
    """Whether the forward pass reads a cache of kv_type ("f32", "f16", "q8", "bf16") with bf16 dot
    products here (pk_attend_bf16_pick: PYKLEI_ATTENTION and the CPU; with log, a
    PYKLEI_LOG=kernels line says which); ValueError for a PYKLEI_ATTENTION other than bf16 or f32."""
    cdef pk_kv_type kt = {"f32": PK_KV_F32, "f16": PK_KV_F16, "q8": PK_KV_Q8, "bf16": PK_KV_BF16}[kv_type]
    cdef int on = pk_attend_bf16_pick(kt, 1 if log else 0)
    if on < 0:
        raise ValueError(_last_error())
    return bool(on)


def _position_blocked(a):
    """Rows a [n, m] of K (or a q8 cache's K scales) as the cache holds them (pk_nn.h):
    [ceil(n/16)][m][16], the last block padded with zeros."""
    n, nb = a.shape[0], (a.shape[0] + PK_KV_BLOCK - 1) // PK_KV_BLOCK
    pad = np.zeros((nb * PK_KV_BLOCK, a.shape[1]), a.dtype)
    pad[:n] = a
    return np.ascontiguousarray(pad.reshape(nb, PK_KV_BLOCK, a.shape[1]).transpose(0, 2, 1))


def kv_bf16_round(x):
    """x (float32) rounded to bf16 as a bf16 KV cache holds it (pk_kv_bf16_round: to nearest
    even, an f32 subnormal to a signed zero), the bits as uint16 (tests)."""
    cdef float[::1] xv = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.empty(xv.shape[0], np.uint16)
    cdef uint16_t[::1] ov = out
    cdef Py_ssize_t i
    with nogil:
        for i in range(xv.shape[0]):
            ov[i] = pk_kv_bf16_round(xv[i])
    return out.reshape(np.shape(x))


def _bf16_pairs(k, v):
    """Rows k, v [n, hd] of bf16 bits as a bf16 cache holds them (contract/pk_kv.h): K's
    blocks [ceil(n/16)][hd/2][16] pairs of dimensions, V [ceil(n/2)][hd] pairs of positions,
    zeros past n."""
    n, hd = k.shape
    nb = (n + PK_KV_BLOCK - 1) // PK_KV_BLOCK
    kp = np.zeros((nb * PK_KV_BLOCK, hd), np.uint16)
    kp[:n] = k
    kp = kp.reshape(nb, PK_KV_BLOCK, hd // 2, 2).transpose(0, 2, 1, 3)
    vp = np.zeros((n + n % 2, hd), np.uint16)
    vp[:n] = v
    vp = vp.reshape(-1, 2, hd).transpose(0, 2, 1)
    return np.ascontiguousarray(kp), np.ascontiguousarray(vp)


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


def attend_group(q, k, v, impl=None, n_pos=None, lo=None, ring=0, bf16=False, cache=None):
    """Causal attention of the query heads q [group, hd] that share one K/V head, over the
    cache rows k, v [n, hd] (float32: an f32 cache; float16: an f16 cache; a pair (int8 [n, hd],
    float16 scales [n, hd // 32]) each: a q8 cache, as kv_q8_rows makes it), by pk_attend_group
    with scale 1/sqrt(hd) (tests). q [rows, group, hd] with n_pos (one count per row, each <=
    n): rows of one sequence by pk_attend_rows, row r over positions [0, n_pos[r]). lo (one
    start per row, lo[r] < n_pos[r]): sliding windows by pk_attend_rows_window, row r over
    [lo[r], n_pos[r]); ring > 0 (a multiple of 512, = n): the cache holds position p at row
    p % ring, so n_pos may pass n (not with impl="reference"). impl:
    "reference" runs pk_attend_group_reference row by row; else, for an f16 or q8 cache, the
    conversion's ISA tag ("scalar", "avx2", "avx512vnni", "neon"; None: the one the forward
    pass picks; KernelError if this CPU cannot run it). bf16: an f16, q8 or bf16 cache's dot products
    in bf16 (pk_kv_head.dot_bf16; the AVX-512 BF16 kernels where attention_bf16_runs(), else
    the reference's same arithmetic). cache="bf16": k, v float32 rows held as a bf16 cache holds
    them (kv_bf16_round, in its pairs' order). -> float32, q's shape"""
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
        if cache not in (None, "bf16") or (cache == "bf16" and ka.dtype != np.float32):
            raise ValueError(f"cache={cache!r}: None, or \"bf16\" with float32 rows")
        kt = PK_KV_BF16 if cache == "bf16" else PK_KV_F16 if ka.dtype == np.float16 else PK_KV_F32
    cdef int rows = qv.shape[0], group = qv.shape[1], hd = qv.shape[2], n = ka.shape[0]
    if ka.ndim != 2 or ka.shape != va.shape or ka.shape[1] != hd or n < 1 or group < 1 or rows < 1:
        raise ValueError(f"shapes: q {list(qa.shape)}, k {list(ka.shape)}, v {list(va.shape)}")
    cdef int[::1] npos = np.full(rows, n, np.int32) if n_pos is None else np.ascontiguousarray(n_pos, np.int32)
    if npos.shape[0] != rows or min(npos) < 1 or (max(npos) > n and not ring):
        raise ValueError(f"n_pos must hold {rows} counts in [1, {n}]")
    cdef int[::1] los = np.zeros(rows, np.int32) if lo is None else np.ascontiguousarray(lo, np.int32)
    cdef bint window = lo is not None or ring != 0
    if window and impl == "reference":
        raise ValueError("the reference runs whole rows: no lo or ring")
    if los.shape[0] != rows or any(not 0 <= los[r] < npos[r] for r in range(rows)):
        raise ValueError(f"lo must hold {rows} starts, each in [0, n_pos)")
    if ring and (ring < 0 or ring % PK_ATTEND_CHUNK or ring != n or any(npos[r] - los[r] > ring for r in range(rows))):
        raise ValueError(f"ring {ring}: a multiple of {PK_ATTEND_CHUNK} that is the cache's {n} rows, "
                         "each window within it")
    cdef int c_ring = ring
    cdef pk_kv_head kv
    cdef const char *tag = NULL
    kv.type = kt
    kv.f16 = NULL
    kv.dot_bf16 = 1 if bf16 else 0
    if (kt == PK_KV_F16 or kt == PK_KV_Q8) and impl != "reference":
        kv.f16 = pk_f16_to_f32_pick(&tag) if impl is None else pk_f16_to_f32_for_isa(impl.encode())
        if kv.f16 == NULL:
            raise KernelError(f"no f16 conversion {impl!r} on this CPU")
    if kt == PK_KV_BF16:
        if hd % 2:
            raise ValueError(f"a bf16 cache pairs dimensions: head size {hd} is odd")
        kb, vc = _bf16_pairs(kv_bf16_round(ka), kv_bf16_round(va))
    else:
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
        elif window:
            pk_attend_rows_window(rows, &los[0], &npos[0], c_ring, group, hd, &qv[0, 0, 0], group * hd, &kv,
                                  scale, &scores[0, 0], n, &out[0, 0, 0], group * hd)
        else:
            pk_attend_rows(rows, &npos[0], group, hd, &qv[0, 0, 0], group * hd, &kv, scale,
                           &scores[0, 0], n, &out[0, 0, 0], group * hd)
    return np.asarray(out)[0] if one else np.asarray(out)
