/* The element formats of pyklei's C layer, in one place: their ids, names, row sizes and
 * element getters. docs/FORMAT.md defines the bytes and the arithmetic.
 *
 * Ids: the quantized weight formats first, with the ids of the Python registry
 * (pyklei/formats/registry.py, WeightFormat.c_id: tests/formats/test_formats.py checks _ext.FORMATS
 * against it); the kernels and the dispatch table index by them (< PK_FMT_QUANT_COUNT).
 * The plain types follow; only embedding tables (pk_tensor, ops/pk_nn.h) use them.
 *
 * A header of the contract (contract/): the kernel layer (ops/) and the ISA files (isa/) both
 * read it. */
#ifndef PK_FORMAT_H
#define PK_FORMAT_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    PK_FMT_QSI4C32 = 0,    /* int4, bf16 scale per block of bl along K: nibbles [n][k/2] */
    PK_FMT_QSI8CX = 1,     /* int8, f32 scale per row: [n][k] */
    PK_FMT_QSI6C32 = 2,    /* int6, bf16 scale per block of 32: [n][3k/4] */
    PK_FMT_QUANT_COUNT,    /* the formats the matmul kernels compute */
    PK_FMT_F32 = PK_FMT_QUANT_COUNT,
    PK_FMT_F16,
    PK_FMT_BF16,
    PK_FMT_COUNT
} pk_format;

/* "qsi4c32", "qsi8cx", "qsi6c32", "f32", "f16", "bf16"; NULL for an unknown id. */
static inline const char *pk_format_name(int fmt) {
    static const char *const names[PK_FMT_COUNT] = {
        [PK_FMT_QSI4C32] = "qsi4c32", [PK_FMT_QSI8CX] = "qsi8cx", [PK_FMT_QSI6C32] = "qsi6c32",
        [PK_FMT_F32] = "f32", [PK_FMT_F16] = "f16", [PK_FMT_BF16] = "bf16",
    };
    return fmt >= 0 && fmt < PK_FMT_COUNT ? names[fmt] : NULL;
}

static inline int pk_format_quantized(int fmt) { return fmt >= 0 && fmt < PK_FMT_QUANT_COUNT; }

/* Bytes of one row of k elements in the canonical layout (the data array; scales apart). */
static inline size_t pk_row_bytes(pk_format fmt, int k) {
    switch (fmt) {
    case PK_FMT_QSI4C32: return (size_t)k / 2;
    case PK_FMT_QSI6C32: return (size_t)k / 4 * 3;
    case PK_FMT_F32: return (size_t)k * 4;
    case PK_FMT_F16:
    case PK_FMT_BF16: return (size_t)k * 2;
    default: return (size_t)k;   /* qsi8cx */
    }
}

/* ---- bf16 (the block scales) ---------------------------------------------------------- */

static inline float pk_bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}

/* Round to nearest even (the converters' rounding; NaN and inf are not expected). */
static inline uint16_t pk_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

/* ---- f16 (embedding tables, the KV cache and its q8 scales) -------------------------------- */

/* IEEE half -> float in plain C: exact; a NaN comes out quiet, as from vcvtph2ps and fcvtl.
 * The reference of the per-ISA conversions (pk_isa_helpers.f16_to_f32, pk_kernel.h). */
static inline float pk_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) bits = sign;
        else {                                   /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {   /* inf, or a quiet NaN */
        bits = sign | 0x7F800000 | (mant << 13) | (mant ? 0x400000u : 0u);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

/* float -> IEEE half: round to nearest even, overflow to inf, a NaN to the quiet NaN 0x7E00.
 * The cases are selects, not branches, so that a loop of it vectorizes (pk_f32_to_f16_row: a
 * prefill writes every K and V row through it; with branches it was half of the "rope"
 * operation's time). */
static inline uint16_t pk_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    const uint32_t sign = (v.u >> 16) & 0x8000, absu = v.u & 0x7FFFFFFF;
    const float small = absu < 0x38800000 ? __builtin_fabsf(f) : 0.0f;      /* in range of the cast */
    const uint32_t sub = (uint32_t)__builtin_rintf(small * 16777216.0f);    /* subnormal: / 2^-24 */
    const uint32_t normal = (absu + 0x0FFF + ((absu >> 13) & 1) - 0x38000000) >> 13;
    const uint32_t h = absu > 0x7F800000 ? 0x7E00 : absu >= 0x477FF000 ? 0x7C00
                     : absu < 0x38800000 ? sub : normal;
    return (uint16_t)(sign | h);
}

/* ---- element getters of the canonical layouts ----------------------------------------- */

/* Element kk of a qsi4c32 row (sign-extended int4), following the chunk nibble order. */
static inline int pk_qsi4c32_get(const uint8_t *row, int kk) {
    const uint8_t b = row[(kk >> 5) * 16 + (kk & 15)];
    const int nib = (kk & 16) ? (b >> 4) : (b & 15);
    return (nib ^ 8) - 8;
}

/* Element kk of a qsi6c32 row, in [-32, 31]. Chunk c of 32 elements is 24 bytes: 16 bytes of
 * low nibbles in qsi4c32's order, then 8 bytes whose byte j holds the top two bits of
 * elements j, j+8, j+16, j+24 (bits 0-1, 2-3, 4-5, 6-7); values are stored as q + 32. */
static inline int pk_qsi6c32_get(const uint8_t *row, int kk) {
    const uint8_t *c = row + (kk >> 5) * 24;
    const int e = kk & 31;
    const int lo = (e & 16) ? (c[e & 15] >> 4) : (c[e & 15] & 15);
    const int hi = (c[16 + (e & 7)] >> (2 * (e >> 3))) & 3;
    return (lo | hi << 4) - 32;
}

#endif
