/* x86 AMX-INT8 GEMM kernels (Sapphire Rapids and later): tdpbssd on 16 x 16 int32 tiles.
 *
 * Tile use, one 32 x 32 output block at a time (C0..C3 = tmm0..3, 2 x 2 tiles of 16 x 16):
 *   tmm4, tmm5  A: 16 activation rows x KD bytes (signed int8, rows i0.., i0+16..)
 *   tmm6, tmm7  B: KD/4 rows x 16 columns x 4 bytes (signed int8 weights, columns np.., np+16..)
 * KD = 32 for qsi4c32 with bl = 32 (one tdpbssd per block), 64 otherwise.
 * B comes from the per-thread 32-row weight panel (x86_avx512_panel.h), built per call from
 * the repacked copy the AVX-512 kernels read too (contract/pk_pack.h): two 16-row panels of the p16
 * copy for qsi4c32 (int4 sign-extended to int8), 32 rows of the p4 copy for qsi8cx. Both
 * operands are signed, so the block dots are exact with no offsets:
 *   qsi4c32: after each block, C is stored, converted and accumulated as s_b * D_b in f32
 *            (AVX-512), then dst = scale * (acc - zp * R) as in the scalar kernel;
 *   qsi8d32 activations (run_d32): KD = 32, each block of 32 scaled by s_b * as_b, dst = acc;
 *   qsi8cx:  C accumulates all of K in int32; dst = (scale * s) * (D - zp * isum), bit-exact
 *            with the scalar kernel.
 * The tile configuration is loaded with an inline ldtilecfg whose operand is the whole
 * 64-byte struct (GCC 12's _tile_loadconfig names only 8 bytes of it, so the compiler may drop
 * the stores filling the rest). The tile loads/stores carry "memory" clobbers for the same
 * reason. The kernels run only when pk_cpu reports PK_CPU_AMX_INT8 (CPUID + XCR0 tile state
 * + arch_prctl(ARCH_REQ_XCOMP_PERM) granted). */
#include "../contract/pk_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "x86_common.h"
#include "x86_avx512_panel.h"


typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

_Static_assert(sizeof(amx_cfg) == 64, "ldtilecfg reads 64 bytes");

static void amx_cfg_init(amx_cfg *c, int kd) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 4; t++) { c->rows[t] = 16; c->colsb[t] = 64; }        /* C: 16 x 16 int32 */
    for (int t = 4; t < 6; t++) { c->rows[t] = 16; c->colsb[t] = (uint16_t)kd; } /* A: 16 x KD int8 */
    for (int t = 6; t < 8; t++) { c->rows[t] = (uint8_t)(kd / 4); c->colsb[t] = 64; } /* B */
}

/* Activations copied to mp = roundup(m, 32) rows of lda = roundup(k, 64) bytes, zero padded. */
static int8_t *amx_copy_lhs(const pk_lhs *lhs, int m, int k, size_t *lda_out) {
    const int mp = (int)pk_round_up((size_t)m, 32);
    const size_t lda = pk_round_up((size_t)k, 64);
    int8_t *act = pk_scratch(2, lda * (size_t)mp);
    if (!act) return NULL;
    for (int i = 0; i < mp; i++) {
        int8_t *o = act + (size_t)i * lda;
        if (i < m) {
            memcpy(o, lhs->q + (size_t)i * lhs->ld, (size_t)k);
            memset(o + k, 0, lda - (size_t)k);
        } else {
            memset(o, 0, lda);
        }
    }
    *lda_out = lda;
    return act;
}

/* ---- real AMX ---------------------------------------------------------------------- */

#define A_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
#define A_NAME(x) x##_amx

static inline __attribute__((always_inline)) A_TARGET void amx_load_cfg(const amx_cfg *c) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*c) : "memory");
}

#define AMX_LOADCFG(c) amx_load_cfg(c)
#define AMX_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define AMX_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t : : "r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define AMX_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" : : "r"((void *)(base)), "r"((long)(stride)) : "memory")
#define AMX_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
/* C[c] += A[a] . B[b]; AT&T operand order is B, A, C */
#define AMX_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

#include "x86_amx_tmpl.h"

/* ---- the test twin: the same kernels over a C model of the tiles ----------------------
 * Tiles are per-thread arrays; the model checks the configuration constraints the hardware
 * enforces (#UD) and computes tdpbssd as the SDM defines it. Priority -1 and isa amx_emul:
 * chosen only when forced; slow (scalar), for tests of the AMX kernels' addressing and
 * arithmetic on machines without AMX. */
#undef A_TARGET
#undef A_NAME
#undef AMX_LOADCFG
#undef AMX_RELEASE
#undef AMX_LOAD
#undef AMX_STORE
#undef AMX_ZERO
#undef AMX_DPBSSD

typedef struct {
    int rows, colsb;
    uint8_t d[16][64];
} emu_tile;
static __thread emu_tile emu_t[8];
static __thread int emu_configured;

static void emu_check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "pyklei: AMX emulation: %s\n", what);
        abort();
    }
}

static void emu_loadcfg(const amx_cfg *c) {
    emu_check(c->palette == 1, "palette must be 1");
    for (int t = 0; t < 8; t++) {
        emu_check(c->rows[t] <= 16 && c->colsb[t] <= 64, "tile shape exceeds 16 x 64 bytes");
        emu_t[t].rows = c->rows[t];
        emu_t[t].colsb = c->colsb[t];
        memset(emu_t[t].d, 0, sizeof emu_t[t].d);
    }
    emu_configured = 1;
}

static void emu_release(void) { emu_configured = 0; }

static void emu_load(int t, const void *base, long stride) {
    emu_check(emu_configured && emu_t[t].rows > 0, "tileloadd on an unconfigured tile");
    memset(emu_t[t].d, 0, sizeof emu_t[t].d);
    for (int r = 0; r < emu_t[t].rows; r++)
        memcpy(emu_t[t].d[r], (const uint8_t *)base + (size_t)r * stride, (size_t)emu_t[t].colsb);
}

static void emu_store(int t, void *base, long stride) {
    emu_check(emu_configured && emu_t[t].rows > 0, "tilestored of an unconfigured tile");
    for (int r = 0; r < emu_t[t].rows; r++)
        memcpy((uint8_t *)base + (size_t)r * stride, emu_t[t].d[r], (size_t)emu_t[t].colsb);
}

static void emu_zero(int t) {
    emu_check(emu_configured, "tilezero before ldtilecfg");
    memset(emu_t[t].d, 0, sizeof emu_t[t].d);
}

static void emu_dpbssd(int c, int a, int b) {
    emu_tile *C = &emu_t[c], *A = &emu_t[a], *B = &emu_t[b];
    emu_check(emu_configured, "tdpbssd before ldtilecfg");
    emu_check(A->colsb / 4 == B->rows && C->rows == A->rows && C->colsb == B->colsb && C->colsb % 4 == 0,
              "tdpbssd tile shapes do not match");
    for (int m = 0; m < C->rows; m++)
        for (int n = 0; n < C->colsb / 4; n++) {
            int32_t acc;
            memcpy(&acc, &C->d[m][4 * n], 4);
            for (int kq = 0; kq < A->colsb / 4; kq++)
                for (int t = 0; t < 4; t++)
                    acc += (int32_t)(int8_t)A->d[m][4 * kq + t] * (int32_t)(int8_t)B->d[kq][4 * n + t];
            memcpy(&C->d[m][4 * n], &acc, 4);
        }
}

#define A_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define A_NAME(x) x##_amx_emul
#define AMX_LOADCFG(c) emu_loadcfg(c)
#define AMX_RELEASE() emu_release()
#define AMX_LOAD(t, base, stride) emu_load(t, base, (long)(stride))
#define AMX_STORE(t, base, stride) emu_store(t, base, (long)(stride))
#define AMX_ZERO(t) emu_zero(t)
#define AMX_DPBSSD(c, a, b) emu_dpbssd(c, a, b)

#include "x86_amx_tmpl.h"

#endif /* __x86_64__ */

#if defined(__x86_64__)
/* m_min: the qsi4c32 kernel computes a whole 32-row tile plan, so its time barely moves from
 * m = 16 to 32. Measured on a Xeon with AMX (1 thread, SmolLM2's and Llama 3.2 1B's shapes),
 * against qai8dx_qsi4c32p16_6x32_avx512vnni: 0.70-0.85x at m = 16, about even at 24, 1.2-1.4x
 * at 32 and 64. Below 32 rows (speculative verification passes, small engine batches) VNNI
 * wins. The qsi8cx kernel (no per-block scales) already wins at 16: 1.5x on 2048 x 2048. */
const pk_kernel pk_kernels_x86_amx[] = {
    {.name = "qai8dx_qsi4c32p16_32x32_amx", .isa = "amx", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AMX_INT8 | PK_CPU_AVX512VNNI,
     .priority = 40, .m_min = 32, .n_step = ZNR,
     .rhs_packed_size = pk_p16_size, .rhs_pack = pk_p16_pack, .run = qai8dx_qsi4c32p16_32x32_amx,
     .run_d32 = qsi8d32_qsi4c32p16_32x32_amx},
    {.name = "qai8dx_qsi8cxp4_32x32_amx", .isa = "amx", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AMX_INT8 | PK_CPU_AVX512VNNI,
     .priority = 40, .m_min = 16, .n_step = ZNR,
     .rhs_packed_size = pk_p4_size, .rhs_pack = pk_p4_pack, .run = qai8dx_qsi8cxp4_32x32_amx},
    {.name = "qai8dx_qsi4c32p16_32x32_amx_emul", .isa = "amx_emul", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX512VNNI,
     .priority = -1, .m_min = 32, .n_step = ZNR,
     .rhs_packed_size = pk_p16_size, .rhs_pack = pk_p16_pack, .run = qai8dx_qsi4c32p16_32x32_amx_emul,
     .run_d32 = qsi8d32_qsi4c32p16_32x32_amx_emul},
    {.name = "qai8dx_qsi8cxp4_32x32_amx_emul", .isa = "amx_emul", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVX512VNNI,
     .priority = -1, .m_min = 16, .n_step = ZNR,
     .rhs_packed_size = pk_p4_size, .rhs_pack = pk_p4_pack, .run = qai8dx_qsi8cxp4_32x32_amx_emul},
};
const int pk_kernels_x86_amx_count = sizeof pk_kernels_x86_amx / sizeof pk_kernels_x86_amx[0];
#endif
