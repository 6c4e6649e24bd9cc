/* Weight repacking (pk_pack.h): portable C, run once per weight at load. */
#include "pk_pack.h"

#include <string.h>

pk_p16_geom pk_p16_geometry(const pk_rhs *rhs) {
    pk_p16_geom g;
    g.panels = (rhs->n + 15) / 16;
    g.panel_bytes = (size_t)(rhs->fmt == PK_FMT_QSI6C32 ? 12 : 8) * rhs->k;
    g.scales_off = (size_t)g.panels * g.panel_bytes;
    g.nb = rhs->k / rhs->bl;
    g.bytes = g.scales_off + sizeof(uint16_t) * 16 * (size_t)g.panels * g.nb;
    return g;
}

size_t pk_p16_size(const pk_rhs *rhs) { return pk_p16_geometry(rhs).bytes; }

/* qsi4c32 rows: per k-octet 64 bytes, offset nibbles u = q + 8. */
static void pack_q4_rows(const pk_rhs *rhs, const pk_p16_geom *g, uint8_t *out) {
    const size_t R = (size_t)rhs->k / 2;
    for (int row = 0; row < rhs->n; row++) {
        const uint8_t *src = rhs->qs + (size_t)row * R;
        uint8_t *panel = out + (size_t)(row / 16) * g->panel_bytes + 4 * (row % 16);
        /* octet o = elements 8o..8o+7 = chunk o/4, the low (o%4 < 2) or high nibbles of its
         * bytes 8*(o%2)..+7 (docs/FORMAT.md, nibble order) */
        for (int o = 0; o < rhs->k / 8; o++) {
            const uint8_t *b = src + 16 * (o / 4) + 8 * (o % 2);
            const int sh = (o % 4) < 2 ? 0 : 4;
            uint8_t *d = panel + (size_t)64 * o;
            for (int t = 0; t < 4; t++)
                d[t] = (uint8_t)((((b[t] >> sh) & 15) ^ 8) | ((((b[t + 4] >> sh) & 15) ^ 8) << 4));
        }
    }
}

/* qsi6c32 rows: 192 bytes per 16 k of a panel: the low nibbles of k-octets 2P and 2P+1 as for
 * qsi4c32 (but u = q + 32 is already unsigned), then 64 bytes of top bits. */
static void pack_q6_rows(const pk_rhs *rhs, const pk_p16_geom *g, uint8_t *out) {
    const int k = rhs->k;
    const size_t R = pk_row_bytes(PK_FMT_QSI6C32, k);
    uint8_t u[32];
    for (int row = 0; row < rhs->n; row++) {
        const uint8_t *src = rhs->qs + (size_t)row * R;
        uint8_t *panel = out + (size_t)(row / 16) * g->panel_bytes + 4 * (row % 16);
        for (int c = 0; c < k / 32; c++) {   /* chunk c = k-octets 4c..4c+3 = pairs 2c, 2c+1 */
            const uint8_t *ch = src + (size_t)24 * c;
            for (int e = 0; e < 32; e++)
                u[e] = (uint8_t)(((e & 16) ? ch[e & 15] >> 4 : ch[e & 15] & 15) | ((ch[16 + (e & 7)] >> (2 * (e >> 3))) & 3) << 4);
            for (int h = 0; h < 2; h++) {
                const uint8_t *v = u + 16 * h;   /* k-octets 2P, 2P+1 with P = 2c + h */
                uint8_t *d = panel + (size_t)192 * (2 * c + h);
                for (int t = 0; t < 4; t++) {
                    d[t] = (uint8_t)((v[t] & 15) | (v[t + 4] & 15) << 4);
                    d[64 + t] = (uint8_t)((v[8 + t] & 15) | (v[12 + t] & 15) << 4);
                    d[128 + t] = (uint8_t)(v[t] >> 4 | (v[t + 4] >> 4) << 2 | (v[8 + t] >> 4) << 4 | (v[12 + t] >> 4) << 6);
                }
            }
        }
    }
}

void pk_p16_pack(const pk_rhs *rhs, void *dst) {
    const pk_p16_geom g = pk_p16_geometry(rhs);
    uint8_t *out = dst;
    if (rhs->n % 16) memset(out + (size_t)(g.panels - 1) * g.panel_bytes, 0, g.panel_bytes);
    if (rhs->fmt == PK_FMT_QSI6C32) pack_q6_rows(rhs, &g, out);
    else pack_q4_rows(rhs, &g, out);
    uint16_t *s = (uint16_t *)(out + g.scales_off);
    memset(s, 0, g.bytes - g.scales_off);
    for (int row = 0; row < rhs->n; row++)
        for (int b = 0; b < g.nb; b++)
            s[((size_t)(row / 16) * g.nb + b) * 16 + row % 16] = ((const uint16_t *)rhs->scales)[(size_t)row * g.nb + b];
}

pk_p4_geom pk_p4_geometry(const pk_rhs *rhs) {
    pk_p4_geom g;
    g.row_bytes = (size_t)rhs->k;
    g.tile_bytes = 4 * g.row_bytes;
    g.tiles = (rhs->n + 3) / 4;
    g.bytes = g.tile_bytes * (size_t)g.tiles;
    return g;
}

size_t pk_p4_size(const pk_rhs *rhs) { return pk_p4_geometry(rhs).bytes; }

void pk_p4_pack(const pk_rhs *rhs, void *dst) {
    const pk_p4_geom g = pk_p4_geometry(rhs);
    uint8_t *out = dst;
    if (rhs->n % 4) memset(out + (size_t)(g.tiles - 1) * g.tile_bytes, 0, g.tile_bytes);
    const size_t R = g.row_bytes;
    for (int row = 0; row < rhs->n; row++) {
        uint8_t *tile = out + (size_t)(row / 4) * g.tile_bytes;
        const uint8_t *src = rhs->qs + (size_t)row * R;
        for (size_t off = 0; off < R; off += 64) {
            const size_t len = R - off < 64 ? R - off : 64;
            memcpy((uint8_t *)pk_p4_at(tile, R, row & 3, off), src + off, len);
        }
    }
}
