/* The state of a model (pk_llama.h) that its making (pk_llama_create.c), the forward pass
 * (pk_llama.c) and its statistics and profile (pk_llama_stats.c) share. Private to model/. */
#ifndef PK_LLAMA_INTERNAL_H
#define PK_LLAMA_INTERNAL_H

#include "pk_llama.h"

/* The (row, K/V head) pairs of a pass that decode at depth may split by chunks over nt
 * threads (pk_llama.c's split_attention); m->parts holds as many. */
#define SPLIT_PAIRS(nt) (2 * (nt))

struct pk_llama {
    pk_llama_hparams hp;
    pk_llama_weights w;
    pk_llama_layer *layers;
    pk_ctx *ctx;
    int rope_dim;        /* dimensions of a head RoPE rotates (hp.rope_dim, or head_dim) */
    int n_bases;         /* distinct RoPE frequency sets (base, linear factor) among the layers */
    int *layer_base;     /* [n_layer]: index of the layer's base, -1 for a layer without RoPE */
    float *inv_freq;     /* [n_bases][rope_dim/2] */
    float attn_scale;    /* hp.attn_scale, or 1/sqrt(head_dim) */
    int ctx_pad;         /* n_ctx rounded up to PK_KV_BLOCK */
    /* A sliding-window layer's cache is a ring of ring[l] positions (position p at p % ring)
     * when that is shorter than ctx_pad: its window and a chunk's rows, rounded up to
     * PK_ATTEND_CHUNK, so that no chunk of attention crosses the wrap; 0: not a ring. */
    int *ring;           /* [n_layer] */
    size_t *layer_off;   /* [n_layer]: the layer's first element within a slot */
    size_t slot_elems;   /* elements of one slot's cache (K or V) */
    /* Slot-major, so a slot's pages are touched only once it holds tokens (see pk_llama.h) */
    void *k_cache;       /* [n_seq][n_layer][n_head_kv][len/16][head_dim][16] f32, f16 or int8 (pk_nn.h), */
    void *v_cache;       /* [n_seq][n_layer][n_head_kv][len][head_dim]; len: ring[l] or ctx_pad */
    uint16_t *k_scale;   /* q8: f16 scales, one per 32 elements of k_cache, in its order (pk_nn.h) */
    uint16_t *v_scale;   /* q8: one per 32 elements of v_cache */
    pk_f16_to_f32_fn kv_read;   /* f16 cache, q8's scales: the conversion attention reads with */
    int kv_bf16;         /* f16, q8 or bf16 cache: its dot products in bf16 (pk_attend_bf16_pick) */
    int *seq_seen;       /* [n_seq] scratch of pk_llama_forward_batch's checks */
    /* scratch, n_batch rows each */
    int32_t *row_seq;    /* [B] slot of each row of a chunk */
    int32_t *row_pos;    /* [B] position of each row of a chunk */
    int32_t *row_out;    /* [B] rows of a chunk whose logits are wanted, ascending */
    float *x;            /* [B][n_embd] residual stream */
    float *xn;           /* [B][n_embd] normalised */
    float *q;            /* [B][n_head*hd] */
    float *k;            /* [B][n_kv*hd] */
    float *v;            /* [B][n_kv*hd] */
    float *att;          /* [B][n_head*hd] attention output */
    float *gate;         /* [mlp_rows][n_ff] */
    float *up;           /* [mlp_rows][n_ff] */
    int mlp_rows;        /* rows per slice of a chunk's MLP (pk_llama_create.c, mlp_slice_rows) */
    float *scores;       /* [n_threads][PK_ATTEND_ROWS][n_head/n_head_kv][ld_scores] */
    int ld_scores;       /* min(n_ctx, PK_ATTEND_CHUNK): attention scores a row holds at once */
    /* decode at depth split over threads by chunks (job_attention_split): each (row, K/V
     * head) pair's chunk partials, [SPLIT_PAIRS(nt)][n_chunks][group * head_dim + 2 * group] */
    float *parts;
    int n_chunks;        /* ceil(n_ctx / PK_ATTEND_CHUNK) */
    float *rope_cs;      /* [n_bases][B][rope_dim]: cos/sin of each row's angles per base */
    float *rot_scratch;  /* [n_threads][max(n_ff, n_embd)]: pk_rotate_row's scratch */
    float *ones;         /* [n_embd]: the gain of the final norm of a rotated file */
    size_t state_bytes;
    double *stats;       /* optional: see pk_llama_stats_enable */
    size_t stats_len;
    long stats_rows, stats_lm_rows;
    int profile;         /* see pk_llama_profile_enable */
    double prof_s[PK_LLAMA_OPS];
    long prof_calls;
};

/* First element of (slot, layer, K/V head) in k_cache / v_cache */
static inline size_t pk_llama_kv_head(const pk_llama *m, int seq, int layer, int h) {
    const size_t len = m->ring[layer] ? (size_t)m->ring[layer] : (size_t)m->ctx_pad;
    return (size_t)seq * m->slot_elems + m->layer_off[layer] + (size_t)h * len * m->hp.head_dim;
}

/* Where position pos of a layer's cache is stored (a sliding layer's ring wraps) */
static inline int pk_llama_kv_index(const pk_llama *m, int layer, int pos) {
    return m->ring[layer] ? pos % m->ring[layer] : pos;
}

/* Section s of layer l of the activation statistics, or NULL when they are off */
double *pk_llama_stat_at(const pk_llama *m, int l, pk_llama_stat s);

/* dst[j] += sum over rows of x[r][j]^2 */
void pk_llama_add_squares(double *dst, const float *x, int rows, int d);

#endif
