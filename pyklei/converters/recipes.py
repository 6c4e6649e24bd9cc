"""The size/quality ladder: which block linears a conversion stores at 6 bits (qsi6c32)
instead of 4 (qsi4c32), by name or by a target size.

A recipe is a list of --keep rules placed after the user's own (the user's win). Named
recipes are fixed rule lists; `--bits B` promotes tensors to 6 bits in PROMOTION_ORDER, one
layer at a time from both ends of the stack inwards (ends_first), for as long as the block
linears' average stays within B bits per weight. The measured result of each rung is in
docs/QUALITY.md ("The ladder"). With GPTQ (the CLI's default) the 6-bit tensors are chosen by
GPTQ on the 6-bit grid too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pyklei.formats import gguf_keys as K

from .errors import ConversionError

BITS_6 = 6.5                          # qsi6c32: int6 + a bf16 scale per 32


def bits_4(group_size: int) -> float:
    """qsi4c32's bits per weight: int4 + a bf16 scale per group."""
    return 4.0 + 16.0 / group_size


# Tensor kinds in the order they go to 6 bits: the most KL divergence bought per byte first,
# measured on SmolLM2 and its off-grid twin, both texts, rotation + GPTQ, each kind alone at
# 6 bits in every layer (`python benchmarks/quality.py --variants sensitivity --out sensitivity`,
# benchmarks/results/sensitivity.md; geometric mean of the KLD ratios, per MB added): attn_v
# 0.82 for 0.8 MB, ffn_down 0.79 for 6.6 MB, ffn_gate 0.91, attn_output 0.97, attn_q 0.99,
# ffn_up 0.98, attn_k 1.06 (single cells move by up to +-50%: the order is coarse). The first
# two are the kinds llama.cpp's Q4_K_M keeps at 6 bits.
PROMOTION_ORDER = ("attn_v", "ffn_down", "ffn_gate", "attn_output", "attn_q", "ffn_up", "attn_k")


# What the ladder's rungs measured with the default method (rotation + GPTQ): bits per weight
# of the block linears -> KL divergence against float32, lowest and highest over SmolLM2-135M
# and its off-grid twin on both texts (benchmarks/quality.py; docs/QUALITY.md "The ladder").
# A conversion's summary quotes the rung at or below its own bits as its expected quality, as
# llama.cpp's quantizer quotes each type's measured perplexity on one model.
MEASURED_RUNGS = ((4.5, "default", 0.053, 0.218), (4.9, "--bits 4.9", 0.037, 0.125),
                  (5.06, "--recipe q4m", 0.036, 0.101), (6.0, "--bits 6.0", 0.021, 0.061))


def expected_quality(block_bits: float) -> str:
    """The summary's line for a rotation + GPTQ conversion whose block linears average
    block_bits bits per weight."""
    bits, name, lo, hi = max((r for r in MEASURED_RUNGS if r[0] <= block_bits + 1e-3),
                             default=MEASURED_RUNGS[0])
    return (f"expected quality: block linears at {block_bits:.2f} bits per weight; {name} "
            f"({bits:g} bits) measured KL divergence {lo:.3f}-{hi:.3f} against float32 on "
            f"SmolLM2-135M and its off-grid twin (docs/QUALITY.md)")


@dataclass(frozen=True)
class Recipe:
    name: str
    parts: tuple[str, ...]            # block linear kinds stored at 6 bits in every layer
    about: str


RECIPES = {r.name: r for r in (
    Recipe("q4", (), "every block linear qsi4c32 (4.5 bits per weight at group 32)"),
    Recipe("q4m", ("attn_v", "ffn_down"),
           "attn_v and ffn_down at qsi6c32, the rest qsi4c32 (as llama.cpp's Q4_K_M keeps "
           "attn_v / ffn_down at 6 bits; also the two kinds that measured best per byte)"),
    Recipe("q6", PROMOTION_ORDER, "every block linear qsi6c32 (6.5 bits per weight)"),
)}


def recipe_keep(name: str) -> list[tuple[str, str]]:
    """A named recipe's --keep rules."""
    r = RECIPES.get(name)
    if r is None:
        raise ConversionError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    return [(K.blk("*", p), "qsi6c32") for p in r.parts]


def ends_first(layers: list[int]) -> list[int]:
    """The order in which --bits promotes the layers of a kind: from both ends inwards (0,
    n-1, 1, n-2, ...), as llama.cpp's Q4_K_M favours the first and last layers. Measured:
    a third of ffn_down's layers at a time buys most at the ends, and --bits 4.9 gains a little
    over index order (docs/QUALITY.md, "Inside a kind, the ends first")."""
    return [layers[j // 2] if j % 2 == 0 else layers[-1 - j // 2] for j in range(len(layers))]


def bits_keep(target: float, shapes: dict[str, tuple[int, int]], group_size: int) -> list[tuple[str, str]]:
    """--keep rules that store the most sensitive block linears at 6 bits while the block
    linears average at most `target` bits per weight. shapes: GGUF name -> (N, K) of every
    block linear (the tensors the ladder chooses between)."""
    lo = bits_4(group_size)
    if not lo <= target:
        raise ConversionError(f"--bits {target:g} is below qsi4c32's {lo:g} bits per weight "
                              f"at group size {group_size}; use a larger --group-size")
    total = sum(math.prod(s) for s in shapes.values())
    budget = (target - lo) * total            # extra bits we may spend
    rules = []
    layers = ends_first(sorted({int(n.split(".")[1]) for n in shapes}))
    for part in PROMOTION_ORDER:
        for i in layers:
            name = K.blk(i, part)
            if name not in shapes:
                continue
            cost = (BITS_6 - lo) * math.prod(shapes[name])
            if cost > budget:
                return rules
            budget -= cost
            rules.append((name, "qsi6c32"))
    return rules
