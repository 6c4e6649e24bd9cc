/* Attention's AVX-512 (F) paths over the KV cache (contract/pk_kv.h): the query-key scores of
 * up to QK_T query vectors over QK_NB K blocks at once (qk_blocks), the scores' max
 * (max_wide), the V sums of up to QK_T query vectors (pv_tile) and the q8 cache's values as
 * f32 (q8_k_wide, q8_v_wide). A template header, not a file of its own: ops/pk_attention.c
 * includes it (defining QK_NB and QK_T first) so that these inline into its x86-64-v4 clones
 * and run under its QK_WIDE() test; each computes what the plain loops there compute, in the
 * same order (bit-identical). Elsewhere they are never called: the #else names them so that
 * the callers compile. */
#ifndef PK_ATTENTION_X86_AVX512_H
#define PK_ATTENTION_X86_AVX512_H

#include <math.h>      /* INFINITY */
#include <stddef.h>
#include <stdint.h>

#include "../contract/pk_kv.h"

#if !defined(QK_NB) || !defined(QK_T)
#error "define QK_NB and QK_T (ops/pk_attention.c) before including this header"
#endif

#if defined(__x86_64__)
#include <immintrin.h>

/* s[t][b * 16 + l] = sum_i qs[t][i] * K[b][i][l] for T query vectors qs[T][HD] (T <= QK_T: a
 * row's G heads, or several rows' in attend_rows_conv) and QK_NB blocks of K as f32
 * ([NB][HD][16]). AVX-512 intrinsics: GCC's vector types have no fused multiply-add (a
 * lane-by-lane fmaf came out as lane inserts, 10x slower). Each K vector is loaded once into
 * a register for all T sums (the empty asm keeps GCC from folding a load into every FMA that
 * uses it: T loads per vector, and the loads, not the FMAs, set the pace). Called from the
 * clones under QK_WIDE() only; inlined into the AVX-512 one, an (unused) call in the others. */
__attribute__((target("avx512f"))) static inline void qk_blocks(const int T, const int HD,
                                                                const float *restrict qs,
                                                                const float *restrict blk,
                                                                float *restrict s) {
    /* fixed-size arrays in fully unrolled loops: GCC keeps them in registers; sized by T and
     * NB they would be VLAs on the stack */
    __m512 acc[QK_T][QK_NB], k[QK_NB];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int b = 0; b < QK_NB; b++) acc[t][b] = _mm512_setzero_ps();
    for (int i = 0; i < HD; i++) {
#pragma GCC unroll 4
        for (int b = 0; b < QK_NB; b++) {
            k[b] = _mm512_loadu_ps(blk + ((size_t)b * HD + i) * PK_KV_BLOCK);
            __asm__("" : "+v"(k[b]));
        }
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            const __m512 qv = _mm512_set1_ps(qs[t * HD + i]);
#pragma GCC unroll 4
            for (int b = 0; b < QK_NB; b++) acc[t][b] = _mm512_fmadd_ps(qv, k[b], acc[t][b]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int b = 0; b < QK_NB; b++) _mm512_storeu_ps(s + (t * QK_NB + b) * PK_KV_BLOCK, acc[t][b]);
}

/* max_f32 on AVX-512: GCC leaves that loop scalar (it may not turn x > m ? x : m into a
 * max without -ffast-math). _mm512_max_ps(x, m) is that same expression lane by lane (m when
 * x is a NaN); a max is exact, so the order of the lanes' reduction does not change it. */
__attribute__((target("avx512f"))) static inline float max_wide(int n, const float *x) {
    const __m512 lo = _mm512_set1_ps(-INFINITY);
    __m512 m[4] = {lo, lo, lo, lo};
    int i = 0;
    for (; i + 64 <= n; i += 64)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) m[u] = _mm512_max_ps(_mm512_loadu_ps(x + i + 16 * u), m[u]);
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        m[0] = _mm512_max_ps(_mm512_mask_loadu_ps(lo, k, x + i), m[0]);
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
}

/* acc[t][i] += p[t][j] * V[j][i] for T query vectors (their weights p[t][j] = sc[t * ld + j])
 * over the n rows of V at v ([n][HD]), j in order, for the columns i in [c0, c0 + NC): pv_rows'
 * sums, T x NC / 16 <= 24 of them in zmm registers, each V vector loaded once for all T (as in
 * qk_blocks). A head wider than 128 (Gemma's 256) goes through in column windows of 128: each
 * sum is its own column's, so the window changes no bit, and three vectors share each V load
 * where one row's whole head would have spilled its sums to memory. */
__attribute__((target("avx512f"))) static inline void pv_tile(const int T, const int HD, const int c0,
                                                              const int NC, int n,
                                                              const float *restrict sc, size_t ld,
                                                              const float *restrict v,
                                                              float *restrict acc) {
    /* T <= 6, NC <= 128, T * NC / 16 <= 24; zeroed for the out-of-line copy in the other clones,
     * whose NC is not a constant (the inlined ones drop the stores) */
    __m512 a[QK_T][8] = {{_mm512_setzero_ps()}}, vv[8];
    v += c0, acc += c0;
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int c = 0; c < NC / 16; c++) a[t][c] = _mm512_loadu_ps(acc + t * HD + c * 16);
    for (int j = 0; j < n; j++) {
#pragma GCC unroll 8
        for (int c = 0; c < NC / 16; c++) {
            vv[c] = _mm512_loadu_ps(v + (size_t)j * HD + c * 16);
            __asm__("" : "+v"(vv[c]));
        }
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            const __m512 p = _mm512_set1_ps(sc[t * ld + j]);
#pragma GCC unroll 8
            for (int c = 0; c < NC / 16; c++) a[t][c] = _mm512_fmadd_ps(p, vv[c], a[t][c]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int c = 0; c < NC / 16; c++) _mm512_storeu_ps(acc + t * HD + c * 16, a[t][c]);
}

/* A q8 cache's values as f32 on AVX-512: 16 int8 widened in one instruction, converted and
 * multiplied by their scales, one zmm at a time. GCC vectorized the plain loops below at 256
 * bits, widening int8 through int16 with lane extracts: the q8 cache's attention ran at half
 * the f16 cache's read rate and decoded slower than it at depth 4096 (docs/KERNELS.md). The
 * products are the plain loops' (exact in f32), so the bits do not change. K: nb blocks of
 * [HD][16] with scales sc [nb][HD/32][16]; V: n rows of [HD] with scales sc [n][HD/32]. */
__attribute__((target("avx512f"))) static inline void q8_k_wide(const int HD, size_t nb,
                                                                const int8_t *restrict k8,
                                                                const float *restrict sc,
                                                                float *restrict tile) {
    for (size_t g = 0; g < nb * (HD / PK_KV_Q8_GROUP); g++) {   /* a group: 32 dimensions x 16 positions */
        const __m512 s = _mm512_loadu_ps(sc + g * PK_KV_BLOCK);
        const int8_t *x = k8 + g * PK_KV_Q8_GROUP * PK_KV_BLOCK;
        float *t = tile + g * PK_KV_Q8_GROUP * PK_KV_BLOCK;
#pragma GCC unroll 4
        for (int i = 0; i < PK_KV_Q8_GROUP; i++)
            _mm512_storeu_ps(t + i * PK_KV_BLOCK, _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + i * PK_KV_BLOCK)))), s));
    }
}
__attribute__((target("avx512f"))) static inline void q8_v_wide(const int HD, size_t n,
                                                                const int8_t *restrict v8,
                                                                const float *restrict sc,
                                                                float *restrict tile) {
    const int GPR = HD / PK_KV_Q8_GROUP;
    for (size_t j = 0; j < n; j++)
        for (int c = 0; c < GPR; c++) {
            const __m512 s = _mm512_set1_ps(sc[j * GPR + c]);
            const int8_t *x = v8 + j * HD + c * PK_KV_Q8_GROUP;
            float *t = tile + j * HD + c * PK_KV_Q8_GROUP;
            for (int h = 0; h < PK_KV_Q8_GROUP; h += 16)
                _mm512_storeu_ps(t + h, _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + h)))), s));
        }
}
#else
/* QK_WIDE() is 0 here: never called (the operands named, so that none is "unused") */
#define qk_blocks(T, HD, qs, blk, s) ((void)(qs), (void)(blk), (void)(s), __builtin_unreachable())
#define pv_tile(T, HD, c0, NC, n, sc, ld, v, acc) ((void)(sc), (void)(v), (void)(acc), __builtin_unreachable())
#define max_wide(n, x) ((void)(x), __builtin_unreachable(), 0.0f)
#define q8_k_wide(HD, nb, k8, sc, tile) ((void)(k8), (void)(sc), (void)(tile), __builtin_unreachable())
#define q8_v_wide(HD, n, v8, sc, tile) ((void)(v8), (void)(sc), (void)(tile), __builtin_unreachable())
#endif

#endif
