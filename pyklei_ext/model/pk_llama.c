#include "pk_llama_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define err(...) pk_set_error(__VA_ARGS__)


/* the operations timed, in the order of pk_llama_stats.c's op_names */
enum { OP_EMBED, OP_ATTN_NORM, OP_QKV, OP_ROPE, OP_ATTENTION, OP_O, OP_FFN_NORM, OP_GATE_UP,
       OP_SWIGLU, OP_DOWN, OP_RESIDUAL, OP_OUT_NORM, OP_LM_HEAD };

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int pk_llama_ring(const pk_llama *m, int layer) {
    return layer >= 0 && layer < m->hp.n_layer ? m->ring[layer] : 0;
}

/* (slot, layer, K/V head)'s cache as attention reads it */
static pk_kv_head kv_view(const pk_llama *m, int seq, int layer, int h) {
    const pk_kv_head all = {.type = (pk_kv_type)m->hp.kv_type, .k = m->k_cache, .v = m->v_cache,
                            .k_scale = m->k_scale, .v_scale = m->v_scale, .f16 = m->kv_read,
                            .dot_bf16 = m->kv_bf16};
    return pk_kv_head_at(&all, pk_llama_kv_head(m, seq, layer, h));
}

/* Per-operation wall time: PROF(op) closes the interval that the previous PROF opened. */
#define PROF(op) do { if (m->profile) { const double t_ = now_s(); m->prof_s[op] += t_ - t_prof; t_prof = t_; } } while (0)

/* ---- parallel row ops ----------------------------------------------------------------- */

/* Row jobs take contiguous shares of whole blocks of the KV cache's positions (pk_pool_share). */
#define ROW_SHARE PK_KV_BLOCK

typedef struct {
    pk_llama *m;
    int n, layer;
    const int32_t *seq, *pos;  /* [n] each row's slot and position */
    const float *norm_w;       /* rmsnorm */
    int next;                  /* attention: the next work item to claim (atomic; 0 before each run) */
} row_job;

static void job_rmsnorm(void *arg, int ith, int nth) {
    row_job *j = arg;
    const int d = j->m->hp.n_embd;
    int lo, hi;
    pk_pool_share(j->n, ROW_SHARE, ith, nth, &lo, &hi);
    for (int t = lo; t < hi; t++)
        pk_rmsnorm(d, j->m->x + (size_t)t * d, j->norm_w, j->m->hp.rms_eps, j->m->xn + (size_t)t * d);
}

/* A row's q, k, v as the layer's features have them before RoPE: biases added, each q and k
 * head RMS-normalised (in place: pk_rmsnorm reads its input before it writes). */
static void head_features(const pk_llama *m, const pk_llama_layer *L, float *q, float *k, float *v) {
    const pk_llama_hparams *hp = &m->hp;
    const int hd = hp->head_dim, nq = hp->n_head * hd, nkv = hp->n_head_kv * hd;
    if (L->bq) for (int i = 0; i < nq; i++) q[i] += L->bq[i];
    if (L->bk) for (int i = 0; i < nkv; i++) k[i] += L->bk[i];
    if (L->bv) for (int i = 0; i < nkv; i++) v[i] += L->bv[i];
    if (L->q_norm)
        for (int h = 0; h < hp->n_head; h++) pk_rmsnorm(hd, q + (size_t)h * hd, L->q_norm, hp->rms_eps, q + (size_t)h * hd);
    if (L->k_norm)
        for (int h = 0; h < hp->n_head_kv; h++) pk_rmsnorm(hd, k + (size_t)h * hd, L->k_norm, hp->rms_eps, k + (size_t)h * hd);
}

/* RoPE on q and k, then K/V rows into their slot of the cache. */
static void job_rope_store(void *arg, int ith, int nth) {
    row_job *j = arg;
    pk_llama *m = j->m;
    const pk_llama_hparams *hp = &m->hp;
    const int hd = hp->head_dim, nkv = hp->n_head_kv, rd = m->rope_dim;
    const pk_llama_layer *L = &m->layers[j->layer];
    const int base = m->layer_base[j->layer];
    int lo, hi;
    pk_pool_share(j->n, ROW_SHARE, ith, nth, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        const int pos = j->pos[t];
        float *q = m->q + (size_t)t * hp->n_head * hd, *k = m->k + (size_t)t * nkv * hd;
        float *v = m->v + (size_t)t * nkv * hd;
        head_features(m, L, q, k, v);
        if (base >= 0) {
            const float *cs = m->rope_cs + ((size_t)base * hp->n_batch + t) * rd;
            if (rd == hd) {
                pk_rope_cs(hp->n_head, hd, cs, q);
                pk_rope_cs(nkv, hd, cs, k);
            } else {   /* the first rd dimensions of each head */
                for (int h = 0; h < hp->n_head; h++) pk_rope_cs(1, rd, cs, q + (size_t)h * hd);
                for (int h = 0; h < nkv; h++) pk_rope_cs(1, rd, cs, k + (size_t)h * hd);
            }
        }
        const int at = pk_llama_kv_index(m, j->layer, pos);   /* where the position is stored */
        for (int h = 0; h < nkv; h++) {
            const size_t head = pk_llama_kv_head(m, j->seq[t], j->layer, h);                /* first element */
            const size_t voff = head + (size_t)at * hd;                            /* V row */
            const size_t kbase = head + (size_t)(at / PK_KV_BLOCK) * PK_KV_BLOCK * hd + at % PK_KV_BLOCK;
            const float *kh = k + (size_t)h * hd, *vh = v + (size_t)h * hd;
            if (hp->kv_type == PK_KV_Q8) {
                /* K's scales follow its blocked order: group c of this position at
                 * (block * hd/32 + c) * 16 + at % 16, i.e. element offset / 32 + c * 16 */
                int8_t k8[512];
                uint16_t ks[512 / PK_KV_Q8_GROUP];
                pk_kv_q8_row(hd, kh, k8, ks);
                const size_t kblk = kbase - at % PK_KV_BLOCK;   /* the block's first element */
                for (int i = 0; i < hd; i++) ((int8_t *)m->k_cache)[kbase + (size_t)i * PK_KV_BLOCK] = k8[i];
                for (int c = 0; c < hd / PK_KV_Q8_GROUP; c++)
                    m->k_scale[kblk / PK_KV_Q8_GROUP + (size_t)c * PK_KV_BLOCK + at % PK_KV_BLOCK] = ks[c];
                pk_kv_q8_row(hd, vh, (int8_t *)m->v_cache + voff, m->v_scale + voff / PK_KV_Q8_GROUP);
            } else if (hp->kv_type == PK_KV_BF16) {   /* in its pairs' order (contract/pk_kv.h) */
                uint16_t k16[512], v16[512];
                pk_f32_to_bf16_row(hd, kh, k16);
                pk_f32_to_bf16_row(hd, vh, v16);
                /* K: dimensions 2p, 2p + 1 one 32-bit pair, a pair row (16 pairs) apart */
                uint16_t *kp = (uint16_t *)m->k_cache + head + pk_kv_bf16_k_at(hd, at, 0);
                for (int p = 0; p < hd / 2; p++) memcpy(kp + (size_t)p * 2 * PK_KV_BLOCK, k16 + 2 * p, 4);
                uint16_t *vp = (uint16_t *)m->v_cache + head + pk_kv_bf16_v_at(hd, at, 0);
                for (int i = 0; i < hd; i++) vp[2 * i] = v16[i];
            } else if (hp->kv_type == PK_KV_F16) {
                uint16_t k16[512];
                pk_f32_to_f16_row(hd, kh, k16);
                for (int i = 0; i < hd; i++) ((uint16_t *)m->k_cache)[kbase + (size_t)i * PK_KV_BLOCK] = k16[i];
                pk_f32_to_f16_row(hd, vh, (uint16_t *)m->v_cache + voff);
            } else {
                for (int i = 0; i < hd; i++) ((float *)m->k_cache)[kbase + (size_t)i * PK_KV_BLOCK] = kh[i];
                memcpy((float *)m->v_cache + voff, vh, sizeof(float) * hd);
            }
        }
    }
}

/* Causal attention: query row t sees the positions [0, pos[t]] of its own slot. One work
 * item = a window of PK_ATTEND_ROWS consecutive rows and one K/V head, so the query heads that
 * share the K/V head read it once, and in a prefill chunk (the window's rows of one slot) an
 * f16 cache is converted once for all the rows (pk_attend_rows_window; a sliding layer's rows
 * each over their own window, together where their windows meet one chunk). Items are claimed
 * by whichever thread is free, the longest (the last windows) first, as the matmuls' chunks
 * are: a thread that the rest of the machine slows takes fewer. A group is not split between
 * threads to balance decode's few items: that measured slower (docs/KERNELS.md, "Attention
 * work items"). */
static int attention_items(const pk_llama *m, int n) {
    return (n + PK_ATTEND_ROWS - 1) / PK_ATTEND_ROWS * m->hp.n_head_kv;
}

static void job_attention(void *arg, int ith, int nth) {
    row_job *j = arg;
    pk_llama *m = j->m;
    const pk_llama_hparams *hp = &m->hp;
    const int hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv, group = nh / nkv;
    const size_t ldq = (size_t)nh * hd;
    const float scale = m->attn_scale;
    const int window = m->layers[j->layer].window;
    float *scores = m->scores + (size_t)ith * PK_ATTEND_ROWS * group * m->ld_scores;
    const int items = attention_items(m, j->n);
    (void)nth;
    for (int c; (c = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < items;) {
        const int idx = items - 1 - c, w = idx / nkv, kvh = idx % nkv;   /* the last windows, the longest, first */
        const int t_end = (w + 1) * PK_ATTEND_ROWS < j->n ? (w + 1) * PK_ATTEND_ROWS : j->n;
        for (int t0 = w * PK_ATTEND_ROWS, t1; t0 < t_end; t0 = t1) {   /* runs of one slot */
            const pk_kv_head kv = kv_view(m, j->seq[t0], j->layer, kvh);
            const size_t qoff = (size_t)t0 * ldq + (size_t)kvh * group * hd;
            int lo[PK_ATTEND_ROWS], hi[PK_ATTEND_ROWS];   /* row t sees [lo, hi): its window, or all before it */
            for (t1 = t0; t1 < t_end && j->seq[t1] == j->seq[t0]; t1++) {
                hi[t1 - t0] = j->pos[t1] + 1;
                lo[t1 - t0] = window && hi[t1 - t0] > window ? hi[t1 - t0] - window : 0;
            }
            pk_attend_rows_window(t1 - t0, lo, hi, m->ring[j->layer], group, hd, m->q + qoff, ldq, &kv, scale, scores,
                                  m->ld_scores, m->att + qoff, ldq);
        }
    }
}

/* Decode at depth: with few (row, K/V head) pairs, a thread each leaves threads idle or
 * uneven (SmolLM2's 3 K/V heads on 2 threads: one does two), and each pair is a long read of
 * the cache. Then each pair's chunks of PK_ATTEND_CHUNK positions are the work items (their
 * partials into m->parts), and a second job folds each pair's partials in order: the same
 * operations as pk_attend_rows on the row, so the same bits whatever the split. */
static int split_attention(const pk_llama *m, int layer, int n, int nth) {
    if (m->n_chunks < 2 || nth < 2 || n * m->hp.n_head_kv > SPLIT_PAIRS(nth) || m->layers[layer].window) return 0;
    for (int t = 0; t < n; t++)
        if (m->row_pos[t] >= PK_ATTEND_CHUNK) return 1;
    return 0;
}

static void job_attention_split(void *arg, int ith, int nth) {
    row_job *j = arg;
    pk_llama *m = j->m;
    const pk_llama_hparams *hp = &m->hp;
    const int hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv, group = nh / nkv;
    const size_t ldq = (size_t)nh * hd, part = (size_t)group * hd + 2 * group;
    const float scale = m->attn_scale;
    float *scores = m->scores + (size_t)ith * PK_ATTEND_ROWS * group * m->ld_scores;
    (void)nth;
    for (int idx; (idx = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n * nkv * m->n_chunks;) {
        const int pair = idx / m->n_chunks, c = idx % m->n_chunks, t = pair / nkv, kvh = pair % nkv;
        const int n_pos = j->pos[t] + 1, p0 = c * PK_ATTEND_CHUNK;
        if (p0 >= n_pos) continue;
        const pk_kv_head kv = kv_view(m, j->seq[t], j->layer, kvh);
        float *o = m->parts + ((size_t)pair * m->n_chunks + c) * part;
        pk_attend_part(group, hd, p0, n_pos - p0 < PK_ATTEND_CHUNK ? n_pos - p0 : PK_ATTEND_CHUNK,
                       m->q + (size_t)t * ldq + (size_t)kvh * group * hd, &kv, scale, scores, m->ld_scores,
                       o, o + (size_t)group * hd);
    }
}

static void job_attention_fold(void *arg, int ith, int nth) {
    row_job *j = arg;
    pk_llama *m = j->m;
    const pk_llama_hparams *hp = &m->hp;
    const int hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv, group = nh / nkv;
    const size_t part = (size_t)group * hd + 2 * group;
    for (int pair = ith; pair < j->n * nkv; pair += nth) {
        const int t = pair / nkv, kvh = pair % nkv, n_pos = j->pos[t] + 1;
        const float *p = m->parts + (size_t)pair * m->n_chunks * part;
        float *out = m->att + (size_t)t * nh * hd + (size_t)kvh * group * hd, ml[2 * group];
        memcpy(out, p, sizeof(float) * group * hd);
        memcpy(ml, p + (size_t)group * hd, sizeof ml);
        for (int c = 1; c * PK_ATTEND_CHUNK < n_pos; c++)
            pk_attend_merge(group, hd, out, ml, p + c * part, p + c * part + (size_t)group * hd);
    }
}

/* The residual add of a block's output m->xn, normalised first where the layer has the
 * output norm `norm_w` (Gemma 3's post-attention / post-MLP norms). */
static void job_residual(void *arg, int ith, int nth) {
    row_job *j = arg;
    const int d = j->m->hp.n_embd;
    int lo, hi;
    pk_pool_share(j->n, ROW_SHARE, ith, nth, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        float *o = j->m->xn + (size_t)t * d, *x = j->m->x + (size_t)t * d;
        if (j->norm_w) pk_rmsnorm(d, o, j->norm_w, j->m->hp.rms_eps, o);
        for (int i = 0; i < d; i++) x[i] += o[i];
    }
}

/* SwiGLU (GeGLU), and in a rotated file the rotation of down_proj's input, while the row is in cache. */
static void job_swiglu(void *arg, int ith, int nth) {
    row_job *j = arg;
    pk_llama *m = j->m;
    const int f = m->hp.n_ff;
    const pk_rotation *rot = &m->w.rot_ffn_down;
    const int rot_len = m->hp.n_ff > m->hp.n_embd ? m->hp.n_ff : m->hp.n_embd;
    int lo, hi;
    pk_pool_share(j->n, ROW_SHARE, ith, nth, &lo, &hi);
    for (int t = lo; t < hi; t++) {
        float *g = m->gate + (size_t)t * f;
        if (m->hp.act == PK_ACT_GELU_TANH) pk_geglu_tanh(f, g, m->up + (size_t)t * f, g);
        else pk_swiglu(f, g, m->up + (size_t)t * f, g);
        if (rot->n) pk_rotate_row(rot, 0, g, m->rot_scratch + (size_t)ith * rot_len);
    }
}

/* The final norm of one row into out; see rot_output in pk_llama.h. for_lm_head: in a rotated
 * file, rotated again for the rotated lm_head; else left in the model's own basis (the hidden
 * state an unrotated checkpoint computes, what embeddings are pooled from). */
static void output_norm_row(pk_llama *m, const float *x, float *out, int for_lm_head) {
    const pk_rotation *rot = &m->w.rot_output;
    const int d = m->hp.n_embd;
    if (!rot->n) {
        pk_rmsnorm(d, x, m->w.output_norm, m->hp.rms_eps, out);
        return;
    }
    pk_rmsnorm(d, x, m->ones, m->hp.rms_eps, out);
    pk_rotate_row(rot, 1, out, m->rot_scratch);
    for (int i = 0; i < d; i++) out[i] *= m->w.output_norm[i];
    if (for_lm_head) pk_rotate_row(rot, 0, out, m->rot_scratch);
}

static void run_rows(pk_llama *m, pk_task_fn fn, row_job *job, int work) {
    if (work <= 1) fn(job, 0, 1);       /* one row: no wake-up */
    else pk_pool_run(pk_ctx_pool(m->ctx), fn, job);
}

static int mm(pk_llama *m, const pk_rhs *w, int n, const float *x, float *y) {
    return pk_matmul_f32(m->ctx, w, n, x, w->k, y, w->n, -INFINITY, INFINITY, NULL);
}

/* Weights applied to the same rows (q/k/v, gate/up): one quantization, one pool job. */
static int mm_multi(pk_llama *m, int count, const pk_rhs *const *w, int n, const float *x, float *const *y) {
    size_t ld[PK_MAX_PARTS];
    for (int i = 0; i < count; i++) ld[i] = (size_t)w[i]->n;
    return pk_matmul_f32_multi(m->ctx, count, w, n, x, w[0]->k, y, ld, -INFINITY, INFINITY, NULL);
}

/* ---- forward ------------------------------------------------------------------------------ */

/* The last layer past its K/V store: only the rows whose output is asked for (m->row_out)
 * still matter, so their q, x, slot and position move to rows 0..n_out-1 (ascending, so each
 * row moves down or stays) and the rest of the layer runs on those alone, as llama.cpp's
 * graph drops the unused rows before the last layer's attention. A prefill chunk then pays
 * one row, not all of them, for the last layer's attention, o_proj and MLP. Every kernel gives
 * a row the same bits whatever the rows beside it (pk_llama.h), so the logits do not change. */
static void keep_out_rows(pk_llama *m, int n_out) {
    const size_t d = (size_t)m->hp.n_embd, qd = (size_t)m->hp.n_head * m->hp.head_dim;
    for (int i = 0; i < n_out; i++) {
        const int r = m->row_out[i];
        if (r != i) {
            memcpy(m->q + i * qd, m->q + (size_t)r * qd, sizeof(float) * qd);
            memcpy(m->x + i * d, m->x + (size_t)r * d, sizeof(float) * d);
            m->row_seq[i] = m->row_seq[r];
            m->row_pos[i] = m->row_pos[r];
        }
        m->row_out[i] = i;
    }
}

/* x += xn, through the layer's output norm where it has one */
static void residual(pk_llama *m, row_job *job, const float *norm_w, int n) {
    if (!norm_w) {   /* Llama: the plain add, in one thread as ever */
        const size_t len = (size_t)n * m->hp.n_embd;
        for (size_t i = 0; i < len; i++) m->x[i] += m->xn[i];
        return;
    }
    job->norm_w = norm_w;
    run_rows(m, job_residual, job, n);
}

/* n <= n_batch rows, each with its slot and position (m->row_seq, m->row_pos); logits for
 * the n_out rows m->row_out (none: only the cache is filled), or with `hidden` their final
 * hidden states [n_out][n_embd] (pk_llama_hidden_batch) in place of logits. */
static int forward_chunk(pk_llama *m, const int32_t *tokens, int n, int n_out, float *logits,
                         int hidden, volatile int *interrupt) {
    const pk_llama_hparams *hp = &m->hp;
    const int d = hp->n_embd;
    double t_prof = m->profile ? now_s() : 0.0;
    for (int t = 0; t < n; t++) pk_tensor_row_f32(&m->w.tok_embd, tokens[t], m->x + (size_t)t * d);
    if (hp->embd_scale > 0.0f && hp->embd_scale != 1.0f)
        for (size_t i = 0; i < (size_t)n * d; i++) m->x[i] *= hp->embd_scale;
    const int rd = m->rope_dim;
    for (int b = 0; b < m->n_bases; b++)
        for (int t = 0; t < n; t++)
            pk_rope_angles(rd, m->row_pos[t], m->inv_freq + (size_t)b * (rd / 2),
                           m->rope_cs + ((size_t)b * hp->n_batch + t) * rd);
    PROF(OP_EMBED);

    row_job job = {m, n, 0, m->row_seq, m->row_pos, NULL};
    const int qd = hp->n_head * hp->head_dim;
    for (int l = 0; l < hp->n_layer; l++) {
        if (interrupt && *interrupt) return 1;
        const pk_llama_layer *L = &m->layers[l];
        job.layer = l;
        /* attention block */
        job.norm_w = L->attn_norm;
        run_rows(m, job_rmsnorm, &job, n);
        if (m->stats) pk_llama_add_squares(pk_llama_stat_at(m, l, PK_LLAMA_STAT_ATTN_IN), m->xn, n, d);
        PROF(OP_ATTN_NORM);
        const pk_rhs *qkv[3] = {L->wq, L->wk, L->wv};
        float *qkv_out[3] = {m->q, m->k, m->v};
        if (mm_multi(m, 3, qkv, n, m->xn, qkv_out)) return -1;
        PROF(OP_QKV);
        run_rows(m, job_rope_store, &job, n);
        PROF(OP_ROPE);
        /* the activation statistics read every row's inputs: then the whole layer runs */
        if (l == hp->n_layer - 1 && n_out < n && !m->stats) {
            if (!n_out) return 0;   /* a chunk that only fills the cache: done */
            keep_out_rows(m, n_out);
            job.n = n = n_out;
        }
        job.next = 0;
        if (split_attention(m, l, n, pk_ctx_threads(m->ctx))) {
            run_rows(m, job_attention_split, &job, n * hp->n_head_kv * m->n_chunks);
            run_rows(m, job_attention_fold, &job, n * hp->n_head_kv);
        } else {
            run_rows(m, job_attention, &job, attention_items(m, n));
        }
        if (m->stats) pk_llama_add_squares(pk_llama_stat_at(m, l, PK_LLAMA_STAT_ATTN_OUT), m->att, n, qd);
        PROF(OP_ATTENTION);
        if (mm(m, L->wo, n, m->att, m->xn)) return -1;
        PROF(OP_O);
        residual(m, &job, L->post_attn_norm, n);
        PROF(OP_RESIDUAL);
        /* MLP block */
        job.norm_w = L->ffn_norm;
        run_rows(m, job_rmsnorm, &job, n);
        if (m->stats) pk_llama_add_squares(pk_llama_stat_at(m, l, PK_LLAMA_STAT_FFN_IN), m->xn, n, d);
        PROF(OP_FFN_NORM);
        const pk_rhs *gu[2] = {L->w_gate, L->w_up};
        float *gu_out[2] = {m->gate, m->up};
        for (int r0 = 0; r0 < n; r0 += m->mlp_rows) {   /* slices: pk_llama_create.c, MLP_SLICE_BYTES */
            const int rows = n - r0 < m->mlp_rows ? n - r0 : m->mlp_rows;
            float *xr = m->xn + (size_t)r0 * d;
            if (mm_multi(m, 2, gu, rows, xr, gu_out)) return -1;
            PROF(OP_GATE_UP);
            job.n = rows;
            run_rows(m, job_swiglu, &job, rows);
            if (m->stats) pk_llama_add_squares(pk_llama_stat_at(m, l, PK_LLAMA_STAT_DOWN_IN), m->gate, rows, hp->n_ff);
            PROF(OP_SWIGLU);
            if (mm(m, L->w_down, rows, m->gate, xr)) return -1;   /* over gate_up's input rows: read */
            PROF(OP_DOWN);
        }
        job.n = n;
        residual(m, &job, L->post_ffn_norm, n);
        PROF(OP_RESIDUAL);
    }
    if (m->stats) m->stats_rows += n;
    if (!n_out) return 0;
    if (hidden) {   /* the final norm's rows are the output: no lm_head, no lm_head statistics */
        for (int i = 0; i < n_out; i++)
            output_norm_row(m, m->x + (size_t)m->row_out[i] * d, logits + (size_t)i * d, 0);
        PROF(OP_OUT_NORM);
        return 0;
    }
    /* final norm and lm_head: the rows asked for only, packed */
    const int rows = n_out;
    for (int i = 0; i < rows; i++)
        output_norm_row(m, m->x + (size_t)m->row_out[i] * d, m->xn + (size_t)i * d, 1);
    if (m->stats) {
        pk_llama_add_squares(pk_llama_stat_at(m, 0, PK_LLAMA_STAT_LM_HEAD_IN), m->xn, rows, d);
        m->stats_lm_rows += rows;
    }
    PROF(OP_OUT_NORM);
    const int rc = mm(m, m->w.lm_head, rows, m->xn, logits);
    if (!rc && hp->logit_softcap > 0.0f) {
        const float c = hp->logit_softcap;
        for (size_t i = 0; i < (size_t)rows * hp->n_vocab; i++) logits[i] = c * tanhf(logits[i] / c);
    }
    PROF(OP_LM_HEAD);
    return rc;
}

int pk_llama_forward(pk_llama *m, const int32_t *tokens, int n, int pos0, float *logits,
                     int all_logits, volatile int *interrupt) {
    const pk_llama_hparams *hp = &m->hp;
    if (n <= 0) return err("no tokens to evaluate");
    if (pos0 < 0 || n > hp->n_ctx - pos0) {   /* (not pos0 + n: that can overflow) */
        return err("positions %d..%lld exceed the context of %d tokens", pos0,
                   (long long)pos0 + n - 1, hp->n_ctx);
    }
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= hp->n_vocab) {
            return err("token id %d at index %d is outside the vocabulary [0, %d)", (int)tokens[t], t,
                       hp->n_vocab);
        }
    for (int c = 0; c < n; c += hp->n_batch) {
        const int len = n - c < hp->n_batch ? n - c : hp->n_batch;
        const int last = c + len == n;
        /* an intermediate chunk without all_logits only fills the cache */
        float *out = all_logits ? logits + (size_t)c * hp->n_vocab : (last ? logits : NULL);
        int n_out = 0;
        for (int t = 0; t < len; t++) {
            m->row_seq[t] = 0;
            m->row_pos[t] = pos0 + c + t;
            if (all_logits || (last && t == len - 1)) m->row_out[n_out++] = t;
        }
        const int rc = forward_chunk(m, tokens + c, len, n_out, out, 0, interrupt);
        if (rc) return rc;
    }
    if (m->profile) m->prof_calls++;
    return 0;
}

/* The batch's rules (pk_llama.h), all checked before anything runs. */
static int check_batch(pk_llama *m, int n, const int32_t *tokens, const int32_t *seq,
                       const int32_t *pos, int n_out, const int32_t *out_rows) {
    const pk_llama_hparams *hp = &m->hp;
    if (n <= 0) return err("no rows to evaluate");
    if (n_out < 0 || n_out > n) return err("%d logit rows asked for a batch of %d rows", n_out, n);
    memset(m->seq_seen, 0, sizeof(int) * hp->n_seq);
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return err("token id %d at row %d is outside the vocabulary [0, %d)", (int)tokens[i], i, hp->n_vocab);
        if (seq[i] < 0 || seq[i] >= hp->n_seq)
            return err("row %d: sequence %d is outside the %d slots", i, (int)seq[i], hp->n_seq);
        if (pos[i] < 0 || pos[i] >= hp->n_ctx)
            return err("row %d: position %d is outside the context of %d tokens", i, (int)pos[i], hp->n_ctx);
        if (i > 0 && seq[i] == seq[i - 1]) {
            if (pos[i] != pos[i - 1] + 1)
                return err("row %d: sequence %d jumps from position %d to %d (rows of a sequence "
                           "take consecutive positions)", i, (int)seq[i], (int)pos[i - 1], (int)pos[i]);
        } else if (m->seq_seen[seq[i]]++) {
            return err("row %d: the rows of sequence %d are not consecutive", i, (int)seq[i]);
        }
    }
    for (int i = 0; i < n_out; i++)
        if (out_rows[i] < 0 || out_rows[i] >= n || (i > 0 && out_rows[i] <= out_rows[i - 1]))
            return err("logit rows must be ascending rows of the batch [0, %d); got %d at index %d",
                       n, (int)out_rows[i], i);
    return 0;
}

/* pk_llama_forward_batch's rows; out: logits, or with `hidden` the final hidden states */
static int forward_rows(pk_llama *m, int n, const int32_t *tokens, const int32_t *seq,
                        const int32_t *pos, int n_out, const int32_t *out_rows, float *out,
                        int hidden, volatile int *interrupt) {
    const pk_llama_hparams *hp = &m->hp;
    const size_t width = hidden ? (size_t)hp->n_embd : (size_t)hp->n_vocab;   /* of an out row */
    if (check_batch(m, n, tokens, seq, pos, n_out, out_rows)) return -1;
    int o = 0;   /* next entry of out_rows */
    for (int c = 0; c < n; c += hp->n_batch) {
        const int len = n - c < hp->n_batch ? n - c : hp->n_batch;
        memcpy(m->row_seq, seq + c, sizeof(int32_t) * len);
        memcpy(m->row_pos, pos + c, sizeof(int32_t) * len);
        int k = 0;
        while (o + k < n_out && out_rows[o + k] < c + len) {
            m->row_out[k] = out_rows[o + k] - c;
            k++;
        }
        const int rc = forward_chunk(m, tokens + c, len, k, k ? out + (size_t)o * width : NULL, hidden,
                                     interrupt);
        if (rc) return rc;
        o += k;
    }
    if (m->profile) m->prof_calls++;
    return 0;
}

int pk_llama_forward_batch(pk_llama *m, int n, const int32_t *tokens, const int32_t *seq,
                           const int32_t *pos, int n_out, const int32_t *out_rows, float *logits,
                           volatile int *interrupt) {
    return forward_rows(m, n, tokens, seq, pos, n_out, out_rows, logits, 0, interrupt);
}

int pk_llama_hidden_batch(pk_llama *m, int n, const int32_t *tokens, const int32_t *seq,
                          const int32_t *pos, int n_out, const int32_t *out_rows, float *hidden,
                          volatile int *interrupt) {
    return forward_rows(m, n, tokens, seq, pos, n_out, out_rows, hidden, 1, interrupt);
}
