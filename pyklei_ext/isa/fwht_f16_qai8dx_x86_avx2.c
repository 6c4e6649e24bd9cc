/* The row helpers on x86 AVX2 + FMA + F16C (the pk_isa_helpers record of tag avx2,
 * contract/pk_kernel.h): the FWHT of the rotation (ops/pk_rotate.c), the f16 -> f32
 * conversion of the KV cache (ops/pk_f16.c) and the qai8dx and qsi8d32 row quantizers
 * (ops/pk_quantize.c), each bit-exact (the quantizers byte-exact) with the scalar record's
 * (isa/fwht_f16_qai8dx_scalar.c). */
#include "../contract/pk_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define Y_TARGET __attribute__((target("avx2,fma,f16c")))   /* as isa/matmul_x86_avx2.c */

/* The FWHT (x86_fwht_tmpl.h): the pairs inside one vector by permuting lanes and adding
 * v * (+1 / -1), exact, so the fused multiply-add rounds once, as a + b on the low lane of a
 * pair and a - b on the high one; then blocks of 8 vectors (of AVX2's 16 ymm registers). */
Y_TARGET static inline __attribute__((always_inline)) __m256 fwht_in_vector(__m256 v) {
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1));                  /* h = 1 */
    v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E));                  /* h = 2 */
    return _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 0x01));       /* h = 4 */
}

#define F_TARGET Y_TARGET
#define F_V __m256
#define F_W 8
#define F_R 8
#define F_LOAD _mm256_loadu_ps
#define F_STORE _mm256_storeu_ps
#define F_ADD _mm256_add_ps
#define F_SUB _mm256_sub_ps
#define F_IN_VECTOR fwht_in_vector
#define F_NAME pk_fwht_avx2
#include "x86_fwht_tmpl.h"

/* f16 -> f32 (the f16 KV cache, ops/pk_f16.c), 8 per vcvtph2ps (F16C). Exact, as is every
 * f16 -> f32 conversion; the tail goes through a zero-padded vector so that every value takes
 * the same instruction (a NaN is quieted the same way as in the vector part). */
Y_TARGET static void pk_f16_to_f32_avx2(size_t n, const uint16_t *x, float *out) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    if (i < n) {
        uint16_t h[8] = {0};
        float f[8];
        memcpy(h, x + i, sizeof(uint16_t) * (n - i));
        _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
        memcpy(out + i, f, sizeof(float) * (n - i));
    }
}

/* qai8dx row quantizer, AVX2: byte-exact with pk_quantize_qai8dx_row_scalar (same min/max
 * semantics, vcvtps2dq = rint under round-to-nearest-even, no FMA, packs = the clamp). */
Y_TARGET static void pk_quantize_qai8dx_row_avx2(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
    __m256 vmn = _mm256_setzero_ps(), vmx = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vmn = _mm256_min_ps(v, vmn);
        vmx = _mm256_max_ps(v, vmx);
    }
    float lmn[8], lmx[8];
    _mm256_storeu_ps(lmn, vmn);
    _mm256_storeu_ps(lmx, vmx);
    float mn = 0.0f, mx = 0.0f;
    for (int j = 0; j < 8; j++) {
        mn = lmn[j] < mn ? lmn[j] : mn;
        mx = lmx[j] > mx ? lmx[j] : mx;
    }
    for (; i < k; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    const float inv = pk_qai8dx_params(mn, mx, scale, zp);
    const int32_t zi = *zp;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i vz = _mm256_set1_epi32(zi), perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int j = 0;
    for (; j + 32 <= k; j += 32) {
        __m256i v[4];
        for (int t = 0; t < 4; t++)
            v[t] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * t), vinv)), vz);
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(p, perm));
    }
    for (; j < k; j++) {
        const int32_t v = _mm_cvtss_si32(_mm_mul_ss(_mm_set_ss(x[j]), _mm_set_ss(inv))) + zi;
        q[j] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
    }
}

/* qsi8d32 row quantizer, AVX2: byte-exact with pk_quantize_qsi8d32_row_scalar (the largest
 * magnitude of the block's 32 as its max loop finds it: max is exact and order-free on
 * numbers; vcvtps2dq = rint; |q| <= 127, so the packs saturate nothing). */
Y_TARGET static void pk_quantize_qsi8d32_row_avx2(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4];
        for (int t = 0; t < 4; t++) v[t] = _mm256_loadu_ps(xb + 8 * t);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const __m256 vinv = _mm256_set1_ps(pk_qsi8d32_params(_mm_cvtss_f32(h), bscale + b));
        __m256i qi[4];
        for (int t = 0; t < 4; t++) qi[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], vinv));
        const __m256i w0 = _mm256_packs_epi32(qi[0], qi[1]), w1 = _mm256_packs_epi32(qi[2], qi[3]);
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w0, w1), perm));
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, ones), _mm256_madd_epi16(w1, ones));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        bsum[b] = _mm_cvtsi128_si32(s4);
    }
}

const pk_isa_helpers pk_helpers_x86_avx2 = {
    .isa = "avx2",
    .features = PK_CPU_AVX2,
    .fwht = pk_fwht_avx2,
    .f16_to_f32 = pk_f16_to_f32_avx2,
    .quantize_qai8dx_row = pk_quantize_qai8dx_row_avx2,
    .quantize_qsi8d32_row = pk_quantize_qsi8d32_row_avx2,
};
#endif
