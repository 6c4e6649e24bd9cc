/* The converter's block-scale search, byte-exact with pyklei.formats.qsi4c32._quantize_blocks
 * (pk_weight_search.h). Each step is the numpy reference's float32 operation in its order:
 * no fused multiply-adds (-ffp-contract=off, cflags.txt), divisions where numpy divides, and
 * sums in numpy's pairwise order, so a near-tie between two candidates goes the same way. */
#include "pk_weight_search.h"

#include <math.h>
#include <string.h>

/* numpy's float32 add.reduce over a contiguous run (pairwise_sum in its loops_utils): under 8
 * values one by one, up to 128 in eight interleaved partial sums, above that split in halves
 * (a multiple of 8 first). The reduction starts from add's identity, 0 + the pairwise sum. */
static float pairwise_sum(const float *a, size_t n) {
    if (n < 8) {
        float res = 0.f;
        for (size_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        size_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

static float reduce_sum(const float *a, size_t n) { return 0.f + pairwise_sum(a, n); }

static uint16_t f32_to_bf16_bits(float f) {     /* pyklei.formats.bf16.f32_to_bf16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + (0x7FFFu + ((u >> 16) & 1u))) >> 16);
}

static float bf16_bits_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* _round_to_int4: rint(x / s) (half to even), 0 where s is not positive, clamped to
 * [qmin, qmax]. Clamping to [qmin - 1, qmax + 1] first (rounding is monotonic, the bounds are
 * integers) keeps the value under 2^22, where adding and removing 1.5 * 2^23 rounds half to
 * even exactly as rint does; unlike a call of rintf, the loop vectorizes. The result is never
 * -0 (numpy's q is int8). */
static void round_block(int bl, const float *x, float s, int qmin, int qmax, float *qf) {
    if (!(s > 0.f)) {
        for (int i = 0; i < bl; i++) qf[i] = 0.f;
        return;
    }
    const float lo = (float)qmin, hi = (float)qmax, magic = 12582912.f;
    for (int i = 0; i < bl; i++) {
        float v = x[i] / s;
        v = v < lo - 1.f ? lo - 1.f : v > hi + 1.f ? hi + 1.f : v;
        v = (v + magic) - magic;
        qf[i] = v < lo ? lo : v > hi ? hi : v;
    }
}

/* err_of(x - s q): the (weighted) sum of squares */
static float block_error(int bl, const float *x, float s, const float *qf, const float *w, float *tmp) {
    if (w) {
        for (int i = 0; i < bl; i++) {
            const float d = x[i] - s * qf[i];
            tmp[i] = (d * d) * w[i];
        }
    } else {
        for (int i = 0; i < bl; i++) {
            const float d = x[i] - s * qf[i];
            tmp[i] = d * d;
        }
    }
    return reduce_sum(tmp, (size_t)bl);
}

enum { MAX_BL = 1024 };

/* The same IEEE operations at any vector width (no FMA: -ffp-contract=off), so a clone per
 * x86 width changes the speed (~2x from SSE2 to AVX-512), never the bytes; GCC picks it at
 * load time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PK_SEARCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PK_SEARCH_CLONES
#endif

PK_SEARCH_CLONES
void pk_weight_search_blocks(size_t n_blocks, int bl, const float *x, const float *w,
                             size_t w_period, int search, const float *divisors, int n_divisors,
                             int qmin, int qmax, int8_t *q, uint16_t *scale_bits) {
    float qf[MAX_BL], tmp[MAX_BL], tmp2[MAX_BL];
    for (size_t b = 0; b < n_blocks; b++) {
        const float *xb = x + b * (size_t)bl;
        const float *wb = w ? w + (b % w_period) * (size_t)bl : NULL;
        float amax = 0.f;
        for (int i = 0; i < bl; i++) {
            const float a = fabsf(xb[i]);
            if (a > amax) amax = a;
        }
        float best_err = INFINITY;
        uint16_t best_bits = 0;
        for (int t = 0; t < n_divisors; t++) {
            const uint16_t bits = f32_to_bf16_bits(amax / divisors[t]);
            const float s = bf16_bits_to_f32(bits);
            round_block(bl, xb, s, qmin, qmax, qf);
            const float err = block_error(bl, xb, s, qf, wb, tmp);
            if (err < best_err) {
                best_err = err;
                best_bits = bits;
            }
        }
        if (search) {   /* one least-squares refit for the chosen rounding: <x,q> / <q,q> */
            round_block(bl, xb, bf16_bits_to_f32(best_bits), qmin, qmax, qf);
            for (int i = 0; i < bl; i++) {
                const float wq = wb ? qf[i] * wb[i] : qf[i];
                tmp[i] = wq * qf[i];
                tmp2[i] = xb[i] * wq;
            }
            const float qq = reduce_sum(tmp, (size_t)bl);
            const float fit = qq > 0.f ? reduce_sum(tmp2, (size_t)bl) / qq : 0.f;
            const uint16_t bits = f32_to_bf16_bits(fabsf(fit));
            const float s2 = bf16_bits_to_f32(bits);
            round_block(bl, xb, s2, qmin, qmax, qf);
            if (block_error(bl, xb, s2, qf, wb, tmp) < best_err) best_bits = bits;
        }
        round_block(bl, xb, bf16_bits_to_f32(best_bits), qmin, qmax, qf);
        for (int i = 0; i < bl; i++) q[b * (size_t)bl + (size_t)i] = (int8_t)qf[i];
        scale_bits[b] = best_bits;
    }
}
