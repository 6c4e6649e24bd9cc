/* Weight preparation for the dispatch table: the repacked copies (contract/pk_pack.h) its
 * kernels read, which copies a weight needs, and whether its canonical arrays are still read.
 * The canonical part (shape checks, row sums) is pk_rhs.c's, which the self-check uses too. */
#include "pk_ops_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- weights --------------------------------------------------------------------------- */

/* Kernels that share a layout (the same rhs_pack) share one buffer, on 2 MB pages
 * (pk_arena.c: a GEMV streams it once per token). */
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
    void *p = pk_packed_alloc(bytes);
    if (!p) return fail("out of memory repacking for %s", kern->name);
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
    if (pk_rhs_prepare_canonical(rhs, fmt, n, k, bl, qs, scales)) return -1;
    /* Repack for every kernel the table may choose for this format, and for `extra`. */
    for (int i = 0; i < pk_n_usable[fmt]; i++)
        if (add_packed(rhs, pk_usable[fmt][i])) { pk_rhs_release(rhs); return -1; }
    if (add_packed(rhs, extra)) { pk_rhs_release(rhs); return -1; }
    return 0;
}

size_t pk_rhs_owned_bytes(const pk_rhs *rhs) {
    size_t b = (rhs->rsum ? sizeof(float) : sizeof(int32_t)) * (size_t)rhs->n;
    for (int i = 0; i < PK_MAX_PACKED; i++) b += rhs->packed_bytes[i];
    return b;
}

const void *pk_rhs_packed_for(const pk_rhs *rhs, const pk_kernel *kern) {
    if (!kern->rhs_pack) return NULL;
    const int i = packed_slot(rhs, kern);
    return i < 0 ? NULL : rhs->packed[i];
}

int pk_rhs_needs_canonical(const pk_rhs *rhs) {
    if (pk_dispatch_init()) return 1;
    /* the table's kernels in its order, up to the first one taking any m (later ones are
     * never picked); the scalar fallback inside kernels is not counted (out of memory only) */
    for (int i = 0; i < pk_n_usable[rhs->fmt]; i++) {
        const pk_kernel *kern = pk_usable[rhs->fmt][i];
        if (!pk_rhs_packed_for(rhs, kern)) return 1;
        if (kern->m_min <= 1) return 0;
    }
    return 1;
}
