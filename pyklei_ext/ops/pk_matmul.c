#include "pk_matmul.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pk_cpu.h"

/* ---- registry: one table per ISA file ------------------------------------------------ */

extern const pk_kernel pk_kernels_scalar[];
extern const int pk_kernels_scalar_count;
#if defined(__x86_64__)
extern const pk_kernel pk_kernels_x86_avx2[], pk_kernels_x86_vnni[], pk_kernels_x86_amx[];
extern const int pk_kernels_x86_avx2_count, pk_kernels_x86_vnni_count, pk_kernels_x86_amx_count;
#elif defined(__aarch64__)
extern const pk_kernel pk_kernels_arm_neon[];
extern const int pk_kernels_arm_neon_count;
#endif

static const struct { const pk_kernel *table; const int *count; } families[] = {
    {pk_kernels_scalar, &pk_kernels_scalar_count},
#if defined(__x86_64__)
    {pk_kernels_x86_avx2, &pk_kernels_x86_avx2_count},
    {pk_kernels_x86_vnni, &pk_kernels_x86_vnni_count},
    {pk_kernels_x86_amx, &pk_kernels_x86_amx_count},
#elif defined(__aarch64__)
    {pk_kernels_arm_neon, &pk_kernels_arm_neon_count},
#endif
};
#define fail pk_set_error
#define N_FAMILIES ((int)(sizeof families / sizeof families[0]))

int pk_kernel_count(void) {
    int n = 0;
    for (int f = 0; f < N_FAMILIES; f++) n += *families[f].count;
    return n;
}

const pk_kernel *pk_kernel_at(int i) {
    for (int f = 0; f < N_FAMILIES; f++) {
        if (i < *families[f].count) return &families[f].table[i];
        i -= *families[f].count;
    }
    return NULL;
}

const pk_kernel *pk_kernel_by_name(const char *name) {
    for (int i = 0; i < pk_kernel_count(); i++)
        if (strcmp(pk_kernel_at(i)->name, name) == 0) return pk_kernel_at(i);
    return NULL;
}

int pk_kernel_supported(const pk_kernel *kern) {
    return (pk_cpu_features() & kern->features) == kern->features;
}

/* ---- errors and logging --------------------------------------------------------------- */

static __thread char last_error[512];

const char *pk_last_error(void) { return last_error; }

int pk_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *fmt_name(pk_format f) {
    return f == PK_FMT_QSI4C32 ? "qsi4c32" : f == PK_FMT_QSI6C32 ? "qsi6c32" : "qsi8cx";
}

/* PYKLEI_LOG=kernels (or 1): one stderr line per distinct (kernel, m, n, k). */
static int log_kernels = -1;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t logged[512];

static void log_call(const pk_kernel *kern, int m, int n, int k) {
    if (!log_kernels) return;
    const uint64_t key = ((uint64_t)(uintptr_t)kern * 0x9E3779B97F4A7C15ull)
                       ^ ((uint64_t)m << 42) ^ ((uint64_t)n << 21) ^ (uint64_t)k;
    pthread_mutex_lock(&log_lock);
    for (size_t i = 0; i < sizeof logged / sizeof logged[0]; i++) {
        size_t slot = (key + i) % (sizeof logged / sizeof logged[0]);
        if (logged[slot] == key) break;
        if (logged[slot] == 0) {
            logged[slot] = key;
            fprintf(stderr, "pyklei: matmul %s m=%d n=%d k=%d -> %s\n", fmt_name(kern->fmt), m, n, k,
                    kern->name);
            break;
        }
    }
    pthread_mutex_unlock(&log_lock);
}

/* ---- dispatch table, built once -------------------------------------------------------- */

#define MAX_KERNELS 64
static pthread_once_t dispatch_once = PTHREAD_ONCE_INIT;
static int dispatch_status = 0;
static char dispatch_error[512];
static const pk_kernel *usable[PK_FMT_COUNT][MAX_KERNELS];  /* sorted by priority, best first */
static int n_usable[PK_FMT_COUNT];

static int forced_match(const char *list, const pk_kernel *kern) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save))
        if (!strcmp(tok, kern->name) || !strcmp(tok, kern->isa)) return 1;
    return 0;
}

static void build_dispatch(void) {
    const char *lv = getenv("PYKLEI_LOG");
    log_kernels = lv && (strstr(lv, "kernel") || !strcmp(lv, "1"));
    const char *force = getenv("PYKLEI_KERNEL");
    if (force && !*force) force = NULL;
    if (force) {   /* every forced name must exist and run on this CPU */
        char buf[512];
        snprintf(buf, sizeof buf, "%s", force);
        for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
            int known = 0, ok = 0;
            for (int i = 0; i < pk_kernel_count(); i++) {
                const pk_kernel *kern = pk_kernel_at(i);
                if (strcmp(tok, kern->name) && strcmp(tok, kern->isa)) continue;
                known = 1;
                ok |= pk_kernel_supported(kern);
            }
            if (!known || !ok) {
                snprintf(dispatch_error, sizeof dispatch_error,
                         "PYKLEI_KERNEL=%s: %s '%s' (CPU features: %s)", force,
                         known ? "this CPU cannot run" : "no kernel or ISA named", tok,
                         pk_cpu_features_string(pk_cpu_features()));
                dispatch_status = -1;
                return;
            }
        }
    }
    for (int f = 0; f < PK_FMT_COUNT; f++) {
        int forced_any = 0;
        for (int i = 0; force && i < pk_kernel_count(); i++)
            forced_any |= pk_kernel_at(i)->fmt == (pk_format)f && forced_match(force, pk_kernel_at(i));
        n_usable[f] = 0;
        for (int i = 0; i < pk_kernel_count() && n_usable[f] < MAX_KERNELS; i++) {
            const pk_kernel *kern = pk_kernel_at(i);
            if (kern->fmt != (pk_format)f || !pk_kernel_supported(kern)) continue;
            if (forced_any && !forced_match(force, kern)) continue;
            int j = n_usable[f]++;
            while (j > 0 && usable[f][j - 1]->priority < kern->priority) {
                usable[f][j] = usable[f][j - 1];
                j--;
            }
            usable[f][j] = kern;
        }
        if (n_usable[f] == 0) {
            snprintf(dispatch_error, sizeof dispatch_error, "no usable %s kernel", fmt_name(f));
            dispatch_status = -1;
            return;
        }
    }
    if (log_kernels)
        fprintf(stderr, "pyklei: CPU features: %s%s%s\n", pk_cpu_features_string(pk_cpu_features()),
                force ? "; PYKLEI_KERNEL=" : "", force ? force : "");
}

int pk_dispatch_init(void) {
    pthread_once(&dispatch_once, build_dispatch);
    if (dispatch_status) return fail("%s", dispatch_error);
    return 0;
}

const pk_kernel *pk_dispatch_select(pk_format fmt, int m) {
    if (pk_dispatch_init() || fmt < 0 || fmt >= PK_FMT_COUNT) return NULL;
    const pk_kernel *fallback = NULL;
    for (int i = 0; i < n_usable[fmt]; i++) {
        const pk_kernel *kern = usable[fmt][i];
        if (kern->m_min <= m) return kern;
        if (!fallback || kern->m_min < fallback->m_min) fallback = kern;
    }
    return fallback;
}

/* ---- weights --------------------------------------------------------------------------- */

/* Kernels that share a layout (the same rhs_pack) share one buffer. Large buffers ask for
 * transparent huge pages: a GEMV streams them once per token, and 2 MB pages spare it the
 * TLB misses of 4 KB ones. */
static int packed_slot(const pk_rhs *rhs, const pk_kernel *kern) {
    for (int i = 0; i < PK_MAX_PACKED; i++)
        if (rhs->packed_for[i] && rhs->packed_for[i]->rhs_pack == kern->rhs_pack) return i;
    return -1;
}

static int add_packed(pk_rhs *rhs, const pk_kernel *kern) {
    if (!kern || !kern->rhs_pack || kern->fmt != rhs->fmt || packed_slot(rhs, kern) >= 0) return 0;
    int slot = -1;
    for (int i = 0; i < PK_MAX_PACKED && slot < 0; i++)
        if (!rhs->packed_for[i]) slot = i;
    if (slot < 0) return fail("too many repacked layouts for one weight");
    const size_t bytes = kern->rhs_packed_size(rhs);
    const size_t huge = (size_t)2 << 20;
    void *p = NULL;
    if (posix_memalign(&p, bytes >= huge ? huge : 64, bytes ? bytes : 64))
        return fail("out of memory repacking for %s", kern->name);
#if defined(MADV_HUGEPAGE)
    if (bytes >= huge) madvise(p, (bytes + huge - 1) & ~(huge - 1), MADV_HUGEPAGE);
#endif
    kern->rhs_pack(rhs, p);
    rhs->packed_for[slot] = kern;
    rhs->packed[slot] = p;
    rhs->packed_bytes[slot] = bytes;
    return 0;
}

int pk_rhs_prepare(pk_rhs *rhs, pk_format fmt, int n, int k, int bl, const void *qs,
                   const void *scales, const pk_kernel *extra) {
    memset(rhs, 0, sizeof *rhs);
    if (pk_dispatch_init()) return -1;
    if (n <= 0 || k <= 0) return fail("weight shape [%d, %d] is empty", n, k);
    if (fmt == PK_FMT_QSI4C32) {
        if (bl != 32 && bl != 64 && bl != 128 && bl != 256)
            return fail("qsi4c32 block size %d is not one of 32, 64, 128, 256", bl);
        if (k % bl) return fail("qsi4c32: K=%d is not a multiple of the block size %d", k, bl);
    } else if (fmt == PK_FMT_QSI6C32) {
        if (bl != 32) return fail("qsi6c32 block size %d is not 32", bl);
        if (k % 32) return fail("qsi6c32: K=%d is not a multiple of 32", k);
    } else if (fmt == PK_FMT_QSI8CX) {
        bl = k;
    } else {
        return fail("unknown weight format %d", (int)fmt);
    }
    rhs->fmt = fmt;
    rhs->n = n;
    rhs->k = k;
    rhs->bl = bl;
    rhs->qs = qs;
    rhs->scales = scales;
    if (fmt == PK_FMT_QSI4C32) {
        rhs->rsum = malloc(sizeof(float) * (size_t)n);
        if (!rhs->rsum) return fail("out of memory");
        const int nb = k / bl;
        for (int r = 0; r < n; r++) {
            const uint8_t *row = rhs->qs + (size_t)r * (k / 2);
            const uint16_t *s = (const uint16_t *)scales + (size_t)r * nb;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                /* sum of sign-extended nibbles: x - 16 * (x >= 8) per nibble, written so that the
                 * compiler vectorizes it (a table lookup per byte made loading a 1B model slow) */
                int isum = 0;
                for (int j = b * bl / 2; j < (b + 1) * bl / 2; j++) {
                    const int v = row[j];
                    isum += (v & 15) + (v >> 4) - ((v & 8) << 1) - ((v >> 3) & 16);
                }
                acc += pk_bf16_to_f32(s[b]) * (float)isum;
            }
            rhs->rsum[r] = acc;
        }
    } else if (fmt == PK_FMT_QSI6C32) {
        rhs->rsum = malloc(sizeof(float) * (size_t)n);
        if (!rhs->rsum) return fail("out of memory");
        const int nb = k / 32;
        for (int r = 0; r < n; r++) {
            const uint8_t *row = rhs->qs + (size_t)r * pk_row_bytes(fmt, k);
            const uint16_t *s = (const uint16_t *)scales + (size_t)r * nb;
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {   /* sum of u - 32 = low nibbles + 16 * top bits - 32 * 32 */
                const uint8_t *c = row + (size_t)24 * b;
                int isum = -32 * 32;
                for (int j = 0; j < 16; j++) isum += (c[j] & 15) + (c[j] >> 4);
                for (int j = 16; j < 24; j++)
                    isum += 16 * ((c[j] & 3) + ((c[j] >> 2) & 3) + ((c[j] >> 4) & 3) + (c[j] >> 6));
                acc += pk_bf16_to_f32(s[b]) * (float)isum;
            }
            rhs->rsum[r] = acc;
        }
    } else {
        rhs->isum = malloc(sizeof(int32_t) * (size_t)n);
        if (!rhs->isum) return fail("out of memory");
        for (int r = 0; r < n; r++) {
            const int8_t *row = (const int8_t *)qs + (size_t)r * k;
            int32_t acc = 0;
            for (int j = 0; j < k; j++) acc += row[j];
            rhs->isum[r] = acc;
        }
    }
    /* Repack for every kernel the table may choose for this format, and for `extra`. */
    for (int i = 0; i < n_usable[fmt]; i++)
        if (add_packed(rhs, usable[fmt][i])) { pk_rhs_release(rhs); return -1; }
    if (add_packed(rhs, extra)) { pk_rhs_release(rhs); return -1; }
    return 0;
}

void pk_rhs_release(pk_rhs *rhs) {
    free(rhs->rsum);
    free(rhs->isum);
    for (int i = 0; i < PK_MAX_PACKED; i++) free(rhs->packed[i]);
    memset(rhs, 0, sizeof *rhs);
}

size_t pk_rhs_owned_bytes(const pk_rhs *rhs) {
    size_t b = (rhs->rsum ? sizeof(float) : sizeof(int32_t)) * (size_t)rhs->n;
    for (int i = 0; i < PK_MAX_PACKED; i++) b += rhs->packed_bytes[i];
    return b;
}

static const void *packed_for(const pk_rhs *rhs, const pk_kernel *kern) {
    if (!kern->rhs_pack) return NULL;
    const int i = packed_slot(rhs, kern);
    return i < 0 ? NULL : rhs->packed[i];
}

int pk_rhs_needs_canonical(const pk_rhs *rhs) {
    if (pk_dispatch_init()) return 1;
    /* the table's kernels in its order, up to the first one taking any m (later ones are
     * never picked); the scalar fallback inside kernels is not counted (out of memory only) */
    for (int i = 0; i < n_usable[rhs->fmt]; i++) {
        const pk_kernel *kern = usable[rhs->fmt][i];
        if (!packed_for(rhs, kern)) return 1;
        if (kern->m_min <= 1) return 0;
    }
    return 1;
}

/* ---- activations ----------------------------------------------------------------------- */

#if defined(__x86_64__)
/* SIMD row quantizers (isa/matmul_x86_avx2.c, isa/matmul_x86_vnni.c), byte-exact with the
 * scalar one below. */
void pk_quantize_qai8dx_row_avx2(int k, const float *x, int8_t *q, float *scale, int32_t *zp);
void pk_quantize_qai8dx_row_avx512(int k, const float *x, int8_t *q, float *scale, int32_t *zp);
#endif

void pk_quantize_qai8dx_row(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
#if defined(__x86_64__)
    const uint32_t f = pk_cpu_features();
    if (f & PK_CPU_AVX512VNNI) { pk_quantize_qai8dx_row_avx512(k, x, q, scale, zp); return; }
    if (f & PK_CPU_AVX2) { pk_quantize_qai8dx_row_avx2(k, x, q, scale, zp); return; }
#endif
    pk_quantize_qai8dx_row_scalar(k, x, q, scale, zp);
}

int pk_quantize_qai8dx_row_impl(const char *impl, int k, const float *x, int8_t *q, float *scale,
                                int32_t *zp) {
    if (!strcmp(impl, "scalar")) { pk_quantize_qai8dx_row_scalar(k, x, q, scale, zp); return 0; }
#if defined(__x86_64__)
    if (!strcmp(impl, "avx2") && (pk_cpu_features() & PK_CPU_AVX2)) {
        pk_quantize_qai8dx_row_avx2(k, x, q, scale, zp);
        return 0;
    }
    if (!strcmp(impl, "avx512") && (pk_cpu_features() & PK_CPU_AVX512VNNI)) {
        pk_quantize_qai8dx_row_avx512(k, x, q, scale, zp);
        return 0;
    }
#endif
    return -1;
}

void pk_quantize_qai8dx_row_scalar(int k, const float *x, int8_t *q, float *scale, int32_t *zp) {
    float mn = 0.0f, mx = 0.0f;
    for (int i = 0; i < k; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    const float inv = pk_qai8dx_params(mn, mx, scale, zp);
    const int32_t zi = *zp;
    for (int i = 0; i < k; i++) {
        int32_t v = (int32_t)rintf(x[i] * inv) + zi;
        q[i] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
    }
}

void pk_quantize_qai8dx2_row(int k, const float *x, float *r, int8_t *q1, float *s1, int32_t *z1,
                             int8_t *q2, float *s2, int32_t *z2) {
    pk_quantize_qai8dx_row(k, x, q1, s1, z1);
    const float s = *s1;
    const int32_t z = *z1;
    for (int i = 0; i < k; i++) r[i] = x[i] - s * (float)((int32_t)q1[i] - z);
    pk_quantize_qai8dx_row(k, r, q2, s2, z2);
}

/* ---- context and matmul ---------------------------------------------------------------- */

struct pk_ctx {
    pk_pool *pool;
    int planes;          /* activation planes: 1 (qai8dx) or 2 (qai8dx2) */
    int8_t *q;           /* scratch for quantized activations [planes*m][ld] */
    float *scale;        /* [planes*m] */
    int32_t *zp;         /* [planes*m] */
    float *resid;        /* [n_threads][k] residual rows (2 planes) */
    float *dst2;         /* [2m][n] per-plane products (2 planes) */
    size_t cap_q, cap_scale, cap_zp, cap_resid, cap_dst2;
};

void pk_ctx_set_act_planes(pk_ctx *ctx, int planes) { ctx->planes = planes == 2 ? 2 : 1; }
int pk_ctx_act_planes(const pk_ctx *ctx) { return ctx->planes; }

pk_ctx *pk_ctx_create(int n_threads) {
    if (pk_dispatch_init()) return NULL;
    pk_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) { fail("out of memory"); return NULL; }
    ctx->pool = pk_pool_create(n_threads);
    if (!ctx->pool) { free(ctx); fail("cannot start %d threads", n_threads); return NULL; }
    ctx->planes = 1;
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
    int chunks;          /* total over the parts */
    int next;            /* atomic */
    /* quantization stage */
    const float *x;
    size_t ldx;
    int8_t *q;
    float *resid;        /* two planes: per-thread residual rows, else NULL */
} matmul_job;

static void run_quantize(void *arg, int ith, int nth) {
    matmul_job *job = arg;
    const int m = job->lhs->m, k = job->lhs->k;
    const size_t ld = job->lhs->ld;
    float *sc = (float *)job->lhs->scale;
    int32_t *zp = (int32_t *)job->lhs->zp;
    if (!job->resid) {
        for (int i = ith; i < m; i += nth)
            pk_quantize_qai8dx_row(k, job->x + (size_t)i * job->ldx, job->q + (size_t)i * ld, sc + i, zp + i);
        return;
    }
    /* two planes: lhs rows 2i (plane 1) and 2i+1 (residual plane) */
    float *r = job->resid + (size_t)ith * k;
    for (int i = ith; i < m / 2; i += nth)
        pk_quantize_qai8dx2_row(k, job->x + (size_t)i * job->ldx, r, job->q + (size_t)(2 * i) * ld,
                                sc + 2 * i, zp + 2 * i, job->q + (size_t)(2 * i + 1) * ld,
                                sc + 2 * i + 1, zp + 2 * i + 1);
}

static void run_part(const matmul_job *job, const mm_part *p, int n0, int n1) {
    if (n0 >= n1) return;
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
            return fail("kernel %s computes %s weights, not %s", (*kern)->name, fmt_name((*kern)->fmt),
                        fmt_name(rhs->fmt));
        if (!pk_kernel_supported(*kern))
            return fail("this CPU cannot run kernel %s (CPU features: %s)", (*kern)->name,
                        pk_cpu_features_string(pk_cpu_features()));
    }
    if ((*kern)->rhs_pack && !packed_for(rhs, *kern))
        return fail("weight was not repacked for kernel %s", (*kern)->name);
    return 0;
}

/* Fills job->part[] for the weights (kernel, packed copy, chunks); returns 0 or -1. */
static int plan_parts(matmul_job *job, int count, const pk_rhs *const *rhs, float *const *dst,
                      const size_t *ldd, const pk_kernel *kern, int nth) {
    if (count < 1 || count > PK_MAX_PARTS) return fail("a matmul call takes 1 to %d weights, not %d", PK_MAX_PARTS, count);
    job->nparts = count;
    job->chunks = 0;
    job->next = 0;
    for (int i = 0; i < count; i++) {
        mm_part *p = &job->part[i];
        const pk_kernel *kr = kern;
        if (rhs[i]->k != job->lhs->k)
            return fail("activation K=%d does not match weight K=%d", job->lhs->k, rhs[i]->k);
        if (check_kernel(rhs[i], &kr, job->lhs->m)) return -1;
        log_call(kr, job->lhs->m, rhs[i]->n, rhs[i]->k);
        *p = (mm_part){kr, rhs[i], packed_for(rhs[i], kr), dst[i], ldd[i], NULL, 0, 0, 0};
    }
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
    if (plan_parts(&job, 1, &rhs, &dst, &ldd, kern, pk_pool_size(ctx->pool))) return -1;
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
    pk_lhs lhs = {rows, k, ctx->q, ld, ctx->scale, ctx->zp};
    matmul_job job = {.lhs = &lhs, .lo = clamp_lo, .hi = clamp_hi, .x = x, .ldx = ldx, .q = ctx->q};
    if (plan_parts(&job, count, rhs, dst, ldd, kern, pk_pool_size(ctx->pool))) return -1;
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
