/* Dispatch: the table of usable kernels per format, built once from the registry
 * (pk_registry.c), the CPU features and PYKLEI_KERNEL (forcing), less the kernels that fail
 * the self-check (pk_selfcheck.c); the PYKLEI_LOG=kernels log of which kernel ran which
 * shape. This file is the only writer of the table. It calls down only (registry,
 * self-check, errors); the files that use the table (pk_weights.c, pk_matmul.c, ...) call it. */
#include "pk_ops_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- logging ------------------------------------------------------------------------ */

/* PYKLEI_LOG=kernels (or 1): one stderr line per distinct (kernel, activations, m, n, k); a
 * call on qsi8d32 activations names the kernel qsi8d32_<its name after the first '_'>, the
 * contract it ran (its run_d32). */
int pk_log_kernels = -1;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t logged[512];

void pk_log_call(const pk_kernel *kern, int d32, int m, int n, int k) {
    if (!pk_log_kernels) return;
    const uint64_t key = (((uint64_t)(uintptr_t)kern + (uint64_t)d32) * 0x9E3779B97F4A7C15ull)
                       ^ ((uint64_t)m << 42) ^ ((uint64_t)n << 21) ^ (uint64_t)k;
    pthread_mutex_lock(&log_lock);
    for (size_t i = 0; i < sizeof logged / sizeof logged[0]; i++) {
        size_t slot = (key + i) % (sizeof logged / sizeof logged[0]);
        if (logged[slot] == key) break;
        if (logged[slot] == 0) {
            logged[slot] = key;
            const char *rest = strchr(kern->name, '_');
            fprintf(stderr, "pyklei: matmul %s m=%d n=%d k=%d -> %s%s\n", pk_format_name(kern->fmt), m, n, k,
                    d32 ? "qsi8d32" : "", d32 && rest ? rest : kern->name);
            break;
        }
    }
    pthread_mutex_unlock(&log_lock);
}

/* Whether PYKLEI_KERNEL's list names ISA tag `isa`, as a tag or as a kernel name's suffix
 * (qai8dx_qsi4c32_1x4_avx2 names avx2; the Arm dotprod and i8mm kernels name neon): the
 * helpers outside the matmul table (FWHTs, f16 conversions) follow the forced ISA this way. */
int pk_force_names_isa(const char *list, const char *isa) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        const char *tag = strrchr(tok, '_') ? strrchr(tok, '_') + 1 : tok;
        if (!strcmp(tag, isa)) return 1;
        if (!strcmp(isa, "neon") && (!strcmp(tag, "dotprod") || !strcmp(tag, "i8mm"))) return 1;
    }
    return 0;
}

/* ---- dispatch table, built once -------------------------------------------------------- */

static pthread_once_t dispatch_once = PTHREAD_ONCE_INIT;
static int dispatch_status = 0;
static char dispatch_error[512];
const pk_kernel *pk_usable[PK_FMT_QUANT_COUNT][PK_MAX_KERNELS];  /* sorted by priority, best first */
int pk_n_usable[PK_FMT_QUANT_COUNT];

static int forced_match(const char *list, const pk_kernel *kern) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save))
        if (!strcmp(tok, kern->name) || !strcmp(tok, kern->isa)) return 1;
    return 0;
}

/* Runs the self-check on the kernels the table can pick (those ranked above the scalar kernel
 * of their format) and drops the ones that fail; a format left with none (PYKLEI_KERNEL forced
 * only failing kernels) gets its scalar kernel, the reference, which never leaves. Test builds
 * only: PYKLEI_TEST_BREAK_KERNEL has the check run a corrupted copy of the kernel it names
 * (tests/kernels/c/pk_testhook.c, linked in where the weak pk_test_hook_kernels_to_check is not NULL),
 * so that kernel fails; the table itself only ever holds registry records. */
static void drop_failing_kernels(void) {
    enum { N = PK_SELFCHECK_MAX };
    const pk_kernel *all[N], *checked[N], *cand[N];
    int n = 0, n_cand = 0, cand_at[N], failed[N], dropped[N] = {0};
    for (int f = 0; f < PK_FMT_QUANT_COUNT; f++)
        for (int i = 0; i < pk_n_usable[f]; i++) all[n++] = pk_usable[f][i];
    for (int i = 0; i < n; i++) checked[i] = all[i];
    if (pk_test_hook_kernels_to_check) pk_test_hook_kernels_to_check(n, all, checked);
    for (int f = 0, at = 0; f < PK_FMT_QUANT_COUNT; at += pk_n_usable[f], f++)
        for (int i = 0; i < pk_n_usable[f] && strcmp(pk_usable[f][i]->isa, "scalar"); i++) {
            cand[n_cand] = checked[at + i];
            cand_at[n_cand++] = at + i;
        }
    pk_self_check(n_cand, cand, failed, pk_log_kernels);
    for (int c = 0; c < n_cand; c++) dropped[cand_at[c]] = failed[c];
    for (int f = 0, at = 0; f < PK_FMT_QUANT_COUNT; f++) {
        const int had = pk_n_usable[f];
        int kept = 0;
        for (int i = 0; i < had; i++)
            if (!dropped[at + i]) pk_usable[f][kept++] = pk_usable[f][i];
        if (kept == 0) pk_usable[f][kept++] = pk_kernel_scalar_for((pk_format)f);
        pk_n_usable[f] = kept;
        at += had;
    }
}

static void build_dispatch(void) {
    const char *lv = getenv("PYKLEI_LOG");
    pk_log_kernels = lv && (strstr(lv, "kernel") || !strcmp(lv, "1"));
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
    for (int f = 0; f < PK_FMT_QUANT_COUNT; f++) {
        int forced_any = 0;
        for (int i = 0; force && i < pk_kernel_count(); i++)
            forced_any |= pk_kernel_at(i)->fmt == (pk_format)f && forced_match(force, pk_kernel_at(i));
        pk_n_usable[f] = 0;
        for (int i = 0; i < pk_kernel_count() && pk_n_usable[f] < PK_MAX_KERNELS; i++) {
            const pk_kernel *kern = pk_kernel_at(i);
            if (kern->fmt != (pk_format)f || !pk_kernel_supported(kern)) continue;
            if (forced_any && !forced_match(force, kern)) continue;
            int j = pk_n_usable[f]++;
            while (j > 0 && pk_usable[f][j - 1]->priority < kern->priority) {
                pk_usable[f][j] = pk_usable[f][j - 1];
                j--;
            }
            pk_usable[f][j] = kern;
        }
        if (pk_n_usable[f] == 0) {
            snprintf(dispatch_error, sizeof dispatch_error, "no usable %s kernel", pk_format_name(f));
            dispatch_status = -1;
            return;
        }
    }
    if (pk_log_kernels)
        fprintf(stderr, "pyklei: CPU features: %s%s%s\n", pk_cpu_features_string(pk_cpu_features()),
                force ? "; PYKLEI_KERNEL=" : "", force ? force : "");
    drop_failing_kernels();
}

int pk_dispatch_init(void) {
    pthread_once(&dispatch_once, build_dispatch);
    if (dispatch_status) return fail("%s", dispatch_error);
    return 0;
}

const pk_kernel *pk_dispatch_select(pk_format fmt, int m) {
    if (pk_dispatch_init() || fmt < 0 || fmt >= PK_FMT_QUANT_COUNT) return NULL;
    const pk_kernel *fallback = NULL;
    for (int i = 0; i < pk_n_usable[fmt]; i++) {
        const pk_kernel *kern = pk_usable[fmt][i];
        if (kern->m_min <= m) return kern;
        if (!fallback || kern->m_min < fallback->m_min) fallback = kern;
    }
    return fallback;
}
