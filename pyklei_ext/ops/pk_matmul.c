/* The matmul entry points: the context (thread pool, activation scratch), quantizing the
 * activations, and splitting N into chunks the pool's threads take as they come. */
#include "pk_ops_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- context and matmul ---------------------------------------------------------------- */

struct pk_ctx {
    pk_pool *pool;
    pk_act act;          /* the requested scheme (a call may fall back: pk_matmul.h) */
    int planes;          /* activation planes: 2 for qai8dx2, else 1 */
    int8_t *q;           /* scratch for quantized activations [planes*m][ld] */
    float *scale;        /* [planes*m] */
    int32_t *zp;         /* [planes*m] */
    float *resid;        /* [n_threads][k] residual rows (2 planes) */
    float *dst2;         /* [2m][n] per-plane products (2 planes) */
    int32_t *bsum32;     /* [planes*m][k/32] block sums of the quantized rows */
    float *bscale;       /* qsi8d32: [m][k/32] block scales */
    size_t cap_q, cap_scale, cap_zp, cap_resid, cap_dst2, cap_bsum32, cap_bscale;
};

void pk_ctx_set_activations(pk_ctx *ctx, pk_act act) {
    ctx->act = act == PK_ACT_QAI8DX2 || act == PK_ACT_QSI8D32 ? act : PK_ACT_QAI8DX;
    ctx->planes = ctx->act == PK_ACT_QAI8DX2 ? 2 : 1;
}
pk_act pk_ctx_activations(const pk_ctx *ctx) { return ctx->act; }

pk_ctx *pk_ctx_create(int n_threads) {
    if (pk_dispatch_init()) return NULL;
    pk_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) { fail("out of memory"); return NULL; }
    ctx->pool = pk_pool_create(n_threads);
    if (!ctx->pool) { free(ctx); fail("cannot start %d threads", n_threads); return NULL; }
    pk_ctx_set_activations(ctx, PK_ACT_QAI8DX);
    return ctx;
}

void pk_ctx_destroy(pk_ctx *ctx) {
    if (!ctx) return;
    pk_pool_destroy(ctx->pool);
    free(ctx->q);
    free(ctx->scale);
    free(ctx->zp);
    free(ctx->resid);
    free(ctx->dst2);
    free(ctx->bsum32);
    free(ctx->bscale);
    free(ctx);
}

int pk_ctx_threads(const pk_ctx *ctx) { return pk_pool_size(ctx->pool); }
pk_pool *pk_ctx_pool(pk_ctx *ctx) { return ctx->pool; }

/* One weight of a matmul call: its kernel and output. */
typedef struct {
    const pk_kernel *kern;
    const pk_rhs *rhs;
    const void *packed;
    float *dst;
    size_t ldd;
    float *out;          /* two planes: the caller's output (dst holds the plane products) */
    size_t ldo;
    int chunk;           /* rows per dynamic chunk (a multiple of the kernel's n_step) */
    int first;           /* index of its first chunk in the call */
} mm_part;

typedef struct {
    mm_part part[PK_MAX_PARTS];
    int nparts;
    const pk_lhs *lhs;
    float lo, hi;        /* the kernels' clamp */
    float out_lo, out_hi;   /* two planes: the clamp of the summed output */
    int d32;             /* the kernels run on qsi8d32 activations (run_d32) */
    int chunks;          /* total over the parts */
    int next;            /* atomic */
    /* quantization stage */
    const float *x;
    size_t ldx;
    int8_t *q;
    float *resid;        /* two planes: per-thread residual rows, else NULL */
} matmul_job;

/* out[b] = the sum of q[32b .. 32b + 31], k a multiple of 32. */
PK_CLONES static void block_sums32(int k, const int8_t *q, int32_t *out) {
    for (int b = 0; b < k / 32; b++) {
        int32_t s = 0;
        for (int i = 0; i < 32; i++) s += q[32 * b + i];
        out[b] = s;
    }
}

static void run_quantize(void *arg, int ith, int nth) {
    matmul_job *job = arg;
    const int m = job->lhs->m, k = job->lhs->k;
    const size_t ld = job->lhs->ld;
    float *sc = (float *)job->lhs->scale;
    int32_t *zp = (int32_t *)job->lhs->zp, *bs = (int32_t *)job->lhs->bsum32;
    if (job->lhs->bscale) {   /* qsi8d32 */
        for (int i = ith; i < m; i += nth)
            pk_quantize_qsi8d32_row(k, job->x + (size_t)i * job->ldx, job->q + (size_t)i * ld,
                                    (float *)job->lhs->bscale + (size_t)i * (k / 32), bs + (size_t)i * (k / 32));
        return;
    }
    if (!job->resid) {
        for (int i = ith; i < m; i += nth) {
            pk_quantize_qai8dx_row(k, job->x + (size_t)i * job->ldx, job->q + (size_t)i * ld, sc + i, zp + i);
            if (bs) block_sums32(k, job->q + (size_t)i * ld, bs + (size_t)i * (k / 32));
        }
        return;
    }
    /* two planes: lhs rows 2i (plane 1) and 2i+1 (residual plane) */
    float *r = job->resid + (size_t)ith * k;
    for (int i = ith; i < m / 2; i += nth) {
        pk_quantize_qai8dx2_row(k, job->x + (size_t)i * job->ldx, r, job->q + (size_t)(2 * i) * ld,
                                sc + 2 * i, zp + 2 * i, job->q + (size_t)(2 * i + 1) * ld,
                                sc + 2 * i + 1, zp + 2 * i + 1);
        for (int p = 0; bs && p < 2; p++)
            block_sums32(k, job->q + (size_t)(2 * i + p) * ld, bs + (size_t)(2 * i + p) * (k / 32));
    }
}

static void run_part(const matmul_job *job, const mm_part *p, int n0, int n1) {
    if (n0 >= n1) return;
    if (job->lhs->bscale) {   /* qsi8d32: plan_parts checked that every part has run_d32 */
        p->kern->run_d32(job->lhs->m, n0, n1, job->lhs, p->rhs, p->packed, p->dst, p->ldd, job->lo, job->hi);
        return;
    }
    if (p->out && p->kern->run_pairs) {   /* the kernel sums the two planes itself */
        p->kern->run_pairs(job->lhs->m, n0, n1, job->lhs, p->rhs, p->packed, p->out, p->ldo, job->out_lo,
                           job->out_hi);
        return;
    }
    p->kern->run(job->lhs->m, n0, n1, job->lhs, p->rhs, p->packed, p->dst, p->ldd, job->lo, job->hi);
    if (!p->out) return;
    /* two planes: out = clamp(plane 1 + plane 2), by the thread that made them (cache-hot) */
    for (int i = 0; i < job->lhs->m / 2; i++) {
        const float *a = p->dst + (size_t)(2 * i) * p->ldd, *b = a + p->ldd;
        float *d = p->out + (size_t)i * p->ldo;
        for (int j = n0; j < n1; j++) d[j] = pk_clampf(a[j] + b[j], job->out_lo, job->out_hi);
    }
}

/* Work is split in chunks that threads take as they come: a thread slowed by the rest of the
 * machine (a shared VM, another process) then costs its share of the time, not the whole
 * call's. */
static void run_kernel(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    matmul_job *job = arg;
    for (int c; (c = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->chunks;) {
        int p = 0;
        while (p + 1 < job->nparts && c >= job->part[p + 1].first) p++;
        const mm_part *pt = &job->part[p];
        const int n0 = (c - pt->first) * pt->chunk, n = pt->rhs->n;
        run_part(job, pt, n0, n0 + pt->chunk < n ? n0 + pt->chunk : n);
    }
}

static int check_kernel(const pk_rhs *rhs, const pk_kernel **kern, int m) {
    if (!*kern) {
        *kern = pk_dispatch_select(rhs->fmt, m);
        if (!*kern) return fail("%s", pk_last_error()[0] ? pk_last_error() : "no kernel");
    } else {
        if ((*kern)->fmt != rhs->fmt)
            return fail("kernel %s computes %s weights, not %s", (*kern)->name, pk_format_name((*kern)->fmt),
                        pk_format_name(rhs->fmt));
        if (!pk_kernel_supported(*kern))
            return fail("this CPU cannot run kernel %s (CPU features: %s)", (*kern)->name,
                        pk_cpu_features_string(pk_cpu_features()));
    }
    if ((*kern)->rhs_pack && !pk_rhs_packed_for(rhs, *kern))
        return fail("weight was not repacked for kernel %s", (*kern)->name);
    return 0;
}

/* Fills job->part[] for the weights (kernel, packed copy, chunks) and job->d32: whether the
 * call runs on qsi8d32 activations, which needs d32 (the scheme asked for), K a multiple of 32
 * and every part's kernel taking them (run_d32: block formats); returns 0 or -1. */
static int plan_parts(matmul_job *job, int count, const pk_rhs *const *rhs, float *const *dst,
                      const size_t *ldd, const pk_kernel *kern, int nth, int d32) {
    if (count < 1 || count > PK_MAX_PARTS) return fail("a matmul call takes 1 to %d weights, not %d", PK_MAX_PARTS, count);
    job->nparts = count;
    job->chunks = 0;
    job->next = 0;
    job->d32 = d32 && job->lhs->k % 32 == 0;
    for (int i = 0; i < count; i++) {
        mm_part *p = &job->part[i];
        const pk_kernel *kr = kern;
        if (rhs[i]->k != job->lhs->k)
            return fail("activation K=%d does not match weight K=%d", job->lhs->k, rhs[i]->k);
        if (check_kernel(rhs[i], &kr, job->lhs->m)) return -1;
        job->d32 &= kr->run_d32 != NULL;
        *p = (mm_part){kr, rhs[i], pk_rhs_packed_for(rhs[i], kr), dst[i], ldd[i], NULL, 0, 0, 0};
    }
    for (int i = 0; i < count; i++) pk_log_call(job->part[i].kern, job->d32, job->lhs->m, rhs[i]->n, rhs[i]->k);
    /* per thread and weight about 4 chunks for a GEMV, 2 for a GEMM (each kernel call prepares
     * the activations again); each chunk at least 16 KiB of weights */
    for (int i = 0; i < count; i++) {
        mm_part *p = &job->part[i];
        const int step = p->kern->n_step > 0 ? p->kern->n_step : 1, per = p->kern->m_min <= 1 ? 4 : 2;
        const size_t row_bytes = pk_row_bytes(p->rhs->fmt, p->rhs->k);
        int rows = p->rhs->n / (per * nth);
        const int min_rows = (int)((16384 + row_bytes - 1) / row_bytes);
        rows = rows < min_rows ? min_rows : rows;
        p->chunk = (rows + step - 1) / step * step;
        p->first = job->chunks;
        job->chunks += (p->rhs->n + p->chunk - 1) / p->chunk;
    }
    return 0;
}

int pk_matmul_lhs(pk_ctx *ctx, const pk_rhs *rhs, const pk_lhs *lhs, float *dst, size_t ldd,
                  float clamp_lo, float clamp_hi, const pk_kernel *kern) {
    if (lhs->k != rhs->k) return fail("activation K=%d does not match weight K=%d", lhs->k, rhs->k);
    if (lhs->m <= 0) return 0;
    matmul_job job = {.lhs = lhs, .lo = clamp_lo, .hi = clamp_hi};
    if (plan_parts(&job, 1, &rhs, &dst, &ldd, kern, pk_pool_size(ctx->pool), lhs->bscale != NULL)) return -1;
    if (lhs->bscale && !job.d32)
        return fail("qsi8d32 activations: kernel %s does not take them (K=%d)", job.part[0].kern->name, lhs->k);
    pk_pool_run(ctx->pool, run_kernel, &job);
    return 0;
}

static int grow(void **p, size_t *cap, size_t bytes) {
    if (*cap >= bytes) return 0;
    free(*p);
    if (posix_memalign(p, 64, bytes)) { *p = NULL; *cap = 0; return fail("out of memory"); }
    *cap = bytes;
    return 0;
}

int pk_matmul_f32_multi(pk_ctx *ctx, int count, const pk_rhs *const *rhs, int m, const float *x,
                        size_t ldx, float *const *dst, const size_t *ldd, float clamp_lo, float clamp_hi,
                        const pk_kernel *kern) {
    if (m <= 0) return 0;
    if (count < 1 || count > PK_MAX_PARTS) return fail("a matmul call takes 1 to %d weights, not %d", PK_MAX_PARTS, count);
    const int k = rhs[0]->k, planes = ctx->planes, rows = planes * m;
    const size_t ld = ((size_t)k + 63) & ~(size_t)63;
    if (grow((void **)&ctx->q, &ctx->cap_q, ld * (size_t)rows) ||
        grow((void **)&ctx->scale, &ctx->cap_scale, sizeof(float) * (size_t)rows) ||
        grow((void **)&ctx->zp, &ctx->cap_zp, sizeof(int32_t) * (size_t)rows))
        return -1;
    if (k % 32 == 0 && grow((void **)&ctx->bsum32, &ctx->cap_bsum32, sizeof(int32_t) * (size_t)rows * (k / 32)))
        return -1;
    pk_lhs lhs = {rows, k, ctx->q, ld, ctx->scale, ctx->zp, k % 32 == 0 ? ctx->bsum32 : NULL, NULL};
    matmul_job job = {.lhs = &lhs, .lo = clamp_lo, .hi = clamp_hi, .x = x, .ldx = ldx, .q = ctx->q};
    if (plan_parts(&job, count, rhs, dst, ldd, kern, pk_pool_size(ctx->pool), ctx->act == PK_ACT_QSI8D32)) return -1;
    if (job.d32) {   /* the quantizing stage fills bscale and bsum32 (allocated above: k % 32 == 0) */
        if (grow((void **)&ctx->bscale, &ctx->cap_bscale, sizeof(float) * (size_t)rows * (k / 32))) return -1;
        lhs.bscale = ctx->bscale;
    }
    if (planes == 2) {
        if (grow((void **)&ctx->resid, &ctx->cap_resid, sizeof(float) * (size_t)k * pk_pool_size(ctx->pool)))
            return -1;
        job.resid = ctx->resid;
        job.out_lo = clamp_lo;
        job.out_hi = clamp_hi;
        /* kernels without run_pairs write the plane products (rows 2t, 2t+1) into their own
         * [2m, n_i] block of dst2, unclamped; run_part adds them into the caller's rows */
        size_t n_buf = 0;
        for (int i = 0; i < count; i++)
            if (!job.part[i].kern->run_pairs) n_buf += (size_t)rhs[i]->n;
        if (n_buf && grow((void **)&ctx->dst2, &ctx->cap_dst2, sizeof(float) * (size_t)rows * n_buf)) return -1;
        float *d2 = ctx->dst2;
        for (int i = 0; i < count; i++) {
            mm_part *pt = &job.part[i];
            pt->out = dst[i];
            pt->ldo = ldd[i];
            if (pt->kern->run_pairs) continue;
            pt->dst = d2;
            pt->ldd = (size_t)rhs[i]->n;
            d2 += (size_t)rows * rhs[i]->n;
        }
        job.lo = -INFINITY;
        job.hi = INFINITY;
    }
    if (m == 1) run_quantize(&job, 0, 1);
    else pk_pool_run(ctx->pool, run_quantize, &job);
    pk_pool_run(ctx->pool, run_kernel, &job);
    return 0;
}

int pk_matmul_f32(pk_ctx *ctx, const pk_rhs *rhs, int m, const float *x, size_t ldx, float *dst,
                  size_t ldd, float clamp_lo, float clamp_hi, const pk_kernel *kern) {
    return pk_matmul_f32_multi(ctx, 1, &rhs, m, x, ldx, &dst, &ldd, clamp_lo, clamp_hi, kern);
}
