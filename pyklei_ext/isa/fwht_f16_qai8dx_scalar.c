/* The row helpers in plain C (the pk_isa_helpers record of tag scalar, contract/pk_kernel.h):
 * the references every SIMD record is bit-exact with, and what runs where none does. The
 * registry (ops/pk_registry.c) lists this record last.
 *   FWHT               pk_fwht_scalar (contract/pk_kernel.h), the rotation's (ops/pk_rotate.c)
 *   f16 -> f32         pk_f16_to_f32_scalar, the KV cache's (ops/pk_f16.c)
 *   qai8dx quantizer   pk_quantize_qai8dx_row_scalar, byte-exact with the numpy reference
 *                      (pyklei.formats; ops/pk_quantize.c picks among the records)
 *   qsi8d32 quantizer  pk_quantize_qsi8d32_row_scalar, likewise */
#include "../contract/pk_kernel.h"

#include <math.h>

void pk_f16_to_f32_scalar(size_t n, const uint16_t *x, float *out) {
    for (size_t i = 0; i < n; i++) out[i] = pk_f16_to_f32(x[i]);
}

void pk_quantize_qai8dx_row_scalar(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
    float mn = 0.0f, mx = 0.0f;
    for (int i = 0; i < k; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    const float inv = pk_qai8dx_params(mn, mx, scale, zp);
    const int32_t zi = *zp;
    for (int i = 0; i < k; i++) {
        int32_t v = (int32_t)rintf(x[i] * inv) + zi;
        q[i] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
    }
}

/* Per block of 32 the largest magnitude sets the scale (pk_qsi8d32_params); the block's sum
 * of q is kept for the kernels' weight-offset correction (pk_lhs.bsum32). */
void pk_quantize_qsi8d32_row_scalar(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum) {
    for (int b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float inv = pk_qsi8d32_params(amax, bscale + b);
        int32_t s = 0;
        for (int i = 0; i < 32; i++) {
            const int32_t v = (int32_t)rintf(xb[i] * inv);
            q[32 * b + i] = (int8_t)v;
            s += v;
        }
        bsum[b] = s;
    }
}

const pk_isa_helpers pk_helpers_scalar = {
    .isa = "scalar",
    .features = 0,
    .fwht = pk_fwht_scalar,
    .f16_to_f32 = pk_f16_to_f32_scalar,
    .quantize_qai8dx_row = pk_quantize_qai8dx_row_scalar,
    .quantize_qsi8d32_row = pk_quantize_qsi8d32_row_scalar,
};
