#include "pk_matmul.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

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

static void break_kernel_for_test(const char *name);
static void self_check_usable(void);

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
    const char *brk = getenv("PYKLEI_TEST_BREAK_KERNEL");
    if (brk && *brk) break_kernel_for_test(brk);
    self_check_usable();
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

/* pk_rhs_prepare without the dispatch table: checks the shape, fills rhs and computes the row
 * sums; no repacked copy. The self-check calls it while the table is being built (inside
 * pk_dispatch_init's pthread_once, which pk_rhs_prepare would wait on forever). */
static int rhs_prepare_canonical(pk_rhs *rhs, pk_format fmt, int n, int k, int bl, const void *qs,
                                 const void *scales) {
    memset(rhs, 0, sizeof *rhs);
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
    return 0;
}

int pk_rhs_prepare(pk_rhs *rhs, pk_format fmt, int n, int k, int bl, const void *qs,
                   const void *scales, const pk_kernel *extra) {
    memset(rhs, 0, sizeof *rhs);
    if (pk_dispatch_init()) return -1;
    if (rhs_prepare_canonical(rhs, fmt, n, k, bl, qs, scales)) return -1;
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

/* ---- self-check: the table's SIMD kernels against the scalar ones ---------------------- */

/* Most SIMD kernels have only run on the CPUs where CI runs (the AMX ones only through their
 * emulated twin). So when the table is built, every kernel it could pick other than the
 * scalar ones computes a few small cases and must agree with the scalar kernel of its format
 * (pk_kernels_scalar). A kernel that does not (a code path wrong on this CPU, a compiler or
 * feature-detection surprise) leaves the table with a warning on stderr, and the next best
 * kernel takes its calls; the scalar kernel never leaves (it is the reference).
 *
 * Which kernels: those of usable[fmt] ranked above the scalar kernel. The ones below it (the
 * priority -1 test twins, unless forced) are never picked, since the scalar kernel takes
 * every m; checking them would only cost time (the AMX twin is a slow C model of the tiles).
 *
 * Cases, per format: K = 256 (qsi4c32 with bl = 32 and bl = 128; qsi6c32) or K = 263 (qsi8cx
 * takes any K: a tail of 7); N = 2 n_step + 5 for the largest n_step among the checked
 * kernels (two panels and a ragged tail), computed in two calls split at the kernel's own
 * n_step, as threads split N; m = 1 and m = m_min; run_pairs with 2 and with m_min (rounded
 * up to even) rows. Data from a small LCG: every int8 / int4 / int6 value, zero points of
 * both signs, scales of both signs; the kernel's own rhs_pack makes its copy of the weight.
 *
 * Tolerance: kernels compute exact int32 block dots and differ from the scalar kernel only
 * in the float32 order of the block sums and of the zero-point term. Each result is within
 * (nb + 24) u T of the exact value (u = 2^-24; T the sum of the magnitudes of all terms; see
 * tolerance() in tests/test_kernels.py), so two kernels agree within 2 (nb + 24) u T. Here T
 * is bounded for all outputs at once by ascale_max * K * (128 + 128 + 256) * wmax; with this
 * data the bound is about 1e-4 of the largest output (the largest difference seen here: 2e-6,
 * 1/4000 of the bound), while one wrong product (one k of one output) moves that output by
 * about 1e-2 of it: a real bug lands far above the bound. A run_pairs output sums two
 * products: twice the bound.
 *
 * Cost, measured on this project's Xeon (AVX-512 VNNI and AVX-VNNI, -O3): 0.9 ms once per
 * process for the 14 kernels checked there, of which 0.65 ms the scalar reference and about
 * 20 us per kernel. No switch turns it off: a benchmark does not see a millisecond at start. */

static uint32_t selfcheck_rand(uint32_t *state) {   /* LCG (Numerical Recipes); top 24 bits */
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

static const pk_kernel *scalar_kernel(pk_format fmt) {
    for (int i = 0; i < pk_kernels_scalar_count; i++)
        if (pk_kernels_scalar[i].fmt == fmt) return &pk_kernels_scalar[i];
    return NULL;
}

/* The kernels of usable[fmt] ranked above the scalar kernel (the ones the table can pick). */
static int selfcheck_candidates(pk_format fmt, const pk_kernel **out) {
    int n = 0;
    for (int i = 0; i < n_usable[fmt] && strcmp(usable[fmt][i]->isa, "scalar"); i++) out[n++] = usable[fmt][i];
    return n;
}

/* Removes kern from usable[fmt]. If that empties it (PYKLEI_KERNEL forced only failing
 * kernels of this format), the scalar kernel takes their place. */
static void drop_usable(pk_format fmt, const pk_kernel *kern) {
    int j = 0;
    for (int i = 0; i < n_usable[fmt]; i++)
        if (usable[fmt][i] != kern) usable[fmt][j++] = usable[fmt][i];
    n_usable[fmt] = j;
    if (j == 0) usable[fmt][n_usable[fmt]++] = scalar_kernel(fmt);
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
    if (!c->qs || !c->scales || !c->q || !c->ascale || !c->zp || !c->ref || !c->ref_pairs) return -1;
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
    c->lhs = (pk_lhs){m, k, c->q, ld, c->ascale, c->zp};
    const float t_max = ldexpf(1.0f, -5) * (float)k * 512.0f * wmax;
    c->tol = 2.0f * (float)(nb + 24) * ldexpf(1.0f, -24) * t_max;
    if (rhs_prepare_canonical(&c->rhs, fmt, n, k, bl, c->qs, c->scales)) return -1;
    scalar_kernel(fmt)->run(m, 0, n, &c->lhs, &c->rhs, NULL, c->ref, (size_t)n, -INFINITY, INFINITY);
    for (int t = 0; t < m / 2; t++)
        for (int j = 0; j < n; j++)
            c->ref_pairs[(size_t)t * n + j] = c->ref[(size_t)(2 * t) * n + j] + c->ref[(size_t)(2 * t + 1) * n + j];
    return 0;
}

/* Runs kern (run_pairs if pairs) on the first m activation rows into dst [rows][n], in two
 * calls split at its n_step; returns max |dst - want| (NaN counts as infinite) and where. */
static float selfcheck_run(const pk_kernel *kern, int pairs, int m, const selfcheck_case *c, const void *packed,
                           float *dst, int *at_row, int *at_col) {
    const int n = c->n, step = kern->n_step > 0 && kern->n_step < n ? kern->n_step : 1;
    pk_lhs lhs = c->lhs;
    lhs.m = m;
    if (pairs) {
        kern->run_pairs(m, 0, step, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
        kern->run_pairs(m, step, n, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
    } else {
        kern->run(m, 0, step, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
        kern->run(m, step, n, &lhs, &c->rhs, packed, dst, (size_t)n, -INFINITY, INFINITY);
    }
    const float *want = pairs ? c->ref_pairs : c->ref;
    float worst = 0.0f;
    *at_row = *at_col = 0;
    for (int i = 0; i < (pairs ? m / 2 : m); i++)
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
    for (int pairs = 0; pairs < (kern->run_pairs ? 2 : 1) && !rc; pairs++)
        for (int t = 0; t < 2 && !rc; t++) {
            const int m = pairs ? mps[t] : ms[t];
            if (t == 1 && m == (pairs ? mps[0] : ms[0])) break;
            int row = 0, col = 0;
            const float d = selfcheck_run(kern, pairs, m, c, packed, dst, &row, &col);
            const float bound = pairs ? 2.0f * c->tol : c->tol;
            if (!(d <= bound)) {
                fprintf(stderr,
                        "pyklei: warning: kernel %s failed its self-check against the scalar kernel "
                        "(%s m=%d n=%d k=%d bl=%d: max |diff| %.3g at [%d][%d], bound %.3g); "
                        "using the next best\n",
                        kern->name, pairs ? "run_pairs" : "run", m, c->n, c->k, c->bl, d, row, col, bound);
                rc = -1;
            }
        }
    free(packed);
    return rc;
}

static void self_check_usable(void) {
    static const struct { pk_format fmt; int k, bl; } shapes[] = {
        {PK_FMT_QSI4C32, 256, 32}, {PK_FMT_QSI4C32, 256, 128}, {PK_FMT_QSI6C32, 256, 32},
        {PK_FMT_QSI8CX, 263, 0},
    };
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const pk_format fmt = shapes[s].fmt;
        const pk_kernel *cand[MAX_KERNELS];
        const int n_cand = selfcheck_candidates(fmt, cand);
        if (!n_cand) continue;
        int m = 2, n_step = 1;
        for (int i = 0; i < n_cand; i++) {
            m = (cand[i]->m_min + 1) / 2 * 2 > m ? (cand[i]->m_min + 1) / 2 * 2 : m;
            n_step = cand[i]->n_step > n_step ? cand[i]->n_step : n_step;
        }
        selfcheck_case c;
        float *dst = NULL;
        /* out of memory while the table is built: the kernels stay unchecked */
        if (!selfcheck_case_make(&c, fmt, m, 2 * n_step + 5, shapes[s].k, shapes[s].bl, 0x5EED0000u + (uint32_t)s) &&
            (dst = malloc(sizeof(float) * (size_t)m * c.n)))
            for (int i = 0; i < n_cand; i++)
                if (selfcheck_kernel(cand[i], &c, dst)) drop_usable(fmt, cand[i]);
        free(dst);
        selfcheck_case_free(&c);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!log_kernels) return;
    char line[2048] = "";
    size_t len = 0;
    for (int f = 0; f < PK_FMT_COUNT; f++) {
        const pk_kernel *cand[MAX_KERNELS];
        const int n_cand = selfcheck_candidates((pk_format)f, cand);
        for (int i = 0; i < n_cand && len < sizeof line; i++)
            len += (size_t)snprintf(line + len, sizeof line - len, "%s%s", len ? ", " : "", cand[i]->name);
    }
    fprintf(stderr, "pyklei: self-check passed (%.2f ms): %s\n",
            (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6,
            len ? line : "no SIMD kernel in the table");
}

/* ---- test hook: PYKLEI_TEST_BREAK_KERNEL ------------------------------------------------- */

/* Tests only (docs/KERNELS.md): PYKLEI_TEST_BREAK_KERNEL=<kernel name> replaces that kernel's
 * entry in the table by a copy whose outputs are corrupted after the real kernel wrote them,
 * so that a test can watch the self-check catch a kernel that really computes wrong logits.
 * The table holds the copy instead of the kernel: no branch on any call when unset. */
static const pk_kernel *broken_real;   /* the kernel whose entry was replaced */
static pk_kernel broken_copy;          /* its replacement */

static void corrupt_rows(int rows, int n0, int n1, float *dst, size_t ldd) {
    for (int i = 0; i < rows; i++)   /* v + 1 + |v| != v for every finite v */
        for (int j = n0; j < n1; j++) dst[(size_t)i * ldd + j] += 1.0f + fabsf(dst[(size_t)i * ldd + j]);
}

static void broken_run(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed,
                       float *dst, size_t ldd, float lo, float hi) {
    broken_real->run(m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi);
    corrupt_rows(m, n0, n1, dst, ldd);
}

static void broken_run_pairs(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed,
                             float *dst, size_t ldd, float lo, float hi) {
    broken_real->run_pairs(m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi);
    corrupt_rows(m / 2, n0, n1, dst, ldd);
}

static void break_kernel_for_test(const char *name) {
    for (int f = 0; f < PK_FMT_COUNT; f++)
        for (int i = 0; i < n_usable[f]; i++) {
            const pk_kernel *kern = usable[f][i];
            if (strcmp(kern->name, name) || !strcmp(kern->isa, "scalar")) continue;
            broken_real = kern;
            broken_copy = *kern;
            broken_copy.run = broken_run;
            broken_copy.run_pairs = kern->run_pairs ? broken_run_pairs : NULL;
            usable[f][i] = &broken_copy;
            return;
        }
    fprintf(stderr, "pyklei: warning: PYKLEI_TEST_BREAK_KERNEL=%s: no SIMD kernel of that name in the "
                    "dispatch table; nothing broken\n", name);
}

const pk_kernel *pk_test_broken_kernel(void) {
    return pk_dispatch_init() || !broken_real ? NULL : &broken_copy;
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
