/* x86 AVX2 + FMA kernels (Haswell and later, Zen): vpmaddubsw (u8 x s8 -> s16 pairs) and
 * vpmaddwd. The qsi4c32 GEMV and GEMM bodies are shared with AVX-VNNI through
 * x86_ymm_tmpl.h; docs/KERNELS.md describes the kernels. All read the canonical weights. */
#include "../contract/pk_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "x86_common.h"

#define Y_TARGET __attribute__((target("avx2,fma,f16c")))
#define Y_NAME(x) x##_avx2
#define Y_VNNI 0
#define Y_MR 4
#define Y_NRV 1
#define Y_Q4_GEMV qai8dx_qsi4c32_1x4_avx2
#define Y_Q4_GEMM qai8dx_qsi4c32_4x8_avx2
#define Y_D32_GEMV qsi8d32_qsi4c32_1x4_avx2
#define Y_D32_GEMM qsi8d32_qsi4c32_4x8_avx2
#include "x86_ymm_tmpl.h"

/* qai8dx x qsi8cx, 1 x 4. vpmaddubsw would saturate on int8 x int8 (2 * 255 * 127 > 32767),
 * so both sides are widened to int16 and multiplied with vpmaddwd: exact int32 dots, the
 * result bit-exact with the scalar kernel. */
Y_TARGET static void qai8dx_qsi8cx_1x4_avx2(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                            const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, G = k / 16;
    const size_t ldo = pk_round_up((size_t)k, 16);
    int16_t *act = pk_scratch(0, sizeof(int16_t) * ldo * (size_t)m);
    if (!act) { pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi); return; }
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        int16_t *o = act + (size_t)i * ldo;
        for (int g = 0; g < G; g++)
            _mm256_store_si256((__m256i *)(o + 16 * g), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + 16 * g))));
        for (int kk = 16 * G; kk < k; kk++) o[kk] = a[kk];
    }
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        const int8_t *w[4];
        for (int r = 0; r < 4; r++) w[r] = (const int8_t *)rhs->qs + (size_t)(n + (r < nr ? r : nr - 1)) * k;
        for (int i = 0; i < m; i++) {
            const int16_t *ai = act + (size_t)i * ldo;
            __m256i acc[4];
            for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_si256();
            for (int g = 0; g < G; g++) {
                const __m256i av = _mm256_load_si256((const __m256i *)(ai + 16 * g));
                for (int r = 0; r < 4; r++) {
                    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + 16 * g)));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(av, wv));
                }
            }
            for (int r = 0; r < nr; r++) {
                const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
                const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                int32_t d = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
                for (int kk = 16 * G; kk < k; kk++) d += (int32_t)ai[kk] * w[r][kk];
                d -= lhs->zp[i] * rhs->isum[n + r];
                const float v = lhs->scale[i] * ((const float *)rhs->scales)[n + r] * (float)d;
                dst[(size_t)i * ldd + n + r] = pk_clampf(v, lo, hi);
            }
        }
    }
}

/* qai8dx x qsi6c32 (the 6-bit lm_head), 1 x 4, canonical layout. A chunk of 32 weights is
 * unpacked to unsigned u = q + 32 in [0, 63] (low nibbles | top bits << 4), vpmaddubsw
 * multiplies u by the signed activations (|u a| * 2 <= 16128: no saturation), vpmaddwd
 * widens; the offset leaves as -32 * (sum of the block's activations), added to lane 0. Per
 * block the 8 int32 lanes are scaled in float and summed at the row end. */
Y_TARGET static inline __m256i y_q6_chunk(const uint8_t *wp) {
    const __m128i l = _mm_loadu_si128((const __m128i *)wp), m30 = _mm_set1_epi8(0x30), m0f = _mm_set1_epi8(0x0F);
    const __m128i h = _mm_loadl_epi64((const __m128i *)(wp + 16));
    const __m128i h2 = _mm_unpacklo_epi64(h, _mm_srli_epi16(h, 2));   /* [H, H >> 2] */
    const __m128i u0 = _mm_or_si128(_mm_and_si128(l, m0f), _mm_and_si128(_mm_slli_epi16(h2, 4), m30));
    const __m128i u1 = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l, 4), m0f), _mm_and_si128(h2, m30));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(u0), u1, 1);
}

Y_TARGET static void qai8dx_qsi6c32_1x4_avx2(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                             const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, nb = k / 32;
    const size_t R = pk_row_bytes(PK_FMT_QSI6C32, k);
    int32_t *corr = pk_scratch(0, sizeof(int32_t) * (size_t)nb * m);
    if (!corr) { pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi); return; }
    for (int i = 0; i < m; i++)
        for (int b = 0; b < nb; b++) {
            int32_t t = 0;
            for (int j = 0; j < 32; j++) t += lhs->q[(size_t)i * lhs->ld + 32 * b + j];
            corr[(size_t)i * nb + b] = -32 * t;
        }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *w[4];
        const uint16_t *s[4];
        for (int r = 0; r < 4; r++) {
            const int row = n + (r < nr ? r : nr - 1);
            w[r] = rhs->qs + (size_t)row * R;
            s[r] = (const uint16_t *)rhs->scales + (size_t)row * nb;
        }
        for (int i = 0; i < m; i++) {
            const int8_t *a = lhs->q + (size_t)i * lhs->ld;
            __m256 f[4];
            for (int r = 0; r < 4; r++) f[r] = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const __m256i av = _mm256_loadu_si256((const __m256i *)(a + 32 * b));
                const __m256i c = _mm256_setr_epi32(corr[(size_t)i * nb + b], 0, 0, 0, 0, 0, 0, 0);
                for (int r = 0; r < 4; r++) {
                    const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(y_q6_chunk(w[r] + 24 * b), av), ones), c);
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(pk_bf16_to_f32(s[r][b])), f[r]);
                }
            }
            for (int r = 0; r < nr; r++) {
                const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(f[r]), _mm256_extractf128_ps(f[r], 1));
                const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
                const float acc = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
                const float v = lhs->scale[i] * (acc - (float)lhs->zp[i] * rhs->rsum[n + r]);
                dst[(size_t)i * ldd + n + r] = pk_clampf(v, lo, hi);
            }
        }
    }
}

#endif /* __x86_64__ */

#if defined(__x86_64__)
const pk_kernel pk_kernels_x86_avx2[] = {
    {.name = "qai8dx_qsi4c32_1x4_avx2", .isa = "avx2", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX2,
     .priority = 10, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi4c32_1x4_avx2, .run_d32 = qsi8d32_qsi4c32_1x4_avx2},
    {.name = "qai8dx_qsi4c32_4x8_avx2", .isa = "avx2", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX2,
     .priority = 11, .m_min = 8, .n_step = 8,
     .run = qai8dx_qsi4c32_4x8_avx2, .run_d32 = qsi8d32_qsi4c32_4x8_avx2},
    {.name = "qai8dx_qsi8cx_1x4_avx2", .isa = "avx2", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVX2,
     .priority = 10, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi8cx_1x4_avx2},
    {.name = "qai8dx_qsi6c32_1x4_avx2", .isa = "avx2", .fmt = PK_FMT_QSI6C32, .features = PK_CPU_AVX2,
     .priority = 10, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi6c32_1x4_avx2},
};
const int pk_kernels_x86_avx2_count = sizeof pk_kernels_x86_avx2 / sizeof pk_kernels_x86_avx2[0];
#endif
