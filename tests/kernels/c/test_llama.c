/* Standalone test of the Llama forward pass (pyklei_ext/model/pk_llama.c) on random tiny
 * weights, meant to run under AddressSanitizer + UndefinedBehaviorSanitizer
 * (scripts/test_sanitizers.sh) as well as natively.
 *
 * Build (bash):  source scripts/cflags.sh   # the flags of pyklei_ext/cflags.txt
 *   gcc -O1 -g -fsanitize=address,undefined "${PK_CFLAGS[@]}" -Ipyklei_ext tests/kernels/c/test_llama.c \
 *       pyklei_ext/model/pk_*.c pyklei_ext/contract/pk_*.c pyklei_ext/ops/pk_*.c \
 *       pyklei_ext/isa/matmul_*.c pyklei_ext/isa/fwht_*.c -lm
 * Arguments: --seed N, --verbose. Last line: "<P> passed, <F> failed"; exit 1 on failure.
 *
 * For several configurations (embedding table f32 / f16 / bf16 / qsi4c32 / qsi8cx, tied
 * lm_head sharing the embedding bytes or not, qsi4c32 and qsi8cx layers, llama3 rope_freqs or
 * none, f32, f16 or q8 KV cache, 1 or 2 activation planes, 1 or 2 threads, shapes whose N and K
 * are not multiples of the kernels' tiles), checks:
 *  - prefill of the whole sequence with all_logits, in one chunk (n_batch >= n) and in chunks
 *    of 3, equals decoding the same tokens one by one from an empty cache (within a float
 *    tolerance: GEMM and GEMV kernels may round differently), and the last-row-only logits
 *    equal the last row of all_logits;
 *  - filling the context exactly (positions 0..n_ctx-1) works, and logits are finite;
 *  - bad calls return -1 with a message and write nothing: n = 0, pos0 < 0, pos0 + n > n_ctx,
 *    token ids -1 / n_vocab / INT32_MIN / INT32_MAX, int overflow in pos0 + n;
 *  - an interrupt flag that is set makes the pass return 1;
 *  - pk_llama_forward_batch: rows of 3 sequences at different positions (prefill chunks of
 *    different lengths in one call, split over n_batch, then one decode row each) give the
 *    same logits, bit for bit, as each sequence alone; pk_llama_kv_copy continues a copied
 *    prefix like the source; bad slots, positions, row orders and logit rows return -1 and
 *    write nothing;
 *  - invalid hyperparameters make pk_llama_create return NULL (no leak);
 *  - everything is freed (LeakSanitizer checks at exit). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
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

/* A random [n, k] weight in fmt (exact-size heap buffers, so ASan sees any overread). */
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

typedef struct {
    const char *name;
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx;
    pk_format emb;          /* embedding table type */
    int tied;              /* lm_head = the embedding bytes (emb must be qsi4c32/qsi8cx) */
    int q8_layers;         /* layer weights qsi8cx instead of qsi4c32 */
    int rope_freqs, kv_type, planes, threads, bl;   /* kv_type: pk_kv_type */
} config;

typedef struct {
    config c;
    weight *lw;            /* [n_layer * 7] */
    pk_llama_layer *layers;
    float **norms;         /* [n_layer * 2] */
    float *out_norm, *rope_freqs;
    void *emb_data, *emb_scales;
    weight lm_head;
    pk_llama_weights w;
    pk_ctx *ctx;
} fixture;

static int setup(fixture *f, const config *c) {
    memset(f, 0, sizeof *f);
    f->c = *c;
    const int h = c->n_embd, hd = c->head_dim, nl = c->n_layer, V = c->n_vocab;
    const pk_format lf = c->q8_layers ? PK_FMT_QSI8CX : PK_FMT_QSI4C32;
    f->lw = calloc((size_t)nl * 7, sizeof(weight));
    f->layers = calloc((size_t)nl, sizeof(pk_llama_layer));
    f->norms = calloc((size_t)nl * 2, sizeof(float *));
    for (int l = 0; l < nl; l++) {
        weight *w = f->lw + l * 7;
        const int shapes[7][2] = {{c->n_head * hd, h}, {c->n_head_kv * hd, h}, {c->n_head_kv * hd, h},
                                  {h, c->n_head * hd}, {c->n_ff, h}, {c->n_ff, h}, {h, c->n_ff}};
        for (int i = 0; i < 7; i++)
            if (make_weight(&w[i], lf, shapes[i][0], shapes[i][1], c->bl, 1.0f)) {
                printf("weight prepare failed: %s\n", pk_last_error());
                return -1;
            }
        pk_llama_layer *L = &f->layers[l];
        L->wq = &w[0].rhs; L->wk = &w[1].rhs; L->wv = &w[2].rhs; L->wo = &w[3].rhs;
        L->w_gate = &w[4].rhs; L->w_up = &w[5].rhs; L->w_down = &w[6].rhs;
        L->attn_norm = f->norms[2 * l] = rand_vec(h, 1.0f, 0.2f);
        L->ffn_norm = f->norms[2 * l + 1] = rand_vec(h, 1.0f, 0.2f);
    }
    f->out_norm = rand_vec(h, 1.0f, 0.2f);
    if (c->rope_freqs) {
        f->rope_freqs = rand_vec(hd / 2, 4.0f, 3.0f);   /* divisors in [1, 7] */
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
    pk_ctx_set_act_planes(f->ctx, c->planes);
    return 0;
}

static void teardown(fixture *f) {
    for (int i = 0; i < f->c.n_layer * 7; i++) free_weight(&f->lw[i]);
    for (int i = 0; i < f->c.n_layer * 2; i++) free(f->norms[i]);
    free(f->lw);
    free(f->layers);
    free(f->norms);
    free(f->out_norm);
    free(f->rope_freqs);
    if (f->c.tied) pk_rhs_release(&f->lm_head.rhs);
    else free_weight(&f->lm_head);
    free(f->emb_data);
    free(f->emb_scales);
    pk_ctx_destroy(f->ctx);
}

static pk_llama *make_model_seq(fixture *f, int n_batch, int n_seq) {
    pk_llama_hparams hp = {
        .n_vocab = f->c.n_vocab, .n_embd = f->c.n_embd, .n_layer = f->c.n_layer,
        .n_head = f->c.n_head, .n_head_kv = f->c.n_head_kv, .head_dim = f->c.head_dim,
        .n_ff = f->c.n_ff, .rms_eps = 1e-5f, .rope_theta = 10000.0f, .n_ctx = f->c.n_ctx,
        .n_batch = n_batch, .kv_type = f->c.kv_type, .n_seq = n_seq,
    };
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

static void test_config(const config *c) {
    fixture f;
    if (setup(&f, c)) {
        CHECK(0, "%s: setup failed: %s", c->name, pk_last_error());
        teardown(&f);
        return;
    }
    const int V = c->n_vocab, n = c->n_ctx;
    int32_t *toks = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) toks[i] = (int32_t)(rnd() % (uint64_t)V);
    toks[0] = 0;
    toks[n - 1] = V - 1;                          /* the first and last rows of the table */
    float *all1 = malloc(sizeof(float) * (size_t)n * V), *all3 = malloc(sizeof(float) * (size_t)n * V);
    float *dec = malloc(sizeof(float) * (size_t)n * V), *last = malloc(sizeof(float) * V);
    const double tol = 2e-3;

    /* prefill in one chunk and in chunks of 3; last-row-only logits */
    pk_llama *m1 = make_model(&f, n + 2), *m3 = make_model(&f, 3);
    CHECK(m1 && m3, "%s: create failed: %s", c->name, pk_last_error());
    if (!m1 || !m3) goto done;
    CHECK(pk_llama_state_bytes(m1) > 0, "%s: state_bytes", c->name);
    CHECK(pk_llama_forward(m1, toks, n, 0, all1, 1, NULL) == 0, "%s: prefill: %s", c->name, pk_last_error());
    CHECK(pk_llama_forward(m3, toks, n, 0, all3, 1, NULL) == 0, "%s: chunked prefill: %s", c->name, pk_last_error());
    CHECK(pk_llama_forward(m3, toks, n, 0, last, 0, NULL) == 0, "%s: last-row prefill", c->name);
    double d13 = rel_diff(all1, all3, (size_t)n * V);
    double dlast = rel_diff(all3 + (size_t)(n - 1) * V, last, V);
    CHECK(d13 <= tol, "%s: one-chunk vs 3-chunk prefill differ by %.3g", c->name, d13);
    CHECK(dlast <= tol, "%s: last-row logits vs all_logits differ by %.3g", c->name, dlast);
    /* the logits carry signal: they vary within a row and between rows */
    double spread = 0, rows = 0;
    for (int i = 1; i < V; i++) spread = fmax(spread, fabs((double)all1[i] - all1[0]));
    for (int i = 0; i < V; i++) rows = fmax(rows, fabs((double)all1[i] - all1[(size_t)(n - 1) * V + i]));
    CHECK(spread > 1e-3 && rows > 1e-3, "%s: degenerate logits (spread %.3g, row diff %.3g)", c->name, spread, rows);
    /* decode one token at a time from an empty cache (m1 is overwritten from position 0) */
    int ok = 1;
    for (int t = 0; t < n && ok; t++)
        ok = pk_llama_forward(m1, toks + t, 1, t, dec + (size_t)t * V, 0, NULL) == 0;
    CHECK(ok, "%s: decode failed: %s", c->name, pk_last_error());
    double dd = rel_diff(all1, dec, (size_t)n * V);
    CHECK(dd <= tol, "%s: prefill vs token-by-token decode differ by %.3g", c->name, dd);
    if (verbose) printf("  %s: prefill/chunked %.2g, last %.2g, prefill/decode %.2g\n", c->name, d13, dlast, dd);

    /* bad calls: -1, a message, and logits untouched */
    for (int i = 0; i < V; i++) last[i] = 12345.0f;
    const int32_t bad_toks[] = {-1, (int32_t)V, INT32_MIN, INT32_MAX};
    for (int i = 0; i < 4; i++) {
        int32_t b2[2] = {0, bad_toks[i]};
        CHECK(pk_llama_forward(m1, b2, 2, 0, last, 0, NULL) == -1 && strstr(pk_last_error(), "outside the vocabulary"),
              "%s: token %d accepted (%s)", c->name, (int)bad_toks[i], pk_last_error());
    }
    CHECK(pk_llama_forward(m1, toks, 0, 0, last, 0, NULL) == -1, "%s: n = 0 accepted", c->name);
    CHECK(pk_llama_forward(m1, toks, 1, -1, last, 0, NULL) == -1, "%s: pos0 = -1 accepted", c->name);
    CHECK(pk_llama_forward(m1, toks, 1, n, last, 0, NULL) == -1, "%s: pos0 = n_ctx accepted", c->name);
    CHECK(pk_llama_forward(m1, toks, 2, n - 1, last, 0, NULL) == -1, "%s: pos0 + n > n_ctx accepted", c->name);
    CHECK(pk_llama_forward(m1, toks, 2, INT32_MAX - 1, last, 0, NULL) == -1, "%s: pos0 + n overflow accepted", c->name);
    CHECK(pk_llama_forward(m1, toks, INT32_MAX, 1, last, 0, NULL) == -1, "%s: n = INT32_MAX accepted", c->name);
    int untouched = 1;
    for (int i = 0; i < V; i++) untouched &= last[i] == 12345.0f;
    CHECK(untouched, "%s: a refused call wrote logits", c->name);
    /* the interrupt flag */
    volatile int flag = 1;
    CHECK(pk_llama_forward(m1, toks, n, 0, all1, 1, &flag) == 1, "%s: interrupt not honoured", c->name);
    flag = 0;
    CHECK(pk_llama_forward(m1, toks, 1, n - 1, last, 0, &flag) == 0, "%s: decode at the last position", c->name);
    for (int i = 0; i < V; i++) untouched &= isfinite(last[i]);
    CHECK(untouched, "%s: non-finite logits", c->name);
done:
    pk_llama_destroy(m1);
    pk_llama_destroy(m3);
    free(toks);
    free(all1);
    free(all3);
    free(dec);
    free(last);
    teardown(&f);
}

/* Several sequences in one pass equal each alone, bit for bit. */
static void test_batch(const config *c) {
    fixture f;
    if (setup(&f, c)) {
        CHECK(0, "%s: setup failed: %s", c->name, pk_last_error());
        teardown(&f);
        return;
    }
    enum { S = 3 };
    const int V = c->n_vocab, n = c->n_ctx;
    int32_t *toks = malloc(sizeof(int32_t) * S * n), *bt = malloc(sizeof(int32_t) * S * n);
    int32_t *bs = malloc(sizeof(int32_t) * S * n), *bp = malloc(sizeof(int32_t) * S * n);
    int32_t *rows = malloc(sizeof(int32_t) * S * n);
    float *solo = malloc(sizeof(float) * S * n * V), *out = malloc(sizeof(float) * S * n * V);
    for (int i = 0; i < S * n; i++) toks[i] = (int32_t)(rnd() % (uint64_t)V);
    pk_llama *m1 = make_model(&f, n), *mb = make_model_seq(&f, 4, S);
    CHECK(m1 && mb, "%s: batch create failed: %s", c->name, pk_last_error());
    if (!m1 || !mb) goto done;
    for (int s = 0; s < S; s++)
        CHECK(pk_llama_forward(m1, toks + s * n, n, 0, solo + (size_t)s * n * V, 1, NULL) == 0, "%s: solo", c->name);
    /* prefill: sequence s runs positions [0, cut[s]) (5 + 3 + 1 rows over chunks of 4) */
    const int cut[S] = {n / 2 + 1, n / 3 + 1, 1};
    int nr = 0;
    for (int s = 0; s < S; s++)
        for (int p = 0; p < cut[s]; p++, nr++) {
            bt[nr] = toks[s * n + p], bs[nr] = s, bp[nr] = p, rows[nr] = nr;
        }
    CHECK(pk_llama_forward_batch(mb, nr, bt, bs, bp, nr, rows, out, NULL) == 0, "%s: batch prefill: %s", c->name, pk_last_error());
    int same = 1;
    for (int r = 0; r < nr; r++)
        same &= !memcmp(out + (size_t)r * V, solo + ((size_t)bs[r] * n + bp[r]) * V, sizeof(float) * V);
    CHECK(same, "%s: batched prefill rows differ from solo rows", c->name);
    /* decode: one row per sequence at its own position, logits of rows 0 and 2 only */
    for (int k = 0; k < n - cut[0]; k++) {
        for (int s = 0; s < S; s++) bt[s] = toks[s * n + cut[s] + k], bs[s] = s, bp[s] = cut[s] + k;
        const int32_t want[2] = {0, 2};
        CHECK(pk_llama_forward_batch(mb, S, bt, bs, bp, 2, want, out, NULL) == 0, "%s: batch decode", c->name);
        same = 1;
        for (int i = 0; i < 2; i++)
            same &= !memcmp(out + (size_t)i * V, solo + ((size_t)want[i] * n + bp[want[i]]) * V, sizeof(float) * V);
        CHECK(same, "%s: batched decode step %d differs from solo", c->name, k);
    }
    /* slot 0 -> 2 for positions [0, n/2 + 1), then the next token on slot 2 */
    const int np = cut[0];
    CHECK(pk_llama_kv_copy(mb, 0, 2, np) == 0, "%s: kv copy: %s", c->name, pk_last_error());
    bt[0] = toks[np], bs[0] = 2, bp[0] = np, rows[0] = 0;
    CHECK(pk_llama_forward_batch(mb, 1, bt, bs, bp, 1, rows, out, NULL) == 0 &&
          !memcmp(out, solo + (size_t)np * V, sizeof(float) * V), "%s: copied prefix continues differently", c->name);
    CHECK(pk_llama_kv_copy(mb, 0, S, 1) == -1 && pk_llama_kv_copy(mb, 0, 1, n + 1) == -1, "%s: bad kv copy accepted", c->name);
    /* bad batches: -1, a message, nothing written */
    for (int i = 0; i < V; i++) out[i] = 12345.0f;
    const struct { int32_t s[2], p[2], r[2]; int n_out; const char *what; } bad[] = {
        {{0, S}, {0, 0}, {0, 1}, 2, "outside the 3 slots"},
        {{0, -1}, {0, 0}, {0, 1}, 2, "outside the 3 slots"},
        {{0, 0}, {0, 2}, {0, 1}, 2, "jumps from position"},
        {{0, 1}, {0, n}, {0, 1}, 2, "outside the context"},
        {{1, 1}, {-1, 0}, {0, 1}, 2, "outside the context"},
        {{0, 1}, {0, 0}, {1, 0}, 2, "logit rows"},
        {{0, 1}, {0, 0}, {0, 2}, 2, "logit rows"},
        {{0, 1}, {0, 0}, {0, 1}, 3, "logit rows"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const int32_t t2[2] = {1, 2};
        CHECK(pk_llama_forward_batch(mb, 2, t2, bad[i].s, bad[i].p, bad[i].n_out, bad[i].r, out, NULL) == -1 &&
              strstr(pk_last_error(), bad[i].what), "%s: bad batch %zu accepted (%s)", c->name, i, pk_last_error());
    }
    const int32_t t3[3] = {1, 2, 3}, s3[3] = {0, 1, 0}, p3[3] = {0, 0, 1}, r3[1] = {2};
    CHECK(pk_llama_forward_batch(mb, 3, t3, s3, p3, 1, r3, out, NULL) == -1 && strstr(pk_last_error(), "not consecutive"),
          "%s: split sequence accepted", c->name);
    same = 1;
    for (int i = 0; i < V; i++) same &= out[i] == 12345.0f;
    CHECK(same, "%s: a refused batch wrote logits", c->name);
done:
    pk_llama_destroy(m1);
    pk_llama_destroy(mb);
    free(toks), free(bt), free(bs), free(bp), free(rows), free(solo), free(out);
    teardown(&f);
}

static void test_bad_hparams(void) {
    config c = {"hp", 33, 64, 1, 4, 2, 16, 96, 8, PK_FMT_F32, 0, 0, 0, 0, 1, 1, 32};
    fixture f;
    if (setup(&f, &c)) {
        CHECK(0, "bad_hparams setup");
        teardown(&f);
        return;
    }
    const pk_llama_hparams good = {33, 64, 1, 4, 2, 16, 96, 1e-5f, 1e4f, 8, 4, 0, 1};
    pk_llama_hparams hp;
#define BAD(field, value)                                                                   \
    do {                                                                                    \
        hp = good;                                                                          \
        hp.field = value;                                                                   \
        pk_llama *m = pk_llama_create(&hp, &f.w, f.ctx);                                    \
        CHECK(m == NULL, "create accepted " #field " = " #value);                         \
        pk_llama_destroy(m);                                                                \
    } while (0)
    BAD(n_embd, 0);
    BAD(n_layer, -1);
    BAD(n_head, 0);
    BAD(n_head_kv, 3);     /* n_head % n_head_kv */
    BAD(head_dim, 15);     /* odd */
    BAD(n_ctx, 0);
    BAD(n_batch, 0);
    BAD(n_ff, -5);
    BAD(kv_type, 3);       /* no such cache type */
    BAD(kv_type, 2);       /* q8 with head_dim 16: not a multiple of its group of 32 */
    BAD(n_vocab, 0);
    BAD(n_seq, -1);
#undef BAD
    hp = good;
    pk_llama *m = pk_llama_create(&hp, &f.w, f.ctx);
    CHECK(m != NULL, "good hparams refused: %s", pk_last_error());
    pk_llama_destroy(m);
    pk_llama_destroy(NULL);
    teardown(&f);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);   /* keep the log if a sanitizer aborts */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--verbose")) verbose = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) rnd_seed(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--seed N] [--verbose]\n", argv[0]);
            return 2;
        }
    }
    if (pk_dispatch_init()) {
        printf("FAIL dispatch init: %s\n", pk_last_error());
        return 1;
    }
    /* name, V, h, layers, heads, kv heads, hd, ff, n_ctx, emb, tied, q8 layers, rope_freqs,
     * kv_type (0 f32, 1 f16, 2 q8), planes, threads, bl */
    const config configs[] = {
        {"f32-emb q4 1thr", 37, 64, 2, 4, 2, 16, 96, 9, PK_FMT_F32, 0, 0, 1, 0, 1, 1, 32},
        {"f16-emb q4 kvf16 2thr", 37, 64, 2, 4, 2, 16, 96, 9, PK_FMT_F16, 0, 0, 0, 1, 2, 2, 32},
        {"bf16-emb q8 2planes", 41, 96, 1, 6, 3, 16, 160, 7, PK_FMT_BF16, 0, 1, 1, 0, 2, 2, 32},
        {"tied q8-emb q4 bl64", 53, 128, 2, 4, 1, 32, 192, 10, PK_FMT_QSI8CX, 1, 0, 1, 0, 2, 2, 64},
        {"tied q4-emb q4", 29, 64, 1, 2, 2, 32, 64, 6, PK_FMT_QSI4C32, 1, 0, 0, 1, 1, 2, 32},
        {"hd128 gqa4 q8", 19, 128, 1, 4, 1, 128, 96, 5, PK_FMT_QSI8CX, 1, 1, 1, 0, 2, 1, 32},
        /* q8 caches past one block of 16 positions: the blocked K scales of a later block */
        {"kvq8 hd32 2thr", 29, 64, 2, 2, 2, 32, 64, 37, PK_FMT_QSI4C32, 1, 0, 0, 2, 1, 2, 32},
        {"kvq8 hd64 gqa3", 31, 192, 1, 6, 2, 64, 128, 35, PK_FMT_F32, 0, 0, 1, 2, 1, 2, 32},
        {"kvq8 hd128 gqa4", 19, 128, 1, 4, 1, 128, 96, 21, PK_FMT_QSI8CX, 1, 1, 1, 2, 2, 1, 32},
        /* past PK_ATTEND_CHUNK (512): chunked attention; with one K/V head and 2 threads the
         * batched decode rows (3 pairs) are split by chunks over the threads, and must equal
         * the solo prefill's rows bit for bit */
        {"chunks kvq8 hd32 2thr", 23, 64, 1, 4, 1, 32, 64, 600, PK_FMT_QSI4C32, 1, 0, 0, 2, 1, 2, 32},
        {"chunks f16 hd64 2thr", 23, 256, 1, 4, 1, 64, 64, 560, PK_FMT_F32, 0, 0, 0, 1, 1, 2, 32},
        {"chunks f32 hd64 gqa2", 23, 128, 1, 4, 2, 64, 64, 530, PK_FMT_F32, 0, 0, 0, 0, 1, 2, 32},
    };
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        const int before = n_fail;
        test_config(&configs[i]);
        test_batch(&configs[i]);
        printf("config %s: %s\n", configs[i].name, n_fail == before ? "ok" : "FAILED");
    }
    test_bad_hparams();
    return pk_test_summary();
}
