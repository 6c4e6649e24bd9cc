/* Model-agnostic transformer ops on float32 rows: RMSNorm, RoPE, attention over a KV cache,
 * SwiGLU, embedding-row dequantization. Shapes are in the comments; rows are contiguous. */
#ifndef PK_NN_H
#define PK_NN_H

#include <stddef.h>
#include <stdint.h>

typedef enum { PK_T_F32 = 0, PK_T_F16, PK_T_BF16, PK_T_QSI4C32, PK_T_QSI8CX } pk_dtype;

/* A 2-D tensor [n, k] read row by row (embedding tables). */
typedef struct {
    pk_dtype type;
    int n, k, bl;            /* bl: qsi4c32 block length */
    const void *data;        /* f32/f16/bf16 [n][k]; qsi4c32 nibbles [n][k/2]; qsi8cx int8 [n][k] */
    const void *scales;      /* qsi4c32 bf16 [n][k/bl]; qsi8cx f32 [n]; else NULL */
} pk_tensor;

/* out[k] = row r of t, dequantized. */
void pk_tensor_row_f32(const pk_tensor *t, int r, float *out);

/* out[d] = x[d] / sqrt(mean(x^2) + eps) * w[d] */
void pk_rmsnorm(int d, const float *x, const float *w, float eps, float *out);

/* Rotates adjacent pairs (x[2i], x[2i+1]) of each head by pos * inv_freq[i] (llama.cpp's
 * "normal" RoPE; the converter permutes q/k rows so this equals Hugging Face's rotate-half).
 * x: [n_heads][head_dim]; inv_freq: [head_dim/2]. */
void pk_rope(int n_heads, int head_dim, int pos, const float *inv_freq, float *x);

/* out[i] = silu(gate[i]) * up[i] */
void pk_swiglu(int n, const float *gate, const float *up, float *out);

/* One query head against positions [0, n_pos) of one KV head.
 * q: [hd]; kt: K transposed, [hd][kt_stride] (position j of dim i at kt[i*kt_stride + j]), so
 * the scores are hd axpy's over positions, not n_pos short dot products; v: [n_pos][hd];
 * K and V are f32 or f16 per kv_f16; scores: scratch [n_pos]; out: [hd]. */
void pk_attend_head(int hd, int n_pos, const float *q, const void *kt, size_t kt_stride,
                    const void *v, int kv_f16, float scale, float *scores, float *out);

void pk_f32_to_f16_row(int n, const float *x, uint16_t *out);

#endif
