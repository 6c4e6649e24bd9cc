/* The softmax's pieces, shared by attention (pk_attention.c, pk_attention_reference.c) and
 * SwiGLU (pk_rmsnorm_swiglu.c): a max, a polynomial e^x for x <= 0, a sum of exponentials and
 * a scaling, all written so the compiler vectorizes them. Static, so that each file's clones
 * keep their own copies (an ISA's clone calls its own). */
#ifndef PK_SOFTMAX_H
#define PK_SOFTMAX_H

#include <math.h>
#include <stdint.h>

#include "pk_ops_internal.h"   /* PK_CLONES */

/* Attention is written so the compiler vectorizes it (independent lanes instead of one
 * reduction it may not reorder; a polynomial exp) and x86 picks an AVX-512 or AVX2 clone at
 * load time (PK_CLONES, pk_ops_internal.h). In a 512-token prefill it was 40% of the time with
 * scalar dot products and libm expf. */

#define LANES 16

PK_CLONES static float max_f32(int n, const float *x) {
    float m[LANES];
    for (int l = 0; l < LANES; l++) m[l] = -INFINITY;
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) m[l] = x[i + l] > m[l] ? x[i + l] : m[l];
    float r = -INFINITY;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    for (int l = 0; l < LANES; l++) r = m[l] > r ? m[l] : r;
    return r;
}

/* e^x for x <= 0 (Cody-Waite range reduction + Cephes' degree-6 polynomial; ~2 ulp), in a
 * form the compiler vectorizes. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } two_n = {(uint32_t)((int32_t)n + 127) << 23};
    return y * two_n.f;
}

/* The same e^x with each step a fused multiply-add (one rounding where exp_nonpos has two):
 * the bf16 attention's exponential (pk_attention_reference.c's attend_head_bf16), which the
 * AVX-512 BF16 kernel computes lane for lane (isa/attention_x86_avx512bf16.h, exp16_fma) in
 * 16 instructions where exp_nonpos's separate products and sums take 26. */
static inline float exp_nonpos_fma(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = __builtin_fmaf(n, 2.12194440e-4f, __builtin_fmaf(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    const float y = __builtin_fmaf(p, r * r, r) + 1.0f;
    union { uint32_t u; float f; } two_n = {(uint32_t)((int32_t)n + 127) << 23};
    return y * two_n.f;
}

/* x[i] = e^(x[i] - mx); returns the sum. Two loops: GCC vectorizes the exp loop only
 * without the (lane-split) sum in it. */
PK_CLONES static float exp_sum(int n, float *x, float mx) {
    for (int i = 0; i < n; i++) x[i] = exp_nonpos(x[i] - mx);
    float s[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) s[l] += x[i + l];
    float r = 0.0f;
    for (; i < n; i++) r += x[i];
    for (int l = 0; l < LANES; l++) r += s[l];
    return r;
}

/* x[i] = e^(x[i] - mx) by exp_nonpos_fma; returns the sum (the bf16 attention's reference):
 * 16 lane sums over every 16 (a last, partial 16 adding zeros past n), then folded in halves
 * (lane l + lane l + 8, then + 4, + 2, + 1), the order of a vector's reduction: a chain of 31
 * dependent adds per query vector was 7% of a prefill's attention. */
static float exp_sum_fma(int n, float *x, float mx) {
    for (int i = 0; i < n; i++) x[i] = exp_nonpos_fma(x[i] - mx);
    float s[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES && i + l < n; l++) s[l] += x[i + l];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) s[l] += s[l + w];
    return s[0];
}

/* x[i] *= c: the softmax's normalisation, done once per score (vectorized) rather than as
 * a scalar multiply and a broadcast per position and head in the PV loops. The same product
 * either way, so the same bits. */
PK_CLONES static void scale_f32(int n, float *x, float c) {
    for (int i = 0; i < n; i++) x[i] *= c;
}

#endif
