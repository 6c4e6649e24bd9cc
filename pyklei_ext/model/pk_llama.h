/* The Llama forward pass: embeddings -> n_layer x (RMSNorm, GQA attention with RoPE over a
 * KV cache, RMSNorm, SwiGLU MLP) -> RMSNorm -> lm_head. The other families (pyklei/formats/
 * families.py) are this pass with per-layer features: q/k/v biases (Qwen2), an RMSNorm of each
 * q and k head (Qwen3, Gemma 3), sliding-window layers and a RoPE base and linear scaling per
 * layer (Gemma 3, Mistral), layers without RoPE (SmolLM3), RoPE on part of a head (Phi-4-mini), GeGLU and
 * norms of the attention's and the MLP's outputs (Gemma 3), scaled embeddings and attention
 * scores, and soft-capped logits. Prefill runs all rows of a chunk
 * through the kernel layer as GEMMs; decode is the same code with one row (GEMVs).
 *
 * Sequences: the model holds n_seq KV cache slots. pk_llama_forward_batch runs rows of several
 * sequences in one pass: every linear sees all rows at once (one activation quantization, the
 * weights streamed once), while RoPE, the K/V store and attention use each row's own slot and
 * position. The kernels give a row the same bits whatever the row count, so a row computes
 * the same logits batched as alone. KV memory: 2 * n_layer * n_head_kv * head_dim * (4 f32,
 * 2 f16, 1 + 2/32 q8) bytes per token per slot (SmolLM2: 46080, 23040, 12240), allocated for
 * n_seq * n_ctx tokens at create but only made resident as positions are written. */
#ifndef PK_LLAMA_H
#define PK_LLAMA_H

#include <stdint.h>

#include "../ops/pk_matmul.h"
#include "../ops/pk_nn.h"
#include "../ops/pk_rotate.h"

typedef struct {
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    float rms_eps, rope_theta;
    int n_ctx;        /* KV cache length */
    int n_batch;      /* rows per prefill chunk (scratch is sized for it) */
    int kv_type;      /* pk_kv_type (contract/pk_kv.h): the KV cache's f32, f16, q8 or bf16 */
    int n_seq;        /* KV cache slots, each of n_ctx positions (0 means 1) */
    /* family features; zero is Llama's behaviour */
    int act;              /* pk_llama_act: the MLP's gate */
    int rope_dim;         /* RoPE rotates the first rope_dim dimensions of a head (0: all) */
    float embd_scale;     /* token embeddings times this (0: 1) */
    float attn_scale;     /* attention scores times this (0: 1/sqrt(head_dim)) */
    float logit_softcap;  /* logits = c tanh(logits / c) (0: none) */
} pk_llama_hparams;

typedef enum { PK_ACT_SILU = 0, PK_ACT_GELU_TANH = 1 } pk_llama_act;   /* SwiGLU, GeGLU */

typedef struct {
    const float *attn_norm, *ffn_norm;                            /* [n_embd] */
    const pk_rhs *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;      /* prepared weights */
    /* per-layer features; NULL / 0 where the layer has none */
    const float *bq, *bk, *bv;          /* biases of q [n_head*hd], k and v [n_head_kv*hd] */
    const float *q_norm, *k_norm;       /* [head_dim]: RMSNorm of each q / k head before RoPE */
    const float *post_attn_norm, *post_ffn_norm;  /* [n_embd]: RMSNorm of the attention's / MLP's output */
    int window;           /* a row attends its last `window` positions, itself included (0: all) */
    float rope_theta;     /* this layer's RoPE base (0: the model's rope_theta) */
    float rope_factor;    /* linear RoPE scaling: this layer's frequencies divided by it (0: 1) */
    int no_rope;          /* 1: q and k are not rotated */
} pk_llama_layer;

typedef struct {
    pk_tensor tok_embd;          /* [n_vocab, n_embd], read by rows */
    const pk_rhs *lm_head;       /* [n_vocab, n_embd]; the same data as tok_embd when tied */
    const float *output_norm;    /* [n_embd] */
    const float *rope_freqs;     /* [head_dim/2] llama3 frequency divisors, or NULL */
    const pk_llama_layer *layers;/* [n_layer] */
    /* Rotated files (pk_rotate.h; n == 0: none): the SwiGLU output is rotated by rot_ffn_down
     * [n_ff] before down_proj, and with rot_output [n_embd] the final norm runs without its
     * gain, the row is rotated back (Q^T), scaled by output_norm and rotated again (Q), so
     * that a tied, rotated embedding table can serve as lm_head. */
    pk_rotation rot_ffn_down, rot_output;
} pk_llama_weights;

typedef struct pk_llama pk_llama;

/* Copies hparams/weight pointers (the weights themselves stay borrowed), allocates the
 * KV cache and scratch. NULL on failure (pk_last_error()). */
pk_llama *pk_llama_create(const pk_llama_hparams *hp, const pk_llama_weights *w, pk_ctx *ctx);
void pk_llama_destroy(pk_llama *model);
size_t pk_llama_state_bytes(const pk_llama *model);   /* KV cache + scratch */

/* Runs tokens[0..n) of slot 0 at positions pos0.. (the cache must hold positions < pos0 already),
 * writing K/V for them. logits: [n][n_vocab] if all_logits, else [n_vocab] for the last token.
 * Returns 0, or -1 (pk_last_error()) for bad token ids or positions beyond n_ctx.
 * *interrupt (may be NULL) is polled between chunks and layers; if set, returns 1. */
int pk_llama_forward(pk_llama *model, const int32_t *tokens, int n, int pos0, float *logits,
                     int all_logits, volatile int *interrupt);

/* Runs n rows of several sequences: row i is token tokens[i] of slot seq[i] at position pos[i].
 * The rows of one slot are consecutive with consecutive positions (p, p+1, ...), and slot s
 * must already hold positions < p (the caller tracks that: this layer cannot tell written K/V
 * from stale). logits: [n_out][n_vocab] for rows out_rows[0..n_out), strictly ascending.
 * Rows beyond n_batch run in chunks. Returns 0, 1 (interrupted) or -1 (pk_last_error()) for a
 * bad token, slot, position or row list; a refused call writes nothing. */
int pk_llama_forward_batch(pk_llama *model, int n, const int32_t *tokens, const int32_t *seq,
                           const int32_t *pos, int n_out, const int32_t *out_rows, float *logits,
                           volatile int *interrupt);

/* pk_llama_forward_batch with the final hidden states in place of logits: hidden
 * [n_out][n_embd] gets, for rows out_rows, the output of the final RMSNorm (in a rotated file
 * with rot_output undone: the unrotated checkpoint's values), and the lm_head does not run.
 * Sequence embeddings are pooled from these rows (pyklei/runtime/embedding.py). The K/V of
 * every row are written as by pk_llama_forward_batch, under the same rules. */
int pk_llama_hidden_batch(pk_llama *model, int n, const int32_t *tokens, const int32_t *seq,
                          const int32_t *pos, int n_out, const int32_t *out_rows, float *hidden,
                          volatile int *interrupt);

/* The ring length of layer l's cache (a sliding-window layer keeps position p at p % ring, the
 * window and a chunk's rows: a slot whose positions reached e holds that layer's positions
 * >= e - ring only), or 0 for a layer that keeps every position. */
int pk_llama_ring(const pk_llama *model, int layer);

/* Copies the K/V of positions [0, n) of slot src into slot dst (a shared prompt prefix runs
 * once). Returns 0 or -1 for a bad slot or n. */
int pk_llama_kv_copy(pk_llama *model, int src, int dst, int n);

/* A slot's K/V rows in and out of the cache, for a prefix cache that outlives the slot
 * (pyklei/runtime/prefix_cache.py). pk_llama_kv_export writes the K/V of every layer and K/V
 * head for positions [a, b) of slot seq into buf (pk_llama_kv_rows_bytes(model, b - a) bytes,
 * in the cache's own type: f32, f16, or q8 with its scales; an opaque layout that
 * pk_llama_kv_import of the same model reads back); pk_llama_kv_import writes them into slot
 * seq at the same positions, bit for bit, so a row after them gets the logits it would after
 * computing them. a and b are multiples of PK_KV_BLOCK (contract/pk_kv.h). A sliding-window
 * layer's ring keeps position p at p % ring: the caller exports only positions the ring still
 * holds. Return 0, or -1 for a bad slot or range (pk_last_error). */
size_t pk_llama_kv_rows_bytes(const pk_llama *model, int n);
int pk_llama_kv_export(pk_llama *model, int seq, int a, int b, void *buf);
int pk_llama_kv_import(pk_llama *model, int seq, int a, int b, const void *buf);

/* Activation statistics for importance-weighted quantization ("imatrix"): when enabled, every
 * forward adds the squares of each linear layer's input rows, per input channel, into a double
 * buffer of sections: per layer the inputs below in this order, then once lm_head_in.
 * pk_llama_stat_section says where each lies; the names are what pyklei's tensor table
 * (pyklei/formats/llama_tensors.py, TensorSpec.input) calls each linear's input. */
typedef enum {
    PK_LLAMA_STAT_ATTN_IN,     /* "attn_in"    [n_embd]: attn_norm's output, read by wq wk wv */
    PK_LLAMA_STAT_ATTN_OUT,    /* "attn_out"   [n_head*head_dim]: attention's output, read by wo */
    PK_LLAMA_STAT_FFN_IN,      /* "ffn_in"     [n_embd]: ffn_norm's output, read by w_gate w_up */
    PK_LLAMA_STAT_DOWN_IN,     /* "down_in"    [n_ff]: the SwiGLU output, read by w_down */
    PK_LLAMA_STAT_LM_HEAD_IN,  /* "lm_head_in" [n_embd]: output_norm's output, after the layers */
    PK_LLAMA_STATS
} pk_llama_stat;
extern const char *const pk_llama_stat_names[PK_LLAMA_STATS];
/* Offset of section s of layer l (l is ignored for lm_head_in) in the buffer; *len: its length. */
size_t pk_llama_stat_section(const pk_llama_hparams *hp, int l, pk_llama_stat s, size_t *len);
/* Enabling zeroes the buffer. Returns 0 or -1 (out of memory). */
int pk_llama_stats_enable(pk_llama *model, int on);
/* The buffer (NULL when disabled), its length, and the number of rows accumulated per layer. */
const double *pk_llama_stats(const pk_llama *model, size_t *len, long *rows, long *lm_rows);

/* Wall time per operation of the forward pass (embed, norms, qkv, rope, attention, o_proj,
 * gate_up, swiglu, down, residual, output_norm, lm_head), summed over calls since enabling;
 * enabling or disabling zeroes it. Costs two clock reads per operation while on. */
#define PK_LLAMA_OPS 13
void pk_llama_profile_enable(pk_llama *model, int on);
/* Sets the names and seconds arrays (PK_LLAMA_OPS entries) and the forward calls counted. */
int pk_llama_profile(const pk_llama *model, const char *const **names, const double **seconds, long *calls);

#endif
