/* The q8 KV cache's writer: one head vector as int8 values and an f16 scale per group of
 * PK_KV_Q8_GROUP (contract/pk_kv.h). Its reader is the attention (pk_attention.c). */
#include "pk_nn.h"

#include <math.h>

void pk_kv_q8_row(int hd, const float *x, int8_t *out, uint16_t *scale) {
    for (int c = 0; c < hd / PK_KV_Q8_GROUP; c++) {
        const float *xc = x + c * PK_KV_Q8_GROUP;
        float amax = 0.0f;
        for (int i = 0; i < PK_KV_Q8_GROUP; i++) amax = fabsf(xc[i]) > amax ? fabsf(xc[i]) : amax;
        /* quantize with the scale as stored (rounded to f16), so value * scale is what the
         * writer meant; the rounding may push |x| / d a little past 127: clamp */
        scale[c] = pk_f32_to_f16(amax / 127.0f);
        const float d = pk_f16_to_f32(scale[c]), id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < PK_KV_Q8_GROUP; i++) {
            const float r = rintf(xc[i] * id);
            out[c * PK_KV_Q8_GROUP + i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
    }
}
