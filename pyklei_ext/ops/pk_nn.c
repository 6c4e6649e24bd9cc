#include "pk_nn.h"

#include <math.h>
#include <string.h>

#include "pk_matmul.h"

/* IEEE half <-> float in plain C (the cache conversion is not on the hot path of the
 * matmuls; the compiler's _Float16 would need F16C for speed anyway). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) bits = sign;
        else {                                   /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

static inline uint16_t f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    const uint32_t sign = (v.u >> 16) & 0x8000;
    const uint32_t absu = v.u & 0x7FFFFFFF;
    if (absu > 0x7F800000) return (uint16_t)(sign | 0x7E00);           /* NaN */
    if (absu >= 0x477FF000) return (uint16_t)(sign | 0x7C00);          /* overflow -> inf */
    if (absu < 0x38800000) {                                           /* subnormal or zero */
        const float a = fabsf(f) * 16777216.0f;                        /* / 2^-24 */
        return (uint16_t)(sign | (uint32_t)rintf(a));
    }
    /* normal: round to nearest even on the 13 dropped bits */
    uint32_t r = absu + 0x0FFF + ((absu >> 13) & 1);
    return (uint16_t)(sign | ((r - 0x38000000) >> 13));
}

void pk_f32_to_f16_row(int n, const float *x, uint16_t *out) {
    for (int i = 0; i < n; i++) out[i] = f32_to_f16(x[i]);
}

void pk_tensor_row_f32(const pk_tensor *t, int r, float *out) {
    const int k = t->k;
    switch (t->type) {
    case PK_T_F32:
        memcpy(out, (const float *)t->data + (size_t)r * k, sizeof(float) * k);
        break;
    case PK_T_F16: {
        const uint16_t *row = (const uint16_t *)t->data + (size_t)r * k;
        for (int i = 0; i < k; i++) out[i] = f16_to_f32(row[i]);
        break;
    }
    case PK_T_BF16: {
        const uint16_t *row = (const uint16_t *)t->data + (size_t)r * k;
        for (int i = 0; i < k; i++) out[i] = pk_bf16_to_f32(row[i]);
        break;
    }
    case PK_T_QSI4C32: {
        const uint8_t *row = (const uint8_t *)t->data + (size_t)r * (k / 2);
        const uint16_t *s = (const uint16_t *)t->scales + (size_t)r * (k / t->bl);
        for (int i = 0; i < k; i++) out[i] = pk_bf16_to_f32(s[i / t->bl]) * (float)pk_qsi4c32_get(row, i);
        break;
    }
    case PK_T_QSI8CX: {
        const int8_t *row = (const int8_t *)t->data + (size_t)r * k;
        const float s = ((const float *)t->scales)[r];
        for (int i = 0; i < k; i++) out[i] = s * (float)row[i];
        break;
    }
    }
}

void pk_rmsnorm(int d, const float *x, const float *w, float eps, float *out) {
    double ss = 0.0;
    for (int i = 0; i < d; i++) ss += (double)x[i] * x[i];
    const float inv = (float)(1.0 / sqrt(ss / d + eps));
    for (int i = 0; i < d; i++) out[i] = x[i] * inv * w[i];
}

void pk_rope(int n_heads, int head_dim, int pos, const float *inv_freq, float *x) {
    for (int i = 0; i < head_dim / 2; i++) {
        const float angle = (float)pos * inv_freq[i];
        const float c = cosf(angle), s = sinf(angle);
        for (int h = 0; h < n_heads; h++) {
            float *p = x + (size_t)h * head_dim + 2 * i;
            const float a = p[0], b = p[1];
            p[0] = a * c - b * s;
            p[1] = a * s + b * c;
        }
    }
}

void pk_swiglu(int n, const float *gate, const float *up, float *out) {
    for (int i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Attention is a small share of a step but runs in plain C: write it so the compiler
 * vectorizes it (16 independent partial sums instead of one reduction, which it may not
 * reorder) and let x86 pick an AVX-512 or AVX2 clone at load time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PK_CLONES
#endif

#define LANES 16

PK_CLONES static float dot_f32(int n, const float *a, const float *b) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

PK_CLONES static void axpy_f32(int n, float p, const float *x, float *y) {
    for (int i = 0; i < n; i++) y[i] += p * x[i];
}

void pk_attend_head(int hd, int n_pos, const float *q, const void *k, const void *v, int kv_f16,
                    float scale, float *scores, float *out) {
    float row[512];   /* one f16 K/V row widened (head_dim <= 512) */
    float mx = -INFINITY;
    for (int j = 0; j < n_pos; j++) {
        const float *kr = (const float *)k + (size_t)j * hd;
        if (kv_f16) {
            const uint16_t *kh = (const uint16_t *)k + (size_t)j * hd;
            for (int i = 0; i < hd; i++) row[i] = f16_to_f32(kh[i]);
            kr = row;
        }
        scores[j] = dot_f32(hd, q, kr) * scale;
        mx = scores[j] > mx ? scores[j] : mx;
    }
    float sum = 0.0f;
    for (int j = 0; j < n_pos; j++) {
        scores[j] = expf(scores[j] - mx);
        sum += scores[j];
    }
    const float inv = 1.0f / sum;
    memset(out, 0, sizeof(float) * hd);
    for (int j = 0; j < n_pos; j++) {
        const float *vr = (const float *)v + (size_t)j * hd;
        if (kv_f16) {
            const uint16_t *vh = (const uint16_t *)v + (size_t)j * hd;
            for (int i = 0; i < hd; i++) row[i] = f16_to_f32(vh[i]);
            vr = row;
        }
        axpy_f32(hd, scores[j] * inv, vr, out);
    }
}
