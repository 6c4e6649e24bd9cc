/* Scalar reference kernels: plain C, every architecture. The SIMD kernels are tested
 * against these; they favour obviousness over speed. */
#include "../contract/pk_kernel.h"

/* qai8dx x qsi4c32: integer dot per block, scaled by the block's bf16 scale. */
static void qai8dx_qsi4c32_1x1_scalar(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                  const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, bl = rhs->bl, nb = k / bl;
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        for (int n = n0; n < n1; n++) {
            const uint8_t *w = rhs->qs + (size_t)n * (k / 2);
            const uint16_t *s = (const uint16_t *)rhs->scales + (size_t)n * nb;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t d = 0;
                for (int kk = b * bl; kk < (b + 1) * bl; kk++) d += (int32_t)a[kk] * pk_qsi4c32_get(w, kk);
                acc += pk_bf16_to_f32(s[b]) * (float)d;
            }
            const float v = lhs->scale[i] * (acc - (float)lhs->zp[i] * rhs->rsum[n]);
            dst[(size_t)i * ldd + n] = pk_clampf(v, lo, hi);
        }
    }
}

/* qai8dx x qsi6c32: as qsi4c32 with 6-bit values and blocks of 32. */
static void qai8dx_qsi6c32_1x1_scalar(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                  const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, nb = k / 32;
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        for (int n = n0; n < n1; n++) {
            const uint8_t *w = rhs->qs + (size_t)n * pk_row_bytes(PK_FMT_QSI6C32, k);
            const uint16_t *s = (const uint16_t *)rhs->scales + (size_t)n * nb;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t d = 0;
                for (int kk = 32 * b; kk < 32 * (b + 1); kk++) d += (int32_t)a[kk] * pk_qsi6c32_get(w, kk);
                acc += pk_bf16_to_f32(s[b]) * (float)d;
            }
            const float v = lhs->scale[i] * (acc - (float)lhs->zp[i] * rhs->rsum[n]);
            dst[(size_t)i * ldd + n] = pk_clampf(v, lo, hi);
        }
    }
}

/* qai8dx x qsi8cx: one integer dot per row, exact until the final scaling. */
static void qai8dx_qsi8cx_1x1_scalar(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                 const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k;
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        for (int n = n0; n < n1; n++) {
            const int8_t *w = (const int8_t *)rhs->qs + (size_t)n * k;
            int32_t d = 0;
            for (int kk = 0; kk < k; kk++) d += (int32_t)a[kk] * w[kk];
            d -= lhs->zp[i] * rhs->isum[n];
            const float v = lhs->scale[i] * ((const float *)rhs->scales)[n] * (float)d;
            dst[(size_t)i * ldd + n] = pk_clampf(v, lo, hi);
        }
    }
}

/* qsi8d32 x qsi4c32 / qsi6c32: an integer dot per block of 32, scaled by the activation
 * block's scale times the weight block's bf16 scale (a weight block of bl covers bl/32
 * activation blocks); symmetric activations, so no zero-point term. */
static void qsi8d32_blocks_1x1_scalar(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                      const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, bl = rhs->bl, nbw = k / bl, nba = k / 32;
    const size_t row_bytes = pk_row_bytes(rhs->fmt, k);
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        const float *as = lhs->bscale + (size_t)i * nba;
        for (int n = n0; n < n1; n++) {
            const uint8_t *w = rhs->qs + (size_t)n * row_bytes;
            const uint16_t *s = (const uint16_t *)rhs->scales + (size_t)n * nbw;
            float acc = 0.0f;
            for (int b = 0; b < nba; b++) {
                int32_t d = 0;
                for (int kk = 32 * b; kk < 32 * (b + 1); kk++)
                    d += (int32_t)a[kk] * (rhs->fmt == PK_FMT_QSI4C32 ? pk_qsi4c32_get(w, kk) : pk_qsi6c32_get(w, kk));
                acc += (pk_bf16_to_f32(s[32 * b / bl]) * as[b]) * (float)d;
            }
            dst[(size_t)i * ldd + n] = pk_clampf(acc, lo, hi);
        }
    }
}

void pk_scalar_run_d32(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed,
                       float *dst, size_t ldd, float lo, float hi) {
    qsi8d32_blocks_1x1_scalar(m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi);
}

void pk_scalar_run(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed,
                   float *dst, size_t ldd, float lo, float hi) {
    switch (rhs->fmt) {
    case PK_FMT_QSI4C32: qai8dx_qsi4c32_1x1_scalar(m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi); break;
    case PK_FMT_QSI6C32: qai8dx_qsi6c32_1x1_scalar(m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi); break;
    default: qai8dx_qsi8cx_1x1_scalar(m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi); break;
    }
}

const pk_kernel pk_kernels_scalar[] = {
    {.name = "qai8dx_qsi4c32_1x1_scalar", .isa = "scalar", .fmt = PK_FMT_QSI4C32, .features = 0,
     .priority = 0, .m_min = 1, .n_step = 1,
     .run = qai8dx_qsi4c32_1x1_scalar, .run_d32 = qsi8d32_blocks_1x1_scalar},
    {.name = "qai8dx_qsi8cx_1x1_scalar", .isa = "scalar", .fmt = PK_FMT_QSI8CX, .features = 0,
     .priority = 0, .m_min = 1, .n_step = 1,
     .run = qai8dx_qsi8cx_1x1_scalar},
    {.name = "qai8dx_qsi6c32_1x1_scalar", .isa = "scalar", .fmt = PK_FMT_QSI6C32, .features = 0,
     .priority = 0, .m_min = 1, .n_step = 1,
     .run = qai8dx_qsi6c32_1x1_scalar, .run_d32 = qsi8d32_blocks_1x1_scalar},
};
const int pk_kernels_scalar_count = sizeof pk_kernels_scalar / sizeof pk_kernels_scalar[0];
