/* The converter's block-scale search (pyklei.formats.qsi4c32._quantize_blocks) in C: the
 * weights of a model pass through it once, at conversion, and in numpy its ~20 candidate
 * scales per block cost most of a conversion's time (a 1B model: minutes). Byte-exact with the
 * numpy reference, which stays the definition (tests/formats/test_weight_search.py). */
#ifndef PK_WEIGHT_SEARCH_H
#define PK_WEIGHT_SEARCH_H

#include <stddef.h>
#include <stdint.h>

/* n_blocks blocks of bl floats x (contiguous, finite) -> q [n_blocks * bl] in [qmin, qmax] and
 * the bf16 bits of each block's scale. Candidates absmax / divisors[i] (each rounded to bf16),
 * the least squared error kept (the first of equal ones), then with `search` one least-squares
 * refit; without, divisors[0] alone and no refit. w: NULL, or importance weights of the
 * squared error, block b reading w + (b % w_period) * bl. Sums run in numpy's pairwise order. */
void pk_weight_search_blocks(size_t n_blocks, int bl, const float *x, const float *w,
                             size_t w_period, int search, const float *divisors, int n_divisors,
                             int qmin, int qmax, int8_t *q, uint16_t *scale_bits);

#endif
