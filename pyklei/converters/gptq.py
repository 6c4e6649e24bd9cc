"""GPTQ for qsi4c32 (and qsi6c32): error-compensating rounding of one linear weight, given the Hessian of
its inputs (issue 15, item 2; Frantar et al., "GPTQ", 2022).

For a weight W [N out, K in] and its inputs X [T tokens, K], the layer's output error
||X W^T - X Q^T||^2 is a quadratic form in each row's error with the Hessian H = X^T X. GPTQ
quantizes the columns of W one at a time and pushes each column's rounding error onto the
columns not yet quantized, weighted by the Cholesky factor of H^-1, so the later columns
absorb what the earlier ones lost:

    H^-1 = U^T U                    (U upper triangular)
    for column j:   q_j   = round(w_j / s) * s
                    e_j   = (w_j - q_j) / U[j, j]
                    w_k  -= e_j * U[j, k]          for every k > j

in blocks of columns (lazy batch updates: inside a block column by column, the rest of the
matrix once per block, as one matrix product). qsi4c32 stores one bf16 scale per group of
`bl` columns; a group's scale is chosen when the quantization reaches its first column, from
the group's current (error-updated) weights, by the format's own per-block scale search
(pyklei.formats.qsi4c32.choose_block_scales), weighted by diag(H) over the group.

Everything is numpy float32 (BLAS): H of an 8192-wide input is 268 MB, its inverse factor is
computed in place of a copy.
"""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass
from typing import Callable

from pyklei.formats import qsi6c32
from pyklei.formats.bf16 import bf16_to_f32
from pyklei.formats.qsi4c32 import QMAX, QMIN, choose_block_scales, pack_nibbles

from .errors import ConversionError

DEFAULT_DAMP = 0.01        # lambda = DEFAULT_DAMP * mean(diag H), added to diag H
DEFAULT_BLOCK = 128        # columns per lazy batch update
_TRI_BASE = 256            # triangular inverse: below this, one np.linalg.inv
SUB_BLOCK = 32             # columns updated column by column inside a block (a second lazy level)
# The scale search's candidates absmax / t inside GPTQ: steps of 0.5 instead of the format's
# 0.125 (SmolLM2 layer 3, output error: attn_q 0.0285 both, attn_v 0.0634 vs 0.0635, ffn_gate
# 0.0451 vs 0.0450; the error feedback makes up for a coarser scale), at a quarter of the cost.
SCALE_DIVISORS = np.arange(6.0, 8.5001, 0.5, dtype=np.float32)


@dataclass(frozen=True)
class Grid:
    """What GPTQ rounds a format's weights onto: the integer range, the candidate scales
    absmax / t searched for each group, and how the integers are stored."""
    fmt: str
    qmin: int
    qmax: int
    divisors: np.ndarray
    pack: Callable[[np.ndarray], np.ndarray]


GRIDS = {g.fmt: g for g in (
    Grid("qsi4c32", QMIN, QMAX, SCALE_DIVISORS, pack_nibbles),
    # qsi6c32's own search steps t by 0.25 over 28..34; whole steps here, as for 4 bits.
    Grid("qsi6c32", qsi6c32.QMIN, qsi6c32.QMAX, np.arange(28.0, 34.0001, 1.0, dtype=np.float32),
         qsi6c32.pack_q6),
)}


def accumulate_gram(h: np.ndarray | None, x: np.ndarray, col_block: int = 1024) -> np.ndarray:
    """h [K, K] float32 (or None: zeros) += x^T x for x [T, K], computing only the lower
    triangle's blocks (half the work of x.T @ x) and mirroring it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[1]
    if h is None:
        h = np.zeros((k, k), np.float32)
    for j0 in range(0, k, col_block):
        j1 = min(k, j0 + col_block)
        h[j0:, j0:j1] += x[:, j0:].T @ x[:, j0:j1]          # [K-j0, j1-j0]
        h[j0:j1, j1:] = h[j1:, j0:j1].T                      # mirror: upper = lower^T
    return h


def _invert_lower_inplace(a: np.ndarray) -> None:
    """a [n, n] lower triangular -> a^-1 (lower triangular), in a's memory (recursively:
    inv [[A, 0], [C, D]] = [[A^-1, 0], [-D^-1 C A^-1, D^-1]])."""
    n = a.shape[0]
    if n <= _TRI_BASE:
        a[...] = np.tril(np.linalg.inv(a))
        return
    m = n // 2
    _invert_lower_inplace(a[:m, :m])
    _invert_lower_inplace(a[m:, m:])
    a[m:, :m] = -(a[m:, m:] @ (a[m:, :m] @ a[:m, :m]))


def inverse_cholesky_upper(h: np.ndarray) -> np.ndarray:
    """H [K, K] symmetric positive definite -> U [K, K] upper triangular with H^-1 = U^T U,
    computed in H's memory (H is destroyed; the result is H's array).

    With J the reversal permutation and J H J = M M^T (Cholesky, M lower):
    H^-1 = (J M^-1 J)^T (J M^-1 J), and J M^-1 J is upper triangular. Raises
    np.linalg.LinAlgError if H is not positive definite."""
    _reverse_inplace(h)                        # J H J
    _cholesky_lower_inplace(h)                 # M
    _invert_lower_inplace(h)                   # M^-1
    _reverse_inplace(h)                        # J M^-1 J
    return h


def _cholesky_lower_inplace(a: np.ndarray, b: int = 512) -> None:
    """a [n, n] symmetric positive definite (lower triangle read) -> its Cholesky factor L
    (lower; the upper triangle zeroed), blocked and in place in float32. numpy's own
    cholesky computes in float64 on a copy: 4x the memory of an 8192-wide H."""
    n = a.shape[0]
    for j in range(0, n, b):
        e = min(n, j + b)
        l11 = np.linalg.cholesky(a[j:e, j:e]).astype(np.float32)     # [b, b], raises if not PD
        a[j:e, j:e] = l11
        a[j:e, e:] = 0.0
        if e == n:
            break
        a[e:, j:e] = a[e:, j:e] @ np.linalg.inv(l11).T.astype(np.float32)   # L21 = A21 L11^-T
        l21 = a[e:, j:e]
        for k in range(e, n, b):               # trailing update, lower blocks only
            k2 = min(n, k + b)
            a[k:, k:k2] -= l21[k - e:] @ l21[k - e:k2 - e].T


def _reverse_inplace(a: np.ndarray) -> None:
    """a [n, n] -> a[::-1, ::-1] in a's memory, one pair of rows at a time (no n x n copy)."""
    n = a.shape[0]
    for i in range(n // 2):
        top = a[i, ::-1].copy()
        a[i] = a[n - 1 - i, ::-1]
        a[n - 1 - i] = top
    if n % 2:
        a[n // 2] = a[n // 2, ::-1].copy()


def _inverse(s: np.ndarray) -> np.ndarray:
    """1 / s, and 0 where s = 0 (an all-zero group: its values round to 0)."""
    return np.where(s > 0, 1.0 / np.where(s > 0, s, 1), 0).astype(np.float32)


def _round(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """w [N] / [N, c] on scales s [N] (or broadcastable) -> int values in [-8, 7] (float32)."""
    safe = np.where(s > 0, s, np.float32(1))
    q = np.clip(np.rint(w / safe), QMIN, QMAX)
    return np.where(s > 0, q, 0).astype(np.float32)


def _damped_factor(h: np.ndarray, damp: float) -> np.ndarray:
    """U of inverse_cholesky_upper(H + lambda I), in H's memory; lambda = damp * mean(diag H).
    If H + lambda I is not numerically positive definite, lambda grows 10x at a time (up to 3
    times) on a fresh copy of H, kept only for that case when H is small."""
    base = float(np.mean(np.diag(h)))
    k = h.shape[0]
    backup = h.copy() if k <= 4096 else None   # an 8192-wide H: 268 MB more; recompute instead
    idx = np.arange(k)
    for attempt in range(4):
        lam = damp * (10 ** attempt) * base
        if attempt and backup is None:
            break
        if attempt:
            h[...] = backup
        h[idx, idx] += np.float32(lam)
        try:
            u = inverse_cholesky_upper(h)
        except np.linalg.LinAlgError:
            continue
        if np.isfinite(np.diag(u)).all():
            return u
    raise ConversionError(f"GPTQ: the inputs' Hessian ({k} wide) is not positive definite with "
                          f"dampening {lam / base:g} x mean(diag H); use more calibration tokens "
                          f"or a larger damp")


def gptq_quantize(w: np.ndarray, h: np.ndarray, bl: int = 32, damp: float = DEFAULT_DAMP,
                  block: int = DEFAULT_BLOCK, act_order: bool = False,
                  weighted_scales: bool = True,
                  grid: Grid = GRIDS["qsi4c32"]) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of one weight. w: float32 [N, K]; h: float32 [K, K], X^T X of its inputs (both
    are overwritten). -> (q int8 [N, K] in [grid.qmin, grid.qmax], scale bits uint16
    [N, K/bl]), so that w ~= bf16_to_f32(bits)[:, k // bl] * q[:, k].

    act_order: quantize columns by descending diag(H) ("static groups": every group's scale
    is chosen first, from the original weights, since a group's columns are then no longer
    reached together). weighted_scales: the scale search weighs a group's columns by diag(H).
    """
    n, k = w.shape
    if k % bl or h.shape != (k, k):
        raise ValueError(f"GPTQ: weight {w.shape}, Hessian {h.shape}, group size {bl}")
    block = max(bl, block - block % bl)                     # groups never straddle a block
    diag = np.diag(h).copy()                                 # [K], before dampening
    dead = diag <= 0                                         # inputs never active
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    imp = np.where(dead, 0, diag).astype(np.float32) if weighted_scales else None
    bits = np.zeros((n, k // bl), np.uint16)
    perm = None
    if act_order:
        for g in range(k // bl):
            c = slice(g * bl, (g + 1) * bl)
            bits[:, g] = choose_block_scales(w[:, c], None if imp is None else imp[c],
                                             grid.divisors, grid.qmin, grid.qmax)
        perm = np.argsort(-diag, kind="stable")
        w = w[:, perm]
        h = h[perm][:, perm]
    scale = bf16_to_f32(bits)                                # [N, K/bl]
    inv_s = _inverse(scale)                                  # 1 / scale, 0 where scale = 0
    u = _damped_factor(h, damp)
    del h
    q = np.empty((n, k), np.int8)
    for i1 in range(0, k, block):
        i2 = min(k, i1 + block)
        w1 = w[:, i1:i2]                                     # [N, B], updated in place
        u1 = np.ascontiguousarray(u[i1:i2, i1:i2])           # [B, B]
        err = np.empty((n, i2 - i1), np.float32)             # [N, B] scaled errors
        for g1 in range(0, i2 - i1, SUB_BLOCK):              # columns g1:g2 of the block
            g2 = min(i2 - i1, g1 + SUB_BLOCK)
            j0 = i1 + g1
            if perm is None and j0 % bl == 0:                # a group starts: its scale
                g = j0 // bl
                bits[:, g] = choose_block_scales(
                    w1[:, g1:g1 + bl], None if imp is None else imp[j0:j0 + bl],
                    grid.divisors, grid.qmin, grid.qmax)
                scale[:, g] = bf16_to_f32(bits[:, g])
                inv_s[:, g] = _inverse(scale[:, g])
            for i in range(g1, g2):
                j = i1 + i
                grp = j // bl if perm is None else perm[j] // bl
                col = w1[:, i]
                qi = np.clip(np.rint(col * inv_s[:, grp]), grid.qmin, grid.qmax)
                q[:, j] = qi
                e = (col - qi * scale[:, grp]) / u1[i, i]
                if i + 1 < g2:                               # the rest of this sub-block
                    w1[:, i + 1:g2] -= np.outer(e, u1[i, i + 1:g2])
                err[:, i] = e
            if g2 < i2 - i1:                                 # the rest of the block, at once
                w1[:, g2:] -= err[:, g1:g2] @ u1[g1:g2, g2:]
        if i2 < k:
            w[:, i2:] -= err @ u[i1:i2, i2:]
    if perm is not None:
        inv = np.empty_like(perm)
        inv[perm] = np.arange(k)
        q = q[:, inv]
    return q, bits


def rtn_quantize(w: np.ndarray, bl: int = 32, importance=None) -> tuple[np.ndarray, np.ndarray]:
    """Plain rounding with the format's scale search (what the default converter stores),
    in gptq_quantize's output form: (q int8 [N, K], bits uint16 [N, K/bl])."""
    n, k = w.shape
    blocks = np.asarray(w, np.float32).reshape(-1, bl)
    imp = None if importance is None else np.broadcast_to(
        np.asarray(importance, np.float32).reshape(1, k // bl, bl), (n, k // bl, bl)).reshape(-1, bl)
    bits = choose_block_scales(blocks, imp)
    q = _round(blocks, bf16_to_f32(bits)[:, None]).astype(np.int8)
    return q.reshape(n, k), bits.reshape(n, k // bl)


def dequantize(q: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """(q int8 [N, K], bits uint16 [N, K/bl]) -> float32 [N, K]."""
    n, k = q.shape
    s = bf16_to_f32(bits)
    return (q.reshape(n, s.shape[1], -1).astype(np.float32) * s[:, :, None]).reshape(n, k)


def pack(q: np.ndarray, bits: np.ndarray, grid: Grid = GRIDS["qsi4c32"]) -> tuple[np.ndarray, np.ndarray]:
    """-> the stored arrays of grid's format (qsi4c32: qs uint8 [N, K/2]; qsi6c32: [N, 3K/4];
    scales uint16 [N, K/bl])."""
    return grid.pack(q), np.ascontiguousarray(bits)
