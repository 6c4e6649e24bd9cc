/* f16 in the kernel layer: the cache writer's f32 -> f16 (and -> bf16) rows, and the choice of the f16 -> f32
 * conversion a KV cache is read through (the ISA files' helper records; PYKLEI_KERNEL's ISA
 * tags steer it, PYKLEI_LOG=kernels names it). The element conversions themselves are the
 * contract's (pk_f16_to_f32, pk_f32_to_f16: contract/pk_format.h). */
#include "pk_nn.h"

#include <stdio.h>
#include <stdlib.h>

#include "pk_ops_internal.h"   /* the helper records, pk_force_names_isa, pk_log_kernels */

PK_CLONES void pk_f32_to_f16_row(int n, const float *x, uint16_t *out) {
    for (int i = 0; i < n; i++) out[i] = pk_f32_to_f16(x[i]);
}

PK_CLONES void pk_f32_to_bf16_row(int n, const float *x, uint16_t *out) {
    for (int i = 0; i < n; i++) out[i] = pk_kv_bf16_round(x[i]);
}

/* The f16 -> f32 conversions come from the registry's helper records (widest first, the
 * scalar one, pk_f16_to_f32_scalar of isa/fwht_f16_qai8dx_scalar.c, last). */
pk_f16_to_f32_fn pk_f16_to_f32_for_isa(const char *isa) {
    const pk_isa_helpers *h = pk_isa_helpers_for(isa);
    return h ? h->f16_to_f32 : NULL;
}

pk_f16_to_f32_fn pk_f16_to_f32_pick(const char **isa) {
    const char *force = getenv("PYKLEI_KERNEL");
    const int n_helpers = pk_isa_helpers_count();
    int named = 0;
    for (int i = 0; force && *force && i < n_helpers; i++)
        named |= pk_isa_helpers_at(i)->f16_to_f32 && pk_force_names_isa(force, pk_isa_helpers_at(i)->isa);
    const pk_isa_helpers *pick = pk_isa_helpers_at(n_helpers - 1);   /* generic, also when the forced ISAs cannot run here */
    for (int i = 0; i < n_helpers - 1; i++) {
        const pk_isa_helpers *h = pk_isa_helpers_at(i);
        if (h->f16_to_f32 && (!named || pk_force_names_isa(force, h->isa)) && pk_f16_to_f32_for_isa(h->isa)) {
            pick = h;
            break;
        }
    }
    if (pk_dispatch_init() == 0 && pk_log_kernels > 0)
        fprintf(stderr, "pyklei: f16 KV cache read with f16_to_f32_%s\n", pick->isa);
    if (isa) *isa = pick->isa;
    return pick->f16_to_f32;
}
