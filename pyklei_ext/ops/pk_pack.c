/* p4 repacking (pk_pack.h): portable C, run once per weight at load. */
#include "pk_pack.h"

#include <string.h>

pk_p4_geom pk_p4_geometry(const pk_rhs *rhs) {
    pk_p4_geom g;
    memset(&g, 0, sizeof g);
    g.row_bytes = rhs->fmt == PK_FMT_QSI4C32 ? (size_t)rhs->k / 2 : (size_t)rhs->k;
    g.tile_bytes = 4 * g.row_bytes;
    g.tiles = (rhs->n + 3) / 4;
    g.bytes = g.tile_bytes * (size_t)g.tiles;
    if (rhs->fmt == PK_FMT_QSI4C32) {
        g.groups = (rhs->k + 127) / 128;
        g.spg = rhs->bl >= 128 ? 1 : 128 / rhs->bl;
        g.scales_off = (g.bytes + 63) & ~(size_t)63;
        g.bytes = g.scales_off + sizeof(uint16_t) * (size_t)g.tiles * g.groups * 4 * g.spg;
    }
    return g;
}

size_t pk_p4_size(const pk_rhs *rhs) { return pk_p4_geometry(rhs).bytes; }

void pk_p4_pack(const pk_rhs *rhs, void *dst) {
    const pk_p4_geom g = pk_p4_geometry(rhs);
    uint8_t *out = dst;
    /* zero only what rows do not fill: the last tile's missing rows and the scales' padding
     * (a fresh buffer is often untouched memory; writing it twice costs load time) */
    if (rhs->n % 4) memset(out + (size_t)(g.tiles - 1) * g.tile_bytes, 0, g.tile_bytes);
    const size_t tiles_end = (size_t)g.tiles * g.tile_bytes;
    memset(out + tiles_end, 0, g.bytes - tiles_end);
    const size_t R = g.row_bytes;
    for (int row = 0; row < rhs->n; row++) {
        uint8_t *tile = out + (size_t)(row / 4) * g.tile_bytes;
        const uint8_t *src = rhs->qs + (size_t)row * R;
        for (size_t off = 0; off < R; off += 64) {
            const size_t len = R - off < 64 ? R - off : 64;
            memcpy((uint8_t *)pk_p4_at(tile, R, row & 3, off), src + off, len);
        }
    }
    if (rhs->fmt != PK_FMT_QSI4C32) return;
    uint16_t *s = (uint16_t *)(out + g.scales_off);
    const int nb = rhs->k / rhs->bl;
    for (int row = 0; row < rhs->n; row++) {
        const uint16_t *rs = (const uint16_t *)rhs->scales + (size_t)row * nb;
        for (int b = 0; b < nb; b++) {
            const size_t j = ((size_t)b * rhs->bl % 128) / rhs->bl;
            /* every group the block covers (two for bl = 256) */
            for (size_t grp = (size_t)b * rhs->bl / 128; grp * 128 < (size_t)(b + 1) * rhs->bl; grp++)
                s[(((size_t)(row / 4) * g.groups + grp) * 4 + (row & 3)) * g.spg + j] = rs[b];
        }
    }
}
