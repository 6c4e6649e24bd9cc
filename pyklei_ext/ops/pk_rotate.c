#include "pk_rotate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pk_ops_internal.h"   /* the helper records, pk_set_error, pk_log_kernels */

/* The FWHTs come from the registry's helper records (widest first, the generic one last). */
int pk_rotation_use(pk_rotation *r, const char *isa) {
    const pk_isa_helpers *h = pk_isa_helpers_for(isa);
    if (!h || !h->fwht) return pk_set_error("rotation: no FWHT for ISA '%s' on this CPU", isa);
    r->fwht = h->fwht;
    r->fwht_isa = h->isa;
    return 0;
}

int pk_rotation_init(pk_rotation *r, int n, const float *signs, const float *mix) {
    memset(r, 0, sizeof *r);
    if (n <= 0 || !signs || !mix) return pk_set_error("rotation: size %d or its tensors missing", n);
    const int p = n & -n, m = n / p;
    if (m > 64) return pk_set_error("rotation: size %d has an odd factor %d > 64", n, m);
    r->n = n;
    r->m = m;
    r->p = p;
    r->signs = signs;
    r->mix = mix;
    const char *force = getenv("PYKLEI_KERNEL");
    int named = 0;
    const int n_helpers = pk_isa_helpers_count();
    for (int i = 0; force && *force && i < n_helpers; i++)
        named |= pk_isa_helpers_at(i)->fwht && pk_force_names_isa(force, pk_isa_helpers_at(i)->isa);
    for (int i = 0; i < n_helpers && !r->fwht; i++) {
        const pk_isa_helpers *h = pk_isa_helpers_at(i);
        if (h->fwht && (!named || pk_force_names_isa(force, h->isa))) pk_rotation_use(r, h->isa);
    }
    if (!r->fwht) pk_rotation_use(r, "scalar");   /* the forced ISAs cannot run here */
    if (pk_dispatch_init() == 0 && pk_log_kernels > 0)
        fprintf(stderr, "pyklei: rotation of %d (%d x %d): fwht_%s\n", n, m, p, r->fwht_isa);
    return 0;
}

/* x[c][:] <- s * sum_a x[a][:] * (transpose ? mix[c][a] : mix[a][c]) for m groups of p, in
 * place, a tile of MIX_T columns at a time: the tile's m x MIX_T sums go through `tile` (m t
 * <= n floats) and back while it is in L1. A pass over whole groups per (a, c) pair, then a
 * scale pass, took about half of SmolLM2's rotation. Each sum starts from 0 and adds the
 * separate products for a = 0, 1, ..., the plain loop's order, in every clone. */
#define MIX_T 16   /* columns per tile: one AVX-512 vector */
static inline __attribute__((always_inline)) void mix_tile(const pk_rotation *r, int transpose, float s, float *x,
                                                            float *restrict tile, int j0, const int t) {
    const int m = r->m, p = r->p;
    for (int c = 0; c < m; c++) {
        float acc[MIX_T] = {0};
        for (int a = 0; a < m; a++) {
            const float w = transpose ? r->mix[c * m + a] : r->mix[a * m + c];
            const float *restrict xa = x + (size_t)a * p + j0;
            for (int j = 0; j < t; j++) acc[j] += w * xa[j];
        }
        for (int j = 0; j < t; j++) tile[c * t + j] = acc[j] * s;
    }
    for (int c = 0; c < m; c++)
        for (int j = 0; j < t; j++) x[(size_t)c * p + j0 + j] = tile[c * t + j];
}

static inline __attribute__((always_inline)) void mix_groups(const pk_rotation *r, int transpose, float s, float *x,
                                                              float *tile) {
    int j0 = 0;
    for (; j0 + MIX_T <= r->p; j0 += MIX_T) mix_tile(r, transpose, s, x, tile, j0, MIX_T);
    if (j0 < r->p) mix_tile(r, transpose, s, x, tile, j0, r->p - j0);
}

/* Cloned (PK_CLONES): the sign, mix and scale loops are element-wise, so every clone gives
 * the baseline's bits; at SSE2 they cost about as much as the FWHTs beside them. */
PK_CLONES void pk_rotate_row(const pk_rotation *r, int transpose, float *x, float *scratch) {
    const int n = r->n, m = r->m, p = r->p;
    const float scale = 1.0f / sqrtf((float)p);
    if (!transpose) {   /* signs, then H within each group, then mix across groups */
        for (int i = 0; i < n; i++) x[i] *= r->signs[i];
        for (int a = 0; a < m; a++) r->fwht(p, x + (size_t)a * p);
        if (m > 1) {
            mix_groups(r, 0, scale, x, scratch);
        } else {
            const float s = scale * r->mix[0];
            for (int i = 0; i < n; i++) x[i] *= s;
        }
    } else {            /* the inverse order: mix^T, H, signs */
        if (m > 1) mix_groups(r, 1, 1.0f, x, scratch);
        for (int a = 0; a < m; a++) r->fwht(p, x + (size_t)a * p);
        const float s = m > 1 ? scale : scale * r->mix[0];
        for (int i = 0; i < n; i++) x[i] *= s * r->signs[i];
    }
}
