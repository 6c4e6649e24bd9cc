/* RoPE: rotary position embedding of query and key heads (pk_nn.h). */
#include "pk_nn.h"

#include <math.h>

void pk_rope_angles(int head_dim, int pos, const float *inv_freq, float *cs) {
    for (int i = 0; i < head_dim / 2; i++) {
        const float angle = (float)pos * inv_freq[i];
        cs[2 * i] = cosf(angle);
        cs[2 * i + 1] = sinf(angle);
    }
}

/* Not in the clones: their vectorizer turns this complex product into vfmaddsub (one rounding
 * where the reference has two) despite -ffp-contract=off, and greedy replies changed. */
void pk_rope_cs(int n_heads, int head_dim, const float *cs, float *x) {
    for (int h = 0; h < n_heads; h++)
        for (int i = 0; i < head_dim / 2; i++) {
            float *p = x + (size_t)h * head_dim + 2 * i;
            const float a = p[0], b = p[1], c = cs[2 * i], s = cs[2 * i + 1];
            p[0] = a * c - b * s;
            p[1] = a * s + b * c;
        }
}

void pk_rope(int n_heads, int head_dim, int pos, const float *inv_freq, float *x) {
    float cs[1024];   /* head_dim <= 512 (pk_llama_create) */
    pk_rope_angles(head_dim, pos, inv_freq, cs);
    pk_rope_cs(n_heads, head_dim, cs, x);
}
