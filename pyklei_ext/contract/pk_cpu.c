#include "pk_cpu.h"

#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18

static uint64_t read_xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static uint32_t detect(void) {
    uint32_t a, b, c, d, f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave) return 0;
    const uint64_t xcr0 = read_xcr0();
    const int ymm_ok = (xcr0 & 0x6) == 0x6;          /* SSE + AVX state */
    const int zmm_ok = ymm_ok && (xcr0 & 0xE0) == 0xE0; /* opmask + ZMM state */
    const int tile_ok = (xcr0 & (3u << 17)) == (3u << 17);
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1;
    const int avx512vl = (b >> 31) & 1, avx512vnni = (c >> 11) & 1;
    const int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    uint32_t a1, b1, c1, d1;
    __cpuid_count(7, 1, a1, b1, c1, d1);
    const int avxvnni = (a1 >> 4) & 1, avx512bf16 = (a1 >> 5) & 1;
    if (ymm_ok && avx2 && fma && f16c) f |= PK_CPU_AVX2;
    if (zmm_ok && avx512f && avx512bw && avx512vl && avx512vnni) f |= PK_CPU_AVX512VNNI;
    if (zmm_ok && avx512bf16) f |= PK_CPU_AVX512BF16;
    if (ymm_ok && avxvnni && (f & PK_CPU_AVX2)) f |= PK_CPU_AVXVNNI;
    if (tile_ok && amx_tile && amx_int8) {
        /* Linux hands out the 8 KiB tile state only on request (since 5.16). */
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
            f |= PK_CPU_AMX_INT8;
    }
    return f;
}

#elif defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif

static uint32_t detect(void) {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    uint32_t f = 0;
    if (hw & HWCAP_ASIMD) f |= PK_CPU_NEON;
    if (hw & HWCAP_ASIMDDP) f |= PK_CPU_DOTPROD;
    if (hw2 & HWCAP2_I8MM) f |= PK_CPU_I8MM;
    return f;
}

#else
static uint32_t detect(void) { return 0; }
#endif

uint32_t pk_cpu_features(void) {
    static volatile int done = 0;
    static uint32_t features;
    if (!done) {              /* idempotent: a race only repeats the same detection */
        features = detect();
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    }
    return features;
}

const char *pk_cpu_features_string(uint32_t f) {
    static const struct { uint32_t bit; const char *name; } names[] = {
        {PK_CPU_AVX2, "avx2"}, {PK_CPU_AVX512VNNI, "avx512vnni"}, {PK_CPU_AVXVNNI, "avxvnni"},
        {PK_CPU_AMX_INT8, "amx_int8"}, {PK_CPU_AVX512BF16, "avx512bf16"},
        {PK_CPU_NEON, "neon"}, {PK_CPU_DOTPROD, "dotprod"}, {PK_CPU_I8MM, "i8mm"},
    };
    static __thread char buf[160];
    buf[0] = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (f & names[i].bit) {
            if (buf[0]) strcat(buf, " ");
            strcat(buf, names[i].name);
        }
    return buf;
}
