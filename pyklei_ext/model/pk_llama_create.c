/* The making and unmaking of a model (pk_llama.h): the checks of its hyperparameters and
 * weights, the KV cache and the forward pass's buffers (sized here, used by pk_llama.c), and
 * the RoPE frequencies. */
#include "pk_llama_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define err(...) pk_set_error(__VA_ARGS__)

/* A prefill chunk's MLP runs in slices of rows: gate_up, SwiGLU and down_proj of one slice
 * before the next, so that gate_up's output (2 * n_ff floats a row) is still in L2 when SwiGLU
 * reads it, rather than written out to L3 or memory and read back. A slice is the most rows
 * whose output fits MLP_SLICE_BYTES, in whole 24s (the GEMM tiles' 6 and 8 rows divide it); at
 * fewer than 24 rows a slice would re-read the weights for too few rows, and the chunk runs
 * whole. SmolLM2 (n_ff 1536, 48-row slices), 512 tokens, 1 thread: gate_up 185 -> 153 ms; the
 * 1B shape (n_ff 8192) in 48-row slices: gate_up 1.04x slower, so it is not sliced
 * (docs/KERNELS.md, "The MLP in slices"). */
#define MLP_SLICE_BYTES (768 << 10)
#define MLP_SLICE_STEP 24

static int mlp_slice_rows(int n_batch, int n_ff) {
    const int rows = (int)(MLP_SLICE_BYTES / (2 * sizeof(float) * (size_t)n_ff)) / MLP_SLICE_STEP * MLP_SLICE_STEP;
    return rows >= MLP_SLICE_STEP && rows < n_batch ? rows : n_batch;
}

static void *alloc(pk_llama *m, size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64)) return NULL;
    m->state_bytes += bytes;
    return p;
}

pk_llama *pk_llama_create(const pk_llama_hparams *hp, const pk_llama_weights *w, pk_ctx *ctx) {
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_head <= 0 || hp->n_head_kv <= 0 ||
        hp->head_dim <= 0 || hp->head_dim % 2 || hp->head_dim > 512 || hp->n_head % hp->n_head_kv || hp->n_ctx <= 0 ||
        hp->n_batch <= 0 || hp->n_ff <= 0 || hp->n_vocab <= 0 || hp->n_seq < 0 ||
        hp->kv_type < PK_KV_F32 || hp->kv_type > PK_KV_BF16 || hp->act < PK_ACT_SILU || hp->act > PK_ACT_GELU_TANH ||
        hp->rope_dim < 0 || hp->rope_dim % 2 || hp->rope_dim > hp->head_dim || !(hp->embd_scale >= 0.0f) ||
        !(hp->attn_scale >= 0.0f) || !(hp->logit_softcap >= 0.0f)) {
        err("invalid hyperparameters");
        return NULL;
    }
    if (hp->kv_type == PK_KV_Q8 && hp->head_dim % PK_KV_Q8_GROUP) {
        err("a q8 KV cache needs a head size that is a multiple of %d, not %d (use f16)", PK_KV_Q8_GROUP,
            hp->head_dim);
        return NULL;
    }
    const int kv_bf16 = hp->kv_type != PK_KV_F32 ? pk_attend_bf16_pick((pk_kv_type)hp->kv_type, 1) : 0;
    if (kv_bf16 < 0) return NULL;   /* PYKLEI_ATTENTION refused, the error set */
    pk_llama *m = calloc(1, sizeof *m);
    if (!m) { err("out of memory"); return NULL; }
    m->kv_bf16 = kv_bf16;
    m->hp = *hp;
    if (m->hp.n_seq == 0) m->hp.n_seq = 1;
    m->w = *w;
    m->ctx = ctx;
    m->layers = malloc(sizeof(pk_llama_layer) * hp->n_layer);
    const int hd = hp->head_dim, B = hp->n_batch, nt = pk_ctx_threads(ctx);
    m->ctx_pad = (hp->n_ctx + PK_KV_BLOCK - 1) / PK_KV_BLOCK * PK_KV_BLOCK;
    m->ring = calloc(hp->n_layer, sizeof(int));
    m->layer_off = calloc(hp->n_layer, sizeof(size_t));
    for (int l = 0; m->ring && m->layer_off && l < hp->n_layer; l++) {
        const long win = w->layers[l].window;
        const long ring = win > 0 ? (win + B - 1 + PK_ATTEND_CHUNK - 1) / PK_ATTEND_CHUNK * PK_ATTEND_CHUNK : 0;
        m->ring[l] = ring && ring < m->ctx_pad ? (int)ring : 0;
        m->layer_off[l] = m->slot_elems;
        m->slot_elems += (size_t)hp->n_head_kv * (m->ring[l] ? m->ring[l] : m->ctx_pad) * hd;
    }
    const size_t kv_elems = (size_t)m->hp.n_seq * m->slot_elems;
    m->kv_read = hp->kv_type == PK_KV_F16 || hp->kv_type == PK_KV_Q8 ? pk_f16_to_f32_pick(NULL) : NULL;
    m->rope_dim = hp->rope_dim ? hp->rope_dim : hd;
    m->attn_scale = hp->attn_scale > 0.0f ? hp->attn_scale : 1.0f / sqrtf((float)hd);
    /* the distinct RoPE frequency sets, each a (base, linear factor) pair (Gemma 3: its
     * sliding-window layers' base, and the global layers' base and factor; 4B+ scale the
     * global ones only) */
    float bases[64], factors[64];
    m->layer_base = alloc(m, sizeof(int) * hp->n_layer);
    for (int l = 0; m->layer_base && l < hp->n_layer; l++) {
        const pk_llama_layer *L = &w->layers[l];
        /* != 0, not > 0: a negative or NaN base or factor is refused below, not taken for the
         * default */
        const float base = L->rope_theta != 0.0f ? L->rope_theta : hp->rope_theta;
        const float factor = L->rope_factor != 0.0f ? L->rope_factor : 1.0f;
        int b = 0;
        while (b < m->n_bases && (bases[b] != base || factors[b] != factor)) b++;
        if (L->window < 0 || !(base > 0.0f) || !(factor > 0.0f) || !isfinite(factor) ||
            (b == m->n_bases && m->n_bases == 64)) {
            pk_llama_destroy(m);
            err("layer %d: invalid window %d, RoPE base %g or RoPE factor %g", l, L->window,
                (double)base, (double)factor);
            return NULL;
        }
        if (b == m->n_bases) {
            bases[m->n_bases] = base;
            factors[m->n_bases++] = factor;
        }
        m->layer_base[l] = L->no_rope ? -1 : b;
    }
    if (!m->n_bases) {
        bases[m->n_bases] = hp->rope_theta;
        factors[m->n_bases++] = 1.0f;
    }
    m->inv_freq = alloc(m, sizeof(float) * m->n_bases * (m->rope_dim / 2));
    m->k_cache = alloc(m, kv_elems * pk_kv_value_bytes((pk_kv_type)hp->kv_type));
    m->v_cache = alloc(m, kv_elems * pk_kv_value_bytes((pk_kv_type)hp->kv_type));
    if (hp->kv_type == PK_KV_Q8) {
        m->k_scale = alloc(m, sizeof(uint16_t) * (kv_elems / PK_KV_Q8_GROUP));
        m->v_scale = alloc(m, sizeof(uint16_t) * (kv_elems / PK_KV_Q8_GROUP));
    }
    m->x = alloc(m, sizeof(float) * B * hp->n_embd);
    m->xn = alloc(m, sizeof(float) * B * hp->n_embd);
    m->q = alloc(m, sizeof(float) * B * hp->n_head * hd);
    m->k = alloc(m, sizeof(float) * B * hp->n_head_kv * hd);
    m->v = alloc(m, sizeof(float) * B * hp->n_head_kv * hd);
    m->att = alloc(m, sizeof(float) * B * hp->n_head * hd);
    m->mlp_rows = mlp_slice_rows(B, hp->n_ff);
    m->gate = alloc(m, sizeof(float) * m->mlp_rows * hp->n_ff);
    m->up = alloc(m, sizeof(float) * m->mlp_rows * hp->n_ff);
    const int group = hp->n_head / hp->n_head_kv;
    m->ld_scores = hp->n_ctx < PK_ATTEND_CHUNK ? hp->n_ctx : PK_ATTEND_CHUNK;
    m->scores = alloc(m, sizeof(float) * nt * PK_ATTEND_ROWS * group * m->ld_scores);
    m->n_chunks = (hp->n_ctx + PK_ATTEND_CHUNK - 1) / PK_ATTEND_CHUNK;
    if (m->n_chunks > 1)
        m->parts = alloc(m, sizeof(float) * SPLIT_PAIRS(nt) * m->n_chunks * ((size_t)group * hd + 2 * group));
    m->rope_cs = alloc(m, sizeof(float) * m->n_bases * B * m->rope_dim);
    m->row_seq = alloc(m, sizeof(int32_t) * B);
    m->row_pos = alloc(m, sizeof(int32_t) * B);
    m->row_out = alloc(m, sizeof(int32_t) * B);
    m->seq_seen = alloc(m, sizeof(int) * m->hp.n_seq);
    const int rot_len = hp->n_ff > hp->n_embd ? hp->n_ff : hp->n_embd;
    m->rot_scratch = alloc(m, sizeof(float) * nt * rot_len);
    m->ones = alloc(m, sizeof(float) * hp->n_embd);
    if ((w->rot_ffn_down.n && w->rot_ffn_down.n != hp->n_ff) ||
        (w->rot_output.n && w->rot_output.n != hp->n_embd)) {
        pk_llama_destroy(m);
        err("rotation sizes %d / %d do not match n_ff %d / n_embd %d", w->rot_ffn_down.n,
            w->rot_output.n, hp->n_ff, hp->n_embd);
        return NULL;
    }
    if (!m->row_seq || !m->row_pos || !m->row_out || !m->seq_seen ||
        !m->rot_scratch || !m->ones || !m->rope_cs || !m->layers || !m->layer_base || !m->ring || !m->layer_off ||
        !m->inv_freq || !m->k_cache ||
        !m->v_cache || (hp->kv_type == PK_KV_Q8 && (!m->k_scale || !m->v_scale)) || !m->x || !m->xn || !m->q ||
        !m->k || !m->v || !m->att || !m->gate || !m->up || !m->scores || (m->n_chunks > 1 && !m->parts)) {
        pk_llama_destroy(m);
        err("out of memory allocating the KV cache and scratch (lower n_ctx or n_batch)");
        return NULL;
    }
    memcpy(m->layers, w->layers, sizeof(pk_llama_layer) * hp->n_layer);
    for (int i = 0; i < hp->n_embd; i++) m->ones[i] = 1.0f;
    m->w.layers = m->layers;
    /* inv_freq[i] = theta^(-2i/rope_dim), divided by llama3's per-frequency factor if present
     * and by the set's linear factor (transformers' "linear" rope_type: inv_freq / factor);
     * computed like the float32 reference implementations do */
    const int rd = m->rope_dim;
    for (int b = 0; b < m->n_bases; b++)
        for (int i = 0; i < rd / 2; i++) {
            float f = (float)(1.0 / pow((double)bases[b], (double)(2 * i) / rd));
            if (w->rope_freqs) f = f / w->rope_freqs[i];
            if (factors[b] != 1.0f) f = f / factors[b];
            m->inv_freq[(size_t)b * (rd / 2) + i] = f;
        }
    return m;
}

void pk_llama_destroy(pk_llama *m) {
    if (!m) return;
    free(m->layers);
    free(m->layer_base);
    free(m->ring);
    free(m->layer_off);
    free(m->inv_freq);
    free(m->k_cache);
    free(m->v_cache);
    free(m->k_scale);
    free(m->v_scale);
    free(m->x);
    free(m->xn);
    free(m->q);
    free(m->k);
    free(m->v);
    free(m->att);
    free(m->gate);
    free(m->up);
    free(m->scores);
    free(m->parts);
    free(m->rope_cs);
    free(m->row_seq);
    free(m->row_pos);
    free(m->row_out);
    free(m->seq_seen);
    free(m->rot_scratch);
    free(m->ones);
    free(m->stats);
    free(m);
}

size_t pk_llama_state_bytes(const pk_llama *m) { return m->state_bytes; }
