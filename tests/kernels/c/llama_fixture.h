/* The model tests/kernels/c/test_llama.c runs: a configuration (shapes, weight and cache
 * types, threads, and the family features of pk_llama.h), random tiny weights for it in
 * exact-size heap buffers (so that AddressSanitizer sees any overread), and models created
 * over them. Header-only, like pk_test.h: test_llama.c is one translation unit. */
#ifndef LLAMA_FIXTURE_H
#define LLAMA_FIXTURE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/pk_llama.h"
#include "ops/pk_matmul.h"
#include "ops/pk_nn.h"
#include "pk_test.h"

static uint16_t f32_to_f16(float f) {   /* small normal values only (the test's range) */
    uint16_t h;
    pk_f32_to_f16_row(1, &f, &h);
    return h;
}

/* ---- random weights ----------------------------------------------------------------------- */

typedef struct {
    pk_rhs rhs;
    void *qs, *scales;
} weight;

/* A random [n, k] weight in fmt. */
static int make_weight(weight *w, pk_format fmt, int n, int k, int bl, float scale) {
    memset(w, 0, sizeof *w);
    if (fmt == PK_FMT_QSI4C32) {
        w->qs = malloc((size_t)n * k / 2);
        w->scales = malloc(sizeof(uint16_t) * (size_t)n * (k / bl));
        for (size_t i = 0; i < (size_t)n * k / 2; i++) ((uint8_t *)w->qs)[i] = (uint8_t)rnd();
        for (size_t i = 0; i < (size_t)n * (k / bl); i++)
            ((uint16_t *)w->scales)[i] = f32_to_bf16(scale * (0.5f + 0.5f * fabsf(rndf())) / 8.0f);
    } else {
        w->qs = malloc((size_t)n * k);
        w->scales = malloc(sizeof(float) * (size_t)n);
        for (size_t i = 0; i < (size_t)n * k; i++) ((int8_t *)w->qs)[i] = (int8_t)rnd();
        for (int i = 0; i < n; i++) ((float *)w->scales)[i] = scale * (0.5f + 0.5f * fabsf(rndf())) / 127.0f;
    }
    return pk_rhs_prepare(&w->rhs, fmt, n, k, bl, w->qs, w->scales, NULL);
}

static void free_weight(weight *w) {
    pk_rhs_release(&w->rhs);
    free(w->qs);
    free(w->scales);
}

static float *rand_vec(int n, float base, float spread) {
    float *v = malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) v[i] = base + spread * rndf();
    return v;
}

/* ---- configurations ----------------------------------------------------------------------- */

/* The family features of pk_llama.h a configuration switches on; all zero is Llama. */
typedef struct {
    int bias;              /* q/k/v biases (Qwen2) */
    int qk_norm;           /* an RMSNorm of each q and k head (Qwen3, Gemma 3) */
    int post_norms;        /* norms of the attention's and the MLP's outputs (Gemma 3) */
    int window;            /* the sliding window of the layers in window_layers */
    unsigned window_layers;/* bit l: layer l slides */
    float local_theta;     /* the RoPE base of the sliding layers (0: the model's) */
    float rope_theta;      /* the model's RoPE base (0: 10000) */
    unsigned nope_layers;  /* bit l: layer l has no RoPE (SmolLM3) */
    int rope_dim;          /* RoPE on part of a head (Phi-3; 0: all) */
    int act;               /* pk_llama_act: PK_ACT_GELU_TANH is GeGLU (Gemma) */
    float embd_scale, attn_scale, logit_softcap;
    int ring_wraps;        /* the test requires: a chunked model's sliding layers keep a ring
                            * shorter than n_ctx (the sequence wraps around it) */
} family;

typedef struct {
    const char *name;
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx;
    pk_format emb;          /* embedding table type */
    int tied;              /* lm_head = the embedding bytes (emb must be qsi4c32/qsi8cx) */
    int q8_layers;         /* layer weights qsi8cx instead of qsi4c32 */
    int rope_freqs, kv_type, planes, threads, bl;   /* kv_type: pk_kv_type */
    family fam;
} config;

/* ---- the fixture: a configuration's weights ------------------------------------------------ */

enum { LAYER_VECS = 9 };   /* attn_norm ffn_norm bq bk bv q_norm k_norm post_attn_norm post_ffn_norm */

typedef struct {
    config c;
    weight *lw;            /* [n_layer * 7] */
    pk_llama_layer *layers;/* [n_layer]: what models are created with (tests vary a copy of it) */
    float **vecs;          /* [n_layer * LAYER_VECS]: norms and biases, NULL where absent */
    float *out_norm, *rope_freqs;
    void *emb_data, *emb_scales;
    weight lm_head;
    pk_llama_weights w;
    pk_ctx *ctx;
} fixture;

static int setup(fixture *f, const config *c) {
    memset(f, 0, sizeof *f);
    f->c = *c;
    const family *fm = &c->fam;
    const int h = c->n_embd, hd = c->head_dim, nl = c->n_layer, V = c->n_vocab;
    const int nq = c->n_head * hd, nkv = c->n_head_kv * hd;
    const pk_format lf = c->q8_layers ? PK_FMT_QSI8CX : PK_FMT_QSI4C32;
    f->lw = calloc((size_t)nl * 7, sizeof(weight));
    f->layers = calloc((size_t)nl, sizeof(pk_llama_layer));
    f->vecs = calloc((size_t)nl * LAYER_VECS, sizeof(float *));
    for (int l = 0; l < nl; l++) {
        weight *w = f->lw + l * 7;
        const int shapes[7][2] = {{nq, h}, {nkv, h}, {nkv, h}, {h, nq}, {c->n_ff, h}, {c->n_ff, h}, {h, c->n_ff}};
        for (int i = 0; i < 7; i++)
            if (make_weight(&w[i], lf, shapes[i][0], shapes[i][1], c->bl, 1.0f)) {
                printf("weight prepare failed: %s\n", pk_last_error());
                return -1;
            }
        pk_llama_layer *L = &f->layers[l];
        float **v = f->vecs + (size_t)l * LAYER_VECS;
        L->wq = &w[0].rhs; L->wk = &w[1].rhs; L->wv = &w[2].rhs; L->wo = &w[3].rhs;
        L->w_gate = &w[4].rhs; L->w_up = &w[5].rhs; L->w_down = &w[6].rhs;
        L->attn_norm = v[0] = rand_vec(h, 1.0f, 0.2f);
        L->ffn_norm = v[1] = rand_vec(h, 1.0f, 0.2f);
        if (fm->bias) {   /* as large as q, k, v themselves, so that they matter */
            L->bq = v[2] = rand_vec(nq, 0.0f, 1.0f);
            L->bk = v[3] = rand_vec(nkv, 0.0f, 1.0f);
            L->bv = v[4] = rand_vec(nkv, 0.0f, 1.0f);
        }
        if (fm->qk_norm) {
            L->q_norm = v[5] = rand_vec(hd, 1.0f, 0.3f);
            L->k_norm = v[6] = rand_vec(hd, 1.0f, 0.3f);
        }
        if (fm->post_norms) {
            L->post_attn_norm = v[7] = rand_vec(h, 1.0f, 0.2f);
            L->post_ffn_norm = v[8] = rand_vec(h, 1.0f, 0.2f);
        }
        const int slides = fm->window_layers >> l & 1;
        L->window = slides ? fm->window : 0;
        L->rope_theta = slides ? fm->local_theta : 0.0f;
        L->no_rope = fm->nope_layers >> l & 1;
    }
    f->out_norm = rand_vec(h, 1.0f, 0.2f);
    if (c->rope_freqs) {
        const int rd = fm->rope_dim ? fm->rope_dim : hd;
        f->rope_freqs = rand_vec(rd / 2, 4.0f, 3.0f);   /* divisors in [1, 7] */
    }
    /* embedding table and lm_head */
    pk_tensor *t = &f->w.tok_embd;
    t->type = c->emb;
    t->n = V;
    t->k = h;
    t->bl = c->bl;
    if (c->emb == PK_FMT_QSI4C32 || c->emb == PK_FMT_QSI8CX) {
        weight e;
        if (make_weight(&e, c->emb, V, h, c->bl, 1.0f))
            return -1;
        pk_rhs_release(&e.rhs);
        f->emb_data = e.qs;
        f->emb_scales = e.scales;
    } else {
        const size_t es = c->emb == PK_FMT_F32 ? 4 : 2;
        f->emb_data = malloc(es * (size_t)V * h);
        for (size_t i = 0; i < (size_t)V * h; i++) {
            const float x = rndf();
            if (c->emb == PK_FMT_F32) ((float *)f->emb_data)[i] = x;
            else if (c->emb == PK_FMT_F16) ((uint16_t *)f->emb_data)[i] = f32_to_f16(x);
            else ((uint16_t *)f->emb_data)[i] = f32_to_bf16(x);
        }
    }
    t->data = f->emb_data;
    t->scales = f->emb_scales;
    if (c->tied) {
        const pk_format ef = c->emb;
        if (pk_rhs_prepare(&f->lm_head.rhs, ef, V, h, ef == PK_FMT_QSI4C32 ? c->bl : h, f->emb_data,
                           f->emb_scales, NULL))
            return -1;
    } else if (make_weight(&f->lm_head, PK_FMT_QSI8CX, V, h, h, 1.0f)) {
        return -1;
    }
    f->w.lm_head = &f->lm_head.rhs;
    f->w.output_norm = f->out_norm;
    f->w.rope_freqs = f->rope_freqs;
    f->w.layers = f->layers;
    f->ctx = pk_ctx_create(c->threads);
    if (!f->ctx) return -1;
    pk_ctx_set_activations(f->ctx, c->planes == 2 ? PK_ACT_QAI8DX2 : PK_ACT_QAI8DX);
    return 0;
}

static void teardown(fixture *f) {
    for (int i = 0; i < f->c.n_layer * 7; i++) free_weight(&f->lw[i]);
    for (int i = 0; i < f->c.n_layer * LAYER_VECS; i++) free(f->vecs[i]);
    free(f->lw);
    free(f->layers);
    free(f->vecs);
    free(f->out_norm);
    free(f->rope_freqs);
    if (f->c.tied) pk_rhs_release(&f->lm_head.rhs);
    else free_weight(&f->lm_head);
    free(f->emb_data);
    free(f->emb_scales);
    pk_ctx_destroy(f->ctx);
}

/* The configuration's hyperparameters for a model of n_batch rows per chunk and n_seq slots */
static pk_llama_hparams fixture_hparams(const fixture *f, int n_batch, int n_seq) {
    const config *c = &f->c;
    const pk_llama_hparams hp = {
        .n_vocab = c->n_vocab, .n_embd = c->n_embd, .n_layer = c->n_layer,
        .n_head = c->n_head, .n_head_kv = c->n_head_kv, .head_dim = c->head_dim,
        .n_ff = c->n_ff, .rms_eps = 1e-5f, .rope_theta = c->fam.rope_theta > 0.0f ? c->fam.rope_theta : 10000.0f,
        .n_ctx = c->n_ctx, .n_batch = n_batch, .kv_type = c->kv_type, .n_seq = n_seq,
        .act = c->fam.act, .rope_dim = c->fam.rope_dim, .embd_scale = c->fam.embd_scale,
        .attn_scale = c->fam.attn_scale, .logit_softcap = c->fam.logit_softcap,
    };
    return hp;
}

static pk_llama *make_model_seq(fixture *f, int n_batch, int n_seq) {
    const pk_llama_hparams hp = fixture_hparams(f, n_batch, n_seq);
    return pk_llama_create(&hp, &f->w, f->ctx);
}

static pk_llama *make_model(fixture *f, int n_batch) { return make_model_seq(f, n_batch, 0); }

/* max |a - b| / (1 + max |a|) over n values; +inf if any is not finite */
static double rel_diff(const float *a, const float *b, size_t n) {
    double md = 0, ma = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(b[i])) return INFINITY;
        md = fmax(md, fabs((double)a[i] - b[i]));
        ma = fmax(ma, fabs((double)a[i]));
    }
    return md / (1.0 + ma);
}

#endif
