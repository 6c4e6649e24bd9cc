/* The kernel layer: f32 activations [M, K] x quantized weights [N, K]^T -> f32 [M, N].
 *
 * Activations are quantized per row to qai8dx (asymmetric int8) on the fly; weights are
 * qsi4c32 (int4, bf16 scale per block of bl along K), qsi6c32 (int6, bf16 scale per block of
 * 32; for the lm_head / tied embedding) or qsi8cx (int8, f32 scale per row).
 * docs/FORMAT.md defines the bytes and the arithmetic; docs/KERNELS.md the kernels.
 *
 * Layers: pk_matmul (this file, the public API: registry, dispatch, weights, activations,
 * threads) -> the micro-kernels (isa/matmul_<isa>.c, one file per ISA family, per-function
 * target attributes), which see only their contract, contract/pk_kernel.h. */
#ifndef PK_MATMUL_H
#define PK_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "../contract/pk_kernel.h"   /* pk_lhs, pk_rhs, pk_kernel, the formats */
#include "pk_pool.h"

/* ---- registry and dispatch ---------------------------------------------------------- */

/* All kernels compiled for this architecture (supported by the CPU or not). */
int pk_kernel_count(void);
const pk_kernel *pk_kernel_at(int i);
const pk_kernel *pk_kernel_by_name(const char *name);
int pk_kernel_supported(const pk_kernel *kern);

/* Builds the dispatch table once from the CPU features and PYKLEI_KERNEL (a comma list of
 * kernel names or ISA tags that restricts the choice; a format with no forced match keeps
 * its default), then checks each SIMD kernel it could pick against the scalar kernel on a
 * small case and drops, with a warning on stderr, any that disagrees (docs/KERNELS.md).
 * Returns 0, or -1 with a message in pk_last_error(). */
int pk_dispatch_init(void);
/* This thread's last error message (ops/pk_error.c). */
const char *pk_last_error(void);
/* Sets this thread's error message (for the layers above the kernels); returns -1. */
int pk_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The kernel the table picks for (fmt, m); NULL if init failed. */
const pk_kernel *pk_dispatch_select(pk_format fmt, int m);

/* ---- weights ------------------------------------------------------------------------ */

/* Fills rhs for borrowed arrays and computes row sums and repacks for the kernels the
 * table may pick (plus `extra`, if not NULL). Returns 0, or -1 (see pk_last_error()). */
int pk_rhs_prepare(pk_rhs *rhs, pk_format fmt, int n, int k, int bl,
                   const void *qs, const void *scales, const pk_kernel *extra);
void pk_rhs_release(pk_rhs *rhs);
size_t pk_rhs_owned_bytes(const pk_rhs *rhs);
/* 0 when every kernel the dispatch table can pick for this weight reads a repacked copy, so
 * the canonical arrays are no longer read (the caller may release their pages); else 1. */
int pk_rhs_needs_canonical(const pk_rhs *rhs);

/* ---- activations -------------------------------------------------------------------- */

/* qai8dx of one row, byte-exact with the numpy reference (pyklei.formats.qai8dx). */
void pk_quantize_qai8dx_row(int k, const float *x, int8_t *q, float *scale, int32_t *zp);
/* A named one for tests: impl "scalar", "avx2" or "avx512" (x86); returns -1 when that
 * implementation is not available here. pk_quantize_qai8dx_row picks the best one for the
 * CPU; all produce the same bytes (the portable one, pk_quantize_qai8dx_row_scalar:
 * contract/pk_kernel.h). */
int pk_quantize_qai8dx_row_impl(const char *impl, int k, const float *x, int8_t *q, float *scale,
                                int32_t *zp);

/* qsi8d32 of one row, k a multiple of 32: q [k], bscale and bsum [k/32] (the block sums of q);
 * byte-exact with pyklei.formats.quantize_qsi8d32. The _impl one names the implementation, as
 * pk_quantize_qai8dx_row_impl. */
void pk_quantize_qsi8d32_row(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum);
int pk_quantize_qsi8d32_row_impl(const char *impl, int k, const float *x, int8_t *q, float *bscale,
                                 int32_t *bsum);

/* ---- matmul ------------------------------------------------------------------------- */

typedef struct pk_ctx pk_ctx;

pk_ctx *pk_ctx_create(int n_threads);
void pk_ctx_destroy(pk_ctx *ctx);
int pk_ctx_threads(const pk_ctx *ctx);
pk_pool *pk_ctx_pool(pk_ctx *ctx);

/* Activation scheme of pk_matmul_f32 (docs/FORMAT.md):
 *   PK_ACT_QAI8DX   one int8 plane per row, asymmetric (KleidiAI's qai8dx);
 *   PK_ACT_QAI8DX2  each row also gets a second qai8dx row quantizing the residual
 *                   x - dequant(plane 1), and the two rows' products are summed. The kernels
 *                   see 2M rows, so weights stream once; ~16-bit activation precision;
 *   PK_ACT_QSI8D32  one symmetric int8 plane with a scale per block of 32 along K (KleidiAI's
 *                   qsi8d32, llama.cpp's Q8_0), folded into the kernels' per-block multiply
 *                   (pk_kernel.run_d32). A call whose kernel has no run_d32, or whose K is
 *                   not a multiple of 32, or a qsi8cx weight, runs qai8dx instead. */
typedef enum { PK_ACT_QAI8DX = 0, PK_ACT_QAI8DX2 = 1, PK_ACT_QSI8D32 = 2 } pk_act;
void pk_ctx_set_activations(pk_ctx *ctx, pk_act act);
pk_act pk_ctx_activations(const pk_ctx *ctx);

/* Two-plane quantization of one row: plane 1 into (q1, s1, z1), its residual into (q2, s2, z2);
 * byte-exact with pyklei.formats.quantize_qai8dx2. r: scratch [k]. */
void pk_quantize_qai8dx2_row(int k, const float *x, float *r, int8_t *q1, float *s1, int32_t *z1,
                             int8_t *q2, float *s2, int32_t *z2);

/* dst[M, N] = clamp(quant(x[M, K]) @ W^T). x rows at x + i*ldx, dst rows at dst + i*ldd.
 * kern NULL: the dispatch table chooses. Returns 0, or -1 (pk_last_error()). */
int pk_matmul_f32(pk_ctx *ctx, const pk_rhs *rhs, int m, const float *x, size_t ldx,
                  float *dst, size_t ldd, float clamp_lo, float clamp_hi, const pk_kernel *kern);

/* Several weights with the same K applied to the same x (q/k/v, gate/up): x is quantized
 * once and one pool job covers all of them. count <= PK_MAX_PARTS. */
#define PK_MAX_PARTS 4
int pk_matmul_f32_multi(pk_ctx *ctx, int count, const pk_rhs *const *rhs, int m, const float *x,
                        size_t ldx, float *const *dst, const size_t *ldd, float clamp_lo, float clamp_hi,
                        const pk_kernel *kern);

/* Same with activations already quantized (tests feed exact integer cases this way). */
int pk_matmul_lhs(pk_ctx *ctx, const pk_rhs *rhs, const pk_lhs *lhs,
                  float *dst, size_t ldd, float clamp_lo, float clamp_hi, const pk_kernel *kern);

#endif
