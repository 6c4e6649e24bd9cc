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
 * 53% of f16); head_dim must be a multiple of the group. */
typedef enum { PK_KV_F32 = 0, PK_KV_F16 = 1, PK_KV_Q8 = 2 } pk_kv_type;
#define PK_KV_Q8_GROUP 32

/* out[i] = x[i] as float, i < n: reads an f16 cache (exact; per-ISA versions in the ISA
 * files' helper records, contract/pk_kernel.h, bit-identical, NaNs quieted). */
typedef void (*pk_f16_to_f32_fn)(size_t n, const uint16_t *x, float *out);

/* One K/V head's cache as attention reads it. */
typedef struct {
    pk_kv_type type;
    const void *k;             /* [ceil(n/16)][hd][16]: float, f16 bits or int8 */
    const void *v;             /* [n][hd] */
    const uint16_t *k_scale;   /* q8: f16 [ceil(n/16)][hd/32][16] (K's blocked order); else NULL */
    const uint16_t *v_scale;   /* q8: f16 [n][hd/32]; else NULL */
    pk_f16_to_f32_fn f16;      /* f16 and q8: the conversion of the values / the scales */
    int dot_bf16;              /* f16 and q8: 1 = QK and PV in bf16 with f32 sums (the arithmetic of
                                * isa/attention_x86_avx512bf16.h, on every path); 0 = in f32 */
} pk_kv_head;

/* Bytes one stored value of a cache of type t takes (q8's scales are apart). */
static inline size_t pk_kv_value_bytes(pk_kv_type t) { return t == PK_KV_F32 ? 4 : t == PK_KV_F16 ? 2 : 1; }

/* The view of kv from element e on (values and, for q8, their scales): a head's cache within
 * the whole cache, or a head's positions from p0 on (e = p0 * hd, p0 a multiple of 16). */
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
