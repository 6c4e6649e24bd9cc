/* The canonical weight: pk_rhs filled for borrowed arrays, its shape checked and its row sums
 * computed, and its release. Apart from the dispatch table (pk_weights.c adds the repacked
 * copies its kernels read), so that the self-check (pk_selfcheck.c), which runs while the
 * table is being built, prepares its cases without calling back into the dispatcher. */
#include "pk_ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* pk_rhs_prepare without the dispatch table: checks the shape, fills rhs and computes the row
 * sums; no repacked copy. The self-check calls it while the table is being built (inside
 * pk_dispatch_init's pthread_once, which pk_rhs_prepare would wait on forever). */
int pk_rhs_prepare_canonical(pk_rhs *rhs, pk_format fmt, int n, int k, int bl, const void *qs,
                                 const void *scales) {
    memset(rhs, 0, sizeof *rhs);
    if (n <= 0 || k <= 0) return fail("weight shape [%d, %d] is empty", n, k);
    if (fmt == PK_FMT_QSI4C32) {
        if (bl != 32 && bl != 64 && bl != 128 && bl != 256)
            return fail("qsi4c32 block size %d is not one of 32, 64, 128, 256", bl);
        if (k % bl) return fail("qsi4c32: K=%d is not a multiple of the block size %d", k, bl);
    } else if (fmt == PK_FMT_QSI6C32) {
        if (bl != 32) return fail("qsi6c32 block size %d is not 32", bl);
        if (k % 32) return fail("qsi6c32: K=%d is not a multiple of 32", k);
    } else if (fmt == PK_FMT_QSI8CX) {
        bl = k;
    } else {
        return fail("unknown weight format %d", (int)fmt);
    }
    rhs->fmt = fmt;
    rhs->n = n;
    rhs->k = k;
    rhs->bl = bl;
    rhs->qs = qs;
    rhs->scales = scales;
    if (fmt == PK_FMT_QSI4C32) {
        rhs->rsum = malloc(sizeof(float) * (size_t)n);
        if (!rhs->rsum) return fail("out of memory");
        const int nb = k / bl;
        for (int r = 0; r < n; r++) {
            const uint8_t *row = rhs->qs + (size_t)r * (k / 2);
            const uint16_t *s = (const uint16_t *)scales + (size_t)r * nb;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                /* sum of sign-extended nibbles: x - 16 * (x >= 8) per nibble, written so that the
                 * compiler vectorizes it (a table lookup per byte made loading a 1B model slow) */
                int isum = 0;
                for (int j = b * bl / 2; j < (b + 1) * bl / 2; j++) {
                    const int v = row[j];
                    isum += (v & 15) + (v >> 4) - ((v & 8) << 1) - ((v >> 3) & 16);
                }
                acc += pk_bf16_to_f32(s[b]) * (float)isum;
            }
            rhs->rsum[r] = acc;
        }
    } else if (fmt == PK_FMT_QSI6C32) {
        rhs->rsum = malloc(sizeof(float) * (size_t)n);
        if (!rhs->rsum) return fail("out of memory");
        const int nb = k / 32;
        for (int r = 0; r < n; r++) {
            const uint8_t *row = rhs->qs + (size_t)r * pk_row_bytes(fmt, k);
            const uint16_t *s = (const uint16_t *)scales + (size_t)r * nb;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {   /* sum of u - 32 = low nibbles + 16 * top bits - 32 * 32 */
                const uint8_t *c = row + (size_t)24 * b;
                int isum = -32 * 32;
                for (int j = 0; j < 16; j++) isum += (c[j] & 15) + (c[j] >> 4);
                for (int j = 16; j < 24; j++)
                    isum += 16 * ((c[j] & 3) + ((c[j] >> 2) & 3) + ((c[j] >> 4) & 3) + (c[j] >> 6));
                acc += pk_bf16_to_f32(s[b]) * (float)isum;
            }
            rhs->rsum[r] = acc;
        }
    } else {
        rhs->isum = malloc(sizeof(int32_t) * (size_t)n);
        if (!rhs->isum) return fail("out of memory");
        for (int r = 0; r < n; r++) {
            const int8_t *row = (const int8_t *)qs + (size_t)r * k;
            int32_t acc = 0;
            for (int j = 0; j < k; j++) acc += row[j];
            rhs->isum[r] = acc;
        }
    }
    return 0;
}

void pk_rhs_release(pk_rhs *rhs) {
    free(rhs->rsum);
    free(rhs->isum);
    for (int i = 0; i < PK_MAX_PACKED; i++) pk_packed_free(rhs->packed[i]);
    memset(rhs, 0, sizeof *rhs);
}
