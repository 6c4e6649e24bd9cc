# pyklei._ext (_ext.pyx includes this): the converter's C helpers. pyklei.formats reaches them
# through pyklei/formats/_native.py and keeps its numpy reference for when the extension is not
# built (the converters import without it).

cdef extern from "ops/pk_weight_search.h":
    void pk_weight_search_blocks(size_t n_blocks, int bl, const float *x, const float *w,
                                 size_t w_period, int search, const float *divisors, int n_divisors,
                                 int qmin, int qmax, int8_t *q, uint16_t *scale_bits) noexcept nogil


def weight_search_blocks(xb, w, bint search, divisors, int qmin, int qmax):
    """pyklei.formats.qsi4c32._quantize_blocks in C, byte for byte: xb float32 [B, bl]
    (C-contiguous, finite), w None or float32 [P, bl] (block b weighted by row b % P), divisors
    float32 (search=False: the one divisor used) -> (q int8 [B, bl], scale bits uint16 [B]).
    Releases the GIL: threads may search disjoint row ranges side by side."""
    cdef const float[:, ::1] xv = np.ascontiguousarray(xb, dtype=np.float32)
    cdef const float[::1] dv = np.ascontiguousarray(divisors, dtype=np.float32).reshape(-1)
    cdef Py_ssize_t nb = xv.shape[0]
    cdef int bl = xv.shape[1]
    cdef const float[:, ::1] wv
    cdef const float *wp = NULL
    cdef size_t period = 1
    if not 0 < bl <= 1024:
        raise ValueError(f"block length {bl} is outside 1..1024")
    if dv.shape[0] < 1:
        raise ValueError("no candidate divisors")
    if w is not None:
        wv = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, bl)
        if wv.shape[0] < 1 or nb % wv.shape[0]:
            raise ValueError(f"weights of {wv.shape[0]} rows do not cycle over {nb} blocks")
        wp = &wv[0, 0]
        period = wv.shape[0]
    q = np.empty((nb, bl), np.int8)
    bits = np.empty(nb, np.uint16)
    cdef int8_t[:, ::1] qv = q
    cdef uint16_t[::1] bv = bits
    if nb:
        with nogil:
            pk_weight_search_blocks(nb, bl, &xv[0, 0], wp, period, search, &dv[0], dv.shape[0],
                                    qmin, qmax, &qv[0, 0], &bv[0])
    return q, bits
