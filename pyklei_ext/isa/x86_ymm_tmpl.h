/* 256-bit kernel template, included by matmul_x86_avx2.c (AVX2: vpmaddubsw + vpmaddwd) and
 * matmul_x86_avxvnni.c (AVX-VNNI: VEX vpdpbusd). Before including, define
 *   Y_TARGET   __attribute__((target(...)))
 *   Y_NAME(x)  x ## _suffix
 *   Y_VNNI     0 or 1
 *   Y_DPBUSD   (Y_VNNI) the ymm vpdpbusd intrinsic: _mm256_dpbusd_avx_epi32 (VEX) or
 *              _mm256_dpbusd_epi32 (EVEX, AVX512VL: the test twin)
 *   Y_MR, Y_NRV  GEMM register tile: Y_MR activation rows x 8*Y_NRV weight rows
 *   Y_Q4_GEMV, Y_Q4_GEMM, Y_D32_GEMV, Y_D32_GEMM (qsi8d32 x qsi4c32; and with Y_VNNI Y_Q8_GEMV,
 *              Y_Q8_GEMM)  the kernels' function names,
 *              the whole names of their table entries (qai8dx_qsi4c32_1x4_avx2, ...), so
 *              that a name in PYKLEI_LOG=kernels greps to the #define next to the include
 *
 * Operand conventions (u8 x s8 products, 4 per int32 lane):
 *  GEMV qsi4c32: u8 = activation q ^ 0x80 (= q + 128), s8 = sign-extended int4 (vpshufb table).
 *    sum_b s_b D'_b - (zp + 128) R is the result (the 128 lives in R). With vpmaddubsw each
 *    int16 lane holds 2 products, |.| <= 2*255*8, and two such are added: no saturation.
 *  GEMM qsi4c32: u8 = w + 8 in [0, 15] (packed panel), s8 = activation (broadcast 4 bytes);
 *    the int32 block accumulator starts at -8 * sum_{k in block} a. vpmaddubsw lanes are
 *    <= 2*15*128 = 3840 per product pair, 2 pairs added: no saturation.
 *  GEMM qsi8cx (VNNI only): u8 = w + 128, start at -128 * sum a.
 *  qsi8d32 (symmetric activations, a scale per block of 32): the GEMV takes u8 = |a| and
 *    s8 = sign(a) * w (vpsignb), so no offset term; the GEMM is the qsi4c32 GEMM with blocks of
 *    32 (corr from the activations' blocks) and the weight block's scale times the activation
 *    block's in the float multiply. */

#define Y_INLINE static inline __attribute__((always_inline)) Y_TARGET

#if Y_VNNI
Y_INLINE __m256i Y_NAME(y_dot2)(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
    return Y_DPBUSD(Y_DPBUSD(acc, u0, s0), u1, s1);
}
#else
Y_INLINE __m256i Y_NAME(y_dot2)(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

/* ---- GEMV qsi4c32: 1 activation row x 4 weight rows ------------------------------------- */

/* Per 64 elements (32 bytes of qs = 2 chunks): bytes 0..31 pair with the low nibbles
 * (chunk 0 elements 0..15 | chunk 1 elements 0..15), bytes 32..63 with the high nibbles. */
/* xr: 0x80 (u8 = q + 128, qai8dx) or 0 (the bytes as they are, qsi8d32); the tail pads with xr. */
Y_TARGET static void Y_NAME(y_prep_q4_gemv)(int m, int k, const pk_lhs *lhs, uint8_t *out, size_t ldo, int xr) {
    const __m256i x80 = _mm256_set1_epi8((char)xr);
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        uint8_t *o = out + (size_t)i * ldo;
        int kk = 0;
        for (; kk + 64 <= k; kk += 64) {
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)(a + kk));
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(a + kk + 32));
            _mm256_store_si256((__m256i *)(o + kk), _mm256_xor_si256(_mm256_permute2x128_si256(y0, y1, 0x20), x80));
            _mm256_store_si256((__m256i *)(o + kk + 32), _mm256_xor_si256(_mm256_permute2x128_si256(y0, y1, 0x31), x80));
        }
        if (kk < k) {   /* one trailing chunk of 32 */
            memset(o + kk, xr, 64);
            for (int j = 0; j < 16; j++) {
                o[kk + j] = (uint8_t)(a[kk + j] ^ xr);
                o[kk + 32 + j] = (uint8_t)(a[kk + 16 + j] ^ xr);
            }
        }
    }
}

Y_INLINE void Y_NAME(y_gemv_q4_rows)(const int BL, int k, const uint8_t *const w[4],
                                     const uint16_t *const s[4], const uint8_t *act, float sums[4]) {
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1,
                                         0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    /* BL 32: 2 scales per 64 elements, lane c takes scale c (bytes 2c, 2c+1 to the top half) */
    const __m256i sctrl = _mm256_setr_epi32(0x0100FFFF, 0x0100FFFF, 0x0100FFFF, 0x0100FFFF,
                                            0x0302FFFF, 0x0302FFFF, 0x0302FFFF, 0x0302FFFF);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    const int G = k / 64;
    if (BL == 32) {
        for (int g = 0; g < G; g++) {
            const __m256i alo = _mm256_load_si256((const __m256i *)(act + 64 * g));
            const __m256i ahi = _mm256_load_si256((const __m256i *)(act + 64 * g + 32));
            for (int r = 0; r < 4; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w[r] + 32 * g));
                const __m256i wlo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m0f));
                const __m256i whi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f));
                const __m256i d = Y_NAME(y_dot2)(_mm256_setzero_si256(), alo, wlo, ahi, whi);
                const __m256 sc = _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_set1_epi32(pk_load_i32(s[r] + 2 * g)), sctrl));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[r]);
            }
        }
        if (k % 64) {   /* one chunk: lane 1 of the weights is zero */
            const __m256i alo = _mm256_load_si256((const __m256i *)(act + 64 * G));
            const __m256i ahi = _mm256_load_si256((const __m256i *)(act + 64 * G + 32));
            for (int r = 0; r < 4; r++) {
                const __m256i v = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(w[r] + 32 * G)));
                const __m256i wlo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m0f));
                const __m256i whi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f));
                const __m256i d = Y_NAME(y_dot2)(_mm256_setzero_si256(), alo, wlo, ahi, whi);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(pk_bf16_to_f32(s[r][2 * G])), acc[r]);
            }
        }
    } else {   /* BL >= 64: whole 64-element groups per block */
        const int gpb = BL / 64, nb = k / BL;
        for (int b = 0; b < nb; b++) {
            __m256i d[4];
            for (int r = 0; r < 4; r++) d[r] = _mm256_setzero_si256();
            for (int gg = 0; gg < gpb; gg++) {
                const int g = b * gpb + gg;
                const __m256i alo = _mm256_load_si256((const __m256i *)(act + 64 * g));
                const __m256i ahi = _mm256_load_si256((const __m256i *)(act + 64 * g + 32));
                for (int r = 0; r < 4; r++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w[r] + 32 * g));
                    const __m256i wlo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m0f));
                    const __m256i whi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f));
                    d[r] = Y_NAME(y_dot2)(d[r], alo, wlo, ahi, whi);
                }
            }
            for (int r = 0; r < 4; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_set1_ps(pk_bf16_to_f32(s[r][b])), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
        sums[r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    }
}

Y_TARGET static void Y_Q4_GEMV(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                       const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, bl = rhs->bl, nb = k / bl;
    const size_t ldo = pk_round_up((size_t)k, 64);
    uint8_t *act = pk_scratch(0, ldo * (size_t)m);
    if (!act) { pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi); return; }
    Y_NAME(y_prep_q4_gemv)(m, k, lhs, act, ldo, 0x80);
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *w[4];
        const uint16_t *s[4];
        for (int r = 0; r < 4; r++) {
            const int rr = n + (r < nr ? r : nr - 1);
            w[r] = rhs->qs + (size_t)rr * (k / 2);
            s[r] = (const uint16_t *)rhs->scales + (size_t)rr * nb;
        }
        for (int i = 0; i < m; i++) {
            float sums[4];
            const uint8_t *ai = act + (size_t)i * ldo;
            switch (bl) {
            case 32: Y_NAME(y_gemv_q4_rows)(32, k, w, s, ai, sums); break;
            case 64: Y_NAME(y_gemv_q4_rows)(64, k, w, s, ai, sums); break;
            case 128: Y_NAME(y_gemv_q4_rows)(128, k, w, s, ai, sums); break;
            default: Y_NAME(y_gemv_q4_rows)(256, k, w, s, ai, sums); break;
            }
            const float zpf = (float)(lhs->zp[i] + 128), sc = lhs->scale[i];
            for (int r = 0; r < nr; r++)
                dst[(size_t)i * ldd + n + r] = pk_clampf(sc * (sums[r] - zpf * rhs->rsum[n + r]), lo, hi);
        }
    }
}

/* qsi8d32 x qsi4c32, 1 activation row x 4 weight rows: per 64-group the low 128-bit lane of the
 * dot is block 2g, the high one block 2g + 1 (y_prep_q4_gemv's order), each multiplied by its
 * weight block's scale times its activation block's. A ragged last group (k % 64 == 32) has zero
 * weights and activations in the high lane. */
Y_TARGET static void Y_D32_GEMV(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, bl = rhs->bl, nbw = k / bl, nba = k / 32, G = (k + 63) / 64;
    const size_t ldo = pk_round_up((size_t)k, 64);
    uint8_t *act = pk_scratch(0, ldo * (size_t)m);
    if (!act) { pk_scalar_run_d32(m, n0, n1, lhs, rhs, NULL, dst, ldd, lo, hi); return; }
    Y_NAME(y_prep_q4_gemv)(m, k, lhs, act, ldo, 0);
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1,
                                         0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *w[4];
        const uint16_t *s[4];
        for (int r = 0; r < 4; r++) {
            const int rr = n + (r < nr ? r : nr - 1);
            w[r] = rhs->qs + (size_t)rr * (k / 2);
            s[r] = (const uint16_t *)rhs->scales + (size_t)rr * nbw;
        }
        for (int i = 0; i < m; i++) {
            const int8_t *ai = (const int8_t *)act + (size_t)i * ldo;
            const float *as = lhs->bscale + (size_t)i * nba;
            __m256 acc[4];
            for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
            for (int g = 0; g < G; g++) {
                const int b0 = 2 * g, b1 = 2 * g + 1 < nba ? 2 * g + 1 : 2 * g;
                const __m256i alo = _mm256_load_si256((const __m256i *)(ai + 64 * g));
                const __m256i ahi = _mm256_load_si256((const __m256i *)(ai + 64 * g + 32));
                const __m256i ulo = _mm256_abs_epi8(alo), uhi = _mm256_abs_epi8(ahi);   /* -128 -> 0x80 = 128 */
                for (int r = 0; r < 4; r++) {
                    const __m256i v = 2 * g + 1 < nba ? _mm256_loadu_si256((const __m256i *)(w[r] + 32 * g))
                                                      : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(w[r] + 32 * g)));
                    const __m256i wlo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m0f));
                    const __m256i whi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f));
                    const __m256i d = Y_NAME(y_dot2)(_mm256_setzero_si256(), ulo, _mm256_sign_epi8(wlo, alo), uhi,
                                                     _mm256_sign_epi8(whi, ahi));
                    const __m256 sc = _mm256_setr_m128(_mm_set1_ps(pk_bf16_to_f32(s[r][32 * b0 / bl]) * as[b0]),
                                                       _mm_set1_ps(pk_bf16_to_f32(s[r][32 * b1 / bl]) * as[b1]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[r]);
                }
            }
            for (int r = 0; r < nr; r++) {
                const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
                const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
                dst[(size_t)i * ldd + n + r] = pk_clampf(_mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2))), lo, hi);
            }
        }
    }
}

/* ---- GEMM: Y_MR rows x (8 * Y_NRV) weight rows, panel transposed per call --------------- */

#define Y_NR (8 * Y_NRV)

/* L[j] lane l dword i -> Q[i] dword 4l + j (4x4 dword transposes inside 128-bit lanes). */
Y_INLINE void Y_NAME(y_transpose4)(const __m256i L[4], __m256i Q[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(L[0], L[1]), t1 = _mm256_unpackhi_epi32(L[0], L[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(L[2], L[3]), t3 = _mm256_unpackhi_epi32(L[2], L[3]);
    Q[0] = _mm256_unpacklo_epi64(t0, t2);
    Q[1] = _mm256_unpackhi_epi64(t0, t2);
    Q[2] = _mm256_unpacklo_epi64(t1, t3);
    Q[3] = _mm256_unpackhi_epi64(t1, t3);
}

Y_INLINE __m256i Y_NAME(y_load2rows)(const uint8_t *r0, const uint8_t *r1) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)r0)),
                                   _mm_loadu_si128((const __m128i *)r1), 1);
}

/* panel[(q * Y_NR + r) * 4 + t] = w(row r, k = 4q + t) + 8 (unsigned). */
Y_TARGET static void Y_NAME(y_pack_q4_panel)(const pk_rhs *rhs, int np, int n1, uint8_t *panel,
                                             float *spanel, float *rs) {
    const int k = rhs->k, nb = k / rhs->bl;
    const uint8_t *row[Y_NR];
    for (int r = 0; r < Y_NR; r++) {
        const int rr = np + r < n1 ? np + r : n1 - 1;
        row[r] = rhs->qs + (size_t)rr * (k / 2);
        const uint16_t *s = (const uint16_t *)rhs->scales + (size_t)rr * nb;
        for (int b = 0; b < nb; b++) spanel[b * Y_NR + r] = pk_bf16_to_f32(s[b]);
        rs[r] = rhs->rsum[rr];
    }
    const __m256i x88 = _mm256_set1_epi8((char)0x88), m0f = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < k / 32; c++) {
        for (int h = 0; h < Y_NRV; h++) {
            __m256i L[4], H[4], Q[4];
            for (int j = 0; j < 4; j++) {
                const __m256i x = _mm256_xor_si256(
                    Y_NAME(y_load2rows)(row[8 * h + j] + 16 * c, row[8 * h + 4 + j] + 16 * c), x88);
                L[j] = _mm256_and_si256(x, m0f);
                H[j] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m0f);
            }
            uint8_t *p = panel + ((size_t)(8 * c) * Y_NR + 8 * h) * 4;
            Y_NAME(y_transpose4)(L, Q);
            for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i *)(p + (size_t)i * Y_NR * 4), Q[i]);
            Y_NAME(y_transpose4)(H, Q);
            for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i *)(p + (size_t)(4 + i) * Y_NR * 4), Q[i]);
        }
    }
}

#if Y_VNNI
/* int8 rows, K padded to kp (multiple of 16), bytes w ^ 0x80 (= w + 128, unsigned). */
Y_TARGET static void Y_NAME(y_pack_q8_panel)(const pk_rhs *rhs, int np, int n1, int kp, uint8_t *panel,
                                             float *ws, int32_t *isum) {
    const int k = rhs->k;
    const uint8_t *row[Y_NR];
    for (int r = 0; r < Y_NR; r++) {
        const int rr = np + r < n1 ? np + r : n1 - 1;
        row[r] = rhs->qs + (size_t)rr * k;
        ws[r] = ((const float *)rhs->scales)[rr];
        isum[r] = rhs->isum[rr];
    }
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    uint8_t tail[Y_NR][16];
    if (k % 16)
        for (int r = 0; r < Y_NR; r++) {
            memset(tail[r], 0, 16);
            memcpy(tail[r], row[r] + (k / 16) * 16, (size_t)(k % 16));
        }
    for (int c = 0; c < kp / 16; c++) {
        const int full = 16 * (c + 1) <= k;
        for (int h = 0; h < Y_NRV; h++) {
            __m256i L[4], Q[4];
            for (int j = 0; j < 4; j++) {
                const int r0 = 8 * h + j, r1 = 8 * h + 4 + j;
                const __m256i v = full ? Y_NAME(y_load2rows)(row[r0] + 16 * c, row[r1] + 16 * c)
                                       : Y_NAME(y_load2rows)(tail[r0], tail[r1]);
                L[j] = _mm256_xor_si256(v, x80);
            }
            Y_NAME(y_transpose4)(L, Q);
            uint8_t *p = panel + ((size_t)(4 * c) * Y_NR + 8 * h) * 4;
            for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i *)(p + (size_t)i * Y_NR * 4), Q[i]);
        }
    }
}
#endif

Y_INLINE void Y_NAME(y_store)(float *d, __m256 v, int nv) {
    if (nv >= 8) {
        _mm256_storeu_ps(d, v);
    } else {
        float t[8];
        _mm256_storeu_ps(t, v);
        for (int j = 0; j < nv; j++) d[j] = t[j];
    }
}

/* D32 (qsi8d32): blocks of 32 (nbk = K/32), spanel row b / sdiv (sdiv = bl / 32) times the
 * activation block's scale; the result is f itself (no zero point). */
Y_INLINE void Y_NAME(y_gemm_tile)(const int MR, const int Q8, const int D32, int sdiv, const pk_lhs *lhs, int i0,
                                  const int8_t *a, size_t lda, const int32_t *corr, int nbc, int nbk, int qpb,
                                  const uint8_t *panel, const float *spanel, const float *rs,
                                  const int32_t *isum, int nvalid, float *dst, size_t ldd, float lo, float hi) {
    __m256 f[Y_MR][Y_NRV];
    __m256i acc[Y_MR][Y_NRV];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < Y_NRV; j++) f[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < nbk; b++) {
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < Y_NRV; j++) acc[i][j] = _mm256_set1_epi32(corr[(size_t)(i0 + i) * nbc + b]);
        const uint8_t *pw = panel + (size_t)b * qpb * Y_NR * 4;
        const int8_t *pa = a + (size_t)i0 * lda + (size_t)b * qpb * 4;
        for (int q = 0; q < qpb; q += 2) {   /* qpb is even: bl/4 >= 8, or kp/4 with kp % 16 == 0 */
            __m256i w0[Y_NRV], w1[Y_NRV];
            for (int j = 0; j < Y_NRV; j++) {
                w0[j] = _mm256_load_si256((const __m256i *)(pw + ((size_t)q * Y_NR + 8 * j) * 4));
                w1[j] = _mm256_load_si256((const __m256i *)(pw + ((size_t)(q + 1) * Y_NR + 8 * j) * 4));
            }
            for (int i = 0; i < MR; i++) {
                const __m256i a0 = _mm256_set1_epi32(pk_load_i32(pa + (size_t)i * lda + 4 * q));
                const __m256i a1 = _mm256_set1_epi32(pk_load_i32(pa + (size_t)i * lda + 4 * q + 4));
                for (int j = 0; j < Y_NRV; j++) acc[i][j] = Y_NAME(y_dot2)(acc[i][j], w0[j], a0, w1[j], a1);
            }
        }
        if (!Q8) {
            for (int j = 0; j < Y_NRV; j++) {
                const __m256 sj = _mm256_load_ps(spanel + (size_t)(D32 ? b / sdiv : b) * Y_NR + 8 * j);
                for (int i = 0; i < MR; i++) {
                    const __m256 mj = D32 ? _mm256_mul_ps(sj, _mm256_set1_ps(lhs->bscale[(size_t)(i0 + i) * nbk + b])) : sj;
                    f[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), mj, f[i][j]);
                }
            }
        }
    }
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (int i = 0; i < MR; i++) {
        const int ii = i0 + i;
        for (int j = 0; j < Y_NRV; j++) {
            const int nv = nvalid - 8 * j;
            if (nv <= 0) break;
            __m256 v;
            if (D32) {
                v = f[i][j];
            } else if (!Q8) {
                const __m256 t = _mm256_mul_ps(_mm256_set1_ps((float)lhs->zp[ii]), _mm256_load_ps(rs + 8 * j));
                v = _mm256_mul_ps(_mm256_set1_ps(lhs->scale[ii]), _mm256_sub_ps(f[i][j], t));
            } else {
                const __m256i d = _mm256_sub_epi32(acc[i][j], _mm256_mullo_epi32(_mm256_set1_epi32(lhs->zp[ii]),
                                                                                  _mm256_load_si256((const __m256i *)(isum + 8 * j))));
                const __m256 ss = _mm256_mul_ps(_mm256_set1_ps(lhs->scale[ii]), _mm256_load_ps(rs + 8 * j));
                v = _mm256_mul_ps(ss, _mm256_cvtepi32_ps(d));
            }
            v = _mm256_min_ps(vhi, _mm256_max_ps(vlo, v));
            Y_NAME(y_store)(dst + (size_t)ii * ldd + 8 * j, v, nv);
        }
    }
}

Y_TARGET static void Y_NAME(y_gemm_panel)(const int Q8, const int D32, int sdiv, int m, const pk_lhs *lhs, const int8_t *a,
                                          size_t lda, const int32_t *corr, int nbc, int nbk, int qpb, const uint8_t *panel,
                                          const float *spanel, const float *rs, const int32_t *isum, int nvalid,
                                          float *dst, size_t ldd, float lo, float hi) {
    int i0 = 0;
    for (; i0 + Y_MR <= m; i0 += Y_MR)
        Y_NAME(y_gemm_tile)(Y_MR, Q8, D32, sdiv, lhs, i0, a, lda, corr, nbc, nbk, qpb, panel, spanel, rs, isum, nvalid, dst,
                            ldd, lo, hi);
    switch (m - i0) {
#define Y_TAIL(R) case R: if (R < Y_MR) Y_NAME(y_gemm_tile)(R < Y_MR ? R : 1, Q8, D32, sdiv, lhs, i0, a, lda, corr, nbc, nbk, qpb, panel, spanel, rs, isum, nvalid, dst, ldd, lo, hi); break;
    Y_TAIL(1) Y_TAIL(2) Y_TAIL(3) Y_TAIL(4) Y_TAIL(5)
#undef Y_TAIL
    default: break;
    }
}

Y_TARGET static void Y_Q4_GEMM(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                       const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, bl = rhs->bl, nb = k / bl;
    const int8_t *a;
    size_t lda;
    int32_t *corr;
    uint8_t *panel = pk_scratch(0, (size_t)k * Y_NR + sizeof(float) * ((size_t)nb * Y_NR + Y_NR));
    if (!panel || pk_gemm_lhs_prep(lhs, m, k, k, bl, 8, &a, &lda, &corr)) {
        pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
        return;
    }
    float *spanel = (float *)(panel + (size_t)k * Y_NR), *rs = spanel + (size_t)nb * Y_NR;
    for (int np = n0; np < n1; np += Y_NR) {
        Y_NAME(y_pack_q4_panel)(rhs, np, n1, panel, spanel, rs);
        Y_NAME(y_gemm_panel)(0, 0, 1, m, lhs, a, lda, corr, nb, nb, bl / 4, panel, spanel, rs, NULL,
                             n1 - np < Y_NR ? n1 - np : Y_NR, dst + np, ldd, lo, hi);
    }
}

/* qsi8d32 x qsi4c32: Y_Q4_GEMM's panels, integer blocks of 32 (D32 in y_gemm_tile). */
Y_TARGET static void Y_D32_GEMM(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, bl = rhs->bl, nb = k / bl;
    const int8_t *a;
    size_t lda;
    int32_t *corr;
    uint8_t *panel = pk_scratch(0, (size_t)k * Y_NR + sizeof(float) * ((size_t)nb * Y_NR + Y_NR));
    if (!panel || pk_gemm_lhs_prep(lhs, m, k, k, 32, 8, &a, &lda, &corr)) {
        pk_scalar_run_d32(m, n0, n1, lhs, rhs, NULL, dst, ldd, lo, hi);
        return;
    }
    float *spanel = (float *)(panel + (size_t)k * Y_NR), *rs = spanel + (size_t)nb * Y_NR;
    for (int np = n0; np < n1; np += Y_NR) {
        Y_NAME(y_pack_q4_panel)(rhs, np, n1, panel, spanel, rs);
        Y_NAME(y_gemm_panel)(0, 1, bl / 32, m, lhs, a, lda, corr, k / 32, k / 32, 8, panel, spanel, rs, NULL,
                             n1 - np < Y_NR ? n1 - np : Y_NR, dst + np, ldd, lo, hi);
    }
}

#if Y_VNNI
Y_TARGET static void Y_Q8_GEMM(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                       const void *packed, float *dst, size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, kp = (int)pk_round_up((size_t)k, 16);
    const int8_t *a;
    size_t lda;
    int32_t *corr;
    uint8_t *panel = pk_scratch(0, (size_t)kp * Y_NR + 2 * sizeof(float) * Y_NR);
    if (!panel || pk_gemm_lhs_prep(lhs, m, k, kp, k, 128, &a, &lda, &corr)) {
        pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
        return;
    }
    float *ws = (float *)(panel + (size_t)kp * Y_NR);
    int32_t *isum = (int32_t *)(ws + Y_NR);
    for (int np = n0; np < n1; np += Y_NR) {
        Y_NAME(y_pack_q8_panel)(rhs, np, n1, kp, panel, ws, isum);
        Y_NAME(y_gemm_panel)(1, 0, 1, m, lhs, a, lda, corr, 1, 1, kp / 4, panel, NULL, ws, isum,
                             n1 - np < Y_NR ? n1 - np : Y_NR, dst + np, ldd, lo, hi);
    }
}
#endif

#if Y_VNNI
/* qai8dx x qsi8cx, 1 x 4: u8 = q ^ 0x80, s8 = w; exact int32, bit-exact with the scalar. */
Y_TARGET static void Y_Q8_GEMV(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs, const void *packed, float *dst,
                                               size_t ldd, float lo, float hi) {
    (void)packed;
    const int k = rhs->k, G = k / 32;
    const size_t ldo = pk_round_up((size_t)k, 32);
    uint8_t *act = pk_scratch(0, ldo * (size_t)m);
    if (!act) { pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi); return; }
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    for (int i = 0; i < m; i++) {
        const int8_t *a = lhs->q + (size_t)i * lhs->ld;
        uint8_t *o = act + (size_t)i * ldo;
        for (int g = 0; g < G; g++)
            _mm256_store_si256((__m256i *)(o + 32 * g),
                               _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + 32 * g)), x80));
        for (int kk = 32 * G; kk < k; kk++) o[kk] = (uint8_t)(a[kk] ^ 0x80);
    }
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        const int8_t *w[4];
        for (int r = 0; r < 4; r++) w[r] = (const int8_t *)rhs->qs + (size_t)(n + (r < nr ? r : nr - 1)) * k;
        for (int i = 0; i < m; i++) {
            const uint8_t *ai = act + (size_t)i * ldo;
            __m256i acc[4];
            for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_si256();
            for (int g = 0; g < G; g++) {
                const __m256i av = _mm256_load_si256((const __m256i *)(ai + 32 * g));
                for (int r = 0; r < 4; r++)
                    acc[r] = Y_DPBUSD(acc[r], av, _mm256_loadu_si256((const __m256i *)(w[r] + 32 * g)));
            }
            for (int r = 0; r < nr; r++) {
                const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
                const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                int32_t d = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
                for (int kk = 32 * G; kk < k; kk++) d += (int32_t)ai[kk] * w[r][kk];
                d -= (lhs->zp[i] + 128) * rhs->isum[n + r];
                const float v = lhs->scale[i] * ((const float *)rhs->scales)[n + r] * (float)d;
                dst[(size_t)i * ldd + n + r] = pk_clampf(v, lo, hi);
            }
        }
    }
}
#endif

#undef Y_INLINE
#undef Y_NR
