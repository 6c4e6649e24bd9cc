/* The KV cache as attention reads it: the layout of one K/V head's cache, its element types,
 * and the f16 -> f32 conversion it is read through. A header of the contract (contract/): the
 * attention in the kernel layer (ops/pk_attention.c) and its SIMD paths in the ISA files
 * (isa/attention_x86_*.h) both follow it; the forward pass (model/pk_llama.c) writes caches
 * in it. */
#ifndef PK_KV_H
#define PK_KV_H

#include <stddef.h>
#include <stdint.h>

/* KV cache of one K/V head: K position-blocked, [ceil(n_ctx/16)][head_dim][16] (positions
 * 16b..16b+15 of dimension i at (b*head_dim + i)*16 + pos%16), V [n_ctx][head_dim]. */
#define PK_KV_BLOCK 16

/* The element types of a KV cache. q8: int8 values with one f16 scale per PK_KV_Q8_GROUP
 * consecutive values of a position's head vector (llama.cpp's q8_0 block: 8.5 bits a value,
 * 53% of f16); head_dim must be a multiple of the group. bf16: the values in the order of the
 * bf16 dot products' pairs (below), so that attention in bf16 reads them as they are. */
typedef enum { PK_KV_F32 = 0, PK_KV_F16 = 1, PK_KV_Q8 = 2, PK_KV_BF16 = 3 } pk_kv_type;
#define PK_KV_Q8_GROUP 32

/* A bf16 cache holds the pairs that one bf16 dot-product lane multiplies (vdpbf16ps: element
 * 2p of a 32-bit lane, the low half, then 2p + 1). K pairs dimensions 2p and 2p + 1 of one
 * position, [ceil(n/16)][head_dim/2][16] pairs; V pairs positions 2p and 2p + 1 of one
 * dimension, [ceil(n/2)][head_dim] pairs. The element offsets of position j, dimension i,
 * counted in bf16 values from the head's first (head_dim even): */
static inline size_t pk_kv_bf16_k_at(int hd, int j, int i) {
    return ((size_t)(j / PK_KV_BLOCK) * hd + (size_t)(i & ~1)) * PK_KV_BLOCK + 2 * (size_t)(j % PK_KV_BLOCK) + (i & 1);
}
static inline size_t pk_kv_bf16_v_at(int hd, int j, int i) {
    return (size_t)(j & ~1) * hd + 2 * (size_t)i + (j & 1);
}

/* x rounded to bf16 as vcvtneps2bf16 rounds: to nearest even, an f32 subnormal to a signed
 * zero, a NaN quiet. A bf16 cache's values, and every value the bf16 attention rounds. */
static inline uint16_t pk_kv_bf16_round(float x) {
    union { float f; uint32_t u; } v = {x};
    const uint32_t nearest = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16;   /* selects: it vectorizes */
    const uint32_t quiet = (v.u | 0x00400000u) >> 16, zero = (v.u & 0x80000000u) >> 16;
    return (uint16_t)((v.u & 0x7F800000u) == 0 ? zero : (v.u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : nearest);
}

/* out[i] = x[i] as float, i < n: reads an f16 cache (exact; per-ISA versions in the ISA
 * files' helper records, contract/pk_kernel.h, bit-identical, NaNs quieted). */
typedef void (*pk_f16_to_f32_fn)(size_t n, const uint16_t *x, float *out);

/* One K/V head's cache as attention reads it. */
typedef struct {
    pk_kv_type type;
    const void *k;             /* [ceil(n/16)][hd][16]: float, f16 bits or int8; bf16 pairs (above) */
    const void *v;             /* [n][hd]; bf16 pairs (above) */
    const uint16_t *k_scale;   /* q8: f16 [ceil(n/16)][hd/32][16] (K's blocked order); else NULL */
    const uint16_t *v_scale;   /* q8: f16 [n][hd/32]; else NULL */
    pk_f16_to_f32_fn f16;      /* f16 and q8: the conversion of the values / the scales */
    int dot_bf16;              /* f16, q8 and bf16: 1 = QK and PV in bf16 with f32 sums (the arithmetic
                                * of isa/attention_x86_avx512bf16.h, on every path); 0 = in f32 */
} pk_kv_head;

/* Bytes one stored value of a cache of type t takes (q8's scales are apart). */
static inline size_t pk_kv_value_bytes(pk_kv_type t) { return t == PK_KV_F32 ? 4 : t == PK_KV_Q8 ? 1 : 2; }

/* The view of kv from element e on (values and, for q8, their scales): a head's cache within
 * the whole cache, or a head's positions from p0 on (e = p0 * hd, p0 a multiple of 16; both
 * bf16 orders keep such a view's offsets). */
static inline pk_kv_head pk_kv_head_at(const pk_kv_head *kv, size_t e) {
    pk_kv_head r = *kv;
    r.k = (const char *)kv->k + e * pk_kv_value_bytes(kv->type);
    r.v = (const char *)kv->v + e * pk_kv_value_bytes(kv->type);
    if (kv->type == PK_KV_Q8) {
        r.k_scale = kv->k_scale + e / PK_KV_Q8_GROUP;
        r.v_scale = kv->v_scale + e / PK_KV_Q8_GROUP;
    }
    return r;
}

#endif
