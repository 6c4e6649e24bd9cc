/* The row helpers on Arm AdvSIMD, baseline armv8-a (the pk_isa_helpers record of tag neon,
 * contract/pk_kernel.h): the FWHT of the rotation (ops/pk_rotate.c) and the f16 -> f32
 * conversion of the KV cache (ops/pk_f16.c), each bit-exact with the scalar record's
 * (isa/fwht_f16_qai8dx_scalar.c); no qai8dx quantizer of its own. */
#include "../contract/pk_kernel.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>

/* Fast Walsh-Hadamard transform of one group (ops/pk_rotate.c), bit-exact with
 * pk_fwht_scalar: the stages with pairs inside one vector swap lanes and add x * (+1 / -1)
 * (exact, so sw + x * s is a + b on the low lane of a pair and a - b on the high one); the
 * stages with h >= the vector width add and subtract whole vectors. Every stage covers all
 * of x before the next, as in the scalar loop. */
static void pk_fwht_neon(int p, float *x) {
    if (p < 4) {
        pk_fwht_scalar(p, x);
        return;
    }
    static const float s1v[4] = {1, -1, 1, -1}, s2v[4] = {1, 1, -1, -1};
    const float32x4_t s1 = vld1q_f32(s1v), s2 = vld1q_f32(s2v);
    for (int j = 0; j < p; j += 4) {   /* h = 1, 2 */
        float32x4_t v = vld1q_f32(x + j);
        v = vaddq_f32(vrev64q_f32(v), vmulq_f32(v, s1));
        v = vaddq_f32(vextq_f32(v, v, 2), vmulq_f32(v, s2));
        vst1q_f32(x + j, v);
    }
    for (int h = 4; h < p; h *= 2)
        for (int i = 0; i < p; i += 2 * h)
            for (int j = i; j < i + h; j += 4) {
                const float32x4_t a = vld1q_f32(x + j), b = vld1q_f32(x + j + h);
                vst1q_f32(x + j, vaddq_f32(a, b));
                vst1q_f32(x + j + h, vsubq_f32(a, b));
            }
}

/* f16 -> f32 (the f16 KV cache, ops/pk_f16.c), 8 per iteration with fcvtl / fcvtl2 (baseline
 * armv8-a AdvSIMD). Exact, as is every f16 -> f32 conversion; the tail goes through a
 * zero-padded vector so that every value takes the same instruction. */
static void pk_f16_to_f32_neon(size_t n, const uint16_t *x, float *out) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(x + i));
        vst1q_f32(out + i, vcvt_f32_f16(vget_low_f16(h)));
        vst1q_f32(out + i + 4, vcvt_high_f32_f16(h));
    }
    if (i < n) {
        uint16_t h[8] = {0};
        float f[8];
        memcpy(h, x + i, sizeof(uint16_t) * (n - i));
        const float16x8_t v = vreinterpretq_f16_u16(vld1q_u16(h));
        vst1q_f32(f, vcvt_f32_f16(vget_low_f16(v)));
        vst1q_f32(f + 4, vcvt_high_f32_f16(v));
        memcpy(out + i, f, sizeof(float) * (n - i));
    }
}

const pk_isa_helpers pk_helpers_arm_neon = {
    .isa = "neon",
    .features = PK_CPU_NEON,
    .fwht = pk_fwht_neon,
    .f16_to_f32 = pk_f16_to_f32_neon,
    .quantize_qai8dx_row = NULL,   /* the scalar record's runs here */
    .quantize_qsi8d32_row = NULL,
};
#endif
