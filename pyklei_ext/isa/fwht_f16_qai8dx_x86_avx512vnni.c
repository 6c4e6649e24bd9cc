/* The row helpers on x86 AVX-512 (the pk_isa_helpers record of tag avx512vnni,
 * contract/pk_kernel.h): the FWHT of the rotation (ops/pk_rotate.c), the f16 -> f32
 * conversion of the KV cache (ops/pk_f16.c) and the qai8dx and qsi8d32 row quantizers
 * (ops/pk_quantize.c), each bit-exact (the quantizers byte-exact) with the scalar record's
 * (isa/fwht_f16_qai8dx_scalar.c). */
#include "../contract/pk_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* the target of isa/matmul_x86_avx512vnni.c, whose tag and feature bit the record shares */
#define Z_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* f16 -> f32 (the f16 KV cache, ops/pk_f16.c), 16 per vcvtph2ps; the tail by a masked load
 * and store. Exact, as is every f16 -> f32 conversion. */
Z_TARGET static void pk_f16_to_f32_avx512(size_t n, const uint16_t *x, float *out) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))));
    if (i < n) {
        const __mmask16 mk = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, mk, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, x + i)));
    }
}

/* Fast Walsh-Hadamard transform of one group (ops/pk_rotate.c), bit-exact with
 * pk_fwht_scalar: every stage adds and subtracts the same pairs as the scalar loop, only
 * grouped differently. Up to 16 vectors are loaded into registers and carried through up to
 * four stages before they are stored: the in-vector stages (h = 1, 2, 4, 8) and h = 16 .. 128
 * on each block of 256 values, then h = 256 .. 2048 on 16 vectors 256 values apart, and so
 * on. A stage by stage loop, which stored and reloaded every vector once per stage from h = 16
 * on, took 1.5x the time at p = 512 (SmolLM2's 1536 = 3 x 512). Each block's stages are
 * complete butterfly groups, so the order of operations on every value is the scalar one's. */
Z_TARGET static inline __attribute__((always_inline)) __m512 fwht_in_vector(__m512 v) {
    /* the pairs inside one vector: permute lanes and add v * (+1 / -1), exact, so the fused
     * multiply-add rounds once, as a + b on the low lane of a pair and a - b on the high one */
    const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));                 /* h = 1 */
    v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));                 /* h = 2 */
    v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));           /* h = 4 */
    return _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));        /* h = 8 */
}

/* The R vectors at x + r * stride (R = 1, 2, 4, 8 or 16, a constant where inlined): the
 * in-vector stages first if asked, then the log2(R) stages between the vectors. */
Z_TARGET static inline __attribute__((always_inline)) void fwht_block(float *x, size_t stride, const int R,
                                                                         const int in_vector) {
    __m512 v[16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        v[r] = _mm512_loadu_ps(x + r * stride);
        if (in_vector) v[r] = fwht_in_vector(v[r]);
    }
#pragma GCC unroll 4
    for (int hh = 1; hh < R; hh *= 2)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            if (!(r & hh)) {
                const __m512 a = v[r], b = v[r + hh];
                v[r] = _mm512_add_ps(a, b);
                v[r + hh] = _mm512_sub_ps(a, b);
            }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(x + r * stride, v[r]);
}

Z_TARGET static void fwht_blocks(float *x, int p, size_t stride, int R, int in_vector) {
    /* blocks of R vectors `stride` apart, each a whole butterfly group of its stages */
    for (int b = 0; b < p; b += (int)stride * R)
        for (int off = 0; off < (int)stride; off += 16) {
            float *y = x + b + off;
            switch (R * 2 + in_vector) {
            case 3: fwht_block(y, stride, 1, 1); break;
            case 5: fwht_block(y, stride, 2, 1); break;
            case 9: fwht_block(y, stride, 4, 1); break;
            case 17: fwht_block(y, stride, 8, 1); break;
            case 33: fwht_block(y, stride, 16, 1); break;
            case 4: fwht_block(y, stride, 2, 0); break;
            case 8: fwht_block(y, stride, 4, 0); break;
            case 16: fwht_block(y, stride, 8, 0); break;
            default: fwht_block(y, stride, 16, 0); break;
            }
        }
}

Z_TARGET static void pk_fwht_avx512(int p, float *x) {
    if (p < 16) {
        pk_fwht_scalar(p, x);
        return;
    }
    fwht_blocks(x, p, 16, p >= 256 ? 16 : p / 16, 1);       /* h = 1 .. 128 */
    for (int h = 256; h < p; h *= 16)                       /* h .. 8 h */
        fwht_blocks(x, p, (size_t)h, p / h >= 16 ? 16 : p / h, 0);
}

/* ====================================================================================
 * qai8dx row quantizer, AVX-512 (F + BW): byte-exact with pk_quantize_qai8dx_row_scalar.
 * min/max in the scalar loop's semantics (min_ps(x, m) = x < m ? x : m); rint(x * inv) by
 * vcvtps2dq under the default round-to-nearest-even; no FMA; saturation = the clamp.
 * ==================================================================================== */
Z_TARGET static void pk_quantize_qai8dx_row_avx512(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
    __m512 vmn = _mm512_setzero_ps(), vmx = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        vmn = _mm512_min_ps(v, vmn);
        vmx = _mm512_max_ps(v, vmx);
    }
    const __mmask16 tm = (__mmask16)((1u << (k - i)) - 1);
    if (i < k) {   /* masked lanes load 0, which cannot move min(0, .) or max(0, .) */
        const __m512 v = _mm512_maskz_loadu_ps(tm, x + i);
        vmn = _mm512_min_ps(v, vmn);
        vmx = _mm512_max_ps(v, vmx);
    }
    const float mn = _mm512_reduce_min_ps(vmn), mx = _mm512_reduce_max_ps(vmx);
    const float inv = pk_qai8dx_params(mn, mx, scale, zp);
    const int32_t zi = *zp;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i vz = _mm512_set1_epi32(zi);
    int j = 0;
    for (; j + 16 <= k; j += 16) {
        const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), vinv)), vz);
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtsepi32_epi8(v));
    }
    if (j < k) {
        const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(tm, x + j), vinv)), vz);
        _mm512_mask_cvtsepi32_storeu_epi8(q + j, tm, v);
    }
}

/* qsi8d32 row quantizer, AVX-512 (F + BW): byte-exact with pk_quantize_qsi8d32_row_scalar
 * (the block's largest magnitude as its max loop finds it: max is exact and order-free on
 * numbers; vcvtps2dq = rint; |q| <= 127, so the narrowing truncates nothing). */
Z_TARGET static void pk_quantize_qsi8d32_row_avx512(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum) {
    for (int b = 0; b < k / 32; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 vinv = _mm512_set1_ps(pk_qsi8d32_params(amax, bscale + b));
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        bsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* The AVX-512 helpers use F + BW (+ VL) only; they sit under the avx512vnni tag and feature
 * bit, as the kernels of this file do. */
const pk_isa_helpers pk_helpers_x86_avx512vnni = {
    .isa = "avx512vnni",
    .features = PK_CPU_AVX512VNNI,
    .fwht = pk_fwht_avx512,
    .f16_to_f32 = pk_f16_to_f32_avx512,
    .quantize_qai8dx_row = pk_quantize_qai8dx_row_avx512,
    .quantize_qsi8d32_row = pk_quantize_qsi8d32_row_avx512,
};
#endif
