/* Arm AdvSIMD kernels: qai8dx activations x qsi4c32 / qsi6c32 / qsi8cx weights.
 *
 * Three ISA levels, chosen at run time (pk_cpu.c: getauxval):
 *   neon     armv8-a baseline (cortex-a53 class): smull/smlal widening multiplies + sadalp.
 *   dotprod  armv8.2-a+dotprod (cortex-a55/a76, neoverse-n1): sdot, 4 int8 products per lane.
 *   i8mm     +i8mm (neoverse-v1/n2, cortex-a510/a710, ...): smmla, a 2x8 by 8x2 int8 matrix
 *            multiply per instruction; used for the GEMM (m >= 4), the GEMV stays on sdot.
 * The file compiles at the armv8-a baseline; only the functions carrying PK_DOTPROD /
 * PK_I8MM use the newer instructions, so one binary runs on every aarch64 CPU.
 *
 * Arithmetic (docs/FORMAT.md): dst = scale[m] * (sum_b s[n,b] * D[m,n,b] - zp[m] * R[n]),
 * D the exact int32 dot product over a block. The float operations are the scalar
 * reference's, in the same order (no fused multiply-add), so the results match
 * matmul_scalar.c bit for bit when compiled with -ffp-contract=off (as setup.py does).
 * qsi8d32 activations (run_d32, the qsi4c32 kernels): the same tiles with integer blocks of 32
 * (a weight block of bl spans bl / 32), each dot multiplied by (s[n, b*32/bl] * as[m, b]) and
 * summed, dst = that sum: the scalar reference's order again, so bit for bit too.
 *
 * qsi4c32 nibbles are two's complement, byte j of a 32-element chunk holds element j (low
 * nibble) and element 16+j (high nibble). The sdot/smmla paths multiply by
 * (int8)(b << 4) = 16*low and (int8)(b & 0xF0) = 16*high and shift the block's int32 sum
 * right by 4 (exact: it is a multiple of 16). The plain-NEON path sign-extends the nibbles
 * to [-8, 7] with shifts, so at most 4 products (|p| <= 1024) share an int16 lane before
 * sadalp widens them.
 *
 * Tiles: kernels compute a tile of MR activation rows x 4 weight rows. Tails (m not a
 * multiple of MR, n1 - n0 not a multiple of 4) repeat the last valid row / weight row and
 * store only the valid results, so every m >= 1 and any [n0, n1) is handled with the same
 * code. smmla wants both operands as 2x8 row-interleaved blocks: the kernels build them in
 * registers with 64-bit zips (zip1/zip2) from the canonical layouts, so no weight repacking
 * (and no extra memory) is needed. */
#include "../contract/pk_kernel.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>


#define PK_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define PK_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#define PK_INLINE static inline __attribute__((always_inline))

/* ---- shared helpers (baseline AdvSIMD, inlined into every level) ---------------------- */

/* Four consecutive weight rows n..n+3 (rows past the valid nv repeat the last valid one). */
typedef struct {
    const uint8_t *w[4];      /* row start: qsi4c32 nibbles or qsi8cx int8 */
    const uint16_t *s[4];     /* qsi4c32: bf16 scales of the row */
    float32x4_t rsum;         /* qsi4c32: R[n] */
    float32x4_t scale;        /* qsi8cx: s[n] */
    int32x4_t isum;           /* qsi8cx: sum_k q_w */
} cols4;

PK_INLINE void cols4_q4(cols4 *c, const pk_rhs *rhs, int n, int nv) {
    const int nb = rhs->k / rhs->bl;
    float r[4];
    for (int j = 0; j < 4; j++) {
        const int row = n + (j < nv ? j : nv - 1);
        c->w[j] = rhs->qs + (size_t)row * (size_t)(rhs->k / 2);
        c->s[j] = (const uint16_t *)rhs->scales + (size_t)row * (size_t)nb;
        r[j] = rhs->rsum[row];
    }
    c->rsum = vld1q_f32(r);
}

PK_INLINE void cols4_q8(cols4 *c, const pk_rhs *rhs, int n, int nv) {
    float s[4];
    int32_t is[4];
    for (int j = 0; j < 4; j++) {
        const int row = n + (j < nv ? j : nv - 1);
        c->w[j] = rhs->qs + (size_t)row * (size_t)rhs->k;
        s[j] = ((const float *)rhs->scales)[row];
        is[j] = rhs->isum[row];
    }
    c->scale = vld1q_f32(s);
    c->isum = vld1q_s32(is);
}

/* The bf16 scales of block b of the four rows, widened to f32 (exact: bits << 16). */
PK_INLINE float32x4_t cols4_bscale(const cols4 *c, int b) {
    uint16x4_t v = vld1_dup_u16(c->s[0] + b);
    v = vld1_lane_u16(c->s[1] + b, v, 1);
    v = vld1_lane_u16(c->s[2] + b, v, 2);
    v = vld1_lane_u16(c->s[3] + b, v, 3);
    return vreinterpretq_f32_u32(vshll_n_u16(v, 16));
}

/* [d0+e0+..., ] : the lane sums of four int32x4 vectors -> one vector (x0, x1, x2, x3). */
PK_INLINE int32x4_t hsum4(int32x4_t x0, int32x4_t x1, int32x4_t x2, int32x4_t x3) {
    return vpaddq_s32(vpaddq_s32(x0, x1), vpaddq_s32(x2, x3));
}

/* Clamps and stores the first nv lanes at d. */
PK_INLINE void store4(float *d, float32x4_t v, int nv, float lo, float hi) {
    v = vminq_f32(vmaxq_f32(v, vdupq_n_f32(lo)), vdupq_n_f32(hi));
    if (nv == 4) {
        vst1q_f32(d, v);
    } else {
        vst1q_lane_f32(d, v, 0);
        if (nv > 1) vst1q_lane_f32(d + 1, v, 1);
        if (nv > 2) vst1q_lane_f32(d + 2, v, 2);
    }
}

/* qsi4c32 epilogue: scale[i] * (acc - zp[i] * R[n]), the reference's operation order. */
PK_INLINE void store_q4(const pk_lhs *lhs, int i, const cols4 *c, float32x4_t acc, float *d, int nv,
                        float lo, float hi) {
    const float32x4_t zr = vmulq_n_f32(c->rsum, (float)lhs->zp[i]);
    store4(d, vmulq_n_f32(vsubq_f32(acc, zr), lhs->scale[i]), nv, lo, hi);
}

/* qsi8cx epilogue: scale[i] * s[n] * float(D - zp[i] * isum[n]). */
PK_INLINE void store_q8(const pk_lhs *lhs, int i, const cols4 *c, int32x4_t dot, float *d, int nv,
                        float lo, float hi) {
    const int32x4_t di = vmlsq_n_s32(dot, c->isum, lhs->zp[i]);
    const float32x4_t sc = vmulq_n_f32(c->scale, lhs->scale[i]);
    store4(d, vmulq_f32(sc, vcvtq_f32_s32(di)), nv, lo, hi);
}

PK_INLINE const int8_t *lhs_row(const pk_lhs *lhs, int i, int m) {
    return lhs->q + (size_t)(i < m ? i : m - 1) * lhs->ld;
}

/* qsi8d32: block b's scale of activation row i (rows past m repeat the last, as lhs_row). */
PK_INLINE float lhs_bscale(const pk_lhs *lhs, int i, int m, int b) {
    return lhs->bscale[(size_t)(i < m ? i : m - 1) * (size_t)(lhs->k / 32) + (size_t)b];
}

/* The block loop of the qsi4c32 kernels: D32 0 walks the weight blocks (nb of bl / 32 chunks),
 * D32 1 the activations' blocks of 32 (one chunk each, weight block b / sdiv). */
typedef struct {
    int nb, cpb, sdiv;
} q4_blocks;

PK_INLINE q4_blocks q4_blocks_of(const int D32, const pk_rhs *rhs) {
    return D32 ? (q4_blocks){rhs->k / 32, 1, rhs->bl / 32} : (q4_blocks){rhs->k / rhs->bl, rhs->bl / 32, 1};
}

/* Stores row i: qai8dx's epilogue, or for qsi8d32 the sum itself. */
PK_INLINE void store_q4_or_d32(const int D32, const pk_lhs *lhs, int i, const cols4 *c, float32x4_t acc, float *d,
                               int nv, float lo, float hi) {
    if (D32) store4(d, acc, nv, lo, hi);
    else store_q4(lhs, i, c, acc, d, nv, lo, hi);
}

/* ---- neon (armv8-a): qsi4c32 ----------------------------------------------------------- */

/* One 32-element chunk of one weight row: acc (int32x4) += products, pairwise widened. */
PK_INLINE int32x4_t q4_chunk_neon(int32x4_t acc, int8x16_t a0, int8x16_t a1, const uint8_t *wp) {
    const int8x16_t w = vreinterpretq_s8_u8(vld1q_u8(wp));
    const int8x16_t wl = vshrq_n_s8(vshlq_n_s8(w, 4), 4);   /* elements 0..15, in [-8, 7] */
    const int8x16_t wh = vshrq_n_s8(w, 4);                  /* elements 16..31 */
    int16x8_t p = vmull_s8(vget_low_s8(a0), vget_low_s8(wl));
    p = vmlal_high_s8(p, a0, wl);
    p = vmlal_s8(p, vget_low_s8(a1), vget_low_s8(wh));
    p = vmlal_high_s8(p, a1, wh);                           /* 4 products per lane, |p| <= 4096 */
    return vpadalq_s16(acc, p);
}

PK_INLINE void q4_neon_run(const int D32, int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                           float *dst, size_t ldd, float lo, float hi) {
    const q4_blocks B = q4_blocks_of(D32, rhs);
    const int nb = B.nb, cpb = B.cpb;
    for (int n = n0; n < n1; n += 4) {
        const int nv = n1 - n < 4 ? n1 - n : 4;
        cols4 c;
        cols4_q4(&c, rhs, n, nv);
        for (int i = 0; i < m; i++) {
            const int8_t *a = lhs->q + (size_t)i * lhs->ld;
            float32x4_t facc = vdupq_n_f32(0.0f);
            for (int b = 0; b < nb; b++) {
                int32x4_t x0 = vdupq_n_s32(0), x1 = x0, x2 = x0, x3 = x0;
                for (int ch = b * cpb; ch < (b + 1) * cpb; ch++) {
                    const int8x16_t a0 = vld1q_s8(a + 32 * ch), a1 = vld1q_s8(a + 32 * ch + 16);
                    x0 = q4_chunk_neon(x0, a0, a1, c.w[0] + 16 * ch);
                    x1 = q4_chunk_neon(x1, a0, a1, c.w[1] + 16 * ch);
                    x2 = q4_chunk_neon(x2, a0, a1, c.w[2] + 16 * ch);
                    x3 = q4_chunk_neon(x3, a0, a1, c.w[3] + 16 * ch);
                }
                const float32x4_t d = vcvtq_f32_s32(hsum4(x0, x1, x2, x3));
                float32x4_t s = cols4_bscale(&c, b / B.sdiv);
                if (D32) s = vmulq_n_f32(s, lhs_bscale(lhs, i, m, b));
                facc = vaddq_f32(facc, vmulq_f32(s, d));
            }
            store_q4_or_d32(D32, lhs, i, &c, facc, dst + (size_t)i * ldd + n, nv, lo, hi);
        }
    }
}

static void qai8dx_qsi4c32_1x4_neon(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                    const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    q4_neon_run(0, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

static void qsi8d32_qsi4c32_1x4_neon(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                     const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    q4_neon_run(1, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

/* ---- qsi6c32 (the 6-bit lm_head): neon and dotprod GEMV ----------------------------------- */

/* One 32-element chunk of a qsi6c32 row (docs/FORMAT.md) as signed int8 in [-32, 31]:
 * w0 = elements 0..15, w1 = elements 16..31. Byte j of the top-bit part holds elements j,
 * j+8 (bits 0-3) and j+16, j+24 (bits 4-7); [H, H >> 2] lines them up with w0 / w1. */
PK_INLINE void q6_chunk(const uint8_t *wp, int8x16_t *w0, int8x16_t *w1) {
    const uint8x16_t l = vld1q_u8(wp), m30 = vdupq_n_u8(0x30);
    const uint8x8_t h = vld1_u8(wp + 16);
    const uint8x16_t h2 = vcombine_u8(h, vshr_n_u8(h, 2));
    const uint8x16_t u0 = vorrq_u8(vandq_u8(l, vdupq_n_u8(0x0F)), vandq_u8(vshlq_n_u8(h2, 4), m30));
    const uint8x16_t u1 = vorrq_u8(vshrq_n_u8(l, 4), vandq_u8(h2, m30));
    *w0 = vsubq_s8(vreinterpretq_s8_u8(u0), vdupq_n_s8(32));
    *w1 = vsubq_s8(vreinterpretq_s8_u8(u1), vdupq_n_s8(32));
}

PK_INLINE void cols4_q6(cols4 *c, const pk_rhs *rhs, int n, int nv) {
    const int nb = rhs->k / 32;
    float r[4];
    for (int j = 0; j < 4; j++) {
        const int row = n + (j < nv ? j : nv - 1);
        c->w[j] = rhs->qs + (size_t)row * pk_row_bytes(PK_FMT_QSI6C32, rhs->k);
        c->s[j] = (const uint16_t *)rhs->scales + (size_t)row * (size_t)nb;
        r[j] = rhs->rsum[row];
    }
    c->rsum = vld1q_f32(r);
}

/* plain NEON: |q a| <= 32 * 128, four products per int16 lane (<= 16384) before sadalp */
PK_INLINE int32x4_t q6_chunk_neon(int32x4_t acc, int8x16_t a0, int8x16_t a1, const uint8_t *wp) {
    int8x16_t w0, w1;
    q6_chunk(wp, &w0, &w1);
    int16x8_t p = vmull_s8(vget_low_s8(a0), vget_low_s8(w0));
    p = vmlal_high_s8(p, a0, w0);
    p = vmlal_s8(p, vget_low_s8(a1), vget_low_s8(w1));
    p = vmlal_high_s8(p, a1, w1);
    return vpadalq_s16(acc, p);
}

PK_DOTPROD PK_INLINE int32x4_t q6_chunk_dot(int32x4_t acc, int8x16_t a0, int8x16_t a1, const uint8_t *wp) {
    int8x16_t w0, w1;
    q6_chunk(wp, &w0, &w1);
    return vdotq_s32(vdotq_s32(acc, a0, w0), a1, w1);
}

/* 1 x 4: per block, the exact int32 dots of 4 rows, then the reference's float order. */
#define Q6_GEMV_BODY(CHUNK)                                                                        \
    (void)packed;                                                                                  \
    const int nb = rhs->k / 32;                                                                    \
    for (int n = n0; n < n1; n += 4) {                                                             \
        const int nv = n1 - n < 4 ? n1 - n : 4;                                                    \
        cols4 c;                                                                                   \
        cols4_q6(&c, rhs, n, nv);                                                                  \
        for (int i = 0; i < m; i++) {                                                              \
            const int8_t *a = lhs->q + (size_t)i * lhs->ld;                                        \
            float32x4_t facc = vdupq_n_f32(0.0f);                                                  \
            for (int b = 0; b < nb; b++) {                                                         \
                const int8x16_t a0 = vld1q_s8(a + 32 * b), a1 = vld1q_s8(a + 32 * b + 16);         \
                const int32x4_t z = vdupq_n_s32(0);                                                \
                const int32x4_t x0 = CHUNK(z, a0, a1, c.w[0] + 24 * b);                            \
                const int32x4_t x1 = CHUNK(z, a0, a1, c.w[1] + 24 * b);                            \
                const int32x4_t x2 = CHUNK(z, a0, a1, c.w[2] + 24 * b);                            \
                const int32x4_t x3 = CHUNK(z, a0, a1, c.w[3] + 24 * b);                            \
                const float32x4_t d = vcvtq_f32_s32(hsum4(x0, x1, x2, x3));                        \
                facc = vaddq_f32(facc, vmulq_f32(cols4_bscale(&c, b), d));                         \
            }                                                                                      \
            store_q4(lhs, i, &c, facc, dst + (size_t)i * ldd + n, nv, lo, hi);                     \
        }                                                                                          \
    }

static void qai8dx_qsi6c32_1x4_neon(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                    const void *packed, float *dst, size_t ldd, float lo, float hi) {
    Q6_GEMV_BODY(q6_chunk_neon)
}

PK_DOTPROD static void qai8dx_qsi6c32_1x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                                  const void *packed, float *dst, size_t ldd, float lo, float hi) {
    Q6_GEMV_BODY(q6_chunk_dot)
}
#undef Q6_GEMV_BODY

/* ---- neon (armv8-a): qsi8cx ------------------------------------------------------------ */

PK_INLINE int32x4_t q8_16_neon(int32x4_t acc, int8x16_t a, const int8_t *wp) {
    const int8x16_t w = vld1q_s8(wp);
    /* one product per int16 lane before widening: safe for any int8 (-128 * -128 = 16384) */
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(w)));
    return vpadalq_s16(acc, vmull_high_s8(a, w));
}

static void qai8dx_qsi8cx_1x4_neon(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                   const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, k16 = k & ~15;
    for (int n = n0; n < n1; n += 4) {
        const int nv = n1 - n < 4 ? n1 - n : 4;
        cols4 c;
        cols4_q8(&c, rhs, n, nv);
        const int8_t *w0 = (const int8_t *)c.w[0], *w1 = (const int8_t *)c.w[1];
        const int8_t *w2 = (const int8_t *)c.w[2], *w3 = (const int8_t *)c.w[3];
        for (int i = 0; i < m; i++) {
            const int8_t *a = lhs->q + (size_t)i * lhs->ld;
            int32x4_t x0 = vdupq_n_s32(0), x1 = x0, x2 = x0, x3 = x0;
            int kk = 0;
            for (; kk < k16; kk += 16) {
                const int8x16_t av = vld1q_s8(a + kk);
                x0 = q8_16_neon(x0, av, w0 + kk);
                x1 = q8_16_neon(x1, av, w1 + kk);
                x2 = q8_16_neon(x2, av, w2 + kk);
                x3 = q8_16_neon(x3, av, w3 + kk);
            }
            int32x4_t dot = hsum4(x0, x1, x2, x3);
            if (kk < k) {   /* K % 16 tail (qsi8cx allows any K) */
                int32_t t[4] = {0, 0, 0, 0};
                for (; kk < k; kk++) {
                    t[0] += a[kk] * w0[kk];
                    t[1] += a[kk] * w1[kk];
                    t[2] += a[kk] * w2[kk];
                    t[3] += a[kk] * w3[kk];
                }
                dot = vaddq_s32(dot, vld1q_s32(t));
            }
            store_q8(lhs, i, &c, dot, dst + (size_t)i * ldd + n, nv, lo, hi);
        }
    }
}

/* ---- dotprod (armv8.2-a+dotprod): MR x 4 tiles, MR = 1 (GEMV) or 4 (GEMM) --------------- */

PK_DOTPROD PK_INLINE void q4_dot_run(const int MR, const int D32, int m, int n0, int n1, const pk_lhs *lhs,
                                     const pk_rhs *rhs, float *dst, size_t ldd, float lo, float hi) {
    const q4_blocks B = q4_blocks_of(D32, rhs);
    const int nb = B.nb, cpb = B.cpb;
    const int8x16_t hmask = vdupq_n_s8((int8_t)0xF0);
    for (int n = n0; n < n1; n += 4) {
        const int nv = n1 - n < 4 ? n1 - n : 4;
        cols4 c;
        cols4_q4(&c, rhs, n, nv);
        for (int i = 0; i < m; i += MR) {
            const int8_t *a[4];
            float32x4_t facc[4];
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                a[r] = lhs_row(lhs, i + r, m);
                facc[r] = vdupq_n_f32(0.0f);
            }
            for (int b = 0; b < nb; b++) {
                int32x4_t x[4][4];
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) x[r][j] = vdupq_n_s32(0);
                for (int ch = b * cpb; ch < (b + 1) * cpb; ch++) {
                    int8x16_t wl[4], wh[4];
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        const int8x16_t w = vreinterpretq_s8_u8(vld1q_u8(c.w[j] + 16 * ch));
                        wl[j] = vshlq_n_s8(w, 4);        /* 16 * elements 0..15 */
                        wh[j] = vandq_s8(w, hmask);      /* 16 * elements 16..31 */
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < MR; r++) {
                        const int8x16_t a0 = vld1q_s8(a[r] + 32 * ch), a1 = vld1q_s8(a[r] + 32 * ch + 16);
#pragma GCC unroll 4
                        for (int j = 0; j < 4; j++) x[r][j] = vdotq_s32(vdotq_s32(x[r][j], a0, wl[j]), a1, wh[j]);
                    }
                }
                const float32x4_t s = cols4_bscale(&c, b / B.sdiv);
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++) {
                    const int32x4_t d = vshrq_n_s32(hsum4(x[r][0], x[r][1], x[r][2], x[r][3]), 4);
                    const float32x4_t sr = D32 ? vmulq_n_f32(s, lhs_bscale(lhs, i + r, m, b)) : s;
                    facc[r] = vaddq_f32(facc[r], vmulq_f32(sr, vcvtq_f32_s32(d)));
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++)
                if (i + r < m)
                    store_q4_or_d32(D32, lhs, i + r, &c, facc[r], dst + (size_t)(i + r) * ldd + n, nv, lo, hi);
        }
    }
}

PK_DOTPROD PK_INLINE void q8_dot_run(const int MR, int m, int n0, int n1, const pk_lhs *lhs,
                                     const pk_rhs *rhs, float *dst, size_t ldd, float lo, float hi) {
    const int k = rhs->k, k16 = k & ~15;
    for (int n = n0; n < n1; n += 4) {
        const int nv = n1 - n < 4 ? n1 - n : 4;
        cols4 c;
        cols4_q8(&c, rhs, n, nv);
        for (int i = 0; i < m; i += MR) {
            const int8_t *a[4];
            int32x4_t x[4][4];
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                a[r] = lhs_row(lhs, i + r, m);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) x[r][j] = vdupq_n_s32(0);
            }
            int kk = 0;
            for (; kk < k16; kk += 16) {
                int8x16_t w[4];
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) w[j] = vld1q_s8((const int8_t *)c.w[j] + kk);
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++) {
                    const int8x16_t av = vld1q_s8(a[r] + kk);
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) x[r][j] = vdotq_s32(x[r][j], av, w[j]);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                int32x4_t dot = hsum4(x[r][0], x[r][1], x[r][2], x[r][3]);
                if (kk < k) {
                    int32_t t[4] = {0, 0, 0, 0};
                    for (int q = kk; q < k; q++)
                        for (int j = 0; j < 4; j++) t[j] += a[r][q] * ((const int8_t *)c.w[j])[q];
                    dot = vaddq_s32(dot, vld1q_s32(t));
                }
                if (i + r < m) store_q8(lhs, i + r, &c, dot, dst + (size_t)(i + r) * ldd + n, nv, lo, hi);
            }
        }
    }
}

PK_DOTPROD static void qai8dx_qsi4c32_1x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs,
                                                  const pk_rhs *rhs, const void *packed, float *dst,
                                                  size_t ldd, float lo, float hi) {
    (void)packed;
    q4_dot_run(1, 0, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_DOTPROD static void qsi8d32_qsi4c32_1x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs,
                                                   const pk_rhs *rhs, const void *packed, float *dst,
                                                   size_t ldd, float lo, float hi) {
    (void)packed;
    q4_dot_run(1, 1, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_DOTPROD static void qai8dx_qsi4c32_4x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs,
                                                  const pk_rhs *rhs, const void *packed, float *dst,
                                                  size_t ldd, float lo, float hi) {
    (void)packed;
    q4_dot_run(4, 0, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_DOTPROD static void qsi8d32_qsi4c32_4x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs,
                                                   const pk_rhs *rhs, const void *packed, float *dst,
                                                   size_t ldd, float lo, float hi) {
    (void)packed;
    q4_dot_run(4, 1, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_DOTPROD static void qai8dx_qsi8cx_1x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs,
                                                 const pk_rhs *rhs, const void *packed, float *dst,
                                                 size_t ldd, float lo, float hi) {
    (void)packed;
    q8_dot_run(1, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_DOTPROD static void qai8dx_qsi8cx_4x4_dotprod(int m, int n0, int n1, const pk_lhs *lhs,
                                                 const pk_rhs *rhs, const void *packed, float *dst,
                                                 size_t ldd, float lo, float hi) {
    (void)packed;
    q8_dot_run(4, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

/* ---- i8mm (smmla): 4 x 4 tiles ---------------------------------------------------------
 * smmla(acc, A, B): A = rows (r, r+1) x 8 k-values, B = weight rows (c, c+1) x the same 8
 * k-values, acc += [r.c, r.c+1, r+1.c, r+1.c+1]. Two 16-byte rows x, y give the operands
 * for k 0..7 and 8..15 as zip1/zip2 of their 64-bit halves. Accumulator x[p][q] holds the
 * 2x2 block of activation rows 2p, 2p+1 and weight rows 2q, 2q+1 of the tile. */

PK_INLINE int8x16_t zip_lo64(int8x16_t x, int8x16_t y) {
    return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)));
}
PK_INLINE int8x16_t zip_hi64(int8x16_t x, int8x16_t y) {
    return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)));
}
PK_INLINE float32x4_t zip_lo64f(float32x4_t x, float32x4_t y) {
    return vreinterpretq_f32_u64(vzip1q_u64(vreinterpretq_u64_f32(x), vreinterpretq_u64_f32(y)));
}
PK_INLINE float32x4_t zip_hi64f(float32x4_t x, float32x4_t y) {
    return vreinterpretq_f32_u64(vzip2q_u64(vreinterpretq_u64_f32(x), vreinterpretq_u64_f32(y)));
}
PK_INLINE int32x4_t zip_lo64i(int32x4_t x, int32x4_t y) {
    return vreinterpretq_s32_s64(vzip1q_s64(vreinterpretq_s64_s32(x), vreinterpretq_s64_s32(y)));
}
PK_INLINE int32x4_t zip_hi64i(int32x4_t x, int32x4_t y) {
    return vreinterpretq_s32_s64(vzip2q_s64(vreinterpretq_s64_s32(x), vreinterpretq_s64_s32(y)));
}

PK_I8MM PK_INLINE void q4_i8mm_run(const int D32, int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                   float *dst, size_t ldd, float lo, float hi) {
    const q4_blocks B = q4_blocks_of(D32, rhs);
    const int nb = B.nb, cpb = B.cpb;
    const int8x16_t hmask = vdupq_n_s8((int8_t)0xF0);
    for (int n = n0; n < n1; n += 4) {
        const int nv = n1 - n < 4 ? n1 - n : 4;
        cols4 c;
        cols4_q4(&c, rhs, n, nv);
        for (int i = 0; i < m; i += 4) {
            const int8_t *a[4];
            for (int r = 0; r < 4; r++) a[r] = lhs_row(lhs, i + r, m);
            float32x4_t f00 = vdupq_n_f32(0.0f), f01 = f00, f10 = f00, f11 = f00;
            for (int b = 0; b < nb; b++) {
                int32x4_t x00 = vdupq_n_s32(0), x01 = x00, x10 = x00, x11 = x00;
                for (int ch = b * cpb; ch < (b + 1) * cpb; ch++) {
                    /* weights: 16*q of rows (0,1) and (2,3), k 0-7, 8-15, 16-23, 24-31 */
                    const int8x16_t u0 = vreinterpretq_s8_u8(vld1q_u8(c.w[0] + 16 * ch));
                    const int8x16_t u1 = vreinterpretq_s8_u8(vld1q_u8(c.w[1] + 16 * ch));
                    const int8x16_t u2 = vreinterpretq_s8_u8(vld1q_u8(c.w[2] + 16 * ch));
                    const int8x16_t u3 = vreinterpretq_s8_u8(vld1q_u8(c.w[3] + 16 * ch));
                    const int8x16_t l0 = vshlq_n_s8(u0, 4), l1 = vshlq_n_s8(u1, 4);
                    const int8x16_t l2 = vshlq_n_s8(u2, 4), l3 = vshlq_n_s8(u3, 4);
                    const int8x16_t h0 = vandq_s8(u0, hmask), h1 = vandq_s8(u1, hmask);
                    const int8x16_t h2 = vandq_s8(u2, hmask), h3 = vandq_s8(u3, hmask);
                    const int8x16_t b0k0 = zip_lo64(l0, l1), b0k1 = zip_hi64(l0, l1);
                    const int8x16_t b0k2 = zip_lo64(h0, h1), b0k3 = zip_hi64(h0, h1);
                    const int8x16_t b1k0 = zip_lo64(l2, l3), b1k1 = zip_hi64(l2, l3);
                    const int8x16_t b1k2 = zip_lo64(h2, h3), b1k3 = zip_hi64(h2, h3);
                    /* activation rows (0,1) */
                    {
                        const int8x16_t p0 = vld1q_s8(a[0] + 32 * ch), p1 = vld1q_s8(a[0] + 32 * ch + 16);
                        const int8x16_t q0 = vld1q_s8(a[1] + 32 * ch), q1 = vld1q_s8(a[1] + 32 * ch + 16);
                        const int8x16_t k0 = zip_lo64(p0, q0), k1 = zip_hi64(p0, q0);
                        const int8x16_t k2 = zip_lo64(p1, q1), k3 = zip_hi64(p1, q1);
                        x00 = vmmlaq_s32(x00, k0, b0k0);
                        x01 = vmmlaq_s32(x01, k0, b1k0);
                        x00 = vmmlaq_s32(x00, k1, b0k1);
                        x01 = vmmlaq_s32(x01, k1, b1k1);
                        x00 = vmmlaq_s32(x00, k2, b0k2);
                        x01 = vmmlaq_s32(x01, k2, b1k2);
                        x00 = vmmlaq_s32(x00, k3, b0k3);
                        x01 = vmmlaq_s32(x01, k3, b1k3);
                    }
                    /* activation rows (2,3) */
                    {
                        const int8x16_t p0 = vld1q_s8(a[2] + 32 * ch), p1 = vld1q_s8(a[2] + 32 * ch + 16);
                        const int8x16_t q0 = vld1q_s8(a[3] + 32 * ch), q1 = vld1q_s8(a[3] + 32 * ch + 16);
                        const int8x16_t k0 = zip_lo64(p0, q0), k1 = zip_hi64(p0, q0);
                        const int8x16_t k2 = zip_lo64(p1, q1), k3 = zip_hi64(p1, q1);
                        x10 = vmmlaq_s32(x10, k0, b0k0);
                        x11 = vmmlaq_s32(x11, k0, b1k0);
                        x10 = vmmlaq_s32(x10, k1, b0k1);
                        x11 = vmmlaq_s32(x11, k1, b1k1);
                        x10 = vmmlaq_s32(x10, k2, b0k2);
                        x11 = vmmlaq_s32(x11, k2, b1k2);
                        x10 = vmmlaq_s32(x10, k3, b0k3);
                        x11 = vmmlaq_s32(x11, k3, b1k3);
                    }
                }
                /* scales in the accumulators' order: [s0 s1 s0 s1], [s2 s3 s2 s3] */
                const float32x4_t s = cols4_bscale(&c, b / B.sdiv);
                const float32x4_t s01 = zip_lo64f(s, s), s23 = zip_hi64f(s, s);
                float32x4_t a01 = vdupq_n_f32(1.0f), a23 = a01;   /* D32: [as0 as0 as1 as1], rows 2, 3 */
                if (D32) {
                    a01 = vcombine_f32(vdup_n_f32(lhs_bscale(lhs, i, m, b)), vdup_n_f32(lhs_bscale(lhs, i + 1, m, b)));
                    a23 = vcombine_f32(vdup_n_f32(lhs_bscale(lhs, i + 2, m, b)), vdup_n_f32(lhs_bscale(lhs, i + 3, m, b)));
                }
                f00 = vaddq_f32(f00, vmulq_f32(D32 ? vmulq_f32(s01, a01) : s01, vcvtq_f32_s32(vshrq_n_s32(x00, 4))));
                f01 = vaddq_f32(f01, vmulq_f32(D32 ? vmulq_f32(s23, a01) : s23, vcvtq_f32_s32(vshrq_n_s32(x01, 4))));
                f10 = vaddq_f32(f10, vmulq_f32(D32 ? vmulq_f32(s01, a23) : s01, vcvtq_f32_s32(vshrq_n_s32(x10, 4))));
                f11 = vaddq_f32(f11, vmulq_f32(D32 ? vmulq_f32(s23, a23) : s23, vcvtq_f32_s32(vshrq_n_s32(x11, 4))));
            }
            /* back to rows: row 0 = low halves of f00, f01; row 1 = high halves; ... */
            float32x4_t rows[4] = {zip_lo64f(f00, f01), zip_hi64f(f00, f01), zip_lo64f(f10, f11),
                                   zip_hi64f(f10, f11)};
            for (int r = 0; r < 4 && i + r < m; r++)
                store_q4_or_d32(D32, lhs, i + r, &c, rows[r], dst + (size_t)(i + r) * ldd + n, nv, lo, hi);
        }
    }
}

PK_I8MM static void qai8dx_qsi4c32_4x4_i8mm(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                            const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    q4_i8mm_run(0, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_I8MM static void qsi8d32_qsi4c32_4x4_i8mm(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                             const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    q4_i8mm_run(1, m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
}

PK_I8MM static void qai8dx_qsi8cx_4x4_i8mm(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                           const void *packed, float *dst, size_t ldd, float lo,
                                           float hi) {
    (void)packed;
    const int k = rhs->k, k16 = k & ~15;
    for (int n = n0; n < n1; n += 4) {
        const int nv = n1 - n < 4 ? n1 - n : 4;
        cols4 c;
        cols4_q8(&c, rhs, n, nv);
        const int8_t *w[4];
        for (int j = 0; j < 4; j++) w[j] = (const int8_t *)c.w[j];
        for (int i = 0; i < m; i += 4) {
            const int8_t *a[4];
            for (int r = 0; r < 4; r++) a[r] = lhs_row(lhs, i + r, m);
            int32x4_t x00 = vdupq_n_s32(0), x01 = x00, x10 = x00, x11 = x00;
            int kk = 0;
            for (; kk < k16; kk += 16) {
                const int8x16_t u0 = vld1q_s8(w[0] + kk), u1 = vld1q_s8(w[1] + kk);
                const int8x16_t u2 = vld1q_s8(w[2] + kk), u3 = vld1q_s8(w[3] + kk);
                const int8x16_t b0k0 = zip_lo64(u0, u1), b0k1 = zip_hi64(u0, u1);
                const int8x16_t b1k0 = zip_lo64(u2, u3), b1k1 = zip_hi64(u2, u3);
                const int8x16_t p0 = vld1q_s8(a[0] + kk), q0 = vld1q_s8(a[1] + kk);
                const int8x16_t p1 = vld1q_s8(a[2] + kk), q1 = vld1q_s8(a[3] + kk);
                const int8x16_t a0k0 = zip_lo64(p0, q0), a0k1 = zip_hi64(p0, q0);
                const int8x16_t a1k0 = zip_lo64(p1, q1), a1k1 = zip_hi64(p1, q1);
                x00 = vmmlaq_s32(vmmlaq_s32(x00, a0k0, b0k0), a0k1, b0k1);
                x01 = vmmlaq_s32(vmmlaq_s32(x01, a0k0, b1k0), a0k1, b1k1);
                x10 = vmmlaq_s32(vmmlaq_s32(x10, a1k0, b0k0), a1k1, b0k1);
                x11 = vmmlaq_s32(vmmlaq_s32(x11, a1k0, b1k0), a1k1, b1k1);
            }
            int32x4_t rows[4] = {zip_lo64i(x00, x01), zip_hi64i(x00, x01), zip_lo64i(x10, x11),
                                 zip_hi64i(x10, x11)};
            if (kk < k) {   /* K % 16 tail */
                for (int r = 0; r < 4; r++) {
                    int32_t t[4] = {0, 0, 0, 0};
                    for (int q = kk; q < k; q++)
                        for (int j = 0; j < 4; j++) t[j] += a[r][q] * w[j][q];
                    rows[r] = vaddq_s32(rows[r], vld1q_s32(t));
                }
            }
            for (int r = 0; r < 4 && i + r < m; r++)
                store_q8(lhs, i + r, &c, rows[r], dst + (size_t)(i + r) * ldd + n, nv, lo, hi);
        }
    }
}

/* ---- table ------------------------------------------------------------------------------ */

#define NEON PK_CPU_NEON
#define DOT (PK_CPU_NEON | PK_CPU_DOTPROD)
#define I8MM (PK_CPU_NEON | PK_CPU_DOTPROD | PK_CPU_I8MM)

const pk_kernel pk_kernels_arm_neon[] = {
    {.name = "qai8dx_qsi4c32_1x4_neon", .isa = "neon", .fmt = PK_FMT_QSI4C32, .features = NEON,
     .priority = 10, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi4c32_1x4_neon, .run_d32 = qsi8d32_qsi4c32_1x4_neon},
    {.name = "qai8dx_qsi8cx_1x4_neon", .isa = "neon", .fmt = PK_FMT_QSI8CX, .features = NEON,
     .priority = 10, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi8cx_1x4_neon},
    {.name = "qai8dx_qsi4c32_1x4_dotprod", .isa = "dotprod", .fmt = PK_FMT_QSI4C32, .features = DOT,
     .priority = 20, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi4c32_1x4_dotprod, .run_d32 = qsi8d32_qsi4c32_1x4_dotprod},
    {.name = "qai8dx_qsi4c32_4x4_dotprod", .isa = "dotprod", .fmt = PK_FMT_QSI4C32, .features = DOT,
     .priority = 21, .m_min = 4, .n_step = 4,
     .run = qai8dx_qsi4c32_4x4_dotprod, .run_d32 = qsi8d32_qsi4c32_4x4_dotprod},
    {.name = "qai8dx_qsi8cx_1x4_dotprod", .isa = "dotprod", .fmt = PK_FMT_QSI8CX, .features = DOT,
     .priority = 20, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi8cx_1x4_dotprod},
    {.name = "qai8dx_qsi8cx_4x4_dotprod", .isa = "dotprod", .fmt = PK_FMT_QSI8CX, .features = DOT,
     .priority = 21, .m_min = 4, .n_step = 4,
     .run = qai8dx_qsi8cx_4x4_dotprod},
    {.name = "qai8dx_qsi4c32_4x4_i8mm", .isa = "i8mm", .fmt = PK_FMT_QSI4C32, .features = I8MM,
     .priority = 30, .m_min = 4, .n_step = 4,
     .run = qai8dx_qsi4c32_4x4_i8mm, .run_d32 = qsi8d32_qsi4c32_4x4_i8mm},
    {.name = "qai8dx_qsi8cx_4x4_i8mm", .isa = "i8mm", .fmt = PK_FMT_QSI8CX, .features = I8MM,
     .priority = 30, .m_min = 4, .n_step = 4,
     .run = qai8dx_qsi8cx_4x4_i8mm},
    {.name = "qai8dx_qsi6c32_1x4_neon", .isa = "neon", .fmt = PK_FMT_QSI6C32, .features = NEON,
     .priority = 10, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi6c32_1x4_neon},
    {.name = "qai8dx_qsi6c32_1x4_dotprod", .isa = "dotprod", .fmt = PK_FMT_QSI6C32, .features = DOT,
     .priority = 20, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi6c32_1x4_dotprod},
};
const int pk_kernels_arm_neon_count = sizeof pk_kernels_arm_neon / sizeof pk_kernels_arm_neon[0];
#endif
