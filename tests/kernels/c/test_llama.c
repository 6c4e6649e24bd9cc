/* Standalone test of the forward pass (pyklei_ext/model/pk_llama.c) on random tiny weights
 * (tests/kernels/c/llama_fixture.h), meant to run under AddressSanitizer +
 * UndefinedBehaviorSanitizer (scripts/test_sanitizers.sh), natively, and on aarch64 under
 * qemu-user (scripts/test_arm.sh, --quick).
 *
 * Build (bash):  source scripts/cflags.sh   # the flags of pyklei_ext/cflags.txt
 *   gcc -O1 -g -fsanitize=address,undefined "${PK_CFLAGS[@]}" -Ipyklei_ext tests/kernels/c/test_llama.c \
 *       pyklei_ext/model/pk_*.c pyklei_ext/contract/pk_*.c pyklei_ext/ops/pk_*.c \
 *       pyklei_ext/isa/matmul_*.c pyklei_ext/isa/fwht_*.c -lm
 * Arguments: --seed N, --quick (leaves out the Llama configurations past one attention chunk:
 * the emulator's set), --verbose. Last line: "<P> passed, <F> failed"; exit 1 on failure.
 *
 * For several configurations (embedding table f32 / f16 / bf16 / qsi4c32 / qsi8cx, tied
 * lm_head sharing the embedding bytes or not, qsi4c32 and qsi8cx layers, llama3 rope_freqs or
 * none, f32, f16, q8 or bf16 KV cache, 1 or 2 activation planes, 1 or 2 threads, shapes whose N and K
 * are not multiples of the kernels' tiles; and the families' features of pk_llama.h: Qwen2's
 * q/k/v biases, Qwen3's q/k norms, SmolLM3's layers without RoPE, Phi-3's partial RoPE, and
 * Gemma 3's all at once, sliding windows below the sequence, once past a ring's wrap), checks:
 *  - prefill of the whole sequence with all_logits, in one chunk (n_batch >= n) and in chunks
 *    of 3, equals decoding the same tokens one by one from an empty cache (within a float
 *    tolerance: GEMM and GEMV kernels may round differently), and the last-row-only logits
 *    equal the last row of all_logits; each sliding layer's ring has the length pk_llama.h says;
 *  - filling the context exactly (positions 0..n_ctx-1) works, and logits are finite;
 *  - bad calls return -1 with a message and write nothing: n = 0, pos0 < 0, pos0 + n > n_ctx,
 *    token ids -1 / n_vocab / INT32_MIN / INT32_MAX, int overflow in pos0 + n;
 *  - an interrupt flag that is set makes the pass return 1;
 *  - pk_llama_forward_batch: rows of 3 sequences at different positions (prefill chunks of
 *    different lengths in one call, split over n_batch, then one decode row each) give the
 *    same logits, bit for bit, as each sequence alone; pk_llama_kv_copy continues a copied
 *    prefix like the source (also one longer than a ring); bad slots, positions, row orders
 *    and logit rows return -1 and write nothing;
 *  - what the features mean, against the same weights with one changed (test_family): a
 *    sliding window (full attention's bits before it, different after), position invariance
 *    of a sliding layer over a ring's wrap, the soft cap, per-layer RoPE bases, NoPE, the
 *    embedding and attention scales, and that no feature is ignored;
 *  - invalid hyperparameters (also rope_dim, act, the scales, a layer's window, RoPE base and
 *    linear RoPE factor)
 *    make pk_llama_create return NULL (no leak);
 *  - everything is freed (LeakSanitizer checks at exit). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama_fixture.h"

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
    /* the sliding layers' rings (pk_llama_ring): window + n_batch - 1 rounded up to whole
     * attention chunks, where that is shorter than the context; m1's rows of a chunk reach
     * past any ring */
    for (int l = 0; l < c->n_layer; l++) {
        const int win = f.layers[l].window, pad = (n + PK_KV_BLOCK - 1) / PK_KV_BLOCK * PK_KV_BLOCK;
        int want = win ? (win + 3 - 1 + PK_ATTEND_CHUNK - 1) / PK_ATTEND_CHUNK * PK_ATTEND_CHUNK : 0;
        want = want < pad ? want : 0;
        CHECK(pk_llama_ring(m3, l) == want && pk_llama_ring(m1, l) == 0, "%s: layer %d: ring %d / %d, want %d / 0",
              c->name, l, pk_llama_ring(m3, l), pk_llama_ring(m1, l), want);
        if (c->fam.ring_wraps && win)
            CHECK(want > 0 && want < n, "%s: layer %d: the ring of %d positions does not wrap in %d", c->name, l, want, n);
    }
    /* decode one token at a time from an empty cache: on m3 (m3's chunks of 3 rows keep a
     * sliding layer in a ring, which wraps where the context is longer than it; m1's one
     * chunk keeps every position) */
    int ok = 1;
    for (int t = 0; t < n && ok; t++)
        ok = pk_llama_forward(m3, toks + t, 1, t, dec + (size_t)t * V, 0, NULL) == 0;
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
    /* slot 0 -> the last for positions [0, n - 2): a sliding layer's ring that has wrapped is
     * copied whole, and no more (the last slot's last layer ends the cache); slot 0 went on
     * to n - 1, but kept the window before n - 2 */
    CHECK(pk_llama_kv_copy(mb, 0, S - 1, n - 2) == 0, "%s: kv copy of %d: %s", c->name, n - 2, pk_last_error());
    bt[0] = toks[n - 2], bs[0] = S - 1, bp[0] = n - 2, rows[0] = 0;
    CHECK(pk_llama_forward_batch(mb, 1, bt, bs, bp, 1, rows, out, NULL) == 0 &&
          !memcmp(out, solo + (size_t)(n - 2) * V, sizeof(float) * V), "%s: a copy of %d positions continues differently",
          c->name, n - 2);
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

/* ---- the family features against what they mean ------------------------------------------ */

/* all_logits of toks[0..n) from position 0 by a new model of hp over f's weights and layers as
 * f->layers has them now; 0, or -1 (pk_last_error()) */
static int logits_of(fixture *f, const pk_llama_hparams *hp, const int32_t *toks, int n, float *out) {
    pk_llama *m = pk_llama_create(hp, &f->w, f->ctx);
    const int rc = m ? pk_llama_forward(m, toks, n, 0, out, 1, NULL) : -1;
    pk_llama_destroy(m);
    return rc;
}

static int rows_equal(const float *a, const float *b, int V, int row) {
    return !memcmp(a + (size_t)row * V, b + (size_t)row * V, sizeof(float) * V);
}

/* The first layer alone, sliding W: attention scores depend on relative positions only (RoPE
 * rotates q and k by their own positions), and a row sees its last W positions, so row p's
 * logits equal the last row of the tokens p - W + 1 .. p run from position 0, wherever they
 * stand. The model runs chunks of 4 rows, so the layer keeps a ring, and a sequence longer
 * than it wraps. Up to rounding, which random weights amplify: RoPE's angles at other
 * positions round differently, and where that moves an activation across an int8 rounding
 * step the row differs by up to ~3% (measured over 20 seeds: at most 6% of the rows beyond
 * 1e-3 with one layer, up to 32% with three, hence one). A wrong window or wrap spoils every
 * row after it: so at least 3/4 of the rows within 1e-3, none beyond 0.1. Over an f32 cache:
 * an f16 or q8 cache rounds K as rotated at its absolute position, which adds 1-30%. */
static void check_translation(fixture *f, const pk_llama_hparams *hp_cfg, const int32_t *toks, float *all, float *one) {
    const config *c = &f->c;
    pk_llama_hparams hp = *hp_cfg;
    hp.kv_type = PK_KV_F32;
    hp.n_layer = 1;
    const int V = c->n_vocab, n = c->n_ctx, W = c->fam.window ? c->fam.window : 3, span = W;
    if (span >= n) return;
    f->layers[0].window = W;
    pk_llama *m = pk_llama_create(&hp, &f->w, f->ctx);
    CHECK(m && pk_llama_forward(m, toks, n, 0, all, 1, NULL) == 0, "%s: layer 0 sliding: %s", c->name, pk_last_error());
    if (m && c->fam.ring_wraps)
        CHECK(pk_llama_ring(m, 0) > 0 && pk_llama_ring(m, 0) < n, "%s: layer 0 sliding: ring %d does not wrap in %d",
              c->name, pk_llama_ring(m, 0), n);
    /* every row of a short sequence; of a long one, its first rows and those about the end of
     * the first attention chunk (a ring's wrap) and on */
    const int far = n > 128 && n - 100 > span + 20 ? n - 100 : n;
    int checked = 0, agree = 0;
    double worst = 0;
    for (int p = span - 1; m && p < n; p = p == span + 19 && far < n ? far : p + 1) {
        CHECK(pk_llama_forward(m, toks + p + 1 - span, span, 0, one, 0, NULL) == 0, "%s: span run", c->name);
        const double d = rel_diff(all + (size_t)p * V, one, V);
        worst = fmax(worst, d);
        checked++;
        agree += d <= 1e-3;
    }
    CHECK(4 * agree >= 3 * checked && worst <= 0.1, "%s: layer 0 sliding %d: %d of %d rows equal their last %d "
          "tokens run alone (worst %.3g)", c->name, W, agree, checked, span, worst);
    if (verbose) printf("  %s: translation (window %d, %d tokens): %d of %d rows within 1e-3, worst %.2g\n", c->name,
                        W, span, agree, checked, worst);
    pk_llama_destroy(m);
}

/* Each feature the configuration has changes the logits: the model without it (one at a
 * time) differs. The invariants above hold whatever a feature computes, and these catch one
 * that is ignored; what each computes, tests/converters/test_hf_families.py checks against
 * transformers. */
static void check_knockouts(fixture *f, const pk_llama_hparams *hp, const int32_t *toks, int n, float *ref, float *out) {
    const config *c = &f->c;
    const int V = c->n_vocab, nl = c->n_layer;
    enum { BQ, BK, BV, Q_NORM, K_NORM, POST_ATTN, POST_FFN, ACT, ATTN_SCALE, EMBD_SCALE, SOFTCAP, ROPE_DIM, N_KO };
    static const char *const names[N_KO] = {"bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm",
                                            "act", "attn_scale", "embd_scale", "logit_softcap", "rope_dim"};
    pk_llama_layer *saved = malloc(sizeof(pk_llama_layer) * nl);
    memcpy(saved, f->layers, sizeof(pk_llama_layer) * nl);
    const float *rope_freqs = f->w.rope_freqs;
    const pk_llama_layer *L0 = &saved[0];
    const int has[N_KO] = {!!L0->bq, !!L0->bk, !!L0->bv, !!L0->q_norm, !!L0->k_norm, !!L0->post_attn_norm,
                           !!L0->post_ffn_norm, hp->act != PK_ACT_SILU, hp->attn_scale > 0.0f,
                           hp->embd_scale > 0.0f, hp->logit_softcap > 0.0f, hp->rope_dim > 0};
    CHECK(logits_of(f, hp, toks, n, ref) == 0, "%s: knockouts: %s", c->name, pk_last_error());
    for (int k = 0; k < N_KO; k++) {
        if (!has[k]) continue;
        pk_llama_hparams off = *hp;
        for (int l = 0; l < nl; l++) {
            pk_llama_layer *L = &f->layers[l];
            if (k == BQ) L->bq = NULL;
            if (k == BK) L->bk = NULL;
            if (k == BV) L->bv = NULL;
            if (k == Q_NORM) L->q_norm = NULL;
            if (k == K_NORM) L->k_norm = NULL;
            if (k == POST_ATTN) L->post_attn_norm = NULL;
            if (k == POST_FFN) L->post_ffn_norm = NULL;
        }
        if (k == ACT) off.act = PK_ACT_SILU;
        if (k == ATTN_SCALE) off.attn_scale = 0.0f;
        if (k == EMBD_SCALE) off.embd_scale = 0.0f;
        if (k == SOFTCAP) off.logit_softcap = 0.0f;
        if (k == ROPE_DIM) {   /* all of a head, without the frequency divisors sized for rope_dim */
            off.rope_dim = 0;
            f->w.rope_freqs = NULL;
        }
        int rc = logits_of(f, &off, toks, n, out);
        memcpy(f->layers, saved, sizeof(pk_llama_layer) * nl);
        if (k == ROPE_DIM) rc |= logits_of(f, hp, toks, n, ref);   /* the last: ref without divisors too */
        f->w.rope_freqs = rope_freqs;
        CHECK(!rc && memcmp(ref, out, sizeof(float) * n * V), "%s: without %s the logits are the same", c->name, names[k]);
    }
    free(saved);
}

/* What each feature of the configuration means, against the same weights with it changed. */
static void test_family(const config *c) {
    fixture f;
    if (setup(&f, c)) {
        CHECK(0, "%s: setup failed: %s", c->name, pk_last_error());
        teardown(&f);
        return;
    }
    const family *fm = &c->fam;
    const int V = c->n_vocab, n = c->n_ctx, nl = c->n_layer, ns = n < 64 ? n : 64;
    pk_llama_layer *saved = malloc(sizeof(pk_llama_layer) * nl);
    memcpy(saved, f.layers, sizeof(pk_llama_layer) * nl);
    int32_t *toks = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) toks[i] = (int32_t)(rnd() % (uint64_t)V);
    float *a = malloc(sizeof(float) * (size_t)n * V), *b = malloc(sizeof(float) * (size_t)n * V);
    float *one = malloc(sizeof(float) * V);
    const pk_llama_hparams hp = fixture_hparams(&f, 4, 0);
    int rc, same, differ;
#define RESTORE() memcpy(f.layers, saved, sizeof(pk_llama_layer) * nl)

    /* sliding layers: the rows before the window have the bits of full attention (the same
     * model with every window 0), and every row from the window on differs */
    if (fm->window_layers) {
        rc = logits_of(&f, &hp, toks, n, a);
        for (int l = 0; l < nl; l++) f.layers[l].window = 0;
        rc |= logits_of(&f, &hp, toks, n, b);
        RESTORE();
        same = differ = !rc;
        for (int p = 0; p < n; p++) {
            if (p < fm->window) same &= rows_equal(a, b, V, p);
            else differ &= !rows_equal(a, b, V, p);
        }
        CHECK(same, "%s: a row before the window differs from full attention", c->name);
        CHECK(differ, "%s: a row beyond the window of %d attends like full attention", c->name, fm->window);
    }
    check_translation(&f, &hp, toks, a, one);
    RESTORE();
    /* soft-capped logits: c tanh(logits / c) of the uncapped model's, all within the cap */
    if (fm->logit_softcap > 0.0f) {
        pk_llama_hparams raw = hp;
        raw.logit_softcap = 0.0f;
        const float cap = fm->logit_softcap;
        rc = logits_of(&f, &hp, toks, ns, a) | logits_of(&f, &raw, toks, ns, b);
        same = !rc;
        int bounded = !rc;
        float biggest = 0.0f;
        for (size_t i = 0; i < (size_t)ns * V; i++) {
            bounded &= fabsf(a[i]) <= cap;
            same &= a[i] == cap * tanhf(b[i] / cap);
            biggest = fmaxf(biggest, fabsf(b[i]));
        }
        CHECK(bounded, "%s: a logit beyond the soft cap %g", c->name, (double)cap);
        CHECK(same, "%s: capped logits are not c tanh(logits / c) of the uncapped", c->name);
        CHECK(biggest > cap, "%s: the cap %g never bites (largest logit %g)", c->name, (double)cap, (double)biggest);
    }
    /* per-layer RoPE bases: the model's base A with the sliding layers' own base B is the
     * model's base B with the other layers' own A; and differs from every layer on A */
    if (fm->local_theta > 0.0f && fm->window_layers) {
        rc = logits_of(&f, &hp, toks, ns, a);
        pk_llama_hparams swapped = hp;
        swapped.rope_theta = fm->local_theta;
        for (int l = 0; l < nl; l++) f.layers[l].rope_theta = saved[l].rope_theta > 0.0f ? 0.0f : hp.rope_theta;
        rc |= logits_of(&f, &swapped, toks, ns, b);
        CHECK(!rc && !memcmp(a, b, sizeof(float) * ns * V), "%s: the per-layer RoPE bases depend on which is the model's", c->name);
        for (int l = 0; l < nl; l++) f.layers[l].rope_theta = 0.0f;
        CHECK(logits_of(&f, &hp, toks, ns, b) == 0 && memcmp(a, b, sizeof(float) * ns * V),
              "%s: the sliding layers' own RoPE base changes nothing", c->name);
        RESTORE();
        /* linear RoPE scaling on the global layers only (Gemma 3 4B+): a factor of 1 is none,
         * bit for bit; 8 changes the logits */
        for (int l = 0; l < nl; l++) f.layers[l].rope_factor = saved[l].rope_theta > 0.0f ? 0.0f : 1.0f;
        CHECK(logits_of(&f, &hp, toks, ns, b) == 0 && !memcmp(a, b, sizeof(float) * ns * V),
              "%s: a linear RoPE factor of 1 changes the logits", c->name);
        for (int l = 0; l < nl; l++) f.layers[l].rope_factor = saved[l].rope_theta > 0.0f ? 0.0f : 8.0f;
        CHECK(logits_of(&f, &hp, toks, ns, b) == 0 && memcmp(a, b, sizeof(float) * ns * V),
              "%s: the global layers' linear RoPE factor changes nothing", c->name);
        RESTORE();
    }
    /* NoPE: a model without RoPE on any layer does not depend on the RoPE base nor rope_dim;
     * the configuration's layers without RoPE differ from the same layers with it */
    if (fm->nope_layers) {
        rc = logits_of(&f, &hp, toks, ns, a);
        for (int l = 0; l < nl; l++) f.layers[l].no_rope = 0;
        rc |= logits_of(&f, &hp, toks, ns, b);
        CHECK(!rc && memcmp(a, b, sizeof(float) * ns * V), "%s: the layers without RoPE rotate", c->name);
        pk_llama_hparams other = hp;
        other.rope_theta = 77.0f;
        other.rope_dim = 2;
        for (int l = 0; l < nl; l++) f.layers[l].no_rope = 1;
        rc = logits_of(&f, &hp, toks, ns, a) | logits_of(&f, &other, toks, ns, b);
        CHECK(!rc && !memcmp(a, b, sizeof(float) * ns * V), "%s: NoPE everywhere depends on the RoPE base", c->name);
        RESTORE();
    }
    /* the embedding scale: s times an f32 table's rows, as a table scaled beforehand */
    if (fm->embd_scale > 0.0f && c->emb == PK_FMT_F32 && !c->tied) {
        pk_llama_hparams unscaled = hp;
        unscaled.embd_scale = 0.0f;
        float *table = f.emb_data, *scaled = malloc(sizeof(float) * (size_t)V * c->n_embd);
        for (size_t i = 0; i < (size_t)V * c->n_embd; i++) scaled[i] = table[i] * fm->embd_scale;
        rc = logits_of(&f, &hp, toks, ns, a);
        f.w.tok_embd.data = scaled;
        rc |= logits_of(&f, &unscaled, toks, ns, b);
        f.w.tok_embd.data = table;
        CHECK(!rc && !memcmp(a, b, sizeof(float) * ns * V), "%s: embd_scale is not the table times it", c->name);
        free(scaled);
    }
    /* the attention scale against q's norm: doubling every q_norm gain doubles q exactly, as
     * doubling attn_scale doubles the scores (powers of two round alike) */
    if (fm->qk_norm && fm->attn_scale > 0.0f) {
        pk_llama_hparams twice = hp;
        twice.attn_scale = 2.0f * fm->attn_scale;
        rc = logits_of(&f, &twice, toks, ns, a);
        float *gains = malloc(sizeof(float) * nl * c->head_dim);
        for (int l = 0; l < nl; l++) {
            for (int i = 0; i < c->head_dim; i++) gains[l * c->head_dim + i] = 2.0f * saved[l].q_norm[i];
            f.layers[l].q_norm = gains + l * c->head_dim;
        }
        rc |= logits_of(&f, &hp, toks, ns, b);
        RESTORE();
        free(gains);
        CHECK(!rc && !memcmp(a, b, sizeof(float) * ns * V), "%s: attn_scale 2s differs from q_norm 2g", c->name);
    }
    check_knockouts(&f, &hp, toks, ns, a, b);
    RESTORE();
#undef RESTORE
    free(saved), free(toks), free(a), free(b), free(one);
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
    BAD(kv_type, 4);       /* no such cache type */
    BAD(kv_type, 2);       /* q8 with head_dim 16: not a multiple of its group of 32 */
    BAD(n_vocab, 0);
    BAD(n_seq, -1);
    BAD(act, 2);           /* no such gate */
    BAD(act, -1);
    BAD(rope_dim, 7);      /* odd: RoPE rotates pairs */
    BAD(rope_dim, 18);     /* beyond head_dim 16 */
    BAD(rope_dim, -2);
    BAD(embd_scale, -1.0f);
    BAD(embd_scale, NAN);
    BAD(attn_scale, -0.5f);
    BAD(attn_scale, NAN);
    BAD(logit_softcap, -30.0f);
    BAD(logit_softcap, NAN);
#undef BAD
    /* a layer's window and RoPE base (pk_llama_layer) */
#define BAD_LAYER(field, value)                                                             \
    do {                                                                                    \
        const pk_llama_layer keep = f.layers[0];                                            \
        f.layers[0].field = value;                                                          \
        pk_llama *m = pk_llama_create(&good, &f.w, f.ctx);                                  \
        CHECK(m == NULL, "create accepted layer " #field " = " #value);                   \
        pk_llama_destroy(m);                                                                \
        f.layers[0] = keep;                                                                 \
    } while (0)
    BAD_LAYER(window, -1);
    BAD_LAYER(window, INT32_MIN);
    BAD_LAYER(rope_theta, -10000.0f);
    BAD_LAYER(rope_theta, NAN);
    BAD_LAYER(rope_factor, -8.0f);
    BAD_LAYER(rope_factor, NAN);
    BAD_LAYER(rope_factor, INFINITY);
#undef BAD_LAYER
    /* the edges that are valid: RoPE on 2 dimensions or on all, a window of 1 */
    hp = good;
    hp.rope_dim = 2;
    pk_llama *m2 = pk_llama_create(&hp, &f.w, f.ctx);
    hp.rope_dim = 16;
    f.layers[0].window = 1;
    pk_llama *m16 = pk_llama_create(&hp, &f.w, f.ctx);
    f.layers[0].window = 0;
    CHECK(m2 && m16, "valid rope_dim 2 / 16 or window 1 refused: %s", pk_last_error());
    pk_llama_destroy(m2);
    pk_llama_destroy(m16);
    hp = good;
    pk_llama *m = pk_llama_create(&hp, &f.w, f.ctx);
    CHECK(m != NULL, "good hparams refused: %s", pk_last_error());
    pk_llama_destroy(m);
    pk_llama_destroy(NULL);
    teardown(&f);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);   /* keep the log if a sanitizer aborts */
    int quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--verbose")) verbose++;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) rnd_seed(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--seed N] [--quick] [--verbose]\n", argv[0]);
            return 2;
        }
    }
    if (pk_dispatch_init()) {
        printf("FAIL dispatch init: %s\n", pk_last_error());
        return 1;
    }
    /* name, V, h, layers, heads, kv heads, hd, ff, n_ctx, emb, tied, q8 layers, rope_freqs,
     * kv_type (0 f32, 1 f16, 2 q8, 3 bf16), planes, threads, bl[, family features] */
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
        /* bf16 caches: K's pairs of dimensions across blocks, V's pairs of positions, an odd n */
        {"kvbf16 hd32 2thr", 29, 64, 2, 4, 2, 32, 64, 37, PK_FMT_QSI4C32, 1, 0, 0, 3, 1, 2, 32},
        /* the families' features (pk_llama.h), each family's at odd tiny sizes */
        {"qwen2 qkv-bias", 37, 64, 2, 4, 2, 16, 96, 11, PK_FMT_F32, 0, 0, 0, 0, 1, 2, 32,
         .fam = {.bias = 1, .rope_theta = 1e6f}},
        {"qwen3 qk-norm kvq8", 41, 96, 2, 6, 2, 32, 160, 13, PK_FMT_BF16, 0, 1, 0, 2, 2, 2, 32,
         .fam = {.qk_norm = 1, .rope_theta = 1e6f}},
        {"smollm3 nope kvf16", 29, 64, 4, 4, 2, 16, 96, 10, PK_FMT_QSI4C32, 1, 0, 0, 1, 1, 1, 32,
         .fam = {.nope_layers = 0x8, .rope_theta = 2e6f}},
        {"phi3 partial-rope", 31, 96, 2, 3, 3, 32, 128, 12, PK_FMT_F16, 0, 0, 1, 0, 1, 2, 32,
         .fam = {.rope_dim = 24}},
        /* Gemma 3: everything at once; layers 0 and 2 slide (windows below the sequence) */
        {"gemma3 f32-emb kvf16", 37, 96, 3, 6, 2, 16, 160, 19, PK_FMT_F32, 0, 1, 0, 1, 2, 1, 32,
         .fam = {.qk_norm = 1, .post_norms = 1, .window = 4, .window_layers = 0x5, .local_theta = 1e4f,
                 .rope_theta = 1e6f, .act = PK_ACT_GELU_TANH, .embd_scale = 9.797959f, .attn_scale = 0.125f,
                 .logit_softcap = 6.0f}},
        /* past PK_ATTEND_CHUNK (512): chunked attention; with one K/V head and 2 threads the
         * batched decode rows (3 pairs) are split by chunks over the threads, and must equal
         * the solo prefill's rows bit for bit */
        {"chunks kvq8 hd32 2thr", 23, 64, 1, 4, 1, 32, 64, 600, PK_FMT_QSI4C32, 1, 0, 0, 2, 1, 2, 32},
        {"chunks f16 hd64 2thr", 23, 256, 1, 4, 1, 64, 64, 560, PK_FMT_F32, 0, 0, 0, 1, 1, 2, 32},
        {"chunks bf16 hd64 2thr", 23, 256, 1, 4, 1, 64, 64, 560, PK_FMT_F32, 0, 0, 0, 3, 1, 2, 32},
        {"chunks f32 hd64 gqa2", 23, 128, 1, 4, 2, 64, 64, 530, PK_FMT_F32, 0, 0, 0, 0, 1, 2, 32},
        /* Gemma 3 past a ring: in chunks of a few rows, the sliding layers (0 and 2) keep a ring of
         * 512 positions that 560 wrap, over a q8 cache; layer 1 sees all, split by chunks */
        {"gemma3 ring kvq8 2thr", 23, 64, 3, 2, 1, 64, 96, 560, PK_FMT_QSI8CX, 1, 0, 0, 2, 1, 2, 32,
         .fam = {.qk_norm = 1, .post_norms = 1, .window = 5, .window_layers = 0x5, .local_theta = 1e4f,
                 .rope_theta = 1e6f, .act = PK_ACT_GELU_TANH, .embd_scale = 8.0f, .attn_scale = 0.0625f,
                 .logit_softcap = 4.0f, .ring_wraps = 1}},
        /* Gemma 3 270M's attention shape (4 heads on one K/V head of 256) with an odd window of
         * 37 over an f16 ring: the rows of a chunk attend together (pk_attend_rows_window), each
         * from its own place in a K block, across the wrap */
        {"gemma3 hd256 win37 ring kvf16", 23, 64, 3, 4, 1, 256, 96, 560, PK_FMT_QSI8CX, 1, 0, 0, 1, 1, 2, 32,
         .fam = {.qk_norm = 1, .post_norms = 1, .window = 37, .window_layers = 0x5, .local_theta = 1e4f,
                 .rope_theta = 1e6f, .act = PK_ACT_GELU_TANH, .embd_scale = 8.0f, .attn_scale = 0.05f,
                 .ring_wraps = 1}},
        /* the same over a bf16 ring: V's pairs of positions across the wrap */
        {"gemma3 hd256 win37 ring kvbf16", 23, 64, 3, 4, 1, 256, 96, 560, PK_FMT_QSI8CX, 1, 0, 0, 3, 1, 2, 32,
         .fam = {.qk_norm = 1, .post_norms = 1, .window = 37, .window_layers = 0x5, .local_theta = 1e4f,
                 .rope_theta = 1e6f, .act = PK_ACT_GELU_TANH, .embd_scale = 8.0f, .attn_scale = 0.05f,
                 .ring_wraps = 1}},
    };
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        const config *c = &configs[i];
        if (quick && c->n_ctx > PK_ATTEND_CHUNK && !c->fam.window_layers) continue;
        const int before = n_fail;
        const double t0 = now_s();
        test_config(c);
        test_batch(c);
        test_family(c);
        printf("config %s: %s (%.1f s)\n", c->name, n_fail == before ? "ok" : "FAILED", now_s() - t0);
    }
    test_bad_hparams();
    return pk_test_summary();
}
