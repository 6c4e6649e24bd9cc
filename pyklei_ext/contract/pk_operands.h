/* The operands of a matmul: pk_lhs (qai8dx or qsi8d32 activations) and pk_rhs (a prepared weight).
 * A header of their own because both the kernel contract (pk_kernel.h) and the repacked
 * layouts (pk_pack.h) are written in terms of them; pk_kernel.h includes pk_pack.h, so
 * pk_pack.h cannot include pk_kernel.h for them. */
#ifndef PK_OPERANDS_H
#define PK_OPERANDS_H

#include <stddef.h>
#include <stdint.h>

#include "pk_format.h"

struct pk_kernel;   /* pk_kernel.h: a weight records which kernels it was repacked for */

/* Quantized activations, canonical layout: qai8dx (asymmetric int8, a scale and zero point per
 * row: x = scale * (q - zp)) or, when bscale is set, qsi8d32 (symmetric int8, a scale per
 * block of 32 along K: x = bscale[b] * q; scale and zp unused). docs/FORMAT.md. */
typedef struct {
    int m, k;
    const int8_t *q;       /* [m][ld] int8, row i at q + i*ld */
    size_t ld;             /* row stride in bytes, >= k */
    const float *scale;    /* qai8dx: [m] */
    const int32_t *zp;     /* qai8dx: [m] */
    /* [m][k/32] the sum of each 32 values of a row (made once per call by the quantizing
     * stage, so that kernels do not sum the rows again in every chunk), or NULL */
    const int32_t *bsum32;
    /* qsi8d32: [m][k/32] f32 scale of each block of 32 (k a multiple of 32); NULL: qai8dx.
     * Only a kernel's run_d32 reads it (contract/pk_kernel.h). */
    const float *bscale;
} pk_lhs;

#define PK_MAX_PACKED 4

/* A weight prepared for the kernels. The canonical arrays are borrowed (often straight
 * from the memory-mapped file); the row sums and any repacked copies are owned. */
typedef struct pk_rhs {
    pk_format fmt;
    int n, k, bl;                   /* bl: block length (32 for qsi6c32); k for qsi8cx */
    const uint8_t *qs;              /* qsi4c32: [n][k/2] nibbles; qsi6c32: [n][3k/4]; qsi8cx: int8 [n][k] */
    const void *scales;             /* qsi4c32, qsi6c32: bf16 [n][k/bl]; qsi8cx: float [n] */
    float *rsum;                    /* qsi4c32, qsi6c32: [n] sum_k of the dequantized row */
    int32_t *isum;                  /* qsi8cx:  [n] sum_k of the int8 row */
    /* Kernel-specific repacked copies (e.g. tile-interleaved for AMX), made on prepare. */
    const struct pk_kernel *packed_for[PK_MAX_PACKED];
    void *packed[PK_MAX_PACKED];
    size_t packed_bytes[PK_MAX_PACKED];
} pk_rhs;

#endif
