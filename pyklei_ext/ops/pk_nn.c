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

/* Attention is written so the compiler vectorizes it (independent lanes instead of one
 * reduction it may not reorder; a polynomial exp) and x86 picks an AVX-512 or AVX2 clone at
 * load time. In a 512-token prefill it was 40% of the time with scalar dot products and libm
 * expf. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PK_CLONES
#endif

#define LANES 16

PK_CLONES static void axpy_f32(int n, float p, const float *x, float *y) {
    for (int i = 0; i < n; i++) y[i] += p * x[i];
}

static void axpy_f16(int n, float p, const uint16_t *x, float *y) {
    for (int i = 0; i < n; i++) y[i] += p * f16_to_f32(x[i]);
}

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

/* silu(g) * u with silu(g) = g / (1 + e^-g), e^-|g| from the polynomial so it vectorizes:
 * g >= 0: g / (1 + e^-g); g < 0: g e^g / (1 + e^g). */
PK_CLONES void pk_swiglu(int n, const float *gate, const float *up, float *out) {
    for (int i = 0; i < n; i++) {
        const float g = gate[i], e = exp_nonpos(g < 0.0f ? g : -g);
        out[i] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
    }
}

/* f32 cache: the whole head in one function (no call per position), `out` kept in
 * registers when HD is a compile-time 64 or 128. */
static inline __attribute__((always_inline)) void attend_f32(const int HD, int n_pos, const float *restrict q,
                                                             const float *restrict kt, size_t kt_stride,
                                                             const float *restrict v, float scale,
                                                             float *restrict scores, float *restrict out) {
    for (int j = 0; j < n_pos; j++) scores[j] = 0.0f;
    for (int i = 0; i < HD; i++) {
        const float qi = q[i] * scale;
        const float *restrict k = kt + (size_t)i * kt_stride;
        for (int j = 0; j < n_pos; j++) scores[j] += qi * k[j];
    }
    const float inv = 1.0f / exp_sum(n_pos, scores, max_f32(n_pos, scores));
    float acc[HD];
    for (int i = 0; i < HD; i++) acc[i] = 0.0f;
    for (int j = 0; j < n_pos; j++) {
        const float p = scores[j] * inv;
        const float *restrict vj = v + (size_t)j * HD;
        for (int i = 0; i < HD; i++) acc[i] += p * vj[i];
    }
    for (int i = 0; i < HD; i++) out[i] = acc[i];
}

PK_CLONES static void attend_f32_hd64(int n_pos, const float *q, const float *kt, size_t kt_stride,
                                      const float *v, float scale, float *scores, float *out) {
    attend_f32(64, n_pos, q, kt, kt_stride, v, scale, scores, out);
}

PK_CLONES static void attend_f32_hd128(int n_pos, const float *q, const float *kt, size_t kt_stride,
                                       const float *v, float scale, float *scores, float *out) {
    attend_f32(128, n_pos, q, kt, kt_stride, v, scale, scores, out);
}

void pk_attend_head(int hd, int n_pos, const float *q, const void *kt, size_t kt_stride,
                    const void *v, int kv_f16, float scale, float *scores, float *out) {
    if (!kv_f16 && hd == 64) { attend_f32_hd64(n_pos, q, kt, kt_stride, v, scale, scores, out); return; }
    if (!kv_f16 && hd == 128) { attend_f32_hd128(n_pos, q, kt, kt_stride, v, scale, scores, out); return; }
    memset(scores, 0, sizeof(float) * n_pos);
    for (int i = 0; i < hd; i++) {
        if (kv_f16) axpy_f16(n_pos, q[i] * scale, (const uint16_t *)kt + i * kt_stride, scores);
        else axpy_f32(n_pos, q[i] * scale, (const float *)kt + i * kt_stride, scores);
    }
    const float inv = 1.0f / exp_sum(n_pos, scores, max_f32(n_pos, scores));
    memset(out, 0, sizeof(float) * hd);
    for (int j = 0; j < n_pos; j++) {
        if (kv_f16) axpy_f16(hd, scores[j] * inv, (const uint16_t *)v + (size_t)j * hd, out);
        else axpy_f32(hd, scores[j] * inv, (const float *)v + (size_t)j * hd, out);
    }
}
