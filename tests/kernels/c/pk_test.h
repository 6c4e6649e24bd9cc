/* Shared by the standalone C tests (tests/kernels/c/test_*.c, one translation unit each): the
 * pass/fail counters and CHECK, a seeded random generator, the bf16 rounding of the
 * converters (contract/pk_format.h), and the last line every test prints. */
#ifndef PK_TEST_H
#define PK_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "contract/pk_format.h"

static int n_pass, n_fail, verbose, fail_prints;

/* Counts a check; prints the first 40 failures with their place and a printf message. */
#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (cond) {                                                                        \
            n_pass++;                                                                      \
        } else {                                                                           \
            n_fail++;                                                                      \
            if (fail_prints++ < 40) {                                                      \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                                \
                printf(__VA_ARGS__);                                                       \
                printf("\n");                                                              \
            }                                                                              \
        }                                                                                  \
    } while (0)

/* xorshift64*: small, fast, good enough for test data; --seed N sets the state (odd). */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static void rnd_seed(const char *arg) { rng_state = strtoull(arg, NULL, 0) | 1; }
static uint64_t rnd(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd() % (uint64_t)(hi - lo + 1)); }   /* [lo, hi] */
static float rnd_unit(void) { return (float)((rnd() >> 40) * (1.0 / 16777216.0)); }          /* [0, 1) */
static float rndf(void) { return rnd_unit() * 2.0f - 1.0f; }                                 /* [-1, 1) */

static uint16_t f32_to_bf16(float f) { return pk_f32_to_bf16(f); }

/* The last line of every test, which the scripts parse; returns the exit status. */
static int pk_test_summary(void) {
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

#endif
