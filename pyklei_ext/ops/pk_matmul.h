/* The kernel layer: f32 activations [M, K] x quantized weights [N, K]^T -> f32 [M, N].
 *
 * Activations are quantized per row to qai8dx (asymmetric int8) on the fly; weights are
 * qsi4c32 (int4, bf16 scale per block of bl along K), qsi6c32 (int6, bf16 scale per block of
 * 32; for the lm_head / tied embedding) or qsi8cx (int8, f32 scale per row).
 * docs/FORMAT.md defines the bytes and the arithmetic; docs/KERNELS.md the kernels.
 *
 * Layers: pk_matmul (this file: weights, dispatch, threads) -> pk_kernel micro-kernels
 * (isa/matmul_<isa>.c, one file per ISA family, per-function target attributes). */
#ifndef PK_MATMUL_H
#define PK_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "pk_pool.h"

typedef enum { PK_FMT_QSI4C32 = 0, PK_FMT_QSI8CX = 1, PK_FMT_QSI6C32 = 2, PK_FMT_COUNT } pk_format;

/* qai8dx activations, canonical layout. */
typedef struct {
    int m, k;
    const int8_t *q;       /* [m][ld] int8, row i at q + i*ld */
    size_t ld;             /* row stride in bytes, >= k */
    const float *scale;    /* [m] */
    const int32_t *zp;     /* [m] */
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

/* One micro-kernel. Any kernel computes correct results for every m >= 1 and any
 * [n0, n1) range; m_min only says from which m the dispatch prefers it. */
typedef struct pk_kernel {
    const char *name;        /* contract in the name: qai8dx_qsi4c32_1x4_avx512vnni */
    const char *isa;         /* tag usable in PYKLEI_KERNEL: scalar, avx2, avx512vnni, ... */
    pk_format fmt;
    uint32_t features;       /* PK_CPU_* bits required */
    int priority;            /* higher wins among usable kernels */
    int m_min;               /* preferred for m >= m_min */
    int n_step;              /* threads split N in multiples of this */
    /* Optional weight repacking for this kernel (NULL when it reads the canonical layout). */
    size_t (*rhs_packed_size)(const pk_rhs *rhs);
    void (*rhs_pack)(const pk_rhs *rhs, void *dst);
    /* dst[i*ldd + j] for i in [0, m), j in [n0, n1); packed is this kernel's repack or NULL */
    void (*run)(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                const void *packed, float *dst, size_t ldd, float clamp_lo, float clamp_hi);
    /* Optional, for two-plane activations (qai8dx2): as run, but lhs rows 2t and 2t+1 are the
     * two planes of output row t (m even): dst row t = clamp(product 2t + product 2t+1),
     * bit-identical to summing run's unclamped rows. NULL: the caller sums. */
    void (*run_pairs)(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                      const void *packed, float *dst, size_t ldd, float clamp_lo, float clamp_hi);
} pk_kernel;

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
const char *pk_last_error(void);
/* Sets this thread's error message (for the layers above the kernels); returns -1. */
int pk_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The kernel the table picks for (fmt, m); NULL if init failed. */
const pk_kernel *pk_dispatch_select(pk_format fmt, int m);

/* Tests only: with PYKLEI_TEST_BREAK_KERNEL=<name>, the corrupted copy of that kernel which
 * was put into the table (and which the table's self-check then drops; docs/KERNELS.md), so
 * that a test can show it computes wrong results; NULL otherwise. */
const pk_kernel *pk_test_broken_kernel(void);

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
/* The portable version, and a named one for tests: impl "scalar", "avx2" or "avx512" (x86);
 * returns -1 when that implementation is not available here. pk_quantize_qai8dx_row picks the
 * best one for the CPU; all produce the same bytes. */
void pk_quantize_qai8dx_row_scalar(int k, const float *x, int8_t *q, float *scale, int32_t *zp);
int pk_quantize_qai8dx_row_impl(const char *impl, int k, const float *x, int8_t *q, float *scale,
                                int32_t *zp);

/* ---- matmul ------------------------------------------------------------------------- */

typedef struct pk_ctx pk_ctx;

pk_ctx *pk_ctx_create(int n_threads);
void pk_ctx_destroy(pk_ctx *ctx);
int pk_ctx_threads(const pk_ctx *ctx);
pk_pool *pk_ctx_pool(pk_ctx *ctx);

/* Activation precision of pk_matmul_f32: 1 plane = qai8dx (KleidiAI's per-row int8);
 * 2 planes = qai8dx2: each row also gets a second qai8dx row quantizing the residual
 * x - dequant(plane 1), and the two rows' products are summed. The kernels see 2M rows, so
 * weights stream once; the result has ~16-bit activation precision (docs/FORMAT.md). */
void pk_ctx_set_act_planes(pk_ctx *ctx, int planes);
int pk_ctx_act_planes(const pk_ctx *ctx);

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

/* ---- helpers shared by the ISA files ------------------------------------------------ */

static inline float pk_bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}

static inline float pk_clampf(float v, float lo, float hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}

/* qai8dx's rule (docs/FORMAT.md) from a row's range [mn, mx] (mn <= 0 <= mx): sets the scale
 * and zero point, returns the inverse scale. One place for every quantizer (scalar and SIMD):
 * float32 arithmetic, no fused multiply-add, round half to even. */
static inline float pk_qai8dx_params(float mn, float mx, float *scale, int32_t *zp) {
    const float rng = mx - mn;
    const float inv = rng == 0.0f ? 1.0f : 255.0f / rng;
    *scale = rng == 0.0f ? 1.0f : rng / 255.0f;
    float z = __builtin_rintf(-128.0f - mn * inv);
    z = z < -128.0f ? -128.0f : (z > 127.0f ? 127.0f : z);
    *zp = (int32_t)z;
    return inv;
}

/* Element kk of a qsi4c32 row (sign-extended int4), following the chunk nibble order. */
static inline int pk_qsi4c32_get(const uint8_t *row, int kk) {
    const uint8_t b = row[(kk >> 5) * 16 + (kk & 15)];
    const int nib = (kk & 16) ? (b >> 4) : (b & 15);
    return (nib ^ 8) - 8;
}

/* Element kk of a qsi6c32 row, in [-32, 31]. Chunk c of 32 elements is 24 bytes: 16 bytes of
 * low nibbles in qsi4c32's order, then 8 bytes whose byte j holds the top two bits of
 * elements j, j+8, j+16, j+24 (bits 0-1, 2-3, 4-5, 6-7); values are stored as q + 32. */
static inline int pk_qsi6c32_get(const uint8_t *row, int kk) {
    const uint8_t *c = row + (kk >> 5) * 24;
    const int e = kk & 31;
    const int lo = (e & 16) ? (c[e & 15] >> 4) : (c[e & 15] & 15);
    const int hi = (c[16 + (e & 7)] >> (2 * (e >> 3))) & 3;
    return (lo | hi << 4) - 32;
}

/* Bytes of one weight row in the canonical layout. */
static inline size_t pk_row_bytes(pk_format fmt, int k) {
    return fmt == PK_FMT_QSI4C32 ? (size_t)k / 2 : fmt == PK_FMT_QSI6C32 ? (size_t)k / 4 * 3 : (size_t)k;
}

#endif
