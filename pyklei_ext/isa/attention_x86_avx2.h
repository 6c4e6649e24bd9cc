/* Attention's AVX2 path over the KV cache (contract/pk_kv.h): the q8 cache's values as f32,
 * where AVX-512 does not run (q8_k_avx2, q8_v_avx2). A template header, as
 * isa/attention_x86_avx512.h: ops/pk_attention.c includes it so that these inline into its
 * x86-64-v3 clones and run under its Q8_AVX2() test; the products are those of the plain
 * loops there (exact in f32). Elsewhere never called: the #else names them. */
#ifndef PK_ATTENTION_X86_AVX2_H
#define PK_ATTENTION_X86_AVX2_H

#include <stddef.h>
#include <stdint.h>

#include "../contract/pk_kv.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* The same on AVX2, 8 values a register (the AVX2 clone's plain loops ran q8 at 0.74x the f16
 * cache's rate). */
__attribute__((target("avx2"))) static inline void q8_k_avx2(const int HD, size_t nb,
                                                             const int8_t *restrict k8,
                                                             const float *restrict sc,
                                                             float *restrict tile) {
    for (size_t g = 0; g < nb * (HD / PK_KV_Q8_GROUP); g++) {
        const __m256 s0 = _mm256_loadu_ps(sc + g * PK_KV_BLOCK), s1 = _mm256_loadu_ps(sc + g * PK_KV_BLOCK + 8);
        const int8_t *x = k8 + g * PK_KV_Q8_GROUP * PK_KV_BLOCK;
        float *t = tile + g * PK_KV_Q8_GROUP * PK_KV_BLOCK;
#pragma GCC unroll 4
        for (int i = 0; i < PK_KV_Q8_GROUP; i++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(x + i * PK_KV_BLOCK));
            _mm256_storeu_ps(t + i * PK_KV_BLOCK, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s0));
            _mm256_storeu_ps(t + i * PK_KV_BLOCK + 8,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), s1));
        }
    }
}
__attribute__((target("avx2"))) static inline void q8_v_avx2(const int HD, size_t n,
                                                             const int8_t *restrict v8,
                                                             const float *restrict sc,
                                                             float *restrict tile) {
    const int GPR = HD / PK_KV_Q8_GROUP;
    for (size_t j = 0; j < n; j++)
        for (int c = 0; c < GPR; c++) {
            const __m256 s = _mm256_set1_ps(sc[j * GPR + c]);
            const int8_t *x = v8 + j * HD + c * PK_KV_Q8_GROUP;
            float *t = tile + j * HD + c * PK_KV_Q8_GROUP;
            for (int h = 0; h < PK_KV_Q8_GROUP; h += 8)
                _mm256_storeu_ps(t + h, _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + h)))), s));
        }
}
#else
#define q8_k_avx2(HD, nb, k8, sc, tile) ((void)(k8), (void)(sc), (void)(tile), __builtin_unreachable())
#define q8_v_avx2(HD, n, v8, sc, tile) ((void)(v8), (void)(sc), (void)(tile), __builtin_unreachable())
#endif

#endif
