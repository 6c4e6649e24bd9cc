/* The arithmetic ceilings of one x86 core with AVX-512 VNNI and BF16: how many zmm vpdpbusd
 * (int8, 64 multiply-adds each: the qsi4c32 kernels' unit of work), vfmadd231ps (f32, 16) and
 * vdpbf16ps (bf16 pairs, 32) it retires per second, each from 12 independent accumulators so
 * that latency never binds, and the clock those run at (a chain of dependent adds, one per
 * cycle). benchmarks/prefill_breakdown.py compares each operation of a prefill with these.
 *
 *   gcc -O2 benchmarks/core_peak.c -o /tmp/core_peak && /tmp/core_peak
 *
 * Prints one JSON line: {"ghz": ..., "vpdpbusd_per_s": ..., "fma_per_s": ..., "dpbf16_per_s": ...}
 * (instructions per second, best of 5 passes of ~0.1 s: the machine may be shared). */
#include <stdio.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define ITERS 3000000L   /* x 12 instructions: ~0.1 s at one per cycle */
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512bf16"), noinline))

/* the asm keeps each instruction (no folding) and each accumulator in its own register */
TARGET static double vnni_rate(void) {
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
#define D(i) __m512i a##i = _mm512_set1_epi32(i);
    R12(D)
#undef D
    const double t0 = now_s();
    for (long n = 0; n < ITERS; n++) {
#define V(i) __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(a##i) : "v"(u), "v"(s));
        R12(V)
#undef V
    }
    const double t = now_s() - t0;
#define K(i) __asm__ volatile("" : : "v"(a##i));
    R12(K)
#undef K
    return 12.0 * ITERS / t;
}

TARGET static double fma_rate(int bf16) {
    const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(0.0f);
#define D(i) __m512 f##i = _mm512_set1_ps((float)i);
    R12(D)
#undef D
    const double t0 = now_s();
    if (bf16) {
        for (long n = 0; n < ITERS; n++) {
#define V(i) __asm__ volatile("vdpbf16ps %2, %1, %0" : "+v"(f##i) : "v"(x), "v"(y));
            R12(V)
#undef V
        }
    } else {
        for (long n = 0; n < ITERS; n++) {
#define V(i) __asm__ volatile("vfmadd231ps %2, %1, %0" : "+v"(f##i) : "v"(x), "v"(y));
            R12(V)
#undef V
        }
    }
    const double t = now_s() - t0;
#define K(i) __asm__ volatile("" : : "v"(f##i));
    R12(K)
#undef K
    return 12.0 * ITERS / t;
}

static double clock_hz(void) {
    long c = 0;
    const double t0 = now_s();
    for (long n = 0; n < 12 * ITERS / 4; n++)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(c));
    return 12.0 * ITERS / (now_s() - t0);
}

int main(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bf16")) {
        fprintf(stderr, "core_peak: this CPU lacks AVX-512 VNNI or BF16\n");
        return 1;
    }
    double best[4] = {0, 0, 0, 0};
    for (int pass = 0; pass < 5; pass++) {
        const double r[4] = {clock_hz(), vnni_rate(), fma_rate(0), fma_rate(1)};
        for (int i = 0; i < 4; i++) best[i] = r[i] > best[i] ? r[i] : best[i];
    }
    printf("{\"ghz\": %.3f, \"vpdpbusd_per_s\": %.4g, \"fma_per_s\": %.4g, \"dpbf16_per_s\": %.4g}\n",
           best[0] / 1e9, best[1], best[2], best[3]);
    return 0;
}
#else
int main(void) {
    fprintf(stderr, "core_peak: x86-64 only\n");
    return 1;
}
#endif
