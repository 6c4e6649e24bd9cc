/* A decode row's attention alone: one thread, H K/V heads' f16 caches of N positions each,
 * read in turn as a forward pass reads them (pk_attend_part over chunks of PK_ATTEND_CHUNK
 * positions, the work items of job_attention_split). H = 1 keeps one head's cache in L2 (the
 * arithmetic alone); H = 32 at N = 4096 (32 MB of cache for head size 64) reads it from
 * memory. Prints the best of REPS passes in microseconds per head and the cache bytes read
 * per second. Build against a tree's sources (a tree before a change and after it, then run
 * the two alternately):
 *
 *   source scripts/cflags.sh; SRCS=$(find pyklei_ext/contract pyklei_ext/ops pyklei_ext/isa -name '*.c')
 *   gcc -O3 "${PK_CFLAGS[@]}" -Ipyklei_ext benchmarks/attention_decode.c $SRCS -lm -o /tmp/attention_decode
 *   /tmp/attention_decode [GROUP 4] [HEAD_DIM 64] [N 4096] [BF16 1] [H 32] [REPS 30] [CACHE f16]
 *
 * BF16 = 1: the bf16 dot products (where AVX-512 BF16 runs; else the reference's arithmetic in
 * plain C), 0: f32. CACHE: f16 or bf16 (the values in the bf16 kernels' pair order,
 * contract/pk_kv.h; the same bytes). Not a test: figures for docs/KERNELS.md. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ops/pk_matmul.h"   /* pk_dispatch_init */
#include "ops/pk_nn.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int arg(int argc, char **argv, int i, int dflt) { return argc > i ? atoi(argv[i]) : dflt; }

int main(int argc, char **argv) {
    const int group = arg(argc, argv, 1, 4), hd = arg(argc, argv, 2, 64), n = arg(argc, argv, 3, 4096);
    const int bf16 = arg(argc, argv, 4, 1), heads = arg(argc, argv, 5, 32), reps = arg(argc, argv, 6, 30);
    const char *cache = argc > 7 ? argv[7] : "f16";
    const pk_kv_type type = !strcmp(cache, "bf16") ? PK_KV_BF16 : PK_KV_F16;
    if (group < 1 || group > 8 || hd < 16 || hd > 256 || hd % 32 || n < 1 || heads < 1 || reps < 1 ||
        (strcmp(cache, "f16") && strcmp(cache, "bf16"))) {
        fprintf(stderr, "usage: %s [GROUP 1-8] [HEAD_DIM 32..256] [N] [BF16 0|1] [HEADS] [REPS] [f16|bf16]\n", argv[0]);
        return 2;
    }
    if (pk_dispatch_init() != 0) {
        fprintf(stderr, "dispatch: %s\n", pk_last_error());
        return 1;
    }
    const size_t e = (size_t)(n + PK_KV_BLOCK - 1) / PK_KV_BLOCK * PK_KV_BLOCK * hd;   /* K is whole blocks */
    uint16_t *k = malloc(e * 2 * heads), *v = malloc(e * 2 * heads);
    float *x = malloc(e * sizeof(float)), *q = malloc(sizeof(float) * group * hd);
    float *scores = malloc(sizeof(float) * group * PK_ATTEND_CHUNK), *out = malloc(sizeof(float) * group * hd);
    float ml[16];
    if (!k || !v || !x || !q || !scores || !out) return 1;
    srand(1);
    for (size_t i = 0; i < e; i++) x[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    for (int h = 0; h < heads; h++) {   /* every head's pages touched, as a filled cache's are */
        /* (the values' order is the cache's own only for f16; timing does not depend on it) */
        (type == PK_KV_BF16 ? pk_f32_to_bf16_row : pk_f32_to_f16_row)((int)e, x, k + h * e);
        (type == PK_KV_BF16 ? pk_f32_to_bf16_row : pk_f32_to_f16_row)((int)e, x, v + h * e);
    }
    for (int i = 0; i < group * hd; i++) q[i] = (float)(rand() % 201 - 100) / 100.0f;
    pk_kv_head kv = {.type = type, .f16 = pk_f16_to_f32_pick(NULL), .dot_bf16 = bf16};
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        for (int h = 0; h < heads; h++) {
            kv.k = k + h * e, kv.v = v + h * e;
            for (int p0 = 0; p0 < n; p0 += PK_ATTEND_CHUNK)
                pk_attend_part(group, hd, p0, n - p0 < PK_ATTEND_CHUNK ? n - p0 : PK_ATTEND_CHUNK, q, &kv,
                               0.125f, scores, PK_ATTEND_CHUNK, out, ml);
        }
        const double t = (now_s() - t0) / heads;
        best = t < best ? t : best;
    }
    printf("group %d, head size %d, %d positions, %s cache, %s, %d heads: %.1f us per head, %.1f GB/s of cache\n",
           group, hd, n, cache, bf16 ? "bf16" : "f32", heads, 1e6 * best, (double)n * hd * 2 * 2 / best / 1e9);
    free(k), free(v), free(x), free(q), free(scores), free(out);
    return 0;
}
