/* Attention's AVX-512 BF16 path (vdpbf16ps) over an f16, q8 or bf16 KV cache (contract/pk_kv.h):
 * the cache's values and the query / probability vectors rounded to bf16 and laid out as pairs
 * (bf16_pairs, k_pairs_*, v_pairs_*, bf16_row; a bf16 cache holds its values so already), the
 * query-key scores of up to QK_T query vectors
 * over QK_NB K blocks (qk_blocks_bf16, copy_scores), the softmax's exponentials and sum
 * (exp16_fma, exp_sum_bf16) and weights (weights_bf16), and the V sums of up to QK_T vectors
 * (pv_tile_bf16, pv_half_bf16). A template header, as isa/attention_x86_avx512.h: ops/pk_attention_bf16.c
 * includes it (QK_NB and QK_T defined first) into functions compiled for AVX-512 BF16 alone
 * (a per-function target attribute), called only when the CPU has it.
 *
 * The arithmetic, which ops/pk_attention_reference.c repeats in plain C (attend_head_bf16):
 * - rounding to bf16 is vcvtneps2bf16's: to nearest even, an f32 subnormal to a signed zero, a
 *   NaN quiet (contract/pk_kv.h's pk_kv_bf16_round);
 * - one vdpbf16ps lane adds a pair's two products to an f32 sum, the odd element's first,
 *   each product exact and each add one rounding, a subnormal sum flushed to zero (Intel's
 *   definition; a Zen 4 gives those bits, checked on 3.2M random lanes);
 * - QK pairs run along the head dimension (2p, 2p + 1), PV pairs along the positions
 *   (2p, 2p + 1 from the partial's first position), a partial's odd last position paired with
 *   a zero weight times a zero value. */
#ifndef PK_ATTENTION_X86_AVX512BF16_H
#define PK_ATTENTION_X86_AVX512BF16_H

#include <stddef.h>
#include <stdint.h>

#include "../contract/pk_kv.h"

#if !defined(QK_NB) || !defined(QK_T)
#error "define QK_NB and QK_T before including this header"
#endif

#if defined(__x86_64__)
#include <immintrin.h>

#define PK_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
/* inlined into the callers, whose T, HD and NC are constants (GCC otherwise kept out-of-line
 * copies with a variable T: sums spilled) */
#define PK_BF16_INLINE PK_BF16_TARGET __attribute__((always_inline))

/* The lanes [0, left) of a 16-lane step that has `left` values to go (all 16 when left >= 16). */
PK_BF16_INLINE static inline __mmask16 lanes_left(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 pairs (even[l], odd[l]) in bf16, lane l's 32 bits, the even one low: the order vdpbf16ps
 * pairs them in. vcvtne2ps2bf16 gives [even 0..15 | odd 0..15]; one vpermw interleaves. */
PK_BF16_INLINE static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(interleave), both);
}

/* x[0, n) in bf16, to out[0, ceil(n / 16) * 16), past n zeros: a query vector's pairs. */
PK_BF16_INLINE static inline void bf16_row(int n, const float *restrict x, uint16_t *restrict out) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, x + i)));
    }
}

/* e^x for x <= 0, 16 lanes: ops/pk_softmax.h's exp_nonpos_fma, step for step (the clamp as
 * its compare: vmaxps returns its second operand, x, for a NaN; rintf as roundscale to
 * nearest; 2^n built in the exponent field). */
PK_BF16_INLINE static inline __m512 exp16_fma(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* x[i] = e^(x[i] - mx) for i < n, returning their sum: pk_softmax.h's exp_sum_fma in one pass
 * (16 lane sums, a last partial 16 adding zeros, then folded in halves: 8, 4, 2, 1). */
PK_BF16_INLINE static inline float exp_sum_bf16(int n, float *restrict x, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        const __m512 e = exp16_fma(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
        _mm512_mask_storeu_ps(x + i, k, e);
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(k, e));
    }
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

/* The weights x[i] * inv for i < n in bf16, to out[0, ceil(n / 16) * 16), past n zeros (a
 * partial's odd last position then pairs with a zero weight): the normalisation and the
 * rounding in one pass. */
PK_BF16_INLINE static inline void weights_bf16(int n, const float *restrict x, float inv, uint16_t *restrict out) {
    const __m512 v = _mm512_set1_ps(inv);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = lanes_left(n - i);
        _mm256_storeu_si256((__m256i *)(out + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), v)));
    }
}

/* How far ahead of the conversion an f16 cache is asked for, one prefetch per 64 bytes
 * converted: a decode row reads its head's cache once, a span converted, then its scores or
 * sums computed with no read in flight; asked for as it goes, the next span's lines arrive
 * meanwhile. The next span asked for at once after each span's conversion gained nothing
 * (the prefetches wait on the same miss buffers as loads); spread over the loop, 8 to 32 KiB
 * ahead, a one-thread decode's attention over 4096 positions read from memory took 1.56-1.64x
 * less time (head sizes 64-256; docs/KERNELS.md, "The bf16 path's cache read ahead"). A bf16
 * cache, read where it is, is asked for the same distance ahead of each load (qk_blocks_bf16's
 * and pv_tile_bf16's PF). Past the cache's end the hint is harmless: a prefetch never faults. */
#define KV_PREFETCH_BYTES 16384

/* K blocks of an f16 cache as pair tiles: nb blocks of [HD][16] f16 to [nb][HD/2][16] pairs
 * (dimensions 2p, 2p + 1 of one position in a lane). The two dimensions' 16 positions are
 * adjacent in the block. */
PK_BF16_INLINE static inline void k_pairs_f16(const int HD, size_t nb, const uint16_t *restrict k16,
                                              uint32_t *restrict tile) {
    for (size_t r = 0; r < nb * HD / 2; r++) {
        const __m256i *h = (const __m256i *)(k16 + r * 2 * PK_KV_BLOCK);   /* two loads folded into the conversions */
        _mm_prefetch((const char *)h + KV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm512_storeu_si512(tile + r * PK_KV_BLOCK,
                            bf16_pairs(_mm512_cvtph_ps(_mm256_loadu_si256(h)), _mm512_cvtph_ps(_mm256_loadu_si256(h + 1))));
    }
}

/* The same from a q8 cache: int8 times its group's scale (exact in f32, as the f32 path's
 * q8_k_wide), sc the nb blocks' scales as f32 ([nb][HD/32][16]); 2p and 2p + 1 share a group. */
PK_BF16_INLINE static inline void k_pairs_q8(const int HD, size_t nb, const int8_t *restrict k8,
                                             const float *restrict sc, uint32_t *restrict tile) {
    for (size_t r = 0; r < nb * HD / 2; r++) {
        const size_t b = r / (HD / 2), i = 2 * (r % (HD / 2));
        const __m512 s = _mm512_loadu_ps(sc + (b * (HD / PK_KV_Q8_GROUP) + i / PK_KV_Q8_GROUP) * PK_KV_BLOCK);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(k8 + r * 2 * PK_KV_BLOCK));
        const __m512 e = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(x))), s);
        const __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(x, 1))), s);
        _mm512_storeu_si512(tile + r * PK_KV_BLOCK, bf16_pairs(e, o));
    }
}

/* V rows [0, n) of a cache as pair tiles: [ceil(n/2)][HD/16][16] pairs (positions 2p, 2p + 1
 * of one dimension in a lane); an odd n's last pair takes a zero row. f16: v16 [n][HD]; q8: v8
 * [n][HD] and sc its scales as f32 [n][HD/32]. */
PK_BF16_INLINE static inline __m512 v_f16_at(const uint16_t *restrict v16, int HD, size_t j, size_t n, int c) {
    return j < n ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v16 + j * HD + c * 16))) : _mm512_setzero_ps();
}
PK_BF16_INLINE static inline void v_pairs_f16(const int HD, size_t n, const uint16_t *restrict v16,
                                              uint32_t *restrict tile) {
    for (size_t j = 0; j < n; j += 2)
        for (int c = 0; c < HD / 16; c++) {   /* rows j and j + 1: HD / 16 lines */
            _mm_prefetch((const char *)(v16 + j * HD) + 64 * c + KV_PREFETCH_BYTES, _MM_HINT_T1);
            _mm512_storeu_si512(tile + (j / 2 * (HD / 16) + c) * 16,
                                bf16_pairs(v_f16_at(v16, HD, j, n, c), v_f16_at(v16, HD, j + 1, n, c)));
        }
}
PK_BF16_INLINE static inline __m512 v_q8_at(const int8_t *restrict v8, const float *restrict sc, int HD, size_t j,
                                            size_t n, int c) {
    if (j >= n) return _mm512_setzero_ps();
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v8 + j * HD + c * 16))));
    return _mm512_mul_ps(x, _mm512_set1_ps(sc[j * (HD / PK_KV_Q8_GROUP) + c * 16 / PK_KV_Q8_GROUP]));
}
PK_BF16_INLINE static inline void v_pairs_q8(const int HD, size_t n, const int8_t *restrict v8,
                                             const float *restrict sc, uint32_t *restrict tile) {
    for (size_t j = 0; j < n; j += 2)
        for (int c = 0; c < HD / 16; c++)
            _mm512_storeu_si512(tile + (j / 2 * (HD / 16) + c) * 16,
                                bf16_pairs(v_q8_at(v8, sc, HD, j, n, c), v_q8_at(v8, sc, HD, j + 1, n, c)));
}

/* s[t][b * 16 + l] = the bf16 dot product of query vector t (qp [T][HD/2] pairs) with position
 * l of K block b (blk: QK_NB pair blocks [HD/2][16]); T <= QK_T. As qk_blocks: each K vector
 * loaded once into a register for all T sums, T x QK_NB independent chains. PF: blk is a bf16
 * cache itself, each line asked for KV_PREFETCH_BYTES ahead as it is loaded. */
PK_BF16_INLINE static inline void qk_blocks_bf16(const int T, const int HD, const int PF, const uint32_t *restrict qp,
                                                 const uint32_t *restrict blk, float *restrict s) {
    __m512 acc[QK_T][QK_NB];
    __m512i k[QK_NB];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int b = 0; b < QK_NB; b++) acc[t][b] = _mm512_setzero_ps();
    for (int p = 0; p < HD / 2; p++) {
#pragma GCC unroll 4
        for (int b = 0; b < QK_NB; b++) {
            const uint32_t *at = blk + ((size_t)b * (HD / 2) + p) * PK_KV_BLOCK;
            k[b] = _mm512_loadu_si512(at);
            if (PF) _mm_prefetch((const char *)at + KV_PREFETCH_BYTES, _MM_HINT_T1);
            __asm__("" : "+v"(k[b]));
        }
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qp[t * (HD / 2) + p]);
#pragma GCC unroll 4
            for (int b = 0; b < QK_NB; b++) acc[t][b] = _mm512_dpbf16_ps(acc[t][b], q, (__m512bh)k[b]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int b = 0; b < QK_NB; b++) _mm512_storeu_ps(s + (t * QK_NB + b) * PK_KV_BLOCK, acc[t][b]);
}

/* d[0, n) = s[0, n), n <= QK_NB * 16: a tile's scores to a row, by masked moves (memcpy of a
 * length known only at run time came out as rep movsq, whose start-up cost was about 7% of a
 * prefill's attention). */
PK_BF16_INLINE static inline void copy_scores(int n, const float *restrict s, float *restrict d) {
    for (int b = 0; b < QK_NB && b * 16 < n; b++) {
        const __mmask16 k = lanes_left(n - b * 16);
        _mm512_mask_storeu_ps(d + b * 16, k, _mm512_maskz_loadu_ps(k, s + b * 16));
    }
}

/* acc[t][c0*16 .. (c0+NC)*16) += the weights' pairs pp[t * ldp + p] times V's pairs p of the
 * tile vt ([np][HD/16][16]), p in order, for T vectors (acc [T][HD]); T x NC <= 24 sums in
 * registers, each V vector loaded once for all T. */
PK_BF16_INLINE static inline void pv_tile_bf16(const int T, const int HD, const int PF, const int c0, const int NC,
                                               int np,
                                               const uint32_t *restrict pp, size_t ldp,
                                               const uint32_t *restrict vt, float *restrict acc) {
    __m512 a[QK_T][8] = {{_mm512_setzero_ps()}};   /* past NC unused; zeroed for the compiler's sake */
    __m512i vv[8];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) a[t][c] = _mm512_loadu_ps(acc + t * HD + (c0 + c) * 16);
    for (int p = 0; p < np; p++) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) {
            const uint32_t *at = vt + ((size_t)p * (HD / 16) + c0 + c) * 16;
            vv[c] = _mm512_loadu_si512(at);
            if (PF) _mm_prefetch((const char *)at + KV_PREFETCH_BYTES, _MM_HINT_T1);
            __asm__("" : "+v"(vv[c]));
        }
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[t * ldp + p]);
#pragma GCC unroll 8
            for (int c = 0; c < NC; c++) a[t][c] = _mm512_dpbf16_ps(a[t][c], w, (__m512bh)vv[c]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(acc + t * HD + (c0 + c) * 16, a[t][c]);
}

/* One vector's odd last position: the pair p of vt with its second position's values zeroed
 * (another row of the tile may see that position; this one pairs a zero weight with a zero,
 * as alone), weights pair w. */
PK_BF16_INLINE static inline void pv_half_bf16(const int HD, uint32_t w, const uint32_t *restrict vp,
                                               float *restrict acc) {
    const __m512i lo = _mm512_set1_epi32(0xFFFF);
    const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)w);
    for (int c = 0; c < HD / 16; c++) {
        const __m512i v = _mm512_and_si512(_mm512_loadu_si512(vp + c * 16), lo);
        _mm512_storeu_ps(acc + c * 16, _mm512_dpbf16_ps(_mm512_loadu_ps(acc + c * 16), wv, (__m512bh)v));
    }
}
#endif

#endif
