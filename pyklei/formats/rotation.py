"""Orthogonal rotations of a model's activations: the numpy reference of what the converter
folds into weights and the C forward pass applies online (pyklei_ext/ops/pk_rotate.c).

A rotation of size n = m * p (p the largest power of two dividing n, m the odd rest) is

    Q = diag(signs) . (M kron H_p) / sqrt(p)          x -> x @ Q      (on the last axis)

with signs in {-1, +1} [n], M an m x m orthogonal matrix ("mix") and H_p the Sylvester
Hadamard matrix. Index i of x is (a, b) = divmod(i, p): H_p mixes within each of the m
contiguous groups of p, M mixes the groups. Every entry of Q has magnitude ~ 1/sqrt(n) when M
is a random orthogonal matrix, so a rotated vector has no outlier channels (QuaRot's point),
and the transform costs n log2(p) + m n operations instead of n^2. Hadamard matrices exist only
for orders 1, 2 and multiples of 4, so sizes like SmolLM2's 576 (= 9 * 64) or Llama 3's 14336
(= 7 * 2048) take a small random orthogonal M in their place: orthogonality is all the exact
folding needs.

docs/FORMAT.md ("Rotations") describes how the file records them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_MIX = 64          # the odd factor m of a supported size (a dense m x m matrix per row)
ORTHO_TOL = 1e-5      # |M M^T - I| allowed in a file's mix matrix


def split_size(n: int) -> tuple[int, int]:
    """n -> (m, p): p the largest power of two dividing n, m = n / p (odd)."""
    if n < 1:
        raise ValueError(f"rotation size must be positive, got {n}")
    p = n & -n
    return n // p, p


def _hadamard(p: int, dt) -> np.ndarray:
    """Sylvester's H_p (p a power of two), entries +-1: H_2k = [[H_k, H_k], [H_k, -H_k]]."""
    h = np.ones((1, 1), dt)
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return h


def fwht(x: np.ndarray) -> np.ndarray:
    """x @ H_p / sqrt(p) on the last axis (p a power of two), in x's float type (float32 for
    the converter's large tensors: ~1e-7 relative error); a new array.

    H_p = H_a kron H_b (p = a b, a <= b <= 2a), so each row, read as an a x b matrix X,
    becomes H_a X H_b: two BLAS products of a + b multiply-adds per value, on every core. A
    stage-by-stage butterfly in numpy (log2 p passes through temporaries) rotated ~10 M values
    a second, minutes of a 1B model's conversion."""
    p = x.shape[-1]
    if p & (p - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {p}")
    dt = np.float32 if x.dtype == np.float32 else np.float64
    a = 1 << ((p.bit_length() - 1) // 2)
    b = p // a
    y = np.asarray(x, dtype=dt).reshape(-1, b) @ _hadamard(b, dt)          # X H_b
    if a > 1:                                                               # H_a (X H_b)
        y = y.reshape(-1, a, b).swapaxes(1, 2).reshape(-1, a) @ _hadamard(a, dt)
        y = y.reshape(-1, b, a).swapaxes(1, 2)
    return y.reshape(x.shape) * dt(1.0 / np.sqrt(p))


@dataclass(frozen=True)
class Rotation:
    signs: np.ndarray     # [n] float32, +-1
    mix: np.ndarray       # [m, m] float32, orthogonal

    @property
    def n(self) -> int:
        return self.signs.shape[0]

    @property
    def m(self) -> int:
        return self.mix.shape[0]

    @property
    def p(self) -> int:
        return self.n // self.m

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x @ Q on the last axis, in float32 (float64 for float64 input)."""
        dt = np.float64 if np.asarray(x).dtype == np.float64 else np.float32
        x = np.asarray(x, dtype=dt) * self.signs.astype(dt)
        y = fwht(x.reshape(*x.shape[:-1], self.m, self.p))
        if self.m > 1:
            y = np.einsum("...ap,ac->...cp", y, self.mix.astype(dt))
        else:
            y = y * self.mix.astype(dt)[0, 0]
        return y.reshape(x.shape)

    def apply_t(self, x: np.ndarray) -> np.ndarray:
        """x @ Q^T on the last axis (the inverse), in float32 (float64 for float64 input)."""
        dt = np.float64 if np.asarray(x).dtype == np.float64 else np.float32
        x = np.asarray(x, dtype=dt)
        y = x.reshape(*x.shape[:-1], self.m, self.p)
        if self.m > 1:
            y = np.einsum("...ap,ca->...cp", y, self.mix.astype(dt))
        else:
            y = y * self.mix.astype(dt)[0, 0]
        return fwht(y).reshape(x.shape) * self.signs.astype(dt)

    def dense(self) -> np.ndarray:
        """Q as an n x n float64 matrix (tests)."""
        return self.apply(np.eye(self.n))


def make_rotation(n: int, rng: np.random.Generator) -> Rotation:
    """A random rotation of size n: random signs, M from the QR of a Gaussian matrix (with
    the signs of R's diagonal moved into Q, so M is Haar-distributed)."""
    m, _ = split_size(n)
    if m > MAX_MIX:
        raise ValueError(f"size {n} = {m} x {n // m}: odd factor {m} is larger than {MAX_MIX}")
    signs = rng.choice(np.array([-1.0, 1.0], np.float32), size=n)
    q, r = np.linalg.qr(rng.standard_normal((m, m)))
    mix = (q * np.sign(np.diag(r))).astype(np.float32)
    return Rotation(signs.astype(np.float32), mix)


def check_rotation(name: str, n: int, signs: np.ndarray, mix: np.ndarray) -> Rotation:
    """A rotation read from a file, validated: shapes, signs +-1, mix orthogonal. ValueError
    naming `name` otherwise."""
    m, _ = split_size(n)
    if signs.shape != (n,):
        raise ValueError(f"rotation {name}: signs have shape {list(signs.shape)}, expected [{n}]")
    if mix.shape != (m, m):
        raise ValueError(f"rotation {name}: mix has shape {list(mix.shape)}; size {n} = "
                         f"{m} x {n // m} needs [{m}, {m}]")
    if not np.all(np.abs(signs) == 1.0):
        raise ValueError(f"rotation {name}: signs must all be -1 or +1")
    err = np.abs(mix.astype(np.float64) @ mix.T.astype(np.float64) - np.eye(m)).max()
    if not np.isfinite(err) or err > ORTHO_TOL:
        raise ValueError(f"rotation {name}: mix is not orthogonal (|M M^T - I| = {err:.3g})")
    return Rotation(np.ascontiguousarray(signs, np.float32), np.ascontiguousarray(mix, np.float32))
