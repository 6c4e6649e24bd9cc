/* Attention over a KV cache (pk_nn.h; the cache's layout: contract/pk_kv.h): the fast paths
 * for the family's (group, head size) shapes, as plain C loops compiled once per ISA clone
 * (PK_CLONES) with the AVX-512 and AVX2 inner steps of isa/attention_x86_*.h inlined into
 * theirs; the chunking of long contexts (pk_attend_part, pk_attend_merge); several rows of a
 * prefill over one converted span (pk_attend_rows). The reference order they all keep is
 * pk_attention_reference.c's. */
#include "pk_nn.h"

#include <math.h>
#include <string.h>

#include "pk_ops_internal.h"   /* PK_CLONES, pk_attend_part_reference */
#include "pk_softmax.h"        /* max_f32, exp_sum, scale_f32, exp_nonpos */

/* The K cache is position-blocked (contract/pk_kv.h): block jb holds positions 16jb..16jb+15 as
 * [head_dim][16], so the scores of 16 positions are one vector accumulated over head_dim from
 * contiguous memory. The fast path handles the G query heads that share one K/V head (GQA) in
 * one pass, each K and V row read once for all of them; `acc` stays in registers when HD is a
 * compile-time 64 or 128. An f16, q8 or bf16 cache is read one block of 16 positions at a time:
 * the block's K (and then its V rows) converted into a tile that stays in L1 (f16 by the ISA's
 * f16 -> f32 instruction; q8 as int8 times its group's scale; bf16 out of its pairs, a shift),
 * and the same float code runs on the tile. The conversions are exact, and per head the
 * arithmetic and its order are those of the reference (pk_attend_group_reference), so every
 * path and every cache type agree with it bit for bit. Decode runs one row here; a prefill
 * window of a converted cache goes through attend_rows_conv below, a sliding window's rows too
 * (pk_attend_rows_window). */

/* Query-key scores on K's blocked layout: a block of 16 positions is 16 lanes per dimension.
 * Every path sums over i in order, one fused multiply-add per term (__builtin_fmaf, written
 * out: -ffp-contract=off fuses nothing by itself, so every path, the reference and -O1
 * builds included, rounds alike). The V sums likewise. A separate product and add cost two
 * instructions on the two FMA ports of an Intel core: attention at depth ran at half its
 * rate. One block at a time leaves G independent sums
 * (3 for SmolLM2), each add waiting on the one before: a third of the adders' rate on
 * AVX-512. Where AVX-512 runs, qk_blocks sums G heads x QK_NB blocks at once (one zmm each:
 * 12 chains for G = 3); elsewhere (AVX2 clones, NEON, where 16 floats take 2 or 4 registers
 * and 12 such sums spill) the plain loops below, one block at a time, which the compiler
 * vectorizes well. benchmarks: docs/KERNELS.md. */
_Static_assert(PK_KV_BLOCK == 16, "a K block is one zmm per dimension");
#define QK_NB 4

/* Whether this clone runs on AVX-512: a clone cannot test its target at compile time, so the
 * AVX-512 clone asks the CPU (a load and a predictable branch per call). */
#if defined(PK_CLONES_ON)
#define QK_WIDE() __builtin_cpu_supports("avx512f")
#elif defined(__AVX512F__)
#define QK_WIDE() 1
#else
#define QK_WIDE() 0
#endif
/* Whether the q8 cache's values are widened by AVX2 (when QK_WIDE() is not): the AVX2 clone
 * asks, as above. */
#if defined(PK_CLONES_ON)
#define Q8_AVX2() __builtin_cpu_supports("avx2")
#elif defined(__AVX2__)
#define Q8_AVX2() 1
#else
#define Q8_AVX2() 0
#endif

#define QK_T 6   /* 6 x QK_NB = 24 sums in zmm registers, with 4 K vectors and a broadcast */
#include "../isa/attention_x86_avx512.h"   /* qk_blocks, max_wide, pv_tile, q8_k_wide, q8_v_wide */
#include "../isa/attention_x86_avx2.h"     /* q8_k_avx2, q8_v_avx2 */

/* scores[g * ld + j] for positions j in [j0, end) from the K blocks at blk (j0's block first,
 * j0 a multiple of 16; K is padded to whole blocks, so the block of end - 1 is whole). padded:
 * blk holds whole groups of QK_NB blocks (a converted tile, its blocks past end zeroed), so
 * that the tail of the span goes through qk_blocks too; the plain loop below, one block at a
 * time, came out as scalar FMAs and lane inserts in the AVX-512 clone. Scores past end are
 * computed and dropped: each lane's sum is its own, so the others' bits do not change. */
static inline __attribute__((always_inline)) void qk_span(const int G, const int HD, const float *restrict qs,
                                                          const float *restrict blk, int j0, int end,
                                                          float *restrict scores, size_t ld, const int padded) {
    const int wide = QK_WIDE();
    for (int j = j0; j < end;) {
        const int left = (end - j + PK_KV_BLOCK - 1) / PK_KV_BLOCK;
        const int nb = wide && (padded || left >= QK_NB) ? QK_NB : 1;
        const float *restrict kb = blk + (size_t)(j - j0) * HD;
        const int nv = end - j < nb * PK_KV_BLOCK ? end - j : nb * PK_KV_BLOCK;
        if (nb == QK_NB) {
            float s[4 * QK_NB * PK_KV_BLOCK];
            qk_blocks(G, HD, qs, kb, s);
            for (int g = 0; g < G; g++) memcpy(scores + g * ld + j, s + g * QK_NB * PK_KV_BLOCK, sizeof(float) * nv);
        } else {
            float s[4][PK_KV_BLOCK];   /* G <= 4; a fixed size, so that the fmaf loop vectorizes */
            for (int g = 0; g < G; g++)
                for (int l = 0; l < PK_KV_BLOCK; l++) s[g][l] = 0.0f;
            for (int i = 0; i < HD; i++)
                for (int g = 0; g < G; g++)
                    for (int l = 0; l < PK_KV_BLOCK; l++)
                        s[g][l] = __builtin_fmaf(qs[g * HD + i], kb[i * PK_KV_BLOCK + l], s[g][l]);
            for (int g = 0; g < G; g++)
                for (int l = 0; l < nv; l++) scores[g * ld + j + l] = s[g][l];
        }
        j += nb * PK_KV_BLOCK;
    }
}

/* acc[g][i] += p[g][j] * V[j][i] for the n rows of V at v ([n][HD]) and their weights
 * p[g][j] = sc[g * ld + j], j in order; acc in memory ([G][HD]), in registers meanwhile (a
 * fixed-size copy: over a variable-length array GCC left the fmaf loop scalar). */
static inline __attribute__((always_inline)) void pv_rows(const int G, const int HD, int n,
                                                          const float *restrict sc, size_t ld,
                                                          const float *restrict v, float *restrict acc) {
    float a[4][256];   /* G <= 4, HD <= 256: the fast paths' shapes */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < HD; i++) a[g][i] = acc[g * HD + i];
    for (int j = 0; j < n; j++) {
        const float *restrict vj = v + (size_t)j * HD;
        for (int g = 0; g < G; g++) {
            const float p = sc[g * ld + j];
            for (int i = 0; i < HD; i++) a[g][i] = __builtin_fmaf(p, vj[i], a[g][i]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < HD; i++) acc[g * HD + i] = a[g][i];
}

/* The most positions converted at once (a prefill window's span). */
#define KV_SPAN 128

/* K blocks [b0, b0 + nb) of a converted (f16, q8 or bf16) cache as f32, [nb][HD][16];
 * nb * 16 <= KV_SPAN. */
static inline __attribute__((always_inline)) void kv_k_to_f32(const pk_kv_type T, const int HD,
                                                              const pk_kv_head *kv, size_t b0, size_t nb,
                                                              float *restrict tile) {
    const size_t e0 = b0 * PK_KV_BLOCK * HD;
    if (T == PK_KV_F16) {
        kv->f16(nb * PK_KV_BLOCK * HD, (const uint16_t *)kv->k + e0, tile);
        return;
    }
    if (T == PK_KV_BF16) {   /* pair row r (dimensions 2p, 2p + 1 of a block) to rows 2r, 2r + 1 */
        const uint16_t *restrict k16 = (const uint16_t *)kv->k + e0;
        for (size_t r = 0; r < nb * HD / 2; r++)
            for (int l = 0; l < PK_KV_BLOCK; l++) {
                tile[2 * r * PK_KV_BLOCK + l] = pk_bf16_to_f32(k16[2 * (r * PK_KV_BLOCK + l)]);
                tile[(2 * r + 1) * PK_KV_BLOCK + l] = pk_bf16_to_f32(k16[2 * (r * PK_KV_BLOCK + l) + 1]);
            }
        return;
    }
    const int NS = HD / PK_KV_Q8_GROUP * PK_KV_BLOCK;   /* scales per block, [HD/32][16] as K's blocked order */
    float sc[KV_SPAN / PK_KV_BLOCK * NS];                 /* the scales of all nb blocks: one call */
    kv->f16(nb * NS, kv->k_scale + e0 / PK_KV_Q8_GROUP, sc);
    if (QK_WIDE()) {
        q8_k_wide(HD, nb, (const int8_t *)kv->k + e0, sc, tile);
        return;
    }
    if (Q8_AVX2()) {
        q8_k_avx2(HD, nb, (const int8_t *)kv->k + e0, sc, tile);
        return;
    }
    for (size_t b = 0; b < nb; b++) {
        const int8_t *restrict k8 = (const int8_t *)kv->k + e0 + b * PK_KV_BLOCK * HD;
        const float *restrict sb = sc + b * NS;
        float *restrict t = tile + b * PK_KV_BLOCK * HD;
        for (int i = 0; i < HD; i++)
            for (int l = 0; l < PK_KV_BLOCK; l++)
                t[i * PK_KV_BLOCK + l] = (float)k8[i * PK_KV_BLOCK + l] * sb[i / PK_KV_Q8_GROUP * PK_KV_BLOCK + l];
    }
}

/* V rows [j0, j0 + n) of a converted cache as f32, [n][HD]; n <= KV_SPAN. */
static inline __attribute__((always_inline)) void kv_v_to_f32(const pk_kv_type T, const int HD,
                                                              const pk_kv_head *kv, size_t j0, size_t n,
                                                              float *restrict tile) {
    if (T == PK_KV_F16) {
        kv->f16(n * HD, (const uint16_t *)kv->v + j0 * HD, tile);
        return;
    }
    if (T == PK_KV_BF16) {   /* j0 any position (a window's start): row j is one half of its pairs */
        for (size_t j = 0; j < n; j++) {
            const uint16_t *restrict vj = (const uint16_t *)kv->v + pk_kv_bf16_v_at(HD, (int)(j0 + j), 0);
            for (int i = 0; i < HD; i++) tile[j * HD + i] = pk_bf16_to_f32(vj[2 * i]);
        }
        return;
    }
    const int GPR = HD / PK_KV_Q8_GROUP;   /* groups per row */
    float sc[KV_SPAN * GPR];
    kv->f16(n * GPR, kv->v_scale + j0 * GPR, sc);
    const int8_t *restrict v8 = (const int8_t *)kv->v + j0 * HD;
    if (QK_WIDE()) {
        q8_v_wide(HD, n, v8, sc, tile);
        return;
    }
    if (Q8_AVX2()) {
        q8_v_avx2(HD, n, v8, sc, tile);
        return;
    }
    for (size_t j = 0; j < n; j++)
        for (int c = 0; c < GPR; c++) {
            const float s = sc[j * GPR + c];
            for (int i = 0; i < PK_KV_Q8_GROUP; i++)
                tile[j * HD + c * PK_KV_Q8_GROUP + i] = (float)v8[j * HD + c * PK_KV_Q8_GROUP + i] * s;
        }
}

/* Asks for values [e0, e0 + n) of a converted cache's K or V (f16, or int8 and its scales)
 * ahead of their use: a decode row's attention streams its head's cache once, and reading it
 * span by span between the arithmetic left it at about half of a core's read bandwidth
 * (docs/KERNELS.md). */
static inline __attribute__((always_inline)) void prefetch_kv(const pk_kv_type T, const void *values,
                                                              const uint16_t *scales, size_t e0, size_t n) {
    const size_t vb = pk_kv_value_bytes(T);
    const char *p = (const char *)values + e0 * vb;
    for (size_t b = 0; b < n * vb; b += 64) __builtin_prefetch(p + b, 0, 2);
    if (T == PK_KV_Q8) {
        const char *s = (const char *)(scales + e0 / PK_KV_Q8_GROUP);
        for (size_t b = 0; b < n / PK_KV_Q8_GROUP * 2; b += 64) __builtin_prefetch(s + b, 0, 2);
    }
}

/* Zeroes the blocks of a K tile from block nb up to the next multiple of QK_NB (where
 * AVX-512 runs: qk_span's padded tiles). A tile holds whole groups of QK_NB blocks. */
static inline __attribute__((always_inline)) void tile_pad(const int HD, int nb, float *restrict tile) {
    if (!QK_WIDE() || nb % QK_NB == 0) return;
    const int to = (nb + QK_NB - 1) / QK_NB * QK_NB;
    memset(tile + (size_t)nb * PK_KV_BLOCK * HD, 0, sizeof(float) * (size_t)(to - nb) * PK_KV_BLOCK * HD);
}

/* Positions [lo, n_pos) of kv (a window's start lo anywhere, here and in attend_rows_conv: the
 * scores of its block's positions before lo are computed and dropped, each lane's sum its
 * own; the softmax and the V sums start at lo, as the reference's partial from lo). */
static inline __attribute__((always_inline)) void attend_fast(const int G, const int HD, const pk_kv_type T,
                                                              int lo, int n_pos, const float *restrict q,
                                                              const pk_kv_head *kv, float scale,
                                                              float *restrict scores, size_t ld_scores,
                                                              float *restrict out, float *restrict ml) {
    float tile[QK_NB * PK_KV_BLOCK * HD];   /* QK_NB blocks of K, or 16 rows of V, as f32 (converted cache) */
    float qs[G * HD];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < HD; i++) qs[g * HD + i] = q[g * HD + i] * scale;
    const int b0 = lo / PK_KV_BLOCK * PK_KV_BLOCK;   /* lo's block */
    if (T == PK_KV_F32) {
        qk_span(G, HD, qs, (const float *)kv->k + (size_t)b0 * HD, b0, n_pos, scores, ld_scores, 0);
    } else {
        for (int j0 = b0; j0 < n_pos; j0 += QK_NB * PK_KV_BLOCK) {
            const int end = n_pos - j0 < QK_NB * PK_KV_BLOCK ? n_pos : j0 + QK_NB * PK_KV_BLOCK;
            const int nb = (end - j0 + PK_KV_BLOCK - 1) / PK_KV_BLOCK;
            kv_k_to_f32(T, HD, kv, (size_t)j0 / PK_KV_BLOCK, (size_t)nb, tile);
            if (end < n_pos) prefetch_kv(T, kv->k, kv->k_scale, (size_t)end * HD, (size_t)QK_NB * PK_KV_BLOCK * HD);
            tile_pad(HD, nb, tile);
            qk_span(G, HD, qs, tile, j0, end, scores, ld_scores, 1);
        }
    }
    const int n = n_pos - lo;
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * ld_scores + lo;
        const float mx = QK_WIDE() ? max_wide(n, sg) : max_f32(n, sg);
        const float sum = exp_sum(n, sg, mx);
        scale_f32(n, sg, 1.0f / sum);
        ml[2 * g] = mx, ml[2 * g + 1] = sum;
    }
    float acc[G][HD];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    for (int j0 = lo; j0 < n_pos; j0 += QK_NB * PK_KV_BLOCK) {   /* V rows QK_NB blocks at a time */
        const int nv = n_pos - j0 < QK_NB * PK_KV_BLOCK ? n_pos - j0 : QK_NB * PK_KV_BLOCK;
        const float *restrict vb = tile;
        if (T == PK_KV_F32) vb = (const float *)kv->v + (size_t)j0 * HD;
        else kv_v_to_f32(T, HD, kv, (size_t)j0, (size_t)nv, tile);
        if (T != PK_KV_F32 && j0 + nv < n_pos) prefetch_kv(T, kv->v, kv->v_scale, (size_t)(j0 + nv) * HD, (size_t)nv * HD);
        pv_rows(G, HD, nv, scores + j0, ld_scores, vb, &acc[0][0]);   /* scores normalised above */
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < HD; i++) out[g * HD + i] = acc[g][i];
}

/* PK_ATTEND_SHAPES: the (group, head size) pairs with compiled kernels (pk_ops_internal.h). */
static int shape_compiled(int group, int hd) {
#define SHAPE(G, HD) if (group == G && hd == HD) return 1;
    PK_ATTEND_SHAPES(SHAPE)
#undef SHAPE
    return 0;
}

/* A group of more than 4 heads runs as fours and a remainder when those shapes are compiled:
 * each head's arithmetic is its own, so the split changes no bits. */
static int by_fours(int group, int hd) {
    return group > 4 && shape_compiled(4, hd) && (group % 4 == 0 || shape_compiled(group % 4, hd));
}

int pk_attend_is_fast(int group, int hd) { return shape_compiled(group, hd) || by_fours(group, hd); }

/* One function per (G, HD) and cache type, so that each keeps no test of the others. */
#define ATTEND(G, HD)                                                                              \
    PK_CLONES static void attend_f32_g##G##_hd##HD(int lo, int n_pos, const float *q, const pk_kv_head *kv, \
                                                   float scale, float *scores, size_t ld_scores, float *out, \
                                                   float *ml) {                                    \
        attend_fast(G, HD, PK_KV_F32, lo, n_pos, q, kv, scale, scores, ld_scores, out, ml);            \
    }                                                                                              \
    PK_CLONES static void attend_f16_g##G##_hd##HD(int lo, int n_pos, const float *q, const pk_kv_head *kv, \
                                                   float scale, float *scores, size_t ld_scores, float *out, \
                                                   float *ml) {                                    \
        attend_fast(G, HD, PK_KV_F16, lo, n_pos, q, kv, scale, scores, ld_scores, out, ml);            \
    }                                                                                              \
    PK_CLONES static void attend_q8_g##G##_hd##HD(int lo, int n_pos, const float *q, const pk_kv_head *kv, \
                                                  float scale, float *scores, size_t ld_scores, float *out, \
                                                  float *ml) {                                     \
        attend_fast(G, HD, PK_KV_Q8, lo, n_pos, q, kv, scale, scores, ld_scores, out, ml);             \
    }                                                                                              \
    PK_CLONES static void attend_bf16_g##G##_hd##HD(int lo, int n_pos, const float *q, const pk_kv_head *kv, \
                                                    float scale, float *scores, size_t ld_scores, float *out, \
                                                    float *ml) {                                   \
        attend_fast(G, HD, PK_KV_BF16, lo, n_pos, q, kv, scale, scores, ld_scores, out, ml);           \
    }
PK_ATTEND_SHAPES(ATTEND)
#undef ATTEND

/* A converted cache (f16, q8 or bf16) in a prefill chunk: R <= PK_ATTEND_ROWS query rows of one
 * sequence (row r sees positions [lo[r], n_pos[r]): a sliding window's rows each start at
 * their own lo) with G heads each, all over one K/V head. The
 * cache is converted once for all R rows, a span of KV_SPAN positions at a time (K, then V,
 * into a tile that stays in L2): the conversion per row cost about as much as the 2G
 * multiply-adds it feeds. On AVX-512 the R x G query vectors go through the span in tiles of
 * up to QK_T (scores) and PV_T(HD) (V sums, 128 columns at a time) vectors, several rows' at once, so a K or V
 * vector loaded into a register feeds up to 6 sums; elsewhere row by row, attend_fast's loops.
 * A tile's V sums run jointly over the positions of the span all its rows see, each
 * vector alone before (from its own lo) and after (to its own end): j in order either way. Per row and head the arithmetic and its
 * order are attend_fast's (and the reference's). The f32 cache keeps attend_fast row by row,
 * which measured faster than sharing its reads (docs/KERNELS.md, "Attention over an f16 KV
 * cache"). */
#define PV_NC(HD) ((HD) > 128 ? 128 : (HD))   /* columns per V-sum tile: pv_tile's window */
#define PV_T(HD) (24 / (PV_NC(HD) / 16))     /* query vectors per V-sum tile: 6 for 64, 3 for 128+ */
static inline __attribute__((always_inline)) void attend_rows_conv(const int G, const int HD, const pk_kv_type T,
                                                                   int R, const int *lo, const int *n_pos,
                                                                   const float *restrict q,
                                                                   size_t ldq, const pk_kv_head *kv, float scale,
                                                                   float *restrict scores, size_t ld_scores,
                                                                   float *restrict out, size_t ldo,
                                                                   float *restrict ml) {
    float tile[KV_SPAN * HD];   /* K blocks or V rows of one span, as f32 */
    float accs[PK_ATTEND_ROWS * G][HD];   /* query vector t = r * G + g */
    float qs[PK_ATTEND_ROWS * G][HD];
    if (R < 1 || R > PK_ATTEND_ROWS) __builtin_unreachable();   /* pk_attend_rows splits larger sets */
    const int wide = QK_WIDE(), NQ = R * G;
    int n_max = 0, lo_min = n_pos[0];
    for (int r = 0; r < R; r++) n_max = n_pos[r] > n_max ? n_pos[r] : n_max;
    for (int r = 0; r < R; r++) lo_min = lo[r] < lo_min ? lo[r] : lo_min;
    const int b0 = lo_min / PK_KV_BLOCK * PK_KV_BLOCK;   /* spans from the first row's block on */
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < HD; i++) qs[r * G + g][i] = q[r * ldq + g * HD + i] * scale;
    for (int p0 = b0; p0 < n_max; p0 += KV_SPAN) {
        const int p1 = n_max - p0 < KV_SPAN ? n_max : p0 + KV_SPAN;
        /* K is padded to whole blocks: convert them all */
        const int nbk = (p1 - p0 + PK_KV_BLOCK - 1) / PK_KV_BLOCK;
        kv_k_to_f32(T, HD, kv, (size_t)p0 / PK_KV_BLOCK, (size_t)nbk, tile);
        if (p1 < n_max) prefetch_kv(T, kv->k, kv->k_scale, (size_t)p1 * HD, (size_t)KV_SPAN * HD);
        tile_pad(HD, nbk, tile);
        int j = p0;   /* the positions before j are scored for every row; QK_NB blocks at a time */
        if (wide)
            for (; j < p1; j += QK_NB * PK_KV_BLOCK)
                for (int t0 = 0; t0 < NQ; t0 += QK_T) {
                    float s[QK_T * QK_NB * PK_KV_BLOCK];
                    const int nt = NQ - t0 < QK_T ? NQ - t0 : QK_T;
                    const float *restrict kb = tile + (size_t)(j - p0) * HD;
                    switch (nt) {   /* a constant T in each: its sums in registers */
                    case 6: qk_blocks(6, HD, qs[t0], kb, s); break;
                    case 5: qk_blocks(5, HD, qs[t0], kb, s); break;
                    case 4: qk_blocks(4, HD, qs[t0], kb, s); break;
                    case 3: qk_blocks(3, HD, qs[t0], kb, s); break;
                    case 2: qk_blocks(2, HD, qs[t0], kb, s); break;
                    default: qk_blocks(1, HD, qs[t0], kb, s); break;
                    }
                    for (int t = 0; t < nt; t++) {
                        const int r = (t0 + t) / G, end = n_pos[r] < p1 ? n_pos[r] : p1;
                        const int nv = end - j < QK_NB * PK_KV_BLOCK ? end - j : QK_NB * PK_KV_BLOCK;
                        float *sg = scores + ((size_t)r * G + (t0 + t) % G) * ld_scores;
                        if (nv > 0) memcpy(sg + j, s + t * QK_NB * PK_KV_BLOCK, sizeof(float) * nv);
                    }
                }
        for (int r = 0; r < R; r++) {   /* the rest, row by row */
            const int end = n_pos[r] < p1 ? n_pos[r] : p1;
            if (end > j)
                qk_span(G, HD, qs[r * G], tile + (size_t)(j - p0) * HD, j, end, scores + (size_t)r * G * ld_scores,
                        ld_scores, 1);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int n = n_pos[r] - lo[r];
            float *sg = scores + ((size_t)r * G + g) * ld_scores + lo[r];
            const float mx = wide ? max_wide(n, sg) : max_f32(n, sg);
            const float sum = exp_sum(n, sg, mx);
            scale_f32(n, sg, 1.0f / sum);
            ml[(r * G + g) * 2] = mx, ml[(r * G + g) * 2 + 1] = sum;
            for (int i = 0; i < HD; i++) accs[r * G + g][i] = 0.0f;
        }
    for (int p0 = b0; p0 < n_max; p0 += KV_SPAN) {
        const int p1 = n_max - p0 < KV_SPAN ? n_max : p0 + KV_SPAN;
        kv_v_to_f32(T, HD, kv, (size_t)p0, (size_t)(p1 - p0), tile);
        if (p1 < n_max) prefetch_kv(T, kv->v, kv->v_scale, (size_t)p1 * HD, (size_t)KV_SPAN * HD);
        for (int t0 = 0; t0 < NQ;) {
            /* a tile of query vectors (without AVX-512: one row's G, pv_rows' registers);
             * scores normalised above */
            const int nt = !wide ? G : NQ - t0 < PV_T(HD) ? NQ - t0 : PV_T(HD);
            /* the positions of the span that all its rows see: [ja, je) */
            int ja = p0, je = p1;
            for (int t = t0; t < t0 + nt; t++) {
                ja = lo[t / G] > ja ? lo[t / G] : ja;
                je = n_pos[t / G] < je ? n_pos[t / G] : je;
            }
            if (!wide) {   /* one row's G, pv_rows' loops */
                if (je > ja)
                    pv_rows(G, HD, je - ja, scores + (size_t)t0 * ld_scores + ja, ld_scores,
                            tile + (size_t)(ja - p0) * HD, accs[t0]);
                t0 += nt;
                continue;
            }
            if (je <= ja) ja = je = p1;   /* none in common: each vector alone below */
            for (int t = t0; t < t0 + nt; t++) {   /* each vector from its own start */
                const int from = lo[t / G] > p0 ? lo[t / G] : p0, end = n_pos[t / G] < ja ? n_pos[t / G] : ja;
                if (end > from)
                    pv_rows(1, HD, end - from, scores + (size_t)t * ld_scores + from, ld_scores,
                            tile + (size_t)(from - p0) * HD, accs[t]);
            }
            const float *restrict st = scores + (size_t)t0 * ld_scores + ja, *restrict vt = tile + (size_t)(ja - p0) * HD;
            if (je > ja)
                for (int c0 = 0; c0 < HD; c0 += PV_NC(HD))
                    switch (nt) {
                    case 6: pv_tile(6, HD, c0, PV_NC(HD), je - ja, st, ld_scores, vt, accs[t0]); break;
                    case 5: pv_tile(5, HD, c0, PV_NC(HD), je - ja, st, ld_scores, vt, accs[t0]); break;
                    case 4: pv_tile(4, HD, c0, PV_NC(HD), je - ja, st, ld_scores, vt, accs[t0]); break;
                    case 3: pv_tile(3, HD, c0, PV_NC(HD), je - ja, st, ld_scores, vt, accs[t0]); break;
                    case 2: pv_tile(2, HD, c0, PV_NC(HD), je - ja, st, ld_scores, vt, accs[t0]); break;
                    default: pv_tile(1, HD, c0, PV_NC(HD), je - ja, st, ld_scores, vt, accs[t0]); break;
                    }
            for (int t = t0; t < t0 + nt; t++) {   /* each vector on to its own end */
                const int from = lo[t / G] > je ? lo[t / G] : je, end = n_pos[t / G] < p1 ? n_pos[t / G] : p1;
                if (end > from)
                    pv_rows(1, HD, end - from, scores + (size_t)t * ld_scores + from, ld_scores,
                            tile + (size_t)(from - p0) * HD, accs[t]);
            }
            t0 += nt;
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            for (int i = 0; i < HD; i++) out[r * ldo + g * HD + i] = accs[r * G + g][i];
}

#define ATTEND_ROWS(G, HD)                                                                         \
    PK_CLONES static void attend_rows_f16_g##G##_hd##HD(int R, const int *lo, const int *n_pos, const float *q, size_t ldq, \
                                                        const pk_kv_head *kv, float scale, float *scores, \
                                                        size_t ld_scores, float *out, size_t ldo, float *ml) { \
        attend_rows_conv(G, HD, PK_KV_F16, R, lo, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml); \
    }                                                                                              \
    PK_CLONES static void attend_rows_q8_g##G##_hd##HD(int R, const int *lo, const int *n_pos, const float *q, size_t ldq, \
                                                       const pk_kv_head *kv, float scale, float *scores, \
                                                       size_t ld_scores, float *out, size_t ldo, float *ml) { \
        attend_rows_conv(G, HD, PK_KV_Q8, R, lo, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml); \
    }                                                                                              \
    PK_CLONES static void attend_rows_bf16_g##G##_hd##HD(int R, const int *lo, const int *n_pos, const float *q, \
                                                         size_t ldq, const pk_kv_head *kv, float scale, float *scores, \
                                                         size_t ld_scores, float *out, size_t ldo, float *ml) { \
        attend_rows_conv(G, HD, PK_KV_BF16, R, lo, n_pos, q, ldq, kv, scale, scores, ld_scores, out, ldo, ml); \
    }
PK_ATTEND_SHAPES(ATTEND_ROWS)
#undef ATTEND_ROWS

/* Long contexts are attended in chunks of PK_ATTEND_CHUNK positions, each with its own
 * softmax (a partial: the normalised output and the (max, sum) of its scores), folded in
 * order by pk_attend_merge. Every path (reference, fast, rows, and the forward pass's split
 * of one decode row over threads) computes the same partials and folds them in the same
 * order, so they agree bit for bit whatever the thread count or batch. */

/* The cache of one head from position p0 on (K's blocks and V's rows both start at element
 * p0 * hd; p0 a multiple of PK_KV_BLOCK). */
static pk_kv_head kv_from(const pk_kv_head *kv, int hd, int p0) { return pk_kv_head_at(kv, (size_t)p0 * hd); }

/* The partial of positions [at + lo, at + n) of the cache (at a multiple of PK_KV_BLOCK, lo < n
 * any position: a window's start), its scores from position at on: the shape's kernel, or the
 * reference. A cache read in bf16 (pk_attention_bf16.c) is read so from a chunk's start only
 * (its V pairs count from there); a partial from inside a chunk (a sliding window's first
 * chunk, lo > 0 here, and pk_attend_rows_window sends every such row apart) runs the f32
 * arithmetic. So which one runs depends on the row alone, never on its batch. (It took the
 * reference's bf16 arithmetic until that made Gemma 3's prefill at depth 4096 20x slower.) */
static void attend_span(int group, int hd, int at, int lo, int n, const float *q, const pk_kv_head *kv,
                        float scale, float *scores, size_t ld_scores, float *out, float *ml) {
    pk_kv_head c = kv_from(kv, hd, at);
    if (lo > 0) c.dot_bf16 = 0;
    if (c.dot_bf16 && c.type != PK_KV_F32) {
        if (pk_attend_rows_bf16(1, &n, group, hd, q, 0, &c, scale, scores, ld_scores, out, 0, ml)) return;
        if (!by_fours(group, hd)) {
            pk_attend_span_reference(group, hd, lo, n - lo, q, &c, scale, scores, out, ml);
            return;
        }
    } else {
#define CASE(G, HD) if (group == G && hd == HD) {                                                  \
        (c.type == PK_KV_F32 ? attend_f32_g##G##_hd##HD                                            \
         : c.type == PK_KV_F16 ? attend_f16_g##G##_hd##HD                                          \
         : c.type == PK_KV_BF16 ? attend_bf16_g##G##_hd##HD : attend_q8_g##G##_hd##HD)(           \
            lo, n, q, &c, scale, scores, ld_scores, out, ml);                                      \
        return; }
    PK_ATTEND_SHAPES(CASE)
#undef CASE
    }
    if (by_fours(group, hd)) {
        for (int g = 0; g < group; g += 4)
            attend_span(group - g < 4 ? group - g : 4, hd, at, lo, n, q + (size_t)g * hd, kv, scale, scores,
                        ld_scores, out + (size_t)g * hd, ml + 2 * g);
        return;
    }
    pk_attend_span_reference(group, hd, lo, n - lo, q, &c, scale, scores, out, ml);
}

void pk_attend_part(int group, int hd, int p0, int n, const float *q, const pk_kv_head *kv, float scale,
                    float *scores, size_t ld_scores, float *out, float *ml) {
    attend_span(group, hd, p0, 0, n, q, kv, scale, scores, ld_scores, out, ml);
}

PK_CLONES void pk_attend_merge(int group, int hd, float *acc, float *acc_ml, const float *part, const float *ml) {
    for (int g = 0; g < group; g++) {
        const float m0 = acc_ml[2 * g], l0 = acc_ml[2 * g + 1], m1 = ml[2 * g], l1 = ml[2 * g + 1];
        const float m = m0 > m1 ? m0 : m1;
        const float w0 = l0 * exp_nonpos(m0 - m), w1 = l1 * exp_nonpos(m1 - m), l = w0 + w1, inv = 1.0f / l;
        float *a = acc + (size_t)g * hd;
        const float *p = part + (size_t)g * hd;
        for (int i = 0; i < hd; i++) a[i] = (a[i] * w0 + p[i] * w1) * inv;
        acc_ml[2 * g] = m, acc_ml[2 * g + 1] = l;
    }
}

/* Chunks after the first: their partials into a scratch and folded into out / ml. `part`
 * is the partial function (fast or reference) of chunk [p0, p0 + n). */
static void attend_chunks(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                          float *scores, size_t ld_scores, float *out, int reference) {
    float ml[2 * group], tmp[(size_t)group * hd], tml[2 * group];
    for (int p0 = 0; p0 < n_pos; p0 += PK_ATTEND_CHUNK) {
        const int n = n_pos - p0 < PK_ATTEND_CHUNK ? n_pos - p0 : PK_ATTEND_CHUNK;
        float *o = p0 ? tmp : out, *m = p0 ? tml : ml;
        if (reference) {
            const pk_kv_head c = kv_from(kv, hd, p0);
            pk_attend_part_reference(group, hd, n, q, &c, scale, scores, o, m);
        } else {
            pk_attend_part(group, hd, p0, n, q, kv, scale, scores, ld_scores, o, m);
        }
        if (p0) pk_attend_merge(group, hd, out, ml, tmp, tml);
    }
}

void pk_attend_group_reference(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                               float *scores, size_t ld_scores, float *out) {
    attend_chunks(group, hd, n_pos, q, kv, scale, scores, ld_scores, out, 1);
}

void pk_attend_group(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                     float *scores, size_t ld_scores, float *out) {
    attend_chunks(group, hd, n_pos, q, kv, scale, scores, ld_scores, out, 0);
}

/* Rows r < rows over the chunk's positions from `at` (a multiple of PK_KV_BLOCK): row r's
 * [at + lo[r], at + n[r]) (lo[r] < n[r], rows <= PK_ATTEND_ROWS), partials into out + r * ldo
 * and ml + r * 2 * group. A converted cache is converted once for all rows. */
static void attend_rows_part(int rows, const int *lo, const int *n, int group, int hd, int at, const float *q,
                             size_t ldq, const pk_kv_head *kv, float scale, float *scores, size_t ld_scores,
                             float *out, size_t ldo, float *ml) {
    if (kv->type != PK_KV_F32 && rows > 1) {
        const pk_kv_head c = kv_from(kv, hd, at);
        int from_start = 1;     /* the bf16 kernels' spans begin at the chunk's start (attend_span) */
        for (int r = 0; r < rows; r++) from_start &= lo[r] == 0;
        if (c.dot_bf16 && from_start &&
            pk_attend_rows_bf16(rows, n, group, hd, q, ldq, &c, scale, scores, ld_scores, out, ldo, ml))
            return;
        if (!c.dot_bf16) {
#define CASE(G, HD) if (group == G && hd == HD) {                                                  \
        (c.type == PK_KV_F16 ? attend_rows_f16_g##G##_hd##HD                                      \
         : c.type == PK_KV_BF16 ? attend_rows_bf16_g##G##_hd##HD : attend_rows_q8_g##G##_hd##HD)( \
            rows, lo, n, q, ldq, &c, scale, scores, ld_scores, out, ldo, ml);                      \
        return; }
        PK_ATTEND_SHAPES(CASE)
#undef CASE
        }
        if (by_fours(group, hd) && (!c.dot_bf16 || from_start)) {
            float ml4[PK_ATTEND_ROWS][4][2];
            for (int g = 0; g < group; g += 4) {
                const int ng = group - g < 4 ? group - g : 4;
                attend_rows_part(rows, lo, n, ng, hd, at, q + (size_t)g * hd, ldq, kv, scale, scores, ld_scores,
                                 out + (size_t)g * hd, ldo, &ml4[0][0][0]);
                for (int r = 0; r < rows; r++)
                    memcpy(ml + ((size_t)r * group + g) * 2, &ml4[0][0][0] + (size_t)r * 2 * ng, sizeof(float) * 2 * ng);
            }
            return;
        }
    }
    for (int r = 0; r < rows; r++)
        attend_span(group, hd, at, lo[r], n[r], q + (size_t)r * ldq, kv, scale, scores, ld_scores,
                    out + (size_t)r * ldo, ml + (size_t)r * 2 * group);
}

/* Per row, the partials of its chunks in order, the first as the result and each later one
 * folded in (pk_attend_merge): the chunks of pk_attend_group when lo = 0, and whichever rows
 * share a chunk compute their partials there together (a prefill window: a run of rows). */
void pk_attend_rows_window(int rows, const int *lo, const int *hi, int ring, int group, int hd, const float *q,
                           size_t ldq, const pk_kv_head *kv, float scale, float *scores, size_t ld_scores,
                           float *out, size_t ldo) {
    if (rows > PK_ATTEND_ROWS) {
        for (int r0 = 0; r0 < rows; r0 += PK_ATTEND_ROWS)
            pk_attend_rows_window(rows - r0 < PK_ATTEND_ROWS ? rows - r0 : PK_ATTEND_ROWS, lo + r0, hi + r0, ring,
                                  group, hd, q + (size_t)r0 * ldq, ldq, kv, scale, scores, ld_scores,
                                  out + (size_t)r0 * ldo, ldo);
        return;
    }
    int lo_min = lo[0], hi_max = 0;
    for (int r = 0; r < rows; r++) {
        lo_min = lo[r] < lo_min ? lo[r] : lo_min;
        hi_max = hi[r] > hi_max ? hi[r] : hi_max;
    }
    float ml[PK_ATTEND_ROWS * 2 * group], tml[PK_ATTEND_ROWS * 2 * group], tmp[(size_t)rows * group * hd];
    for (int c0 = lo_min / PK_ATTEND_CHUNK * PK_ATTEND_CHUNK; c0 < hi_max; c0 += PK_ATTEND_CHUNK) {
        /* the rows that see this chunk, each with its positions in it, from the block of the
         * first one's start (a ring holds the chunk whole: ring is a multiple of the chunk) */
        int idx[PK_ATTEND_ROWS] = {0}, s[PK_ATTEND_ROWS], e[PK_ATTEND_ROWS], k = 0;
        for (int r = 0; r < rows; r++) {
            const int a = lo[r] > c0 ? lo[r] : c0, b = hi[r] < c0 + PK_ATTEND_CHUNK ? hi[r] : c0 + PK_ATTEND_CHUNK;
            if (a >= b) continue;
            idx[k] = r, s[k] = a, e[k++] = b;
        }
        if (!k) continue;
        /* bf16 reads a chunk from its start only (attend_span): the rows whose window starts
         * inside this chunk go apart, in f32 (pass 1) */
        const int split = kv->dot_bf16 && kv->type != PK_KV_F32;
        for (int pass = 0; pass <= split; pass++) {
            pk_kv_head v = *kv;
            if (pass) v.dot_bf16 = 0;
            int sel[PK_ATTEND_ROWS], m = 0, from = hi_max;   /* sel: indices into idx, s, e */
            for (int i = 0; i < k; i++)
                if (!split || (s[i] > c0) == pass) {
                    sel[m++] = i;
                    from = s[i] < from ? s[i] : from;
                }
            if (!m) continue;
            const int base = from / PK_KV_BLOCK * PK_KV_BLOCK, at = (ring ? c0 % ring : c0) + (base - c0);
            int ss[PK_ATTEND_ROWS], ee[PK_ATTEND_ROWS];
            for (int j = 0; j < m; j++) ss[j] = s[sel[j]] - base, ee[j] = e[sel[j]] - base;
            /* the rows as a run when they are one (a prefill window's rows), else one by one */
            if (sel[m - 1] - sel[0] + 1 == m && idx[sel[m - 1]] - idx[sel[0]] + 1 == m) {
                attend_rows_part(m, ss, ee, group, hd, at, q + (size_t)idx[sel[0]] * ldq, ldq, &v, scale, scores,
                                 ld_scores, tmp + (size_t)sel[0] * group * hd, (size_t)group * hd,
                                 tml + (size_t)sel[0] * 2 * group);
            } else {
                for (int j = 0; j < m; j++)
                    attend_span(group, hd, at, ss[j], ee[j], q + (size_t)idx[sel[j]] * ldq, &v, scale, scores,
                                ld_scores, tmp + (size_t)sel[j] * group * hd, tml + (size_t)sel[j] * 2 * group);
            }
        }
        for (int i = 0; i < k; i++) {
            const int r = idx[i];
            float *o = out + (size_t)r * ldo, *m = ml + (size_t)r * 2 * group;
            const float *t = tmp + (size_t)i * group * hd, *tm = tml + (size_t)i * 2 * group;
            if (lo[r] >= c0) {   /* the row's first chunk */
                memcpy(o, t, sizeof(float) * (size_t)group * hd);
                memcpy(m, tm, sizeof(float) * 2 * group);
            } else {
                pk_attend_merge(group, hd, o, m, t, tm);
            }
        }
    }
}

void pk_attend_rows(int rows, const int *n_pos, int group, int hd, const float *q, size_t ldq,
                    const pk_kv_head *kv, float scale, float *scores, size_t ld_scores, float *out, size_t ldo) {
    int lo[rows];
    memset(lo, 0, sizeof lo);
    pk_attend_rows_window(rows, lo, n_pos, 0, group, hd, q, ldq, kv, scale, scores, ld_scores, out, ldo);
}

void pk_attend_window(int group, int hd, int lo, int hi, int ring, const float *q, const pk_kv_head *kv,
                      float scale, float *scores, size_t ld_scores, float *out) {
    pk_attend_rows_window(1, &lo, &hi, ring, group, hd, q, 0, kv, scale, scores, ld_scores, out, 0);
}
