/* Activation quantizers: qai8dx (one int8 plane per row), qai8dx2 (two planes) and qsi8d32
 * (symmetric int8, a scale per block of 32), byte-exact with the numpy reference
 * (pyklei.formats); the SIMD qai8dx row quantizers live in the ISA files and reach this file
 * through the registry's helper records (contract/pk_kernel.h, pk_isa_helpers), picked by CPU
 * feature, as do the qsi8d32 ones. */
#include "pk_ops_internal.h"

#include <string.h>

/* ---- activations ----------------------------------------------------------------------- */

/* The widest quantizer among the registry's helper records that this CPU runs (the generic
 * one, pk_quantize_qai8dx_row_scalar of isa/fwht_f16_qai8dx_scalar.c, last); all produce the
 * same bytes, so PYKLEI_KERNEL does not steer this choice. A walk of a few records per row:
 * noise next to quantizing k floats. */
void pk_quantize_qai8dx_row(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
    const uint32_t f = pk_cpu_features();
    for (int i = 0;; i++) {
        const pk_isa_helpers *h = pk_isa_helpers_at(i);
        if (h->quantize_qai8dx_row && (f & h->features) == h->features) {
            h->quantize_qai8dx_row(k, x, q, scale, zp);
            return;
        }
    }
}

/* The helper record of a quantizer name tests pass (pk_matmul.h), or NULL: "avx512" is the
 * avx512vnni record's, whose quantizers need AVX-512 F + BW only. */
static const pk_isa_helpers *named_quantizers(const char *impl) {
    static const struct { const char *impl, *isa; } names[] = {
        {"scalar", "scalar"}, {"avx2", "avx2"}, {"avx512", "avx512vnni"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(impl, names[i].impl)) return pk_isa_helpers_for(names[i].isa);
    return NULL;
}

int pk_quantize_qai8dx_row_impl(const char *impl, int k, const float *x, int8_t *q, float *scale,
                                int32_t *zp) {
    const pk_isa_helpers *h = named_quantizers(impl);
    if (!h || !h->quantize_qai8dx_row) return -1;
    h->quantize_qai8dx_row(k, x, q, scale, zp);
    return 0;
}

void pk_quantize_qai8dx2_row(int k, const float *x, float *r, int8_t *q1, float *s1, int32_t *z1,
                             int8_t *q2, float *s2, int32_t *z2) {
    pk_quantize_qai8dx_row(k, x, q1, s1, z1);
    const float s = *s1;
    const int32_t z = *z1;
    for (int i = 0; i < k; i++) r[i] = x[i] - s * (float)((int32_t)q1[i] - z);
    pk_quantize_qai8dx_row(k, r, q2, s2, z2);
}

/* qsi8d32 of one row: the widest of the records' quantizers that this CPU runs, as for qai8dx
 * (every one gives the same bytes). */
void pk_quantize_qsi8d32_row(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum) {
    const uint32_t f = pk_cpu_features();
    for (int i = 0;; i++) {
        const pk_isa_helpers *h = pk_isa_helpers_at(i);
        if (h->quantize_qsi8d32_row && (f & h->features) == h->features) {
            h->quantize_qsi8d32_row(k, x, q, bscale, bsum);
            return;
        }
    }
}

int pk_quantize_qsi8d32_row_impl(const char *impl, int k, const float *x, int8_t *q, float *bscale,
                                 int32_t *bsum) {
    const pk_isa_helpers *h = named_quantizers(impl);
    if (!h || !h->quantize_qsi8d32_row) return -1;
    h->quantize_qsi8d32_row(k, x, q, bscale, bsum);
    return 0;
}
