"""The size/quality ladder: which block linears a conversion stores at 6 bits (qsi6c32)
instead of 4 (qsi4c32), by name or by a target size.

A recipe is a list of --keep rules placed after the user's own (the user's win). Named
recipes are fixed rule lists; `--bits B` promotes tensors to 6 bits in PROMOTION_ORDER, one
layer at a time, for as long as the block linears' average stays within B bits per weight.
The measured result of each rung is in docs/QUALITY.md ("The ladder"). PROMOTION_ORDER is not
measured per kind yet: it starts with the two kinds llama.cpp's Q4_K_M keeps at 6 bits
(ffn_down, attn_v), then the attention output and keys/queries, then the wide gate/up.
6-bit tensors are rounded per block (GPTQ chooses the 4-bit ones).
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


# Tensor kinds in the order they go to 6 bits (see the module doc: not yet measured per kind).
PROMOTION_ORDER = ("ffn_down", "attn_v", "attn_output", "attn_k", "attn_q", "ffn_up", "ffn_gate")


@dataclass(frozen=True)
class Recipe:
    name: str
    parts: tuple[str, ...]            # block linear kinds stored at 6 bits in every layer
    about: str


RECIPES = {r.name: r for r in (
    Recipe("q4", (), "every block linear qsi4c32 (4.5 bits per weight at group 32)"),
    Recipe("q4m", PROMOTION_ORDER[:2],
           "ffn_down and attn_v at qsi6c32, the rest qsi4c32 (as llama.cpp's Q4_K_M keeps "
           "attn_v / ffn_down at 6 bits)"),
    Recipe("q6", PROMOTION_ORDER, "every block linear qsi6c32 (6.5 bits per weight)"),
)}


def recipe_keep(name: str) -> list[tuple[str, str]]:
    """A named recipe's --keep rules."""
    r = RECIPES.get(name)
    if r is None:
        raise ConversionError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    return [(f"blk.*.{p}.weight", "qsi6c32") for p in r.parts]


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
    layers = sorted({int(n.split(".")[1]) for n in shapes})
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
