/* A model's activation statistics (the imatrix's squares per input channel) and its profile of
 * wall time per operation (pk_llama.h). */
#include <stdlib.h>
#include <string.h>

#include "pk_llama_internal.h"

#define err(...) pk_set_error(__VA_ARGS__)

static const char *const op_names[PK_LLAMA_OPS] = {
    "embed", "attn_norm", "qkv", "rope", "attention", "o_proj", "ffn_norm", "gate_up",
    "swiglu", "down", "residual", "output_norm", "lm_head",
};

void pk_llama_profile_enable(pk_llama *m, int on) {
    m->profile = on;
    memset(m->prof_s, 0, sizeof m->prof_s);
    m->prof_calls = 0;
}

int pk_llama_profile(const pk_llama *m, const char *const **names, const double **seconds, long *calls) {
    *names = op_names;
    *seconds = m->prof_s;
    *calls = m->prof_calls;
    return PK_LLAMA_OPS;
}

const char *const pk_llama_stat_names[PK_LLAMA_STATS] = {
    "attn_in", "attn_out", "ffn_in", "down_in", "lm_head_in",
};

static size_t stat_len(const pk_llama_hparams *hp, pk_llama_stat s) {
    switch (s) {
    case PK_LLAMA_STAT_ATTN_OUT: return (size_t)hp->n_head * hp->head_dim;
    case PK_LLAMA_STAT_DOWN_IN: return (size_t)hp->n_ff;
    default: return (size_t)hp->n_embd;
    }
}

static size_t stats_layer_len(const pk_llama_hparams *hp) {
    size_t n = 0;
    for (int s = 0; s < PK_LLAMA_STAT_LM_HEAD_IN; s++) n += stat_len(hp, (pk_llama_stat)s);
    return n;
}

size_t pk_llama_stat_section(const pk_llama_hparams *hp, int l, pk_llama_stat s, size_t *len) {
    *len = stat_len(hp, s);
    if (s == PK_LLAMA_STAT_LM_HEAD_IN) return stats_layer_len(hp) * hp->n_layer;
    size_t off = stats_layer_len(hp) * l;
    for (int t = 0; t < (int)s; t++) off += stat_len(hp, (pk_llama_stat)t);
    return off;
}

/* Section s of layer l of the statistics, or NULL when they are off */
double *pk_llama_stat_at(const pk_llama *m, int l, pk_llama_stat s) {
    size_t len;
    return m->stats ? m->stats + pk_llama_stat_section(&m->hp, l, s, &len) : NULL;
}

int pk_llama_stats_enable(pk_llama *m, int on) {
    free(m->stats);
    m->stats = NULL;
    m->stats_len = 0;
    m->stats_rows = m->stats_lm_rows = 0;
    if (!on) return 0;
    size_t lm_len;
    m->stats_len = pk_llama_stat_section(&m->hp, 0, PK_LLAMA_STAT_LM_HEAD_IN, &lm_len) + lm_len;
    m->stats = calloc(m->stats_len, sizeof(double));
    return m->stats ? 0 : err("out of memory for activation statistics");
}

const double *pk_llama_stats(const pk_llama *m, size_t *len, long *rows, long *lm_rows) {
    *len = m->stats_len;
    *rows = m->stats_rows;
    *lm_rows = m->stats_lm_rows;
    return m->stats;
}

/* dst[j] += sum over rows of x[r][j]^2 */
void pk_llama_add_squares(double *dst, const float *x, int rows, int d) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < d; j++) dst[j] += (double)x[(size_t)r * d + j] * x[(size_t)r * d + j];
}

