/* The kernel registry: the ISA files' tables (contract/pk_kernel.h) seen as one constant list of
 * what kernels exist and their contracts, and their row helpers (FWHT, f16 conversion,
 * activation quantizer) as one list of records. Nothing here changes at run time: which of them the
 * dispatch table uses is pk_dispatch.c's business, the start-up check of them pk_selfcheck.c's,
 * and the test hook that breaks one on purpose tests/kernels/c/pk_testhook.c's (test builds only). */
#include "pk_ops_internal.h"

#include <string.h>

/* ---- registry: one table per ISA file ------------------------------------------------ */

static const struct { const pk_kernel *table; const int *count; } families[] = {
    {pk_kernels_scalar, &pk_kernels_scalar_count},
#if defined(__x86_64__)
    {pk_kernels_x86_avx2, &pk_kernels_x86_avx2_count},
    {pk_kernels_x86_avx512vnni, &pk_kernels_x86_avx512vnni_count},
    {pk_kernels_x86_avxvnni, &pk_kernels_x86_avxvnni_count},
    {pk_kernels_x86_amx, &pk_kernels_x86_amx_count},
#elif defined(__aarch64__)
    {pk_kernels_arm_neon, &pk_kernels_arm_neon_count},
#endif
};
#define N_FAMILIES ((int)(sizeof families / sizeof families[0]))

/* The row helpers (pk_isa_helpers), widest first: the order the ops files pick in. The last
 * record is the scalar one (isa/fwht_f16_qai8dx_scalar.c), which runs everywhere. */
static const pk_isa_helpers *const helpers[] = {
#if defined(__x86_64__)
    &pk_helpers_x86_avx512vnni,
    &pk_helpers_x86_avx2,
#elif defined(__aarch64__)
    &pk_helpers_arm_neon,
#endif
    &pk_helpers_scalar,
};

int pk_isa_helpers_count(void) { return (int)(sizeof helpers / sizeof helpers[0]); }

const pk_isa_helpers *pk_isa_helpers_at(int i) { return helpers[i]; }

const pk_isa_helpers *pk_isa_helpers_for(const char *isa) {
    for (int i = 0; i < pk_isa_helpers_count(); i++)
        if (!strcmp(helpers[i]->isa, isa) && (pk_cpu_features() & helpers[i]->features) == helpers[i]->features)
            return helpers[i];
    return NULL;
}

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

const pk_kernel *pk_kernel_scalar_for(pk_format fmt) {
    for (int i = 0; i < pk_kernels_scalar_count; i++)
        if (pk_kernels_scalar[i].fmt == fmt) return &pk_kernels_scalar[i];
    return NULL;
}
