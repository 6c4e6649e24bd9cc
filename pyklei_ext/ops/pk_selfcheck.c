/* The start-up self-check of the kernels the dispatch table may pick: each runs a few small
 * cases and must agree with the scalar kernel of its format (docs/KERNELS.md, "Self-check").
 * It writes no table: it returns which kernels failed, and pk_dispatch.c drops them. */
#include "pk_ops_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Most SIMD kernels have only run on the CPUs where CI runs (the AMX ones only through their
 * emulated twin). So when the table is built, every kernel it could pick other than the
 * scalar ones computes a few small cases and must agree with the scalar kernel of its format
 * (pk_kernels_scalar). A kernel that does not (a code path wrong on this CPU, a compiler or
 * feature-detection surprise) leaves the table with a warning on stderr, and the next best
 * kernel takes its calls; the scalar kernel never leaves (it is the reference).
 *
 * Which kernels: the caller's list. The dispatch table (pk_dispatch.c) passes those it ranks
 * above the scalar kernel of their format. The ones below it (the priority -1 test twins,
 * unless forced) are never picked, since the scalar kernel takes every m; checking them would
 * only cost time (the AMX twin is a slow C model of the tiles).
 *
 * Why apart from the table: the check reads only the kernel records it is handed and returns
 * its verdict; the dispatcher decides what a failure means for its table (pk_dispatch.c).
 *
 * Cases, per format: K = 256 (qsi4c32 with bl = 32 and bl = 128; qsi6c32) or K = 263 (qsi8cx
 * takes any K: a tail of 7); N = 2 n_step + 5 for the largest n_step among the checked
 * kernels (two panels and a ragged tail), computed in two calls split at the kernel's own
 * n_step, as threads split N; m = 1 and m = m_min; run_pairs with 2 and with m_min (rounded
 * up to even) rows; run_d32 (block formats) with m = 1 and m_min on the same int8 rows read as
 * qsi8d32, block scales in [2^-6, 2^-5) like the row scales (no zero-point term: its bound is
 * below run's). Data from a small LCG: every int8 / int4 / int6 value, zero points of
 * both signs, scales of both signs; the kernel's own rhs_pack makes its copy of the weight.
 *
 * Tolerance: kernels compute exact int32 block dots and differ from the scalar kernel only
 * in the float32 order of the block sums and of the zero-point term. Each result is within
 * (nb + 24) u T of the exact value (u = 2^-24; T the sum of the magnitudes of all terms; see
 * tolerance() in tests/kernels/test_kernels.py), so two kernels agree within 2 (nb + 24) u T. Here T
 * is bounded for all outputs at once by ascale_max * K * (128 + 128 + 256) * wmax; with this
 * data the bound is about 1e-4 of the largest output (the largest difference seen here: 2e-6,
 * 1/4000 of the bound), while one wrong product (one k of one output) moves that output by
 * about 1e-2 of it: a real bug lands far above the bound. A run_pairs output sums two
 * products: twice the bound.
 *
 * Cost: about a millisecond once per process (measured in docs/KERNELS.md, "Self-check"), so
 * no switch turns it off. */

static uint32_t selfcheck_rand(uint32_t *state) {   /* LCG (Numerical Recipes); top 24 bits */
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

typedef struct {
    int m, n, k, bl;
    uint8_t *qs;          /* canonical weight [n][row bytes] */
    void *scales;         /* bf16 [n][k/bl] or f32 [n] (qsi8cx) */
    int8_t *q;            /* activations [m][ld], ld = k rounded up to 64 (as pk_matmul_f32) */
    float *ascale;        /* [m] */
    int32_t *zp;          /* [m] */
    pk_rhs rhs;           /* row sums only: each kernel repacks into its own buffer */
    pk_lhs lhs;
    float *ref;           /* [m][n] the scalar kernel, unclamped */
    float *ref_pairs;     /* [m/2][n] ref rows 2t + 2t+1 */
    float *bscale;        /* qsi8d32 view of the same q: [m][k/32] block scales (block formats) */
    float *ref_d32;       /* [m][n] the scalar kernel's run_d32, unclamped (block formats) */
    float tol;            /* bound on |kernel - ref| for one product */
} selfcheck_case;

static void selfcheck_case_free(selfcheck_case *c) {
    pk_rhs_release(&c->rhs);
    free(c->qs);
    free(c->scales);
    free(c->q);
    free(c->ascale);
    free(c->zp);
    free(c->ref);
    free(c->ref_pairs);
    free(c->bscale);
    free(c->ref_d32);
}

/* m rows x n weight rows x k (m even); returns 0, or -1 when out of memory. */
static int selfcheck_case_make(selfcheck_case *c, pk_format fmt, int m, int n, int k, int bl, uint32_t seed) {
    const int blocks = fmt != PK_FMT_QSI8CX;
    bl = blocks ? bl : k;
    const int nb = k / bl;
    const size_t row_bytes = pk_row_bytes(fmt, k), ld = ((size_t)k + 63) & ~(size_t)63;
    *c = (selfcheck_case){.m = m, .n = n, .k = k, .bl = bl};
    c->qs = malloc(row_bytes * (size_t)n);
    c->scales = malloc(blocks ? sizeof(uint16_t) * (size_t)n * nb : sizeof(float) * (size_t)n);
    if (posix_memalign((void **)&c->q, 64, ld * (size_t)m)) c->q = NULL;
    c->ascale = malloc(sizeof(float) * (size_t)m);
    c->zp = malloc(sizeof(int32_t) * (size_t)m);
    c->ref = malloc(sizeof(float) * (size_t)m * n);
    c->ref_pairs = malloc(sizeof(float) * (size_t)(m / 2) * n);
    c->bscale = malloc(sizeof(float) * (size_t)m * (k / 32 + 1));
    c->ref_d32 = malloc(sizeof(float) * (size_t)m * n);
    if (!c->qs || !c->scales || !c->q || !c->ascale || !c->zp || !c->ref || !c->ref_pairs || !c->bscale || !c->ref_d32)
        return -1;
    uint32_t st = seed;
    /* weights: any int4 / int6 byte; int8 in [-127, 127] (qsi8cx is symmetric); scales of
     * both signs, |s| in [2^-7, 2^-6) (bf16) or [2^-10, 2^-9) (qsi8cx) */
    for (size_t i = 0; i < row_bytes * (size_t)n; i++) {
        const uint32_t r = selfcheck_rand(&st);
        c->qs[i] = blocks ? (uint8_t)r : (uint8_t)(int8_t)((int)(r % 255) - 127);
    }
    float wmax;
    if (blocks) {
        for (int i = 0; i < n * nb; i++) {
            const uint32_t r = selfcheck_rand(&st);
            ((uint16_t *)c->scales)[i] = (uint16_t)((r & 0x8000) | (120u << 7) | (r & 0x7F));
        }
        wmax = ldexpf(1.0f, -6) * (fmt == PK_FMT_QSI4C32 ? 8.0f : 32.0f);
    } else {
        for (int i = 0; i < n; i++)
            ((float *)c->scales)[i] = ldexpf(1.0f + (float)(selfcheck_rand(&st) & 0xFFFF) / 65536.0f, -10);
        wmax = ldexpf(1.0f, -9) * 127.0f;
    }
    /* activations: any int8 (the padding too: kernels must not read it), zero points in
     * [-128, 127], scales in [2^-6, 2^-5) */
    for (size_t i = 0; i < ld * (size_t)m; i++) c->q[i] = (int8_t)selfcheck_rand(&st);
    for (int i = 0; i < m; i++) {
        c->ascale[i] = ldexpf(1.0f + (float)(selfcheck_rand(&st) & 0xFFFF) / 65536.0f, -6);
        c->zp[i] = (int32_t)(selfcheck_rand(&st) & 255) - 128;
    }
    for (int i = 0; i < m * (k / 32); i++)
        c->bscale[i] = ldexpf(1.0f + (float)(selfcheck_rand(&st) & 0xFFFF) / 65536.0f, -6);
    c->lhs = (pk_lhs){m, k, c->q, ld, c->ascale, c->zp, NULL, NULL};
    const float t_max = ldexpf(1.0f, -5) * (float)k * 512.0f * wmax;
    c->tol = 2.0f * (float)(nb + 24) * ldexpf(1.0f, -24) * t_max;
    if (pk_rhs_prepare_canonical(&c->rhs, fmt, n, k, bl, c->qs, c->scales)) return -1;
    pk_kernel_scalar_for(fmt)->run(m, 0, n, &c->lhs, &c->rhs, NULL, c->ref, (size_t)n, -INFINITY, INFINITY);
    for (int t = 0; t < m / 2; t++)
        for (int j = 0; j < n; j++)
            c->ref_pairs[(size_t)t * n + j] = c->ref[(size_t)(2 * t) * n + j] + c->ref[(size_t)(2 * t + 1) * n + j];
    if (blocks) {
        pk_lhs d = c->lhs;
        d.bscale = c->bscale;
        pk_kernel_scalar_for(fmt)->run_d32(m, 0, n, &d, &c->rhs, NULL, c->ref_d32, (size_t)n, -INFINITY, INFINITY);
    }
    return 0;
}

enum { RUN = 0, RUN_PAIRS = 1, RUN_D32 = 2 };

/* Runs kern (run, run_pairs or run_d32, as `pairs` says) on the first m activation rows into
 * dst [rows][n], in two calls split at its n_step; returns max |dst - want| (NaN counts as
 * infinite) and where. */
static float selfcheck_run(const pk_kernel *kern, int pairs, int m, const selfcheck_case *c, const void *packed,
                           float *dst, int *at_row, int *at_col) {
    const int n = c->n, step = kern->n_step > 0 && kern->n_step < n ? kern->n_step : 1;
    pk_lhs lhs = c->lhs;
    lhs.m = m;
    if (pairs == RUN_D32) {
        lhs.bscale = c->bscale;
        kern->run_d32(m, 0, step, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
        kern->run_d32(m, step, n, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
    } else if (pairs) {
        kern->run_pairs(m, 0, step, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
        kern->run_pairs(m, step, n, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
    } else {
        kern->run(m, 0, step, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
        kern->run(m, step, n, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
    }
    const float *want = pairs == RUN_D32 ? c->ref_d32 : pairs ? c->ref_pairs : c->ref;
    float worst = 0.0f;
    *at_row = *at_col = 0;
    for (int i = 0; i < (pairs == RUN_PAIRS ? m / 2 : m); i++)
        for (int j = 0; j < n; j++) {
            float d = fabsf(dst[(size_t)i * n + j] - want[(size_t)i * n + j]);
            if (d != d) d = INFINITY;
            if (d > worst) {
                worst = d;
                *at_row = i;
                *at_col = j;
            }
        }
    return worst;
}

/* Checks one kernel on case c; returns 0, or -1 after printing the warning. */
static int selfcheck_kernel(const pk_kernel *kern, const selfcheck_case *c, float *dst) {
    void *packed = NULL;
    if (kern->rhs_pack) {
        const size_t bytes = kern->rhs_packed_size(&c->rhs);
        if (posix_memalign(&packed, 64, bytes ? bytes : 64)) return 0;   /* out of memory: unchecked */
        kern->rhs_pack(&c->rhs, packed);
    }
    const int ms[2] = {1, kern->m_min > 1 ? kern->m_min : 1};
    const int mps[2] = {2, kern->m_min > 2 ? (kern->m_min + 1) & ~1 : 2};
    int rc = 0;
    for (int pairs = RUN; pairs <= RUN_D32 && !rc; pairs++) {
        if ((pairs == RUN_PAIRS && !kern->run_pairs) || (pairs == RUN_D32 && (!kern->run_d32 || kern->fmt == PK_FMT_QSI8CX)))
            continue;
        for (int t = 0; t < 2 && !rc; t++) {
            const int m = pairs == RUN_PAIRS ? mps[t] : ms[t];
            if (t == 1 && m == (pairs == RUN_PAIRS ? mps[0] : ms[0])) break;
            int row = 0, col = 0;
            const float d = selfcheck_run(kern, pairs, m, c, packed, dst, &row, &col);
            const float bound = pairs == RUN_PAIRS ? 2.0f * c->tol : c->tol;
            if (!(d <= bound)) {
                fprintf(stderr,
                        "pyklei: warning: kernel %s failed its self-check against the scalar kernel "
                        "(%s m=%d n=%d k=%d bl=%d: max |diff| %.3g at [%d][%d], bound %.3g); "
                        "using the next best\n",
                        kern->name, pairs == RUN_D32 ? "run_d32" : pairs ? "run_pairs" : "run", m, c->n, c->k,
                        c->bl, d, row, col, bound);
                rc = -1;
            }
        }
    }
    free(packed);
    return rc;
}

void pk_self_check(int n, const pk_kernel *const *kernels, int *failed, int log) {
    static const struct { pk_format fmt; int k, bl; } shapes[] = {
        {PK_FMT_QSI4C32, 256, 32}, {PK_FMT_QSI4C32, 256, 128}, {PK_FMT_QSI6C32, 256, 32},
        {PK_FMT_QSI8CX, 263, 0},
    };
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n; i++) failed[i] = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const pk_format fmt = shapes[s].fmt;
        /* the kernels of this format not failed yet (one failure is enough: no second warning) */
        int cand[PK_SELFCHECK_MAX], n_cand = 0;
        for (int i = 0; i < n && n_cand < PK_SELFCHECK_MAX; i++)
            if (kernels[i]->fmt == fmt && !failed[i]) cand[n_cand++] = i;
        if (!n_cand) continue;
        int m = 2, n_step = 1;
        for (int i = 0; i < n_cand; i++) {
            const pk_kernel *kern = kernels[cand[i]];
            m = (kern->m_min + 1) / 2 * 2 > m ? (kern->m_min + 1) / 2 * 2 : m;
            n_step = kern->n_step > n_step ? kern->n_step : n_step;
        }
        selfcheck_case c;
        float *dst = NULL;
        /* out of memory while the table is built: the kernels stay unchecked */
        if (!selfcheck_case_make(&c, fmt, m, 2 * n_step + 5, shapes[s].k, shapes[s].bl, 0x5EED0000u + (uint32_t)s) &&
            (dst = malloc(sizeof(float) * (size_t)m * c.n)))
            for (int i = 0; i < n_cand; i++)
                if (selfcheck_kernel(kernels[cand[i]], &c, dst)) failed[cand[i]] = 1;
        free(dst);
        selfcheck_case_free(&c);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!log) return;
    char line[2048] = "";
    size_t len = 0;
    for (int i = 0; i < n && len < sizeof line; i++)
        if (!failed[i])
            len += (size_t)snprintf(line + len, sizeof line - len, "%s%s", len ? ", " : "", kernels[i]->name);
    fprintf(stderr, "pyklei: self-check passed (%.2f ms): %s\n",
            (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6,
            len ? line : "no SIMD kernel in the table");
}
