/* CPU feature detection: what the ISA kernels may use on this machine.
 * x86: cpuid + xgetbv (the OS must save the vector state), arch_prctl for AMX tiles.
 * aarch64: getauxval(AT_HWCAP / AT_HWCAP2). */
#ifndef PK_CPU_H
#define PK_CPU_H

#include <stdint.h>

enum {
    PK_CPU_AVX2       = 1u << 0,   /* AVX2 + FMA + F16C */
    PK_CPU_AVX512VNNI = 1u << 1,   /* AVX-512 F/BW/VL + VNNI (EVEX vpdpbusd) */
    PK_CPU_AVXVNNI    = 1u << 2,   /* AVX-VNNI (VEX vpdpbusd, client CPUs without AVX-512) */
    PK_CPU_AMX_INT8   = 1u << 3,   /* AMX tiles + int8, with tile state granted by the OS */
    PK_CPU_AVX512BF16 = 1u << 4,
    PK_CPU_NEON       = 1u << 8,   /* AdvSIMD (always on aarch64) */
    PK_CPU_DOTPROD    = 1u << 9,   /* sdot/udot */
    PK_CPU_I8MM       = 1u << 10,  /* smmla/ummla */
};

/* Feature bits of this CPU (detected once, thread-safe after the first call). */
uint32_t pk_cpu_features(void);

/* "avx2 avx512vnni ..." for logs; returns a static string. */
const char *pk_cpu_features_string(uint32_t features);

#endif
