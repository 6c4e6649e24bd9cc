/* x86 AVX-512 VNNI kernels (EVEX vpdpbusd on zmm). docs/KERNELS.md describes the kernels;
 * docs/FORMAT.md the arithmetic; contract/pk_pack.h the repacked copies they read, made at prepare
 * time.
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes, four products per int32 lane.
 *
 * qsi4c32 / qsi6c32 (p16 copy: 16-row panels of unsigned w + off, off 8 or 32): one
 *   micro-kernel, z_qp16_tile, for the GEMV (8x16: up to 8 activation rows x one 16-row panel
 *   per weight load, so m <= 8 reads the weights once) and the GEMM (6x32: 6 rows x two
 *   panels, m >= 9); the rows left after whole tiles make one more tile. Weights are the unsigned
 *   operand, activations signed and broadcast 4 bytes at a time; each block's int32
 *   accumulator starts at -off * sum_{k in block} a. GEMV and GEMM do the same per-output
 *   arithmetic, so their results are bit-identical whatever M is.
 * qsi8cx GEMV (p4 copy, 1x4: 4-row tiles, one memory stream per tile): activations become
 *   unsigned (q ^ 0x80 = q + 128) and weights stay signed; sum_k (q+128) w = D + 128 sum_k w,
 *   and the 128 folds into the zero point: dst = (scale * s) * (D' - (zp + 128) isum).
 * qsi8cx GEMM (6x32): a panel of 32 weight rows is transposed per call from the p4 copy into a
 *   per-thread buffer (x86_avx512_panel.h: dword j of a vector = 4 consecutive k of row j)
 *   holding unsigned w + 128; activations are signed; the accumulator starts at -128 sum a.
 * The AVX-512 row helpers (FWHT, f16 conversion, quantizer): isa/fwht_f16_qai8dx_x86_avx512vnni.c. */
#include "../contract/pk_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "x86_common.h"

#define ZMR 6    /* GEMM tiles: 6 activation rows (x 32 weight rows) */
#define ZVMR 8   /* p16 GEMV tiles: up to 8 activation rows x one 16-row panel */
#define ZQMR 8   /* the most activation rows of any p16 tile */
/* Software prefetch distance of the p16 kernels, in bytes of a panel ahead of the loads: the
 * hardware prefetchers alone left a 1-8 row pass waiting on DRAM (docs/KERNELS.md). */
#define ZPF 4096
#include "x86_avx512_panel.h"   /* ZNR = 32-row weight panels */

#define Z_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define Z_INLINE static inline __attribute__((always_inline)) Z_TARGET

/* ====================================================================================
 * AVX-512 VNNI, GEMV and GEMM: qai8dx x qsi4c32 / qsi6c32 (p16 copy)
 * ==================================================================================== */

/* acc + dot4(u, a) per int32 lane. GCC's _mm512_dpbusd_epi32 copied the accumulator into
 * another register before nearly every vpdpbusd of a tile (one extra move each, and the 6x32
 * tile ran slower: docs/KERNELS.md); the asm ties it to one register. Same instruction. */
Z_INLINE __m512i z_dpbusd(__m512i acc, __m512i u, __m512i a) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(a));
    return acc;
}

/* One k-octet (8 k) of the tile: wl / wh hold k-quads 0-3 / 4-7 of 16 weight rows per panel;
 * activation bytes k..k+7 of row i at ar[i] + ko. With one panel the wh products go to
 * acc[i][1], a second chain (summed per block: exact), so that 8 rows keep 16 vpdpbusd in
 * flight rather than 8 chains of 2. */
Z_INLINE void z_qp16_octet(const int MR, const int NP, __m512i acc[][2], const __m512i wl[2], const __m512i wh[2],
                           const int8_t *const ar[], size_t ko) {
    for (int i = 0; i < MR; i++) {
        const __m512i al = _mm512_set1_epi32(pk_load_i32(ar[i] + ko)), ah = _mm512_set1_epi32(pk_load_i32(ar[i] + ko + 4));
        if (NP == 1) {
            acc[i][0] = z_dpbusd(acc[i][0], wl[0], al);
            acc[i][1] = z_dpbusd(acc[i][1], wh[0], ah);
        } else {
            for (int p = 0; p < NP; p++) {
                acc[i][p] = z_dpbusd(acc[i][p], wl[p], al);
                acc[i][p] = z_dpbusd(acc[i][p], wh[p], ah);
            }
        }
    }
}

/* The per-block corrections of the activation rows: row i, block b is mul * v[i * ld + b]
 * (mul 1: made by z_qp16_lhs; mul -off: the rows' block sums, pk_lhs.bsum32, as they are). */
typedef struct {
    const int32_t *v;
    int ld, mul;
} z_corr;

/* MR activation rows x NP panels (16 weight rows each) of the p16 copy (contract/pk_pack.h).
 * Per output (row i, weight row j), for every block b in order:
 *     acc = corr[i][b] + sum_q dot4(u_q, a_q)        (exact int32: u = w + off, corr = -off sum a)
 *     f   = fma(float(acc), s_b[j], f)
 * then dst = scale_i * (f - zp_i * R_j). D32 (qsi8d32 activations, run_d32): the blocks are the
 * activations' blocks of 32 (a weight block of bl spans sdiv = bl / 32 of them), the multiply is
 *     f   = fma(float(acc), s_{b / sdiv}[j] * as_i[b], f)
 * and dst = f (symmetric: no zero-point term). Every tile (GEMV: MR <= 8, NP = 1; GEMM: MR <= 6,
 * NP = 1 or 2) does exactly this, so a row's result is bit-identical whatever M is and whichever
 * tile computed it. (The int32 sums may be added in any order: they are exact.)
 * BITS 4: qsi4c32 (off 8, 64 bytes per k-octet); BITS 6: qsi6c32 (off 32, per 16 k two nibble
 * pieces and one piece of top bits, OR-ed into bits 4-5 of each unsigned byte). */
Z_INLINE void z_qp16_tile(const int BITS, const int MR, const int NP, const int PAIRS, const int D32, const pk_lhs *lhs,
                          int i0, const int8_t *a, size_t lda, z_corr corr, int nb, int bl, int sdiv, const uint8_t *w,
                          size_t panel_bytes, const uint16_t *s, size_t panel_scales, const float *rs, int c0, int c1,
                          float *dst, size_t ldd, float lo, float hi) {
    const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const int opb = bl / 8;   /* k-octets per block */
    const int8_t *ar[ZQMR];
    for (int i = 0; i < MR; i++) ar[i] = a + (size_t)(i0 + i) * lda;
    __m512 f[ZQMR][2];
    for (int i = 0; i < MR; i++)
        for (int p = 0; p < NP; p++) f[i][p] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i acc[ZQMR][2];
        for (int i = 0; i < MR; i++)
            for (int p = 0; p < NP; p++) acc[i][p] = _mm512_set1_epi32(corr.mul * corr.v[(size_t)(i0 + i) * corr.ld + b]);
        if (NP == 1)
            for (int i = 0; i < MR; i++) acc[i][1] = _mm512_setzero_si512();
        if (BITS == 4) {
            for (int o = b * opb; o < (b + 1) * opb; o++) {   /* 64 bytes per panel and k-octet */
                __m512i wl[2], wh[2];
                for (int p = 0; p < NP; p++) {
                    _mm_prefetch((const char *)(w + p * panel_bytes + (size_t)64 * o + ZPF), _MM_HINT_T0);
                    const __m512i v = _mm512_load_si512(w + p * panel_bytes + (size_t)64 * o);
                    wl[p] = _mm512_and_si512(v, m0f);
                    wh[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
                }
                z_qp16_octet(MR, NP, acc, wl, wh, ar, (size_t)8 * o);
            }
        } else {
            for (int o2 = b * opb; o2 < (b + 1) * opb; o2 += 2) {   /* two k-octets: 192 bytes per panel */
                for (int h = 0; h < 2; h++) {   /* top bits: 0-1 / 2-3 of the piece for octet o2, 4-5 / 6-7 for o2+1 */
                    __m512i wl[2], wh[2];
                    for (int p = 0; p < NP; p++) {
                        const uint8_t *wp = w + p * panel_bytes + (size_t)96 * o2;
                        _mm_prefetch((const char *)(wp + 64 * h + ZPF), _MM_HINT_T0);
                        if (h == 0) _mm_prefetch((const char *)(wp + 128 + ZPF), _MM_HINT_T0);
                        const __m512i v = _mm512_load_si512(wp + 64 * h), t = _mm512_load_si512(wp + 128);
                        const __m512i tl = h ? t : _mm512_slli_epi16(t, 4);
                        const __m512i th = h ? _mm512_srli_epi16(t, 2) : _mm512_slli_epi16(t, 2);
                        wl[p] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, m0f), tl, m30, 0xF8);   /* a | (b & c) */
                        wh[p] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), m0f), th, m30, 0xF8);
                    }
                    z_qp16_octet(MR, NP, acc, wl, wh, ar, (size_t)8 * (o2 + h));
                }
            }
        }
        if (NP == 1)   /* the two chains; exact: int32 sums in any order */
            for (int i = 0; i < MR; i++) acc[i][0] = _mm512_add_epi32(acc[i][0], acc[i][1]);
        for (int p = 0; p < NP; p++) {
            const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(s + p * panel_scales + (size_t)16 * (D32 ? b / sdiv : b)))), 16));
            for (int i = 0; i < MR; i++) {
                const __m512 m = D32 ? _mm512_mul_ps(sc, _mm512_set1_ps(lhs->bscale[(size_t)(i0 + i) * nb + b])) : sc;
                f[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][p]), m, f[i][p]);
            }
        }
    }
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (int i = 0; i < MR; i += PAIRS ? 2 : 1) {
        for (int p = 0; p < NP; p++) {   /* store columns [c0, c1) of the tile */
            const int e = c1 - 16 * p < 16 ? c1 - 16 * p : 16, st = c0 - 16 * p > 0 ? c0 - 16 * p : 0;
            if (e <= st) continue;
            const __mmask16 sm = (__mmask16)(((1u << e) - 1) & ~((1u << st) - 1));
            const __m512 r = D32 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(sm, rs + 16 * p);
            __m512 v[2];
            if (D32) v[0] = f[i][p];
            else for (int h = 0; h < (PAIRS ? 2 : 1); h++) {   /* scale * (f - zp * R), the scalar kernel's order */
                const int ii = i0 + i + h;
                const __m512 t = _mm512_mul_ps(_mm512_set1_ps((float)lhs->zp[ii]), r);
                v[h] = _mm512_mul_ps(_mm512_set1_ps(lhs->scale[ii]), _mm512_sub_ps(f[i + h][p], t));
            }
            __m512 o = PAIRS ? _mm512_add_ps(v[0], v[1]) : v[0];   /* two planes: their sum */
            o = _mm512_min_ps(vhi, _mm512_max_ps(vlo, o));       /* NaN passes through, as in pk_clampf */
            _mm512_mask_storeu_ps(dst + (size_t)((i0 + i) / (PAIRS ? 2 : 1)) * ldd + 16 * p, sm, o);
        }
    }
}

/* Rows [n0, n1) of a p16 weight for all m activation rows, MR rows x NP panels at a time, then
 * the m % MR rows left as one tile, so each panel is streamed from memory once and re-read from
 * L1 by the next tiles (PAIRS: m even, rows taken two by two, output row = pair index). */
Z_INLINE void z_qp16_run(const int BITS, const int MR, const int NP, const int PAIRS, const int D32, int m, int n0, int n1, const pk_lhs *lhs,
                          const pk_rhs *rhs, const uint8_t *packed, const int8_t *a, size_t lda, z_corr corr,
                          float *dst, size_t ldd, float lo, float hi) {
    const pk_p16_geom g = pk_p16_geometry(rhs);
    const size_t pscales = (size_t)16 * g.nb;
    for (int n = n0 & ~15; n < n1; n += 16 * NP) {   /* panels from the one holding n0 */
        const int np = NP == 2 && n1 - n > 16 ? 2 : 1;
        const int c0 = n < n0 ? n0 - n : 0, c1 = n1 - n < 16 * np ? n1 - n : 16 * np;
        const int p = n / 16;
        const uint8_t *w = packed + (size_t)p * g.panel_bytes;
        const uint16_t *s = pk_p16_scales(packed, &g, p, 0);
        /* rsum is read for columns [c0, c1) only (masked loads) */
        int i0 = 0;
        /* D32: the integer blocks are the activations' 32 (bsum32: corr), sdiv of them per weight block */
        const int nb = D32 ? rhs->k / 32 : g.nb, bl = D32 ? 32 : rhs->bl, sdiv = rhs->bl / 32;
#define Z_T(R) do { if (np == 2) z_qp16_tile(BITS, R, 2, PAIRS, D32, lhs, i0, a, lda, corr, nb, bl, sdiv, w,          \
                                             g.panel_bytes, s, pscales, rhs->rsum + n, c0, c1, dst + n, ldd, lo, hi);  \
                    else z_qp16_tile(BITS, R, 1, PAIRS, D32, lhs, i0, a, lda, corr, nb, bl, sdiv, w, g.panel_bytes, s, \
                                     pscales, rhs->rsum + n, c0, c1, dst + n, ldd, lo, hi); } while (0)
        for (; i0 + MR <= m; i0 += MR) Z_T(MR);
        switch (m - i0) {   /* the rows left: one tile of them (PAIRS: an even count) */
#define Z_TAIL(R) case R: if (R < MR && (!PAIRS || R % 2 == 0)) Z_T(R); break;
        Z_TAIL(1) Z_TAIL(2) Z_TAIL(3) Z_TAIL(4) Z_TAIL(5) Z_TAIL(6) Z_TAIL(7)
#undef Z_TAIL
        default: break;
        }
#undef Z_T
    }
}

/* The activation side of the p16 kernels: signed rows and the per-block corrections
 * -off * sum_{k in block} a (off: the weights' offset, 8 or 32). */
Z_TARGET static int z_qp16_lhs(const pk_lhs *lhs, int m, int k, int bl, int off, const int8_t **a, size_t *lda,
                               z_corr *corr) {
    *a = lhs->q;
    *lda = lhs->ld;
    if (lhs->bsum32 && bl == 32) {   /* summed once per call by the quantizing stage */
        *corr = (z_corr){lhs->bsum32, k / 32, -off};
        return 0;
    }
    const int nb = k / bl;
    int32_t *c = pk_scratch(1, sizeof(int32_t) * (size_t)m * nb);
    if (!c) return -1;
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    for (int i = 0; i < m; i++) {
        const int8_t *row = lhs->q + (size_t)i * lhs->ld;
        int32_t *ci = c + (size_t)i * nb;
        for (int b = 0; b < nb; b++) ci[b] = 0;
        /* sums of 32 bytes: vpsadbw on a + 128 gives 8-byte sums (of unsigned bytes) */
        for (int kk = 0; kk < k; kk += 64) {
            const __mmask64 lm = k - kk >= 64 ? ~(__mmask64)0 : (__mmask64)((1ull << (k - kk)) - 1);
            const __m512i v = _mm512_xor_si512(_mm512_maskz_loadu_epi8(lm, row + kk), x80);
            uint64_t q8[8];
            _mm512_storeu_si512(q8, _mm512_sad_epu8(v, zero));
            for (int h = 0; h < 2 && kk + 32 * h < k; h++)
                ci[(kk + 32 * h) / bl] += (int32_t)(q8[4 * h] + q8[4 * h + 1] + q8[4 * h + 2] + q8[4 * h + 3]) - 128 * 32;
        }
        for (int b = 0; b < nb; b++) ci[b] *= -off;
    }
    *corr = (z_corr){c, nb, 1};
    return 0;
}

/* GEMV (tiles of up to 8 activation rows x 16 weight rows) or GEMM (6 x 32): one micro-kernel;
 * mode 1: two-plane rows summed in the kernel (pk_kernel.run_pairs); the GEMV's tile of 8 rows is
 * then 4 output rows; mode 2: qsi8d32 activations (pk_kernel.run_d32). */
Z_INLINE void z_qp16(const int BITS, const int MR, const int NP, int mode, int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                     const void *packed, float *dst, size_t ldd, float lo, float hi) {
    const int8_t *a;
    size_t lda;
    z_corr corr;
    if (!packed || z_qp16_lhs(lhs, m, rhs->k, mode == 2 ? 32 : rhs->bl, BITS == 6 ? 32 : 8, &a, &lda, &corr)) {
        if (mode == 2) pk_scalar_run_d32(m, n0, n1, lhs, rhs, NULL, dst, ldd, lo, hi);
        else if (!mode) pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
        else pk_run_scalar_pairs(m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
        return;
    }
    if (mode == 2) z_qp16_run(BITS, MR, NP, 0, 1, m, n0, n1, lhs, rhs, packed, a, lda, corr, dst, ldd, lo, hi);
    else if (mode) z_qp16_run(BITS, MR, NP, 1, 0, m, n0, n1, lhs, rhs, packed, a, lda, corr, dst, ldd, lo, hi);
    else z_qp16_run(BITS, MR, NP, 0, 0, m, n0, n1, lhs, rhs, packed, a, lda, corr, dst, ldd, lo, hi);
}

#define Z_QP16_ENTRY(NAME, BITS, MR, NP, MODE)                                                       \
    Z_TARGET static void NAME(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,          \
                              const void *packed, float *dst, size_t ldd, float lo, float hi) {     \
        z_qp16(BITS, MR, NP, MODE, m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi);                    \
    }
Z_QP16_ENTRY(qai8dx_qsi4c32p16_8x16_avx512vnni, 4, ZVMR, 1, 0)
Z_QP16_ENTRY(qai8dx2_qsi4c32p16_8x16_avx512vnni, 4, ZVMR, 1, 1)
Z_QP16_ENTRY(qai8dx_qsi4c32p16_6x32_avx512vnni, 4, ZMR, 2, 0)
Z_QP16_ENTRY(qai8dx2_qsi4c32p16_6x32_avx512vnni, 4, ZMR, 2, 1)
Z_QP16_ENTRY(qai8dx_qsi6c32p16_8x16_avx512vnni, 6, ZVMR, 1, 0)
Z_QP16_ENTRY(qai8dx2_qsi6c32p16_8x16_avx512vnni, 6, ZVMR, 1, 1)
Z_QP16_ENTRY(qai8dx_qsi6c32p16_6x32_avx512vnni, 6, ZMR, 2, 0)
Z_QP16_ENTRY(qai8dx2_qsi6c32p16_6x32_avx512vnni, 6, ZMR, 2, 1)
Z_QP16_ENTRY(qsi8d32_qsi4c32p16_8x16_avx512vnni, 4, ZVMR, 1, 2)
Z_QP16_ENTRY(qsi8d32_qsi4c32p16_6x32_avx512vnni, 4, ZMR, 2, 2)
Z_QP16_ENTRY(qsi8d32_qsi6c32p16_8x16_avx512vnni, 6, ZVMR, 1, 2)
Z_QP16_ENTRY(qsi8d32_qsi6c32p16_6x32_avx512vnni, 6, ZMR, 2, 2)
#undef Z_QP16_ENTRY

/* Activation rows i0, i0+1 of a GEMV pass (the second repeats the first when m is odd). */
static inline int z_act_pair(int m, int i0, const uint8_t *act, size_t ldo, const uint8_t *ap[2]) {
    const int ma = m - i0 < 2 ? 1 : 2;
    ap[0] = act + (size_t)i0 * ldo;
    ap[1] = act + (size_t)(i0 + ma - 1) * ldo;
    return ma;
}

/* ====================================================================================
 * AVX-512 VNNI, GEMV: qai8dx x qsi8cx (p4 copy), 1 x 4, exact int32 until the final scaling
 * ==================================================================================== */

Z_TARGET static void qai8dx_qsi8cxp4_1x4_avx512vnni(int m, int n0, int n1, const pk_lhs *lhs,
                                                    const pk_rhs *rhs, const void *packed, float *dst,
                                                    size_t ldd, float lo, float hi) {
    const int k = rhs->k, G = k / 64, T = k % 64;
    const size_t ldo = pk_round_up((size_t)k, 64);
    uint8_t *act = pk_scratch(0, ldo * (size_t)m);
    if (!act || !packed) { pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi); return; }
    const size_t tile_bytes = pk_p4_geometry(rhs).tile_bytes;
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    const __mmask64 tm = (__mmask64)((1ull << T) - 1);
    for (int i = 0; i < m; i++) {   /* unsigned activations; past K: 0x80 (= 0 after the offset) */
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        uint8_t *o = act + (size_t)i * ldo;
        for (int g = 0; g < G; g++)
            _mm512_store_si512(o + 64 * g, _mm512_xor_si512(_mm512_loadu_si512(a + 64 * g), x80));
        if (T) _mm512_store_si512(o + 64 * G, _mm512_xor_si512(_mm512_maskz_loadu_epi8(tm, a + 64 * G), x80));
    }
    for (int n = n0 & ~3; n < n1; n += 4) {
        const uint8_t *tile = (const uint8_t *)packed + (size_t)(n / 4) * tile_bytes;
        const int r0 = n < n0 ? n0 - n : 0, r1 = n1 - n < 4 ? n1 - n : 4;
        /* two activation rows per pass: each weight vector is loaded once for both (decode
         * runs two rows per token with the qai8dx2 residual plane) */
        for (int i0 = 0; i0 < m; i0 += 2) {
            const uint8_t *ai[2];
            const int ma = z_act_pair(m, i0, act, ldo, ai);
            __m512i acc[2][4];
            for (int i = 0; i < 2; i++)
                for (int r = 0; r < 4; r++) acc[i][r] = _mm512_setzero_si512();
            for (int g = 0; g < G + (T ? 1 : 0); g++) {
                const __m512i a0 = _mm512_load_si512(ai[0] + 64 * g), a1 = _mm512_load_si512(ai[1] + 64 * g);
                for (int r = 0; r < 4; r++) {
                    const __m512i wv = g < G ? _mm512_loadu_si512(tile + 256 * g + 64 * r)   /* 4K may not be 64-aligned */
                                             : _mm512_maskz_loadu_epi8(tm, tile + 256 * G + (size_t)T * r);
                    acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], a0, wv);
                    acc[1][r] = _mm512_dpbusd_epi32(acc[1][r], a1, wv);
                }
            }
            for (int i = 0; i < ma; i++) {
                const int ii = i0 + i;
                const int32_t zp = lhs->zp[ii] + 128;
                for (int r = r0; r < r1; r++) {
                    const int32_t d = _mm512_reduce_add_epi32(acc[i][r]) - zp * rhs->isum[n + r];
                    const float v = lhs->scale[ii] * ((const float *)rhs->scales)[n + r] * (float)d;
                    dst[(size_t)ii * ldd + n + r] = pk_clampf(v, lo, hi);
                }
            }
        }
    }
}

/* ====================================================================================
 * AVX-512 VNNI, GEMM: qai8dx x qsi8cx (int8 panels from the p4 copy), register tile 6 x 32
 * ==================================================================================== */

/* MR rows of activations x one 32-row panel, int32 over all of K (nq quads), then
 * dst = (scale * s) * (float)(D - zp * isum): bit-exact with the scalar kernel. */
Z_INLINE void z_gemm_q8_tile(const int MR, const pk_lhs *lhs, int i0, const int8_t *a, size_t lda,
                             const int32_t *corr, int nq, const uint8_t *panel, const float *ws,
                             const int32_t *isum, int nvalid, float *dst, size_t ldd, float lo, float hi) {
    __m512i acc[ZMR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_set1_epi32(corr[i0 + i]);
    const int8_t *pa = a + (size_t)i0 * lda;
    for (int q = 0; q < nq; q++) {
        const __m512i w0 = _mm512_load_si512(panel + (size_t)q * ZNR * 4);
        const __m512i w1 = _mm512_load_si512(panel + (size_t)q * ZNR * 4 + 64);
        for (int i = 0; i < MR; i++) {
            const __m512i av = _mm512_set1_epi32(pk_load_i32(pa + (size_t)i * lda + 4 * q));
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, av);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, av);
        }
    }
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (int i = 0; i < MR; i++) {
        const int ii = i0 + i;
        for (int j = 0; j < 2; j++) {
            const int nv = nvalid - 16 * j;
            if (nv <= 0) break;
            const __mmask16 sm = nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);
            const __m512i d = _mm512_sub_epi32(acc[i][j], _mm512_mullo_epi32(_mm512_set1_epi32(lhs->zp[ii]),
                                                                              _mm512_load_si512(isum + 16 * j)));
            const __m512 ss = _mm512_mul_ps(_mm512_set1_ps(lhs->scale[ii]), _mm512_load_ps(ws + 16 * j));
            __m512 v = _mm512_mul_ps(ss, _mm512_cvtepi32_ps(d));
            v = _mm512_min_ps(vhi, _mm512_max_ps(vlo, v));   /* NaN passes through, as in pk_clampf */
            _mm512_mask_storeu_ps(dst + (size_t)ii * ldd + 16 * j, sm, v);
        }
    }
}

Z_TARGET static void z_gemm_q8_panel(int m, const pk_lhs *lhs, const int8_t *a, size_t lda, const int32_t *corr,
                                     int nq, const uint8_t *panel, const float *ws, const int32_t *isum,
                                     int nvalid, float *dst, size_t ldd, float lo, float hi) {
    int i0 = 0;
    for (; i0 + ZMR <= m; i0 += ZMR) z_gemm_q8_tile(ZMR, lhs, i0, a, lda, corr, nq, panel, ws, isum, nvalid, dst, ldd, lo, hi);
    switch (m - i0) {
#define Z_TAIL(R) case R: z_gemm_q8_tile(R, lhs, i0, a, lda, corr, nq, panel, ws, isum, nvalid, dst, ldd, lo, hi); break;
    Z_TAIL(1) Z_TAIL(2) Z_TAIL(3) Z_TAIL(4) Z_TAIL(5)
#undef Z_TAIL
    default: break;
    }
}

Z_TARGET static void qai8dx_qsi8cxp4_6x32_avx512vnni(int m, int n0, int n1, const pk_lhs *lhs,
                                                   const pk_rhs *rhs, const void *packed, float *dst,
                                                   size_t ldd, float lo, float hi) {
    const int k = rhs->k, kp = (int)pk_round_up((size_t)k, 16);
    const int8_t *a;
    size_t lda;
    int32_t *corr;
    uint8_t *panel = pk_scratch(0, (size_t)kp * ZNR + 2 * sizeof(float) * ZNR);
    if (!panel || !packed || pk_gemm_lhs_prep(lhs, m, k, kp, k, 128, &a, &lda, &corr)) {
        pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
        return;
    }
    float *ws = (float *)(panel + (size_t)kp * ZNR);
    int32_t *isum = (int32_t *)(ws + ZNR);
    for (int np = n0; np < n1; np += ZNR) {
        z_pack_q8_panel(rhs, packed, np, n1, kp, panel, ws, isum, 0x80);
        z_gemm_q8_panel(m, lhs, a, lda, corr, kp / 4, panel, ws, isum, n1 - np < ZNR ? n1 - np : ZNR,
                        dst + np, ldd, lo, hi);
    }
}

#endif /* __x86_64__ */

/* ---- table --------------------------------------------------------------------------- */
#if defined(__x86_64__)
const pk_kernel pk_kernels_x86_avx512vnni[] = {
    {.name = "qai8dx_qsi4c32p16_8x16_avx512vnni", .isa = "avx512vnni", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX512VNNI,
     .priority = 30, .m_min = 1, .n_step = 16,
     .rhs_packed_size = pk_p16_size, .rhs_pack = pk_p16_pack, .run = qai8dx_qsi4c32p16_8x16_avx512vnni, .run_pairs = qai8dx2_qsi4c32p16_8x16_avx512vnni,
     .run_d32 = qsi8d32_qsi4c32p16_8x16_avx512vnni},
    {.name = "qai8dx_qsi4c32p16_6x32_avx512vnni", .isa = "avx512vnni", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX512VNNI,
     .priority = 31, .m_min = ZVMR + 1, .n_step = ZNR,
     .rhs_packed_size = pk_p16_size, .rhs_pack = pk_p16_pack, .run = qai8dx_qsi4c32p16_6x32_avx512vnni, .run_pairs = qai8dx2_qsi4c32p16_6x32_avx512vnni,
     .run_d32 = qsi8d32_qsi4c32p16_6x32_avx512vnni},
    {.name = "qai8dx_qsi6c32p16_8x16_avx512vnni", .isa = "avx512vnni", .fmt = PK_FMT_QSI6C32, .features = PK_CPU_AVX512VNNI,
     .priority = 30, .m_min = 1, .n_step = 16,
     .rhs_packed_size = pk_p16_size, .rhs_pack = pk_p16_pack, .run = qai8dx_qsi6c32p16_8x16_avx512vnni, .run_pairs = qai8dx2_qsi6c32p16_8x16_avx512vnni,
     .run_d32 = qsi8d32_qsi6c32p16_8x16_avx512vnni},
    {.name = "qai8dx_qsi6c32p16_6x32_avx512vnni", .isa = "avx512vnni", .fmt = PK_FMT_QSI6C32, .features = PK_CPU_AVX512VNNI,
     .priority = 31, .m_min = ZVMR + 1, .n_step = ZNR,
     .rhs_packed_size = pk_p16_size, .rhs_pack = pk_p16_pack, .run = qai8dx_qsi6c32p16_6x32_avx512vnni, .run_pairs = qai8dx2_qsi6c32p16_6x32_avx512vnni,
     .run_d32 = qsi8d32_qsi6c32p16_6x32_avx512vnni},
    {.name = "qai8dx_qsi8cxp4_1x4_avx512vnni", .isa = "avx512vnni", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVX512VNNI,
     .priority = 30, .m_min = 1, .n_step = 4,
     .rhs_packed_size = pk_p4_size, .rhs_pack = pk_p4_pack, .run = qai8dx_qsi8cxp4_1x4_avx512vnni},
    {.name = "qai8dx_qsi8cxp4_6x32_avx512vnni", .isa = "avx512vnni", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVX512VNNI,
     .priority = 31, .m_min = ZMR, .n_step = ZNR,
     .rhs_packed_size = pk_p4_size, .rhs_pack = pk_p4_pack, .run = qai8dx_qsi8cxp4_6x32_avx512vnni},
};
const int pk_kernels_x86_avx512vnni_count = sizeof pk_kernels_x86_avx512vnni / sizeof pk_kernels_x86_avx512vnni[0];
#endif
