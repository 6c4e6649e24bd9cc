/* Tests only: the PYKLEI_TEST_BREAK_KERNEL hook (docs/KERNELS.md), compiled into test builds
 * only: the C test programs (scripts/test_arm.sh, scripts/test_sanitizers.sh) and the
 * extension built with PYKLEI_TEST_HOOKS=1 (setup.py; scripts/test.sh builds it so). The
 * dispatcher (pyklei_ext/ops/pk_dispatch.c) holds a weak reference to
 * pk_test_hook_kernels_to_check: where this file is not linked in, the reference is NULL and
 * no test code exists. The hook only tells the dispatcher which kernel record the self-check
 * should run in place of the named kernel, and the self-check's verdict does the rest; the
 * registry stays a constant table and the dispatch table never holds anything but its
 * records. */
#include "contract/pk_kernel.h"
#include "pk_testhook.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* PYKLEI_TEST_BREAK_KERNEL=<kernel name> stands that kernel in, for the self-check, by a copy
 * whose outputs are corrupted after the real kernel wrote them, so that a test can watch the
 * self-check catch a kernel that really computes wrong logits (and then run the copy itself,
 * pk_test_broken_kernel). Unset, nothing here runs after the table is built: no branch on any
 * matmul call. Written once, inside the dispatcher's pthread_once, and read only after it. */
static const pk_kernel *broken_real;   /* the kernel the variable named */
static pk_kernel broken_copy;          /* its corrupted copy */

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

void pk_test_hook_kernels_to_check(int n, const pk_kernel *const *kernels, const pk_kernel **checked) {
    for (int i = 0; i < n; i++) checked[i] = kernels[i];
    const char *name = getenv("PYKLEI_TEST_BREAK_KERNEL");
    if (!name || !*name) return;
    for (int i = 0; i < n; i++) {
        const pk_kernel *kern = kernels[i];
        if (strcmp(kern->name, name) || !strcmp(kern->isa, "scalar")) continue;
        broken_real = kern;
        broken_copy = *kern;
        broken_copy.run = broken_run;
        broken_copy.run_pairs = kern->run_pairs ? broken_run_pairs : NULL;
        checked[i] = &broken_copy;
        return;
    }
    fprintf(stderr, "pyklei: warning: PYKLEI_TEST_BREAK_KERNEL=%s: no SIMD kernel of that name in the "
                    "dispatch table; nothing broken\n", name);
}

const pk_kernel *pk_test_broken_kernel(void) {
    return broken_real ? &broken_copy : NULL;
}
