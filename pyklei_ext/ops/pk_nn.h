/* Model-agnostic transformer ops on float32 rows: RMSNorm, RoPE, attention over a KV cache,
 * SwiGLU, embedding-row dequantization. Shapes are in the comments; rows are contiguous.
 * One header, a file per concern:
 *   pk_tensor_row.c            embedding rows as f32
 *   pk_rmsnorm_swiglu.c        RMSNorm, SwiGLU
 *   pk_rope.c                  RoPE
 *   pk_f16.c                   f32 -> f16 rows (cache writes), the f16 -> f32 reader's choice
 *   pk_kv_q8.c                 the q8 KV cache's writer
 *   pk_attention.c             attention: fast paths, chunks, rows (SIMD steps: isa/attention_x86_*.h)
 *   pk_attention_reference.c   attention: the reference
 *   pk_softmax.h               the softmax's pieces they share */
#ifndef PK_NN_H
#define PK_NN_H

#include <stddef.h>
#include <stdint.h>

#include "../contract/pk_format.h"
#include "../contract/pk_kv.h"


/* A 2-D tensor [n, k] read row by row (embedding tables). */
typedef struct {
    pk_format type;          /* any format, plain or quantized */
    int n, k, bl;            /* bl: qsi4c32 block length */
    const void *data;        /* f32/f16/bf16 [n][k]; qsi4c32 nibbles [n][k/2]; qsi6c32 [n][3k/4]; qsi8cx int8 [n][k] */
    const void *scales;      /* qsi4c32, qsi6c32 bf16 [n][k/bl]; qsi8cx f32 [n]; else NULL */
} pk_tensor;

/* out[k] = row r of t, dequantized. */
void pk_tensor_row_f32(const pk_tensor *t, int r, float *out);

/* out[d] = x[d] / sqrt(mean(x^2) + eps) * w[d] */
void pk_rmsnorm(int d, const float *x, const float *w, float eps, float *out);

/* Rotates adjacent pairs (x[2i], x[2i+1]) of each head by pos * inv_freq[i] (llama.cpp's
 * "normal" RoPE; the converter permutes q/k rows so this equals Hugging Face's rotate-half).
 * x: [n_heads][head_dim]; inv_freq: [head_dim/2]. */
void pk_rope(int n_heads, int head_dim, int pos, const float *inv_freq, float *x);
/* The same with the angles' cosines and sines given: cs[2i] = cos, cs[2i+1] = sin of
 * pos * inv_freq[i] (pk_rope_angles), so that the layers of one position share them. */
void pk_rope_angles(int head_dim, int pos, const float *inv_freq, float *cs);
void pk_rope_cs(int n_heads, int head_dim, const float *cs, float *x);

/* out[i] = silu(gate[i]) * up[i] */
void pk_swiglu(int n, const float *gate, const float *up, float *out);
/* out[i] = gelu_tanh(gate[i]) * up[i] (GeGLU; out may be gate) */
void pk_geglu_tanh(int n, const float *gate, const float *up, float *out);

/* The KV cache (its layout, element types and pk_kv_head): contract/pk_kv.h. Its f16 -> f32
 * conversions are the ISA files' helper records (contract/pk_kernel.h; the plain C one,
 * pk_f16_to_f32_scalar, is the reference). */

/* The widest conversion this CPU runs (only ISAs named in PYKLEI_KERNEL, if it names any;
 * scalar if none of those runs here), its ISA tag in *isa if isa is not NULL; with
 * PYKLEI_LOG=kernels a line on stderr names it. (ops/pk_f16.c) */
pk_f16_to_f32_fn pk_f16_to_f32_pick(const char **isa);
/* The conversion of ISA tag isa ("scalar", "avx2", "avx512vnni", "neon"); NULL if unknown or
 * not runnable here (tests). */
pk_f16_to_f32_fn pk_f16_to_f32_for_isa(const char *isa);

/* One head vector x[hd] as a q8 cache holds it: scale[c] = f16(max |x| of group c / 127),
 * out[i] = round(x[i] / scale) in [-127, 127] (0 where the scale is 0). hd % 32 == 0. */
void pk_kv_q8_row(int hd, const float *x, int8_t *out, uint16_t *scale);

/* Causal attention of the `group` query heads q[group][hd] that share one K/V head (GQA) over
 * cache positions [0, n_pos): K and V are read once for all of them. scores: [group][ld_scores
 * >= min(n_pos, PK_ATTEND_CHUNK)] scratch; out: [group][hd]. Bit-identical to pk_attend_group_reference for every
 * head size, group, cache type and conversion (the fast paths keep its order of operations,
 * and a converted value, f16 or int8 times an f16 scale, is exact in f32). */
void pk_attend_group(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                     float *scores, size_t ld_scores, float *out);
/* The same for `rows` query rows of one sequence over the same K/V head (a prefill chunk):
 * row r's heads q + r * ldq ([group][hd]) see positions [0, n_pos[r]) and write out + r * ldo.
 * An f16, q8 or bf16 cache is converted once per span for up to PK_ATTEND_ROWS rows. scores:
 * [min(rows, PK_ATTEND_ROWS)][group][ld_scores >= min(max n_pos, PK_ATTEND_CHUNK)] scratch. Each row bit-identical
 * to pk_attend_group on it alone. */
/* 8 rather than 4: the f16 cache's conversion shared by more rows (docs/KERNELS.md); the
 * forward pass holds [threads][8][group][n_ctx] floats of scores. */
#define PK_ATTEND_ROWS 8
void pk_attend_rows(int rows, const int *n_pos, int group, int hd, const float *q, size_t ldq,
                    const pk_kv_head *kv, float scale, float *scores, size_t ld_scores, float *out, size_t ldo);
/* The reference: one head at a time, one position at a time, values converted in plain C
 * (kv->f16 is not used). */
void pk_attend_group_reference(int group, int hd, int n_pos, const float *q, const pk_kv_head *kv, float scale,
                               float *scores, size_t ld_scores, float *out);

/* The dot-product arithmetic the forward pass reads an f16, q8 or bf16 cache of `type` with
 * (pk_kv_head.dot_bf16): 1 for bf16 where AVX-512 BF16 runs and PYKLEI_ATTENTION=bf16 asks
 * (or the default does), else 0 (f32; always for an f32 cache); -1 with the error set for a
 * PYKLEI_ATTENTION other than bf16 or f32. With log_choice and PYKLEI_LOG=kernels, a line on
 * stderr says which: the forward pass logs it when it is made, Python's KV policy asks quietly
 * (kv_policy.py), so the line appears once. (ops/pk_attention_bf16.c) */
int pk_attend_bf16_pick(pk_kv_type type, int log_choice);
/* Whether this CPU runs the bf16 attention kernels (AVX-512 F/BW/VL and BF16). */
int pk_attend_bf16_runs(void);

/* Whether attention of `group` query heads per K/V head of size hd runs a compiled kernel
 * (else the plain reference, some 50x slower). */
int pk_attend_is_fast(int group, int hd);

/* Chunks: every path above attends positions [0, n_pos) as chunks of PK_ATTEND_CHUNK
 * positions, each a partial with its own softmax (pk_attend_part), folded in order by
 * pk_attend_merge (the online softmax of flash attention's tiles). The scores scratch needs
 * ld_scores >= min(n_pos, PK_ATTEND_CHUNK) only, and a decode row at depth can be split over
 * threads by its chunks (pk_llama.c) with the same bits as one thread computing it. */
#define PK_ATTEND_CHUNK 512
/* The partial of positions [p0, p0 + n) (p0 a multiple of PK_ATTEND_CHUNK, n <= it): out
 * [group][hd] the normalised attention over them alone, ml [group][2] the max of each head's
 * scores and the sum of their exponentials from it. */
void pk_attend_part(int group, int hd, int p0, int n, const float *q, const pk_kv_head *kv, float scale,
                    float *scores, size_t ld_scores, float *out, float *ml);
/* Sliding-window attention of `rows` query rows of one sequence: row r's heads q + r * ldq
 * attend positions [lo[r], hi[r]) only (0 <= lo[r] < hi[r]) and write out + r * ldo. ring > 0
 * (a multiple of PK_ATTEND_CHUNK): the cache holds position p at p % ring. Each row is the
 * partials of the chunks of PK_ATTEND_CHUNK positions its window meets (the first from lo[r],
 * wherever it falls in a K block), folded in order, so with lo[r] = 0 it is pk_attend_group's
 * row; rows that meet one chunk compute their partials there together (as pk_attend_rows:
 * a converted cache converted once for up to PK_ATTEND_ROWS rows), and each row is
 * bit-identical to itself alone. scores: as pk_attend_rows'. */
void pk_attend_rows_window(int rows, const int *lo, const int *hi, int ring, int group, int hd, const float *q,
                           size_t ldq, const pk_kv_head *kv, float scale, float *scores, size_t ld_scores,
                           float *out, size_t ldo);
/* One row of it: positions [lo, hi). */
void pk_attend_window(int group, int hd, int lo, int hi, int ring, const float *q, const pk_kv_head *kv,
                      float scale, float *scores, size_t ld_scores, float *out);
/* Folds a later chunk's partial (part, ml) into the result so far (acc, acc_ml), in place. */
void pk_attend_merge(int group, int hd, float *acc, float *acc_ml, const float *part, const float *ml);

/* out[i] = f16(x[i]), i < n (pk_f32_to_f16, contract/pk_format.h): a cache row written. */
void pk_f32_to_f16_row(int n, const float *x, uint16_t *out);
/* out[i] = pk_kv_bf16_round(x[i]), i < n: a bf16 cache's values (ops/pk_f16.c). */
void pk_f32_to_bf16_row(int n, const float *x, uint16_t *out);

#endif
