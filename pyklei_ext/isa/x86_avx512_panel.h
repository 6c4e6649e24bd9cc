/* AVX-512 weight panels for the GEMM kernels (matmul_x86_avx512vnni.c, matmul_x86_amx.c): 32
 * weight rows transposed so that 4 consecutive k of one row form one dword and a 64-byte
 * row of the panel holds one k-quad of 16 weight rows. This is the int8 "VNNI layout" both
 * vpdpbusd (one zmm per 16 rows) and the AMX B tile (K/4 rows x 16 columns x 4 bytes, stride
 * 128 bytes here) consume. Include after x86_common.h and <immintrin.h>. */
#ifndef PK_X86_AVX512_PANEL_H
#define PK_X86_AVX512_PANEL_H

#define ZP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define ZP_INLINE static inline __attribute__((always_inline)) ZP_TARGET

#include "../contract/pk_kernel.h"

#define ZNR 32

/* 4x4 transposes of dwords inside 128-bit lanes: L[j] lane l dword i -> Q[i] dword 4l+j. */
ZP_INLINE void z_transpose4(const __m512i L[4], __m512i Q[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(L[0], L[1]), t1 = _mm512_unpackhi_epi32(L[0], L[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(L[2], L[3]), t3 = _mm512_unpackhi_epi32(L[2], L[3]);
    Q[0] = _mm512_unpacklo_epi64(t0, t2);
    Q[1] = _mm512_unpackhi_epi64(t0, t2);
    Q[2] = _mm512_unpacklo_epi64(t1, t3);
    Q[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Rows of a panel in the p4 layout (pk_pack.h): byte `off` of row r is at
 *   full[r] + off + 192 * (off / 64)   while off < R & ~63 (the 64-byte slices),
 *   tail[r] + off                      after (the compact tail).
 * Rows >= n1 repeat row n1 - 1. Returns the number of bytes in full slices. */
ZP_INLINE size_t z_p4_rows(const uint8_t *packed, const pk_p4_geom *g, int np, int n1,
                           const uint8_t *full[ZNR], const uint8_t *tail[ZNR]) {
    const size_t R = g->row_bytes, nfull = R & ~(size_t)63;
    for (int r = 0; r < ZNR; r++) {
        const int rr = np + r < n1 ? np + r : n1 - 1;
        const uint8_t *tile = packed + (size_t)(rr / 4) * g->tile_bytes;
        full[r] = tile + 64 * (rr & 3);
        tail[r] = tile + 4 * nfull + (R - nfull) * (rr & 3) - nfull;
    }
    return nfull;
}

/* Panel of 32 rows [np, np+32) from the p16 copy (np a multiple of 32; rows past n1 hold
 * padding or repeat a panel: their outputs are never stored), quad-major:
 * panel[(q * 32 + r) * 4 + t] = weight (row r, k = 4q + t) + 8 - sub, as bytes (sub == 8
 * gives signed int4 for AMX). A p16 piece already holds two quads of 16 rows as dwords. */
ZP_TARGET static void z_pack_q4_panel(const pk_rhs *rhs, const uint8_t *packed, int np, int n1,
                                     uint8_t *panel, float *spanel, float *rs, int sub) {
    const int k = rhs->k;
    const pk_p16_geom g = pk_p16_geometry(rhs);
    const int p0 = np / 16, p1 = np + 16 < n1 ? p0 + 1 : p0;
    for (int r = 0; r < ZNR; r++) rs[r] = rhs->rsum[np + r < n1 ? np + r : n1 - 1];
    for (int b = 0; b < g.nb; b++)
        for (int h = 0; h < 2; h++) {
            const uint16_t *s = pk_p16_scales(packed, &g, h ? p1 : p0, b);
            for (int r = 0; r < 16; r++) spanel[b * ZNR + 16 * h + r] = pk_bf16_to_f32(s[r]);
        }
    const __m512i m0f = _mm512_set1_epi8(0x0F), vsub = _mm512_set1_epi8((char)sub);
    for (int o = 0; o < k / 8; o++)
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_load_si512(packed + (size_t)(h ? p1 : p0) * g.panel_bytes + (size_t)64 * o);
            uint8_t *q = panel + (size_t)(2 * o) * ZNR * 4 + 64 * h;
            _mm512_store_si512(q, _mm512_sub_epi8(_mm512_and_si512(v, m0f), vsub));
            _mm512_store_si512(q + ZNR * 4, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m0f), vsub));
        }
}

/* int8 rows from the p4 copy, K padded to kp (multiple of 16) with zeros; bytes w ^ xr
 * (0x80: unsigned w+128). */
ZP_TARGET static void z_pack_q8_panel(const pk_rhs *rhs, const uint8_t *packed, int np, int n1, int kp,
                                     uint8_t *panel, float *ws, int32_t *isum, int xr) {
    const int k = rhs->k;
    const pk_p4_geom g = pk_p4_geometry(rhs);
    const uint8_t *full[ZNR], *tail[ZNR];
    const size_t nfull = z_p4_rows(packed, &g, np, n1, full, tail);
    for (int r = 0; r < ZNR; r++) {
        const int rr = np + r < n1 ? np + r : n1 - 1;
        ws[r] = ((const float *)rhs->scales)[rr];
        isum[r] = rhs->isum[rr];
    }
    const __m512i vx = _mm512_set1_epi8((char)xr);
    for (int c = 0; c < kp / 16; c++) {
        const int rem = k - 16 * c;
        const __mmask16 lm = rem >= 16 ? (__mmask16)0xFFFF : rem > 0 ? (__mmask16)((1u << rem) - 1) : 0;
        const size_t off = (size_t)16 * c;
        const uint8_t *const *row = off < nfull ? full : tail;
        const size_t o = off < nfull ? off + 192 * (off / 64) : off;
        for (int h = 0; h < 2; h++) {
            __m512i L[4], Q[4];
            for (int j = 0; j < 4; j++) {
                const uint8_t *const *rw = row + 16 * h;
                __m512i v = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(lm, rw[j] + o));
                v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(lm, rw[4 + j] + o), 1);
                v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(lm, rw[8 + j] + o), 2);
                v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(lm, rw[12 + j] + o), 3);
                L[j] = _mm512_xor_si512(v, vx);
            }
            z_transpose4(L, Q);
            uint8_t *p = panel + ((size_t)(4 * c) * ZNR + 16 * h) * 4;
            for (int i = 0; i < 4; i++) _mm512_store_si512(p + (size_t)i * ZNR * 4, Q[i]);
        }
    }
}

#endif
