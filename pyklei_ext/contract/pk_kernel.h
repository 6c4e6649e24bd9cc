/* The contract between the kernel layer (ops/pk_*.c) and the ISA files (isa/): everything an
 * ISA file may see, and nothing more. contract/ is the floor both stand on: an ISA file
 * includes headers from here (and its own template headers in isa/), never from ops/. A
 * matmul ISA file (isa/matmul_<isa>.c) fills one table of pk_kernel records; a row-helper
 * file (isa/fwht_f16_qai8dx_<isa>.c) fills one pk_isa_helpers record (FWHT, f16 conversion,
 * activation quantizer); the registry (ops/pk_registry.c) lists the tables and records
 * declared here, and the kernel layer reaches those ISA files only through them. The
 * attention's SIMD paths (isa/attention_x86_*.h) are inlined into ops/pk_attention.c's
 * clones and follow contract/pk_kv.h.
 *
 *   formats, element getters, bf16      pk_format.h
 *   CPU feature bits of the records     pk_cpu.h
 *   operands                            pk_operands.h (pk_lhs: qai8dx / qsi8d32 activations, pk_rhs: a weight)
 *   the kernel record                   pk_kernel
 *   repacked weight layouts             pk_pack.h (p16, p4)
 *   the scalar reference                pk_scalar_run, the fallback of SIMD kernels
 *   row helpers                         pk_isa_helpers (FWHT, f16 -> f32, qai8dx quantizer)
 *
 * Kernel names state the contract: qai8dx_<weight format>[p<layout>]_<MR>x<NR>_<isa>, e.g.
 * qai8dx_qsi4c32p16_8x16_avx512vnni; docs/KERNELS.md lists them. A record's run_d32 is the same
 * tile on qsi8d32 activations; the kernel log names it qsi8d32_<the rest of the name>. */
#ifndef PK_KERNEL_H
#define PK_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#include "pk_cpu.h"
#include "pk_format.h"
#include "pk_kv.h"         /* pk_f16_to_f32_fn */
#include "pk_operands.h"   /* pk_lhs, pk_rhs */
#include "pk_pack.h"       /* the repacked layouts the kernels read */

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
    /* Optional, for block-scaled activations (qsi8d32: lhs->bscale set, k a multiple of 32,
     * block formats only): as run, but each block of 32's int32 dot is scaled by the activation
     * block's scale times the weight block's, and there is no zero point:
     *     dst = clamp(sum_b (ws_b * as_b) * dot_b)
     * NULL: this kernel takes only qai8dx (the matmul layer then quantizes per row for it). */
    void (*run_d32)(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                    const void *packed, float *dst, size_t ldd, float clamp_lo, float clamp_hi);
} pk_kernel;

/* ---- helpers for the kernels and quantizers --------------------------------------------- */

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

/* qsi8d32's rule (docs/FORMAT.md) for one block of 32 with largest magnitude amax: sets the
 * block's scale, returns the inverse scale; q = rint(x * inverse), which lands in [-127, 127].
 * One place for every quantizer: float32 arithmetic, round half to even. */
static inline float pk_qsi8d32_params(float amax, float *scale) {
    *scale = amax / 127.0f;
    return amax == 0.0f ? 0.0f : 127.0f / amax;
}

/* ---- the ISA tables (the registry, ops/pk_registry.c, lists them in this order) ----------- */

extern const pk_kernel pk_kernels_scalar[];          /* isa/matmul_scalar.c */
extern const int pk_kernels_scalar_count;
#if defined(__x86_64__)
extern const pk_kernel pk_kernels_x86_avx2[];        /* isa/matmul_x86_avx2.c */
extern const int pk_kernels_x86_avx2_count;
extern const pk_kernel pk_kernels_x86_avx512vnni[];  /* isa/matmul_x86_avx512vnni.c */
extern const int pk_kernels_x86_avx512vnni_count;
extern const pk_kernel pk_kernels_x86_avxvnni[];     /* isa/matmul_x86_avxvnni.c */
extern const int pk_kernels_x86_avxvnni_count;
extern const pk_kernel pk_kernels_x86_amx[];         /* isa/matmul_x86_amx.c */
extern const int pk_kernels_x86_amx_count;
#elif defined(__aarch64__)
extern const pk_kernel pk_kernels_arm_neon[];        /* isa/matmul_arm_neon.c */
extern const int pk_kernels_arm_neon_count;
#endif

/* The scalar reference for any format (isa/matmul_scalar.c; `run` of its table's records):
 * SIMD kernels hand rows to it when they cannot get scratch memory. */
void pk_scalar_run(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed,
                   float *dst, size_t ldd, float lo, float hi);
/* The same for qsi8d32 activations (run_d32 of the scalar records; qsi4c32 and qsi6c32). */
void pk_scalar_run_d32(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed,
                       float *dst, size_t ldd, float lo, float hi);

/* ---- helpers an ISA file may offer besides its kernels ---------------------------------- */

/* x[p] <- x @ H_p, unnormalised, p a power of two: butterflies on pairs (i, i + h) in blocks of
 * 2h, stage by stage. The reference every FWHT follows (the SIMD ones do the same additions in
 * the same order, so they are bit-exact) and their fallback for p below one vector; here, in
 * the contract, so that the ISA files need not call up into ops/ for it. */
static inline void pk_fwht_scalar(int p, float *x) {
    for (int h = 1; h < p; h *= 2)
        for (int i = 0; i < p; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* The kernel layer's row helpers, one record per ISA (isa/fwht_f16_qai8dx_<isa>.c). Each SIMD
 * one is bit-exact (the quantizer byte-exact) with the generic version of the scalar record
 * (pk_fwht_scalar above, pk_f16_to_f32_scalar, pk_quantize_qai8dx_row_scalar,
 * pk_quantize_qsi8d32_row_scalar), which runs
 * everywhere. The registry (ops/pk_registry.c) lists the records, widest first, the scalar one
 * last, and the ops files pick from that list by CPU feature (and, for the FWHT and the f16
 * conversion, by PYKLEI_KERNEL's ISA tags): they never name an ISA file's function, as with
 * the kernels. */
typedef struct {
    const char *isa;          /* ISA tag as in PYKLEI_KERNEL: avx2, avx512vnni, neon */
    uint32_t features;        /* PK_CPU_* bits required */
    /* x[p] <- x @ H_p unnormalised, p a power of two (ops/pk_rotate.c, one per rotation) */
    void (*fwht)(int p, float *x);
    /* out[i] = x[i] as float, i < n (ops/pk_f16.c, the f16 KV cache, one per model) */
    pk_f16_to_f32_fn f16_to_f32;
    /* qai8dx of one row (ops/pk_quantize.c); NULL: none for this ISA */
    void (*quantize_qai8dx_row)(int k, const float *x, int8_t *q, float *scale, int32_t *zp);
    /* qsi8d32 of one row, k a multiple of 32: q [k], the block scales and the block sums of q
     * [k / 32] (ops/pk_quantize.c); NULL: none for this ISA */
    void (*quantize_qsi8d32_row)(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum);
} pk_isa_helpers;

extern const pk_isa_helpers pk_helpers_scalar;           /* isa/fwht_f16_qai8dx_scalar.c */
#if defined(__x86_64__)
extern const pk_isa_helpers pk_helpers_x86_avx2;         /* isa/fwht_f16_qai8dx_x86_avx2.c */
extern const pk_isa_helpers pk_helpers_x86_avx512vnni;   /* isa/fwht_f16_qai8dx_x86_avx512vnni.c */
#elif defined(__aarch64__)
extern const pk_isa_helpers pk_helpers_arm_neon;         /* isa/fwht_f16_qai8dx_arm_neon.c */
#endif

/* The generic row helpers of the scalar record (isa/fwht_f16_qai8dx_scalar.c), named: the
 * references the SIMD ones are tested against. */
void pk_f16_to_f32_scalar(size_t n, const uint16_t *x, float *out);
void pk_quantize_qai8dx_row_scalar(int k, const float *x, int8_t *q, float *scale, int32_t *zp);
void pk_quantize_qsi8d32_row_scalar(int k, const float *x, int8_t *q, float *bscale, int32_t *bsum);

#endif
