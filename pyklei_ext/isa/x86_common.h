/* Helpers shared by the x86 kernel files (matmul_x86_avx2.c, matmul_x86_avxvnni.c,
 * matmul_x86_avx512vnni.c, matmul_x86_amx.c): per-thread scratch buffers and the fallback to
 * the scalar reference (pk_scalar_run, contract/pk_kernel.h).
 *
 * The GEMM kernels transpose a panel of weight rows into a per-thread buffer per call;
 * the GEMV kernels rearrange the activation row once per call. Those buffers
 * are per thread, grow on demand, are reused across calls and freed when the thread exits. */
#ifndef PK_X86_COMMON_H
#define PK_X86_COMMON_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "../contract/pk_kernel.h"

#define PK_SCRATCH_SLOTS 4

typedef struct {
    void *p[PK_SCRATCH_SLOTS];
    size_t cap[PK_SCRATCH_SLOTS];
} pk_scratch_set;

static pthread_key_t pk_scratch_key;
static pthread_once_t pk_scratch_once = PTHREAD_ONCE_INIT;
static int pk_scratch_key_ok;

static void pk_scratch_free(void *v) {
    pk_scratch_set *s = v;
    for (int i = 0; i < PK_SCRATCH_SLOTS; i++) free(s->p[i]);
    free(s);
}

static void pk_scratch_init(void) {
    pk_scratch_key_ok = pthread_key_create(&pk_scratch_key, pk_scratch_free) == 0;
}

/* A 64-byte aligned per-thread buffer of at least `bytes` (slot < PK_SCRATCH_SLOTS); its
 * contents are undefined. NULL when out of memory. */
static void *pk_scratch(int slot, size_t bytes) {
    pthread_once(&pk_scratch_once, pk_scratch_init);
    if (!pk_scratch_key_ok) return NULL;
    pk_scratch_set *s = pthread_getspecific(pk_scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || pthread_setspecific(pk_scratch_key, s)) { free(s); return NULL; }
    }
    if (s->cap[slot] < bytes) {
        free(s->p[slot]);
        s->p[slot] = NULL;
        s->cap[slot] = 0;
        const size_t cap = ((bytes + bytes / 4 + 4096) + 63) & ~(size_t)63;
        void *p = NULL;
        if (posix_memalign(&p, 64, cap)) return NULL;
        s->p[slot] = p;
        s->cap[slot] = cap;
    }
    return s->p[slot];
}

/* When scratch memory cannot be had, a kernel hands its rows to the scalar reference. */
static void pk_run_scalar(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                          float *dst, size_t ldd, float lo, float hi) {
    pk_scalar_run(m, n0, n1, lhs, rhs, NULL, dst, ldd, lo, hi);
}

/* The same for run_pairs: the plane products of one row pair and up to 64 weight rows at a
 * time on the stack (through a view of those weight rows), then summed. */
static void pk_run_scalar_pairs(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                float *dst, size_t ldd, float lo, float hi) {
    float tmp[2][64];
    const int blocks = rhs->fmt != PK_FMT_QSI8CX;   /* bf16 block scales and rsum */
    const size_t row_bytes = pk_row_bytes(rhs->fmt, rhs->k);
    for (int c = n0; c < n1; c += 64) {
        const int w = n1 - c < 64 ? n1 - c : 64;
        pk_rhs sub = *rhs;   /* rows [c, c + w) */
        sub.n = w;
        sub.qs = rhs->qs + (size_t)c * row_bytes;
        if (blocks) {
            sub.scales = (const uint16_t *)rhs->scales + (size_t)c * (rhs->k / rhs->bl);
            sub.rsum = rhs->rsum + c;
        } else {
            sub.scales = (const float *)rhs->scales + c;
            sub.isum = rhs->isum + c;
        }
        for (int t = 0; t < m / 2; t++) {
            pk_lhs pair = *lhs;
            pair.m = 2;
            pair.q = lhs->q + (size_t)(2 * t) * lhs->ld;
            pair.scale = lhs->scale + 2 * t;
            pair.zp = lhs->zp + 2 * t;
            pk_run_scalar(2, 0, w, &pair, &sub, &tmp[0][0], 64, -INFINITY, INFINITY);
            for (int j = 0; j < w; j++) dst[(size_t)t * ldd + c + j] = pk_clampf(tmp[0][j] + tmp[1][j], lo, hi);
        }
    }
}

static inline size_t pk_round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

static inline int32_t pk_load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* GEMM activation side, shared by all x86 GEMM kernels: the int8 rows (copied only when K
 * needs padding to `kpad`) and the per-(row, block) correction that turns the dot product
 * with offset weights (w + off, off = 8 for int4, 128 for int8) back into sum(a * w):
 *     corr[i * nbc + b] = -off * sum_{k in block b} a[i, k]          (nbc = k / bl)
 * Returns 0, or -1 when out of memory. */
static int pk_gemm_lhs_prep(const pk_lhs *lhs, int m, int k, int kpad, int bl, int off,
                            const int8_t **a_out, size_t *lda_out, int32_t **corr_out) {
    const int nbc = k / bl;
    int32_t *corr = pk_scratch(1, sizeof(int32_t) * (size_t)m * (size_t)nbc);
    if (!corr) return -1;
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        for (int b = 0; b < nbc; b++) {
            int32_t s = 0;
            for (int kk = b * bl; kk < (b + 1) * bl; kk++) s += a[kk];
            corr[(size_t)i * nbc + b] = -off * s;
        }
    }
    if (kpad == k) {
        *a_out = lhs->q;
        *lda_out = lhs->ld;
    } else {
        const size_t lda = pk_round_up((size_t)kpad, 64);
        int8_t *buf = pk_scratch(2, lda * (size_t)m);
        if (!buf) return -1;
        for (int i = 0; i < m; i++) {
            memcpy(buf + (size_t)i * lda, lhs->q + (size_t)i * lhs->ld, (size_t)k);
            memset(buf + (size_t)i * lda + k, 0, lda - (size_t)k);
        }
        *a_out = buf;
        *lda_out = lda;
    }
    *corr_out = corr;
    return 0;
}

#endif
