/* The PYKLEI_TEST_BREAK_KERNEL hook of test builds (tests/kernels/c/pk_testhook.c; docs/KERNELS.md). */
#ifndef PK_TESTHOOK_H
#define PK_TESTHOOK_H

#include "contract/pk_kernel.h"

/* checked[i] = the kernel record the self-check runs for kernels[i]: kernels[i] itself, except
 * for the SIMD kernel that PYKLEI_TEST_BREAK_KERNEL names, whose corrupted copy stands in.
 * Called by the dispatcher (ops/pk_dispatch.c) while it builds its table, where linked in. */
void pk_test_hook_kernels_to_check(int n, const pk_kernel *const *kernels, const pk_kernel **checked);

/* After pk_dispatch_init: with PYKLEI_TEST_BREAK_KERNEL=<name>, the corrupted copy of that
 * kernel which the self-check ran in its place (and so dropped the kernel from the table), so
 * that a test can show it computes wrong results; NULL otherwise. */
const pk_kernel *pk_test_broken_kernel(void);

#endif
