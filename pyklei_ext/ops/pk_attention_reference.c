/* The reference attention: one head at a time, one position at a time, the cache's values
 * converted in plain C (kv->f16 is not used). Every fast path of pk_attention.c keeps its
 * order of operations and agrees with it bit for bit; it also runs the shapes that have no
 * fast path. A cache read in bf16 (pk_kv_head.dot_bf16) has its own arithmetic, attend_head_bf16. pk_attention.c folds its chunks' partials (pk_attend_group_reference). */
#include "pk_nn.h"

#include "pk_softmax.h"   /* max_f32, exp_sum, exp_sum_fma */

/* K of position j, dimension i, and V of (j, i), converted in plain C. */
static inline float k_at(const pk_kv_head *kv, int hd, int j, int i) {
    const size_t b = (size_t)(j / PK_KV_BLOCK), l = (size_t)(j % PK_KV_BLOCK);
    const size_t e = (b * hd + i) * PK_KV_BLOCK + l;
    switch (kv->type) {
    case PK_KV_F32: return ((const float *)kv->k)[e];
    case PK_KV_F16: return pk_f16_to_f32(((const uint16_t *)kv->k)[e]);
    case PK_KV_BF16: return pk_bf16_to_f32(((const uint16_t *)kv->k)[pk_kv_bf16_k_at(hd, j, i)]);
    default:
        return (float)((const int8_t *)kv->k)[e] *
               pk_f16_to_f32(kv->k_scale[(b * (hd / PK_KV_Q8_GROUP) + i / PK_KV_Q8_GROUP) * PK_KV_BLOCK + l]);
    }
}

static inline float v_at(const pk_kv_head *kv, int hd, int j, int i) {
    const size_t e = (size_t)j * hd + i;
    switch (kv->type) {
    case PK_KV_F32: return ((const float *)kv->v)[e];
    case PK_KV_F16: return pk_f16_to_f32(((const uint16_t *)kv->v)[e]);
    case PK_KV_BF16: return pk_bf16_to_f32(((const uint16_t *)kv->v)[pk_kv_bf16_v_at(hd, j, i)]);
    default:
        return (float)((const int8_t *)kv->v)[e] * pk_f16_to_f32(kv->v_scale[e / PK_KV_Q8_GROUP]);
    }
}

/* x rounded to bf16 (contract/pk_kv.h's rounding), as a float. */
static inline float bf16_round(float x) { return pk_bf16_to_f32(pk_kv_bf16_round(x)); }

/* s + a * b (exact product, one rounding), a subnormal result flushed to a signed zero: one
 * of vdpbf16ps's two steps. */
static inline float dot_step(float a, float b, float s) {
    union { float f; uint32_t u; } v = {__builtin_fmaf(a, b, s)};
    if ((v.u & 0x7F800000u) == 0) v.u &= 0x80000000u;
    return v.f;
}

/* One head in bf16 (kv->dot_bf16): q * scale, K, V and the normalised weights rounded to bf16,
 * the exponentials by exp_nonpos_fma, f32 sums by pairs, each pair's odd element first (QK: dimensions 2p, 2p + 1; PV: positions
 * 2p, 2p + 1 from the span's first; an odd last position pairs a zero weight with a zero):
 * the arithmetic of isa/attention_x86_avx512bf16.h. */
static void attend_head_bf16(int hd, int j0, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                             float *scores, float *out, float *ml) {
    for (int j = 0; j < n_pos; j++) {
        float s = 0.0f;
        for (int i = 0; i < hd; i += 2) {
            s = dot_step(bf16_round(q[i + 1] * scale), bf16_round(k_at(kv, hd, j0 + j, i + 1)), s);
            s = dot_step(bf16_round(q[i] * scale), bf16_round(k_at(kv, hd, j0 + j, i)), s);
        }
        scores[j] = s;
    }
    const float mx = max_f32(n_pos, scores), sum = exp_sum_fma(n_pos, scores, mx), inv = 1.0f / sum;
    ml[0] = mx, ml[1] = sum;
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    for (int j = 0; j < n_pos; j += 2) {
        const int odd = j + 1 < n_pos;
        const float p0 = bf16_round(scores[j] * inv), p1 = odd ? bf16_round(scores[j + 1] * inv) : 0.0f;
        for (int i = 0; i < hd; i++) {
            const float v1 = odd ? bf16_round(v_at(kv, hd, j0 + j + 1, i)) : 0.0f;
            out[i] = dot_step(p0, bf16_round(v_at(kv, hd, j0 + j, i)), dot_step(p1, v1, out[i]));
        }
    }
}

/* One head, any head size and cache type: the reference order of the fast paths
 * (pk_attention.c). */
static void attend_head(int hd, int j0, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                        float *scores, float *out, float *ml) {
    for (int j = 0; j < n_pos; j++) {
        float s = 0.0f;
        for (int i = 0; i < hd; i++) s = __builtin_fmaf(q[i] * scale, k_at(kv, hd, j0 + j, i), s);
        scores[j] = s;
    }
    const float mx = max_f32(n_pos, scores), sum = exp_sum(n_pos, scores, mx), inv = 1.0f / sum;
    ml[0] = mx, ml[1] = sum;
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    for (int j = 0; j < n_pos; j++) {
        const float p = scores[j] * inv;
        for (int i = 0; i < hd; i++) out[i] = __builtin_fmaf(p, v_at(kv, hd, j0 + j, i), out[i]);
    }
}

void pk_attend_part_reference(int group, int hd, int n, const float *q, const pk_kv_head *kv, float scale,
                           float *scores, float *out, float *ml) {
    pk_attend_span_reference(group, hd, 0, n, q, kv, scale, scores, out, ml);
}

void pk_attend_span_reference(int group, int hd, int j0, int n, const float *q, const pk_kv_head *kv, float scale,
                              float *scores, float *out, float *ml) {
    /* bf16 from a chunk's start only; a partial from inside one in f32 (pk_attention.c's attend_span) */
    const int bf16 = kv->dot_bf16 && kv->type != PK_KV_F32 && j0 == 0;
    for (int g = 0; g < group; g++)
        (bf16 ? attend_head_bf16 : attend_head)(hd, j0, n, q + (size_t)g * hd, kv, scale, scores, out + (size_t)g * hd, ml + 2 * g);
}
