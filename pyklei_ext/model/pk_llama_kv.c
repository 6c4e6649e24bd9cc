/* A slot's K/V cache as bytes: copied to another slot (a shared prefix: pk_llama_kv_copy), and
 * moved out to a buffer and back (the prefix cache that outlives a slot:
 * pyklei/runtime/prefix_cache.py). The layout they walk is pk_llama_internal.h's. */
#include "pk_llama_internal.h"

#include <string.h>

#define err(...) pk_set_error(__VA_ARGS__)

int pk_llama_kv_copy(pk_llama *m, int src, int dst, int n) {
    const pk_llama_hparams *hp = &m->hp;
    if (src < 0 || src >= hp->n_seq || dst < 0 || dst >= hp->n_seq)
        return err("kv copy: slots %d -> %d outside [0, %d)", src, dst, hp->n_seq);
    if (n < 0 || n > hp->n_ctx) return err("kv copy: %d positions outside [0, %d]", n, hp->n_ctx);
    if (src == dst || n == 0) return 0;
    const size_t es = pk_kv_value_bytes((pk_kv_type)hp->kv_type), hd = (size_t)hp->head_dim;
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            /* K is stored in blocks of PK_KV_BLOCK positions: copy whole blocks (the tail of
             * the last one is beyond n in both slots, and is rewritten before it is read); a
             * ring that has wrapped, whole */
            const int ring = m->ring[l], wrapped = ring && n > ring;
            const size_t k_pos = wrapped ? (size_t)ring : (size_t)(n + PK_KV_BLOCK - 1) / PK_KV_BLOCK * PK_KV_BLOCK;
            /* a bf16 cache's V pairs positions 2p, 2p + 1: whole pairs (contract/pk_kv.h) */
            const size_t v_pos = wrapped ? (size_t)ring
                                 : hp->kv_type == PK_KV_BF16 ? (size_t)(n + 1) / 2 * 2 : (size_t)n;
            const size_t s = pk_llama_kv_head(m, src, l, h) * es, d = pk_llama_kv_head(m, dst, l, h) * es;
            memcpy((char *)m->k_cache + d, (const char *)m->k_cache + s, k_pos * hd * es);
            memcpy((char *)m->v_cache + d, (const char *)m->v_cache + s, v_pos * hd * es);
            if (hp->kv_type == PK_KV_Q8) {   /* and the scales of those elements */
                const size_t ks = pk_llama_kv_head(m, src, l, h) / PK_KV_Q8_GROUP, kd = pk_llama_kv_head(m, dst, l, h) / PK_KV_Q8_GROUP;
                memcpy(m->k_scale + kd, m->k_scale + ks, sizeof(uint16_t) * (k_pos * hd / PK_KV_Q8_GROUP));
                memcpy(m->v_scale + kd, m->v_scale + ks, sizeof(uint16_t) * (v_pos * hd / PK_KV_Q8_GROUP));
            }
        }
    return 0;
}

/* Moves the K/V of positions [a, b) of slot seq between the cache and buf (out: cache -> buf).
 * a and b are multiples of PK_KV_BLOCK, so each unit of PK_KV_BLOCK positions is, per (layer,
 * K/V head), one contiguous run of K, one of V (and, for q8, one of each's scales) at the same
 * element offset: K's [len/16][hd][16] blocks and V's [len][hd] rows both start a unit at
 * position * hd. A ring layer's rings are multiples of PK_ATTEND_CHUNK, so no unit crosses a
 * wrap; position p goes to p % ring there, as the forward pass writes it. */
static int kv_rows(pk_llama *m, int seq, int a, int b, char *buf, int out) {
    const pk_llama_hparams *hp = &m->hp;
    if (seq < 0 || seq >= hp->n_seq) return err("kv rows: slot %d outside [0, %d)", seq, hp->n_seq);
    if (a < 0 || b < a || b > m->ctx_pad || a % PK_KV_BLOCK || b % PK_KV_BLOCK)
        return err("kv rows: positions [%d, %d) are not multiples of %d within [0, %d]", a, b,
                   PK_KV_BLOCK, m->ctx_pad);
    const size_t es = pk_kv_value_bytes((pk_kv_type)hp->kv_type), hd = (size_t)hp->head_dim;
    const size_t unit = PK_KV_BLOCK * hd, unit_bytes = unit * es;
    const size_t scale_bytes = hp->kv_type == PK_KV_Q8 ? sizeof(uint16_t) * (unit / PK_KV_Q8_GROUP) : 0;
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++)
            for (int p = a; p < b; p += PK_KV_BLOCK) {
                const size_t e = pk_llama_kv_head(m, seq, l, h) + (size_t)pk_llama_kv_index(m, l, p) * hd;
                char *const parts[4] = {(char *)m->k_cache + e * es, (char *)m->v_cache + e * es,
                                        m->k_scale ? (char *)(m->k_scale + e / PK_KV_Q8_GROUP) : NULL,
                                        m->v_scale ? (char *)(m->v_scale + e / PK_KV_Q8_GROUP) : NULL};
                const size_t sizes[4] = {unit_bytes, unit_bytes, scale_bytes, scale_bytes};
                for (int i = 0; i < 4; i++) {
                    if (!sizes[i]) continue;
                    if (out) memcpy(buf, parts[i], sizes[i]);
                    else memcpy(parts[i], buf, sizes[i]);
                    buf += sizes[i];
                }
            }
    return 0;
}

size_t pk_llama_kv_rows_bytes(const pk_llama *m, int n) {
    const pk_llama_hparams *hp = &m->hp;
    const size_t vals = (size_t)n * hp->n_layer * hp->n_head_kv * hp->head_dim;
    return 2 * vals * pk_kv_value_bytes((pk_kv_type)hp->kv_type) +
           (hp->kv_type == PK_KV_Q8 ? 2 * sizeof(uint16_t) * (vals / PK_KV_Q8_GROUP) : 0);
}

int pk_llama_kv_export(pk_llama *m, int seq, int a, int b, void *buf) {
    return kv_rows(m, seq, a, b, buf, 1);
}

int pk_llama_kv_import(pk_llama *m, int seq, int a, int b, const void *buf) {
    return kv_rows(m, seq, a, b, (char *)buf, 0);
}
