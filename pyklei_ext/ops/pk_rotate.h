/* Orthogonal rotations of activation rows, applied online by the forward pass where the
 * converter folded the inverse into the next weight (docs/FORMAT.md "Rotations"; the numpy
 * reference is pyklei/formats/rotation.py):
 *
 *   Q = diag(signs) . (mix kron H_p) / sqrt(p),   n = m * p, p a power of two, m odd
 *
 * H_p is the Sylvester Hadamard matrix (a fast Walsh-Hadamard transform, n log2 p adds), mix an
 * m x m orthogonal matrix (m n multiply-adds). Index i of a row is (a, b) = (i / p, i % p). */
#ifndef PK_ROTATE_H
#define PK_ROTATE_H

/* x[p] <- x @ H_p (unnormalised), p a power of two; the generic one and the per-ISA helper
 * records in contract/pk_kernel.h. */
typedef void (*pk_fwht_fn)(int p, float *x);

typedef struct {
    int n, m, p;            /* n = m * p; n == 0: no rotation */
    const float *signs;     /* [n], each -1 or +1 */
    const float *mix;       /* [m][m], orthogonal */
    pk_fwht_fn fwht;        /* the transform of one group, for this CPU (bit-exact across ISAs) */
    const char *fwht_isa;   /* its ISA tag: "scalar", "avx2", "avx512vnni", "neon" */
} pk_rotation;

/* Fills r from n, signs and mix and picks the widest FWHT this CPU runs (only ISAs named in
 * PYKLEI_KERNEL, if it names any; a line on stderr with PYKLEI_LOG=kernels); -1
 * (pk_set_error) if n is not m * 2^k with m <= 64 odd. */
int pk_rotation_init(pk_rotation *r, int n, const float *signs, const float *mix);

/* Uses the FWHT of ISA tag `isa` instead (tests); -1 if unknown or not runnable here. */
int pk_rotation_use(pk_rotation *r, const char *isa);

/* x[n] <- x @ Q (transpose = 0) or x @ Q^T (transpose = 1), in place; scratch: [n] floats. */
void pk_rotate_row(const pk_rotation *r, int transpose, float *x, float *scratch);

#endif
