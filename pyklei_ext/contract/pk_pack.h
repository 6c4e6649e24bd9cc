/* Repacked weight layouts, made once at load for the kernels that read them (their
 * rhs_pack). docs/FORMAT.md has the bytes, docs/KERNELS.md why.
 *
 * p16 (qsi4c32): 16 rows per panel, unsigned nibbles (w + 8), two k-quads per 64 bytes:
 * the unpacked low nibbles of a 64-byte piece are one k-quad of 16 rows as dwords, the layout
 * vpdpbusd takes against a broadcast activation quad, so a GEMV and a GEMM over it run the
 * same per-output arithmetic (bit-identical results for any M).
 *
 * p4 (qsi8cx): rows in tiles of 4, interleaved in 64-byte slices, so that a GEMV working on
 * 4 rows streams one contiguous run of memory instead of 4 separate ones.
 *
 * The same panels hold qsi6c32 (the 6-bit lm_head): per 16 k, the two nibble pieces of qsi4c32
 * (low 4 bits of u = q + 32) and 64 bytes with the top 2 bits (docs/FORMAT.md).
 *
 * Why repack at all: a 1x4 GEMV over the canonical layout reads 4 weight rows (and, for
 * qsi4c32, 4 scale rows) at once; the hardware prefetchers do not keep up with 8 streams.
 * Measured on the AVX-512 GEMV at K = 2048 with weights far beyond the caches: 9.9 -> 26.7
 * GB/s on one core. The canonical arrays stay valid; row sums and the scalar fallback
 * read them. */
#ifndef PK_PACK_H
#define PK_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "pk_operands.h"   /* pk_rhs; not pk_kernel.h, which includes this file */

/* ---- p16 ---------------------------------------------------------------------------- */
typedef struct {
    int panels;           /* ceil(N / 16) */
    size_t panel_bytes;   /* 8K (qsi4c32: K/8 pieces of 64 bytes) or 12K (qsi6c32) */
    size_t scales_off;    /* panels * panel_bytes */
    int nb;               /* blocks per row */
    size_t bytes;
} pk_p16_geom;

pk_p16_geom pk_p16_geometry(const pk_rhs *rhs);
size_t pk_p16_size(const pk_rhs *rhs);
void pk_p16_pack(const pk_rhs *rhs, void *dst);

/* bf16 scales of block b of panel p: 16 values, one per row. */
static inline const uint16_t *pk_p16_scales(const uint8_t *packed, const pk_p16_geom *g, int p, int b) {
    return (const uint16_t *)(packed + g->scales_off) + ((size_t)p * g->nb + b) * 16;
}

/* ---- p4 ----------------------------------------------------------------------------- */
typedef struct {
    size_t row_bytes;     /* R = K */
    size_t tile_bytes;    /* 4R */
    int tiles;            /* ceil(N / 4) */
    size_t bytes;
} pk_p4_geom;

pk_p4_geom pk_p4_geometry(const pk_rhs *rhs);
size_t pk_p4_size(const pk_rhs *rhs);
void pk_p4_pack(const pk_rhs *rhs, void *dst);

/* Address of byte `off` of row r (0..3) inside a tile: 64-byte slices interleaved, then the
 * last R % 64 bytes of rows 0..3 back to back. */
static inline const uint8_t *pk_p4_at(const uint8_t *tile, size_t row_bytes, int r, size_t off) {
    const size_t full = row_bytes & ~(size_t)63;
    if (off < full) return tile + (off & ~(size_t)63) * 4 + (size_t)64 * r + (off & 63);
    return tile + 4 * full + (row_bytes - full) * (size_t)r + (off - full);
}

#endif
