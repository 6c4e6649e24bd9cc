/* The "p4" repacked weight layout (docs/FORMAT.md, "Runtime layout p4"): rows in tiles of
 * 4, interleaved in 64-byte slices, so that a kernel working on 4 rows streams one
 * contiguous run of memory instead of 4 (+4 scale) separate ones. Measured on the x86
 * AVX-512 GEMV at K = 2048 with weights far beyond the caches: 9.9 -> 26.7 GB/s on one core
 * (the hardware prefetchers follow one stream, not eight).
 *
 * Bytes: each weight row is R bytes (qsi4c32: K/2 nibble bytes in the canonical chunk
 * order; qsi8cx: K int8). Tile t holds rows 4t..4t+3 (rows >= N are zero):
 *     slice s (64 bytes) of rows 0, 1, 2, 3, then slice s + 1 of rows 0..3, ...
 *     then the last R % 64 bytes of rows 0, 1, 2, 3, back to back (no padding).
 * A tile is 4R bytes; the tiles follow each other.
 * qsi4c32 adds its scales after all tiles (offset rounded up to 64): per tile, per group of
 * 128 elements g = 0 .. ceil(K/128) - 1, per row r, spg = max(1, 128/bl) bf16 values, the
 * scales of the blocks that group covers (bl = 256: the block's scale, in both of its groups);
 * zero where the group runs past K.
 * The canonical arrays stay valid and are what row sums and the scalar fallback read. */
#ifndef PK_PACK_H
#define PK_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "pk_matmul.h"

typedef struct {
    size_t row_bytes;     /* R */
    size_t tile_bytes;    /* 4R */
    int tiles;            /* ceil(N / 4) */
    int groups;           /* qsi4c32: ceil(K / 128) scale groups per row */
    int spg;              /* qsi4c32: bf16 scales per (group, row) */
    size_t scales_off;    /* qsi4c32: byte offset of the scales region */
    size_t bytes;         /* whole packed buffer */
} pk_p4_geom;

pk_p4_geom pk_p4_geometry(const pk_rhs *rhs);

/* rhs_packed_size / rhs_pack of the kernels that read p4 (one buffer shared by them all). */
size_t pk_p4_size(const pk_rhs *rhs);
void pk_p4_pack(const pk_rhs *rhs, void *dst);

/* Address of byte `off` of row r (0..3) inside a tile. A read of up to 16 bytes from there
 * stays inside the row's piece when off is a multiple of 16 and R % 16 == 0. */
static inline const uint8_t *pk_p4_at(const uint8_t *tile, size_t row_bytes, int r, size_t off) {
    const size_t full = row_bytes & ~(size_t)63;
    if (off < full) return tile + (off & ~(size_t)63) * 4 + (size_t)64 * r + (off & 63);
    return tile + 4 * full + (row_bytes - full) * (size_t)r + (off - full);
}

/* bf16 scale of block b of weight row `row` in the p4 scales region. */
static inline uint16_t pk_p4_scale(const uint8_t *packed, const pk_p4_geom *g, int bl, int row, int b) {
    const uint16_t *s = (const uint16_t *)(packed + g->scales_off);
    const size_t grp = (size_t)b * bl / 128, j = ((size_t)b * bl % 128) / bl;
    return s[(((size_t)(row / 4) * g->groups + grp) * 4 + (row & 3)) * g->spg + j];
}

#endif
