/* The fast Walsh-Hadamard transform of one group (ops/pk_rotate.c) with blocks of vectors in
 * registers, included by fwht_f16_qai8dx_x86_avx2.c (8 floats a vector, 8 vectors a block)
 * and fwht_f16_qai8dx_x86_avx512vnni.c (16 and 16). Before including, define
 *   F_TARGET       __attribute__((target(...)))
 *   F_V, F_W       the vector type (__m256, __m512) and its floats
 *   F_R            the vectors a block holds (8 or 16)
 *   F_LOAD, F_STORE, F_ADD, F_SUB   its unaligned load and store, add and subtract
 *   F_IN_VECTOR    F_V -> F_V: the stages h = 1 .. F_W / 2, whose pairs lie in one vector
 *   F_NAME         the transform's name, void F_NAME(int p, float *x)
 *
 * Bit-exact with pk_fwht_scalar: a block of up to F_R vectors is loaded, carried through up
 * to log2(F_R) stages and stored. The first pass takes the in-vector stages and
 * h = F_W .. F_W F_R / 2 on each F_W F_R values; each later pass the next log2(F_R) stages on
 * F_R vectors h apart. A block's stages are whole butterfly groups, so every value sees the
 * scalar loop's adds and subtracts in its order. The stage by stage loop before stored and
 * reloaded every vector once per stage: at p = 512 (SmolLM2's 1536 = 3 x 512) it took 1.5x
 * (AVX-512) and 2.7x (AVX2) the time. */

#define F_INLINE static inline __attribute__((always_inline)) F_TARGET

/* The R vectors at x + r * stride (R a constant where inlined): the in-vector stages first
 * if asked, then the log2(R) stages between the vectors. */
F_INLINE void fwht_block(float *x, size_t stride, const int R, const int in_vector) {
    F_V v[F_R];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        v[r] = F_LOAD(x + r * stride);
        if (in_vector) v[r] = F_IN_VECTOR(v[r]);
    }
#pragma GCC unroll 4
    for (int hh = 1; hh < R; hh *= 2)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            if (!(r & hh)) {
                const F_V a = v[r], b = v[r + hh];
                v[r] = F_ADD(a, b);
                v[r + hh] = F_SUB(a, b);
            }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) F_STORE(x + r * stride, v[r]);
}

/* Blocks of R vectors `stride` apart (R a power of two <= F_R), each a whole butterfly group
 * of its stages. */
F_TARGET static void fwht_blocks(float *x, int p, size_t stride, int R, int in_vector) {
    for (int b = 0; b < p; b += (int)stride * R)
        for (int off = 0; off < (int)stride; off += F_W) {
            float *y = x + b + off;
            switch (R) {
#define F_CASE(n)                                                   \
            case n:                                                 \
                if (in_vector) fwht_block(y, stride, n, 1);         \
                else fwht_block(y, stride, n, 0);                   \
                break;
            F_CASE(1) F_CASE(2) F_CASE(4) F_CASE(8)
#if F_R == 16
            F_CASE(16)
#endif
#undef F_CASE
            }
        }
}

F_TARGET static void F_NAME(int p, float *x) {
    if (p < F_W) {
        pk_fwht_scalar(p, x);
        return;
    }
    fwht_blocks(x, p, F_W, p >= F_W * F_R ? F_R : p / F_W, 1);
    for (int h = F_W * F_R; h < p; h *= F_R)
        fwht_blocks(x, p, (size_t)h, p / h >= F_R ? F_R : p / h, 0);
}

#undef F_INLINE
/* the parameters too, so that nothing after the include reads them by accident */
#undef F_TARGET
#undef F_V
#undef F_W
#undef F_R
#undef F_LOAD
#undef F_STORE
#undef F_ADD
#undef F_SUB
#undef F_IN_VECTOR
#undef F_NAME
