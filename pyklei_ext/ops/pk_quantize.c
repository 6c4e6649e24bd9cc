/* Activation quantizers: qai8dx (one int8 plane per row) and qai8dx2 (two planes), byte-exact
 * with the numpy reference (pyklei.formats); the SIMD row quantizers live in the ISA files
 * (ops/pk_kernel.h) and are picked here by CPU feature. */
#include "pk_ops_internal.h"

#include <math.h>
#include <string.h>

/* ---- activations ----------------------------------------------------------------------- */

void pk_quantize_qai8dx_row(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
#if defined(__x86_64__)
    const uint32_t f = pk_cpu_features();
    if (f & PK_CPU_AVX512VNNI) { pk_quantize_qai8dx_row_avx512(k, x, q, scale, zp); return; }
    if (f & PK_CPU_AVX2) { pk_quantize_qai8dx_row_avx2(k, x, q, scale, zp); return; }
#endif
    pk_quantize_qai8dx_row_scalar(k, x, q, scale, zp);
}

int pk_quantize_qai8dx_row_impl(const char *impl, int k, const float *x, int8_t *q, float *scale,
                                int32_t *zp) {
    if (!strcmp(impl, "scalar")) { pk_quantize_qai8dx_row_scalar(k, x, q, scale, zp); return 0; }
#if defined(__x86_64__)
    if (!strcmp(impl, "avx2") && (pk_cpu_features() & PK_CPU_AVX2)) {
        pk_quantize_qai8dx_row_avx2(k, x, q, scale, zp);
        return 0;
    }
    if (!strcmp(impl, "avx512") && (pk_cpu_features() & PK_CPU_AVX512VNNI)) {
        pk_quantize_qai8dx_row_avx512(k, x, q, scale, zp);
        return 0;
    }
#endif
    return -1;
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

void pk_quantize_qai8dx2_row(int k, const float *x, float *r, int8_t *q1, float *s1, int32_t *z1,
                             int8_t *q2, float *s2, int32_t *z2) {
    pk_quantize_qai8dx_row(k, x, q1, s1, z1);
    const float s = *s1;
    const int32_t z = *z1;
    for (int i = 0; i < k; i++) r[i] = x[i] - s * (float)((int32_t)q1[i] - z);
    pk_quantize_qai8dx_row(k, r, q2, s2, z2);
}
