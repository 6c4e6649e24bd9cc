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

/* The FWHT (x86_fwht_tmpl.h): the pairs inside one vector by permuting lanes and adding
 * v * (+1 / -1), exact, so the fused multiply-add rounds once, as a + b on the low lane of a
 * pair and a - b on the high one; then blocks of 16 vectors. */
Z_TARGET static inline __attribute__((always_inline)) __m512 fwht_in_vector(__m512 v) {
    const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));                 /* h = 1 */
    v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));                 /* h = 2 */
    v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));           /* h = 4 */
    return _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));        /* h = 8 */
}

#define F_TARGET Z_TARGET
#define F_V __m512
#define F_W 16
#define F_R 16
#define F_LOAD _mm512_loadu_ps
#define F_STORE _mm512_storeu_ps
#define F_ADD _mm512_add_ps
#define F_SUB _mm512_sub_ps
#define F_IN_VECTOR fwht_in_vector
#define F_NAME pk_fwht_avx512
#include "x86_fwht_tmpl.h"

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
