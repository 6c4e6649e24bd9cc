/* x86 AVX-VNNI kernels (VEX vpdpbusd on ymm: client CPUs without AVX-512): the 256-bit
 * template x86_ymm_tmpl.h with vpdpbusd, over the canonical weight layout (no repacked copy).
 * GEMV 1x4 (4 weight rows per pass), GEMM 3x16 (a 16-row panel transposed per call into a
 * per-thread buffer of unsigned w + 8 / w + 128). docs/KERNELS.md describes them; the operand
 * conventions are at the top of x86_ymm_tmpl.h.
 *
 * Also their test twin, *_avxvnni_evex: the same template with the EVEX encoding, so that
 * AVX-512 machines (and CI) run the AVX-VNNI code paths. */
#include "../contract/pk_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "x86_common.h"

/* ====================================================================================
 * AVX-VNNI (VEX vpdpbusd on ymm): the 256-bit template with vpdpbusd, tile 3 x 16
 * ==================================================================================== */

#define Y_TARGET __attribute__((target("avxvnni,avx2,fma,f16c")))
#define Y_NAME(x) x##_avxvnni
#define Y_VNNI 1
#define Y_MR 3
#define Y_NRV 2
#define Y_DPBUSD _mm256_dpbusd_avx_epi32
#define Y_Q4_GEMV qai8dx_qsi4c32_1x4_avxvnni
#define Y_Q4_GEMM qai8dx_qsi4c32_3x16_avxvnni
#define Y_D32_GEMV qsi8d32_qsi4c32_1x4_avxvnni
#define Y_D32_GEMM qsi8d32_qsi4c32_3x16_avxvnni
#define Y_Q8_GEMV qai8dx_qsi8cx_1x4_avxvnni
#define Y_Q8_GEMM qai8dx_qsi8cx_3x16_avxvnni
#include "x86_ymm_tmpl.h"

/* Test twin of the AVX-VNNI kernels: the same template compiled with the EVEX encoding of
 * vpdpbusd on ymm (AVX512VL + VNNI), so AVX-512 machines (and CI) check the AVX-VNNI code
 * paths; only the instruction encoding differs. Priority -1: never chosen unless forced. */
#undef Y_TARGET
#undef Y_NAME
#undef Y_DPBUSD
#undef Y_Q4_GEMV
#undef Y_Q4_GEMM
#undef Y_D32_GEMV
#undef Y_D32_GEMM
#undef Y_Q8_GEMV
#undef Y_Q8_GEMM
#define Y_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))
#define Y_NAME(x) x##_avxvnni_evex
#define Y_DPBUSD _mm256_dpbusd_epi32
#define Y_Q4_GEMV qai8dx_qsi4c32_1x4_avxvnni_evex
#define Y_Q4_GEMM qai8dx_qsi4c32_3x16_avxvnni_evex
#define Y_D32_GEMV qsi8d32_qsi4c32_1x4_avxvnni_evex
#define Y_D32_GEMM qsi8d32_qsi4c32_3x16_avxvnni_evex
#define Y_Q8_GEMV qai8dx_qsi8cx_1x4_avxvnni_evex
#define Y_Q8_GEMM qai8dx_qsi8cx_3x16_avxvnni_evex
#include "x86_ymm_tmpl.h"

#endif /* __x86_64__ */

/* ---- table --------------------------------------------------------------------------- */
#if defined(__x86_64__)
const pk_kernel pk_kernels_x86_avxvnni[] = {
    {.name = "qai8dx_qsi4c32_1x4_avxvnni", .isa = "avxvnni", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVXVNNI,
     .priority = 20, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi4c32_1x4_avxvnni, .run_d32 = qsi8d32_qsi4c32_1x4_avxvnni},
    {.name = "qai8dx_qsi4c32_3x16_avxvnni", .isa = "avxvnni", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVXVNNI,
     .priority = 21, .m_min = 6, .n_step = 16,
     .run = qai8dx_qsi4c32_3x16_avxvnni, .run_d32 = qsi8d32_qsi4c32_3x16_avxvnni},
    {.name = "qai8dx_qsi8cx_1x4_avxvnni", .isa = "avxvnni", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVXVNNI,
     .priority = 20, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi8cx_1x4_avxvnni},
    {.name = "qai8dx_qsi8cx_3x16_avxvnni", .isa = "avxvnni", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVXVNNI,
     .priority = 21, .m_min = 6, .n_step = 16,
     .run = qai8dx_qsi8cx_3x16_avxvnni},
    {.name = "qai8dx_qsi4c32_1x4_avxvnni_evex", .isa = "avxvnni_evex", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX512VNNI,
     .priority = -1, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi4c32_1x4_avxvnni_evex, .run_d32 = qsi8d32_qsi4c32_1x4_avxvnni_evex},
    {.name = "qai8dx_qsi4c32_3x16_avxvnni_evex", .isa = "avxvnni_evex", .fmt = PK_FMT_QSI4C32, .features = PK_CPU_AVX512VNNI,
     .priority = -1, .m_min = 4, .n_step = 16,
     .run = qai8dx_qsi4c32_3x16_avxvnni_evex, .run_d32 = qsi8d32_qsi4c32_3x16_avxvnni_evex},
    {.name = "qai8dx_qsi8cx_1x4_avxvnni_evex", .isa = "avxvnni_evex", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVX512VNNI,
     .priority = -1, .m_min = 1, .n_step = 4,
     .run = qai8dx_qsi8cx_1x4_avxvnni_evex},
    {.name = "qai8dx_qsi8cx_3x16_avxvnni_evex", .isa = "avxvnni_evex", .fmt = PK_FMT_QSI8CX, .features = PK_CPU_AVX512VNNI,
     .priority = -1, .m_min = 4, .n_step = 16,
     .run = qai8dx_qsi8cx_3x16_avxvnni_evex},
};
const int pk_kernels_x86_avxvnni_count = sizeof pk_kernels_x86_avxvnni / sizeof pk_kernels_x86_avxvnni[0];
#endif
