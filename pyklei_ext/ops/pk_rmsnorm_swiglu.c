/* RMSNorm and SwiGLU, the element-wise steps of a transformer block (pk_nn.h), as plain C
 * loops the compiler vectorizes in each clone (PK_CLONES, pk_ops_internal.h). */
#include "pk_nn.h"

#include <math.h>

#include "pk_softmax.h"   /* exp_nonpos */

/* The sum of squares in 8 double lanes (one zmm; exact products, then adds in a fixed order,
 * the same in every clone and on Arm): one chain of dependent adds made the norms 4% of a
 * SmolLM2 prefill. */
PK_CLONES void pk_rmsnorm(int d, const float *x, const float *w, float eps, float *out) {
    double lane[8] = {0.0};
    int i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)x[i + l] * x[i + l];
    double ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; i < d; i++) ss += (double)x[i] * x[i];
    const float inv = (float)(1.0 / sqrt(ss / d + eps));
    for (int i = 0; i < d; i++) out[i] = x[i] * inv * w[i];
}

/* silu(g) * u with silu(g) = g / (1 + e^-g), e^-|g| from the polynomial so it vectorizes:
 * g >= 0: g / (1 + e^-g); g < 0: g e^g / (1 + e^g). */
PK_CLONES void pk_swiglu(int n, const float *gate, const float *up, float *out) {
    for (int i = 0; i < n; i++) {
        const float g = gate[i], e = exp_nonpos(g < 0.0f ? g : -g);
        out[i] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
    }
}

/* gelu(g) * u with the tanh approximation (Gemma's GeGLU, PyTorch's gelu(approximate="tanh")):
 * 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), which is g * sigmoid(2y): the same
 * sigmoid as pk_swiglu's, so it vectorizes alike. */
PK_CLONES void pk_geglu_tanh(int n, const float *gate, const float *up, float *out) {
    const float c = 0.7978845608028654f;   /* sqrt(2/pi) */
    for (int i = 0; i < n; i++) {
        const float g = gate[i], z = 2.0f * c * (g + 0.044715f * g * g * g);
        const float e = exp_nonpos(z < 0.0f ? z : -z);
        out[i] = g * ((z < 0.0f ? e : 1.0f) / (1.0f + e)) * up[i];
    }
}
