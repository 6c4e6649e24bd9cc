/* Attention over an f16, q8 or bf16 KV cache in bf16 (pk_kv_head.dot_bf16): the query-key scores and
 * the V sums on AVX-512 BF16's vdpbf16ps (isa/attention_x86_avx512bf16.h, whose header states
 * the arithmetic), f32 sums; the softmax's exponentials and sum in one pass of its own
 * (exp_sum_bf16: pk_softmax.h's exp_sum_fma); the chunks (partials of PK_ATTEND_CHUNK
 * positions, folded by pk_attend_merge) and the scores' scratch are pk_attention.c's. One function
 * serves a decode row and a prefill chunk's rows alike (R = 1 or more), so batched rows are
 * their solo selves bit for bit, and both are the bf16 reference's
 * (pk_attention_reference.c). Elsewhere (no AVX-512 BF16, or a shape without a kernel) the
 * reference runs the same arithmetic; the forward pass asks for bf16 only where it runs here
 * (pk_attend_bf16_pick). Why a pair of bf16 products: twice the multiply-adds of an f32 FMA
 * per instruction, on the same ports (docs/KERNELS.md). A bf16 cache holds the pairs the kernels
 * read (contract/pk_kv.h): its spans are read where they are, with no conversion, which was half
 * of a decode row's arithmetic over an f16 cache. */
#include "pk_nn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../contract/pk_cpu.h"
#include "pk_ops_internal.h"   /* PK_ATTEND_SHAPES, pk_log_kernels */

int pk_attend_bf16_runs(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    const uint32_t f = pk_cpu_features();
    return (f & PK_CPU_AVX512BF16) && (f & PK_CPU_AVX512VNNI);
#else
    return 0;
#endif
}

/* The forward pass's default when PYKLEI_ATTENTION is unset, by the cache's type: bf16 where
 * it held the KLD bound (issue 45: at most +1% over f32 attention's, at depth 0 and 4096 on
 * both test beds): the f16 and bf16 caches (Python's default "auto" picks bf16 where this
 * runs, kv_policy.py), the latter holding its values as bf16 reads them; f32 for the q8 cache,
 * which did not at depth 0.
 * The figures that decided it: docs/QUALITY.md, "Attention in bf16 at depth". */
static int bf16_by_default(pk_kv_type type) { return type == PK_KV_F16 || type == PK_KV_BF16; }

int pk_attend_bf16_pick(pk_kv_type type, int log_choice) {
    const char *want = getenv("PYKLEI_ATTENTION");
    int bf16 = bf16_by_default(type);
    if (want && *want) {
        if (strcmp(want, "bf16") && strcmp(want, "f32")) {
            fail("PYKLEI_ATTENTION=%s: expected bf16 or f32", want);
            return -1;
        }
        bf16 = !strcmp(want, "bf16");
    }
    const int on = bf16 && type != PK_KV_F32 && pk_attend_bf16_runs();
    if (log_choice && type != PK_KV_F32 && pk_dispatch_init() == 0 && pk_log_kernels > 0)
        fprintf(stderr, "pyklei: attention dot products in %s\n",
                on ? "bf16 (avx512bf16)" : !bf16 ? "f32"
                : want && *want ? "f32 (bf16 asked; no AVX-512 BF16 here)" : "f32 (no AVX-512 BF16 here)");
    return on;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define QK_NB 4
#define QK_T 6
#include "../isa/attention_x86_avx512.h"       /* max_wide */
#include "../isa/attention_x86_avx512bf16.h"

#define SPAN 128   /* positions converted at once (K pairs, then V pairs: L2-resident) */
#define LDP (PK_ATTEND_CHUNK / 2 + 8)   /* a vector's weight pairs; weights_bf16 writes whole 16s */

/* R query rows (R <= PK_ATTEND_ROWS) of G heads over one K/V head's partial: row r sees
 * positions [0, n_pos[r]) (<= PK_ATTEND_CHUNK); out, ml as pk_attend_part's. As
 * attend_rows_conv (pk_attention.c): a span of the cache converted once for all rows (a bf16
 * cache's read where it lies), query vectors in tiles of QK_T (scores) and 24 / NC (V sums) over it; a tile's V sums jointly over
 * the pairs all its vectors see, then each vector on to its own end. */
PK_BF16_TARGET static inline __attribute__((always_inline)) void
attend_rows_bf16(const int G, const int HD, const pk_kv_type T, int R, const int *n_pos, const float *restrict q,
                 size_t ldq, const pk_kv_head *kv, float scale, float *restrict scores, size_t ld_scores,
                 float *restrict out, size_t ldo, float *restrict ml) {
    uint32_t tile[SPAN / 2 * HD];   /* K pair blocks [SPAN/16][HD/2][16] or V pair rows [SPAN/2][HD] */
    float accs[PK_ATTEND_ROWS * G][HD];   /* query vector t = r * G + g */
    uint32_t qp[PK_ATTEND_ROWS * G][HD / 2];
    uint32_t pp[PK_ATTEND_ROWS * G][LDP];
    float sc[SPAN * HD / PK_KV_Q8_GROUP];   /* q8: a span's scales as f32 */
    const int NQ = R * G, NC = HD / 16 > 8 ? 8 : HD / 16, PT = 24 / NC;
    int n_max = 0;
    for (int r = 0; r < R; r++) n_max = n_pos[r] > n_max ? n_pos[r] : n_max;
    for (int t = 0; t < NQ; t++) {
        float qs[HD];
        for (int i = 0; i < HD; i++) qs[i] = q[(t / G) * ldq + (t % G) * HD + i] * scale;
        bf16_row(HD, qs, (uint16_t *)qp[t]);
    }
    for (int p0 = 0; p0 < n_max; p0 += SPAN) {
        const int p1 = n_max - p0 < SPAN ? n_max : p0 + SPAN;
        const int nbk = (p1 - p0 + PK_KV_BLOCK - 1) / PK_KV_BLOCK, nbp = (nbk + QK_NB - 1) / QK_NB * QK_NB;
        const size_t e0 = (size_t)p0 * HD;
        /* the span's K pair blocks, padded with zeros to whole groups of QK_NB: a bf16 cache's
         * are read where they are, but for the last group's, copied (no read past the cache) */
        const uint32_t *kt = tile;
        int copied = 0;   /* the first block of kt that is the tile's block 0 */
        if (T == PK_KV_BF16) {
            kt = (const uint32_t *)kv->k + e0 / 2;
            copied = nbk / QK_NB * QK_NB;
            if (copied < nbk)
                memcpy(tile, kt + (size_t)copied * HD / 2 * PK_KV_BLOCK,
                       sizeof(uint32_t) * (nbk - copied) * HD / 2 * PK_KV_BLOCK);
        } else if (T == PK_KV_F16) {
            k_pairs_f16(HD, nbk, (const uint16_t *)kv->k + e0, tile);
        } else {
            kv->f16((size_t)nbk * HD / PK_KV_Q8_GROUP * PK_KV_BLOCK, kv->k_scale + e0 / PK_KV_Q8_GROUP, sc);
            k_pairs_q8(HD, nbk, (const int8_t *)kv->k + e0, sc, tile);
        }
        memset(tile + (size_t)(nbk - copied) * HD / 2 * PK_KV_BLOCK, 0,
               sizeof(uint32_t) * (nbp - nbk) * HD / 2 * PK_KV_BLOCK);
        for (int j = p0; j < p1; j += QK_NB * PK_KV_BLOCK)
            for (int t0 = 0; t0 < NQ; t0 += QK_T) {
                float s[QK_T * QK_NB * PK_KV_BLOCK];
                const int nt = NQ - t0 < QK_T ? NQ - t0 : QK_T, b = (j - p0) / PK_KV_BLOCK;
                const uint32_t *kb = b >= copied ? tile + (size_t)(b - copied) * HD / 2 * PK_KV_BLOCK
                                                 : kt + (size_t)b * HD / 2 * PK_KV_BLOCK;
                switch (nt) {   /* a constant T in each: its sums in registers */
                case 6: qk_blocks_bf16(6, HD, T == PK_KV_BF16, qp[t0], kb, s); break;
                case 5: qk_blocks_bf16(5, HD, T == PK_KV_BF16, qp[t0], kb, s); break;
                case 4: qk_blocks_bf16(4, HD, T == PK_KV_BF16, qp[t0], kb, s); break;
                case 3: qk_blocks_bf16(3, HD, T == PK_KV_BF16, qp[t0], kb, s); break;
                case 2: qk_blocks_bf16(2, HD, T == PK_KV_BF16, qp[t0], kb, s); break;
                default: qk_blocks_bf16(1, HD, T == PK_KV_BF16, qp[t0], kb, s); break;
                }
                for (int t = 0; t < nt; t++) {
                    const int r = (t0 + t) / G, end = n_pos[r] < p1 ? n_pos[r] : p1;
                    const int nv = end - j < QK_NB * PK_KV_BLOCK ? end - j : QK_NB * PK_KV_BLOCK;
                    if (nv > 0) copy_scores(nv, s + t * QK_NB * PK_KV_BLOCK, scores + (size_t)(t0 + t) * ld_scores + j);
                }
            }
    }
    for (int t = 0; t < NQ; t++) {   /* the softmax (exp_nonpos_fma's), then the weights in bf16 */
        float *sg = scores + (size_t)t * ld_scores;
        const int n = n_pos[t / G];
        const float mx = max_wide(n, sg), sum = exp_sum_bf16(n, sg, mx);
        ml[2 * t] = mx, ml[2 * t + 1] = sum;
        weights_bf16(n, sg, 1.0f / sum, (uint16_t *)pp[t]);
        for (int i = 0; i < HD; i++) accs[t][i] = 0.0f;
    }
    for (int p0 = 0; p0 < n_max; p0 += SPAN) {
        const int p1 = n_max - p0 < SPAN ? n_max : p0 + SPAN;
        const size_t e0 = (size_t)p0 * HD, GPR = HD / PK_KV_Q8_GROUP;
        const uint32_t *vt = tile;   /* the span's V pairs: a bf16 cache's where they are */
        if (T == PK_KV_BF16) {
            vt = (const uint32_t *)kv->v + e0 / 2;
        } else if (T == PK_KV_F16) {
            v_pairs_f16(HD, (size_t)(p1 - p0), (const uint16_t *)kv->v + e0, tile);
        } else {
            kv->f16((size_t)(p1 - p0) * GPR, kv->v_scale + (size_t)p0 * GPR, sc);
            v_pairs_q8(HD, (size_t)(p1 - p0), (const int8_t *)kv->v + e0, sc, tile);
        }
        for (int t0 = 0; t0 < NQ; t0 += PT) {
            const int nt = NQ - t0 < PT ? NQ - t0 : PT;
            int joint = p1;   /* the positions of the span that all the tile's vectors see */
            for (int t = t0; t < t0 + nt; t++) joint = n_pos[t / G] < joint ? n_pos[t / G] : joint;
            const int np = joint > p0 ? (joint - p0) / 2 : 0;   /* whole pairs */
            for (int c0 = 0; c0 < HD / 16 && np > 0; c0 += NC)
                switch (nt) {
                case 6: pv_tile_bf16(6, HD, T == PK_KV_BF16, c0, NC, np, pp[t0] + p0 / 2, LDP, vt, accs[t0]); break;
                case 5: pv_tile_bf16(5, HD, T == PK_KV_BF16, c0, NC, np, pp[t0] + p0 / 2, LDP, vt, accs[t0]); break;
                case 4: pv_tile_bf16(4, HD, T == PK_KV_BF16, c0, NC, np, pp[t0] + p0 / 2, LDP, vt, accs[t0]); break;
                case 3: pv_tile_bf16(3, HD, T == PK_KV_BF16, c0, NC, np, pp[t0] + p0 / 2, LDP, vt, accs[t0]); break;
                case 2: pv_tile_bf16(2, HD, T == PK_KV_BF16, c0, NC, np, pp[t0] + p0 / 2, LDP, vt, accs[t0]); break;
                default: pv_tile_bf16(1, HD, T == PK_KV_BF16, c0, NC, np, pp[t0] + p0 / 2, LDP, vt, accs[t0]); break;
                }
            const int from = p0 + 2 * np;
            for (int t = t0; t < t0 + nt; t++) {   /* each vector on to its own end */
                const int end = n_pos[t / G] < p1 ? n_pos[t / G] : p1, whole = end > from ? (end - from) / 2 : 0;
                for (int c0 = 0; c0 < HD / 16 && whole > 0; c0 += NC)
                    pv_tile_bf16(1, HD, T == PK_KV_BF16, c0, NC, whole, pp[t] + from / 2, LDP,
                                 vt + (size_t)(from - p0) / 2 * HD, accs[t]);
                if (end > from && (end - from) % 2)   /* an odd last position: p1 is even unless n_max */
                    pv_half_bf16(HD, pp[t][(end - 1) / 2], vt + (size_t)(end - 1 - p0) / 2 * HD, accs[t]);
            }
        }
    }
    for (int t = 0; t < NQ; t++)
        for (int i = 0; i < HD; i++) out[(t / G) * ldo + (t % G) * HD + i] = accs[t][i];
}

#define ATTEND_BF16(G, HD)                                                                         \
    PK_BF16_TARGET static void attend_bf16_f16_g##G##_hd##HD(int R, const int *n_pos, const float *q, size_t ldq, \
                                                             const pk_kv_head *kv, float scale, float *scores, \
                                                             size_t ld_scores, float *out, size_t ldo, float *ml) { \
        attend_rows_bf16(G, HD, PK_KV_F16, R, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml); \
    }                                                                                              \
    PK_BF16_TARGET static void attend_bf16_q8_g##G##_hd##HD(int R, const int *n_pos, const float *q, size_t ldq, \
                                                            const pk_kv_head *kv, float scale, float *scores, \
                                                            size_t ld_scores, float *out, size_t ldo, float *ml) { \
        attend_rows_bf16(G, HD, PK_KV_Q8, R, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml); \
    }                                                                                              \
    PK_BF16_TARGET static void attend_bf16_bf16_g##G##_hd##HD(int R, const int *n_pos, const float *q, size_t ldq, \
                                                              const pk_kv_head *kv, float scale, float *scores, \
                                                              size_t ld_scores, float *out, size_t ldo, float *ml) { \
        attend_rows_bf16(G, HD, PK_KV_BF16, R, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml); \
    }
PK_ATTEND_SHAPES(ATTEND_BF16)
#undef ATTEND_BF16
#endif

int pk_attend_rows_bf16(int rows, const int *n_pos, int group, int hd, const float *q, size_t ldq,
                        const pk_kv_head *kv, float scale, float *scores, size_t ld_scores, float *out, size_t ldo,
                        float *ml) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int runs = -1;   /* a benign race: every thread stores the same value */
    if (runs < 0) runs = pk_attend_bf16_runs();
    if (!runs || kv->type == PK_KV_F32 || rows < 1 || rows > PK_ATTEND_ROWS) return 0;
#define CASE(G, HD) if (group == G && hd == HD) {                                                  \
        (kv->type == PK_KV_F16 ? attend_bf16_f16_g##G##_hd##HD                                    \
         : kv->type == PK_KV_BF16 ? attend_bf16_bf16_g##G##_hd##HD : attend_bf16_q8_g##G##_hd##HD)( \
            rows, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml);                     \
        return 1; }
    PK_ATTEND_SHAPES(CASE)
#undef CASE
#else
    (void)rows, (void)n_pos, (void)group, (void)hd, (void)q, (void)ldq, (void)kv, (void)scale, (void)scores,
        (void)ld_scores, (void)out, (void)ldo, (void)ml;
#endif
    return 0;
}
