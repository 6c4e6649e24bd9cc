/* AMX kernel template, included twice by matmul_x86_amx.c: with the real tile instructions
 * and with a C emulation of them (the test twin). Define before including:
 *   A_NAME(x), A_TARGET, AMX_LOAD(t, base, stride), AMX_STORE(t, base, stride), AMX_ZERO(t),
 *   AMX_DPBSSD(c, a, b), AMX_LOADCFG(cfg pointer), AMX_RELEASE(). */
#define A_INLINE static inline __attribute__((always_inline)) A_TARGET

/* 32 x 32 int32 block: 4 x tdpbssd for one KD step at activation column kk. */
A_INLINE void A_NAME(amx_step)(const int8_t *act, size_t lda, int i0, int kk, const uint8_t *panel) {
    AMX_LOAD(4, act + (size_t)i0 * lda + kk, lda);
    AMX_LOAD(5, act + (size_t)(i0 + 16) * lda + kk, lda);
    AMX_LOAD(6, panel + (size_t)(kk / 4) * ZNR * 4, ZNR * 4);
    AMX_LOAD(7, panel + (size_t)(kk / 4) * ZNR * 4 + 64, ZNR * 4);
    AMX_DPBSSD(0, 4, 6);
    AMX_DPBSSD(1, 4, 7);
    AMX_DPBSSD(2, 5, 6);
    AMX_DPBSSD(3, 5, 7);
}

/* C0..C3 -> cbuf as int32 [32][32] (row stride 128 bytes). */
A_INLINE void A_NAME(amx_store_c)(int32_t *cbuf) {
    AMX_STORE(0, cbuf, 128);
    AMX_STORE(1, cbuf + 16, 128);
    AMX_STORE(2, cbuf + 16 * 32, 128);
    AMX_STORE(3, cbuf + 16 * 32 + 16, 128);
}

A_INLINE __m512 A_NAME(amx_clamp)(__m512 v, float lo, float hi) {
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), v));
}

/* qai8dx_qsi4c32p16_32x32_amx (D32 0) and qsi8d32_qsi4c32p16_32x32_amx (D32 1: qsi8d32
 * activations, integer blocks of 32 whatever bl, each scaled by s_{b / sdiv} * as_b; no zero
 * point), and their _amx_emul twins */
A_INLINE void A_NAME(amx_q4_32x32)(const int D32, int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                   const void *packed, float *dst, size_t ldd, float lo, float hi) {
    const int k = rhs->k, bl = rhs->bl, nbw = k / bl, bli = D32 ? 32 : bl, nb = k / bli, sdiv = bl / bli;
    const int kd = bli == 32 ? 32 : 64, steps = bli / kd;
    size_t lda;
    uint8_t *panel = pk_scratch(0, (size_t)k * ZNR + sizeof(float) * ((size_t)nbw * ZNR + ZNR));
    float *work = pk_scratch(3, 2 * sizeof(float) * 32 * 32);
    int8_t *act = panel && work && packed ? amx_copy_lhs(lhs, m, k, &lda) : NULL;
    if (!act) {
        if (D32) pk_scalar_run_d32(m, n0, n1, lhs, rhs, NULL, dst, ldd, lo, hi);
        else pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi);
        return;
    }
    float *spanel = (float *)(panel + (size_t)k * ZNR), *rs = spanel + (size_t)nbw * ZNR;
    int32_t *cbuf = (int32_t *)work;
    float *facc = work + 32 * 32;
    amx_cfg cfg;
    amx_cfg_init(&cfg, kd);
    AMX_LOADCFG(&cfg);
    for (int np = n0 & ~15; np < n1; np += ZNR) {   /* p16 panels from the one holding n0 */
        const int nv = n1 - np < ZNR ? n1 - np : ZNR, c0 = n0 > np ? n0 - np : 0;
        z_pack_q4_panel(rhs, packed, np, n1, panel, spanel, rs, 8);   /* signed int4 -> int8 */
        for (int i0 = 0; i0 < m; i0 += 32) {
            const int mr = m - i0 < 32 ? m - i0 : 32;
            for (int r = 0; r < mr; r++) {
                _mm512_store_ps(facc + r * 32, _mm512_setzero_ps());
                _mm512_store_ps(facc + r * 32 + 16, _mm512_setzero_ps());
            }
            for (int b = 0; b < nb; b++) {
                AMX_ZERO(0);
                AMX_ZERO(1);
                AMX_ZERO(2);
                AMX_ZERO(3);
                for (int st = 0; st < steps; st++) A_NAME(amx_step)(act, lda, i0, b * bli + st * kd, panel);
                A_NAME(amx_store_c)(cbuf);
                const float *sb = spanel + (size_t)(b / sdiv) * ZNR;
                for (int r = 0; r < mr; r++) {
                    __m512 s0 = _mm512_load_ps(sb), s1 = _mm512_load_ps(sb + 16);
                    if (D32) {
                        const __m512 a = _mm512_set1_ps(lhs->bscale[(size_t)(i0 + r) * nb + b]);
                        s0 = _mm512_mul_ps(s0, a);
                        s1 = _mm512_mul_ps(s1, a);
                    }
                    float *f = facc + r * 32;
                    _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + r * 32)), s0, _mm512_load_ps(f)));
                    _mm512_store_ps(f + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + r * 32 + 16)), s1,
                                                            _mm512_load_ps(f + 16)));
                }
            }
            for (int r = 0; r < mr; r++) {
                const int ii = i0 + r;
                for (int j = 0; j < 2 && nv > 16 * j; j++) {   /* columns [c0, nv) of the block */
                    const int e = nv - 16 * j < 16 ? nv - 16 * j : 16, st = c0 - 16 * j > 0 ? c0 - 16 * j : 0;
                    if (e <= st) continue;
                    const __mmask16 sm = (__mmask16)(((1u << e) - 1) & ~((1u << st) - 1));
                    __m512 v = _mm512_load_ps(facc + r * 32 + 16 * j);
                    if (!D32) {
                        const __m512 t = _mm512_mul_ps(_mm512_set1_ps((float)lhs->zp[ii]), _mm512_load_ps(rs + 16 * j));
                        v = _mm512_mul_ps(_mm512_set1_ps(lhs->scale[ii]), _mm512_sub_ps(v, t));
                    }
                    _mm512_mask_storeu_ps(dst + (size_t)ii * ldd + np + 16 * j, sm, A_NAME(amx_clamp)(v, lo, hi));
                }
            }
        }
    }
    AMX_RELEASE();
}

A_TARGET static void A_NAME(qai8dx_qsi4c32p16_32x32)(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                                     const void *packed, float *dst, size_t ldd, float lo, float hi) {
    A_NAME(amx_q4_32x32)(0, m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi);
}

A_TARGET static void A_NAME(qsi8d32_qsi4c32p16_32x32)(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                                      const void *packed, float *dst, size_t ldd, float lo, float hi) {
    A_NAME(amx_q4_32x32)(1, m, n0, n1, lhs, rhs, packed, dst, ldd, lo, hi);
}

/* qai8dx_qsi8cxp4_32x32_amx, qai8dx_qsi8cxp4_32x32_amx_emul */
A_TARGET static void A_NAME(qai8dx_qsi8cxp4_32x32)(int m, int n0, int n1, const pk_lhs *lhs, const pk_rhs *rhs,
                                             const void *packed, float *dst, size_t ldd, float lo, float hi) {
    const int k = rhs->k, kp = (int)pk_round_up((size_t)k, 64);
    size_t lda;
    uint8_t *panel = pk_scratch(0, (size_t)kp * ZNR + 2 * sizeof(float) * ZNR);
    int32_t *cbuf = pk_scratch(3, sizeof(int32_t) * 32 * 32);
    int8_t *act = panel && cbuf && packed ? amx_copy_lhs(lhs, m, k, &lda) : NULL;
    if (!act) { pk_run_scalar(m, n0, n1, lhs, rhs, dst, ldd, lo, hi); return; }
    float *ws = (float *)(panel + (size_t)kp * ZNR);
    int32_t *isum = (int32_t *)(ws + ZNR);
    amx_cfg cfg;
    amx_cfg_init(&cfg, 64);
    AMX_LOADCFG(&cfg);
    for (int np = n0; np < n1; np += ZNR) {
        const int nv = n1 - np < ZNR ? n1 - np : ZNR;
        z_pack_q8_panel(rhs, packed, np, n1, kp, panel, ws, isum, 0);   /* signed int8, zero padded */
        for (int i0 = 0; i0 < m; i0 += 32) {
            const int mr = m - i0 < 32 ? m - i0 : 32;
            AMX_ZERO(0);
            AMX_ZERO(1);
            AMX_ZERO(2);
            AMX_ZERO(3);
            for (int kk = 0; kk < kp; kk += 64) A_NAME(amx_step)(act, lda, i0, kk, panel);
            A_NAME(amx_store_c)(cbuf);
            for (int r = 0; r < mr; r++) {
                const int ii = i0 + r;
                for (int j = 0; j < 2 && nv > 16 * j; j++) {
                    const int c = nv - 16 * j;
                    const __mmask16 sm = c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << c) - 1);
                    const __m512i d = _mm512_sub_epi32(_mm512_load_si512(cbuf + r * 32 + 16 * j),
                                                       _mm512_mullo_epi32(_mm512_set1_epi32(lhs->zp[ii]),
                                                                          _mm512_load_si512(isum + 16 * j)));
                    const __m512 ss = _mm512_mul_ps(_mm512_set1_ps(lhs->scale[ii]), _mm512_load_ps(ws + 16 * j));
                    _mm512_mask_storeu_ps(dst + (size_t)ii * ldd + np + 16 * j, sm,
                                          A_NAME(amx_clamp)(_mm512_mul_ps(ss, _mm512_cvtepi32_ps(d)), lo, hi));
                }
            }
        }
    }
    AMX_RELEASE();
}


#undef A_INLINE
