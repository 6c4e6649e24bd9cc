/* Rows of a 2-D tensor (embedding tables) as f32, in any format (pk_tensor, pk_nn.h). */
#include "pk_nn.h"

#include <string.h>

void pk_tensor_row_f32(const pk_tensor *t, int r, float *out) {
    const int k = t->k;
    switch (t->type) {
    case PK_FMT_F32:
        memcpy(out, (const float *)t->data + (size_t)r * k, sizeof(float) * k);
        break;
    case PK_FMT_F16: {
        const uint16_t *row = (const uint16_t *)t->data + (size_t)r * k;
        for (int i = 0; i < k; i++) out[i] = pk_f16_to_f32(row[i]);
        break;
    }
    case PK_FMT_BF16: {
        const uint16_t *row = (const uint16_t *)t->data + (size_t)r * k;
        for (int i = 0; i < k; i++) out[i] = pk_bf16_to_f32(row[i]);
        break;
    }
    case PK_FMT_QSI4C32: {
        const uint8_t *row = (const uint8_t *)t->data + (size_t)r * (k / 2);
        const uint16_t *s = (const uint16_t *)t->scales + (size_t)r * (k / t->bl);
        for (int i = 0; i < k; i++) out[i] = pk_bf16_to_f32(s[i / t->bl]) * (float)pk_qsi4c32_get(row, i);
        break;
    }
    case PK_FMT_QSI6C32: {
        const uint8_t *row = (const uint8_t *)t->data + (size_t)r * pk_row_bytes(PK_FMT_QSI6C32, k);
        const uint16_t *s = (const uint16_t *)t->scales + (size_t)r * (k / 32);
        for (int i = 0; i < k; i++) out[i] = pk_bf16_to_f32(s[i / 32]) * (float)pk_qsi6c32_get(row, i);
        break;
    }
    case PK_FMT_QSI8CX: {
        const int8_t *row = (const int8_t *)t->data + (size_t)r * k;
        const float s = ((const float *)t->scales)[r];
        for (int i = 0; i < k; i++) out[i] = s * (float)row[i];
        break;
    }
    default:   /* not a format id (the caller checks) */
        break;
    }
}
