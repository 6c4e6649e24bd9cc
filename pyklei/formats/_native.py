"""The compiled extension's help to the format layer, when it is built.

pyklei.formats is numpy and imports without the extension (the converters run from a bare
checkout: scripts/make_llama32_1b_random.py); where `pyklei._ext` is built, the block-scale
search of qsi4c32 / qsi6c32 runs in C instead (byte-identical: tests/formats/test_weight_search.py),
one range of rows per core. The search is most of a conversion's arithmetic: numpy's ~20
passes over temporaries per candidate scale made a 1B model's conversion take minutes.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache


@lru_cache(maxsize=None)
def search_blocks():
    """pyklei._ext.weight_search_blocks, or None when the extension is not built."""
    try:
        from .._ext import weight_search_blocks
    except ImportError:         # not built (or built before it had the search)
        return None
    return weight_search_blocks


def each_chunk(fn, starts) -> None:
    """fn(start) for every start: on one thread per core when the C search (which releases the
    GIL) is there, else one after another (numpy's temporaries would only compete for memory)."""
    starts = list(starts)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if search_blocks() is None or cores < 2 or len(starts) < 2:
        for s in starts:
            fn(s)
        return
    with ThreadPoolExecutor(min(cores, len(starts)), thread_name_prefix="pyklei-quantize") as pool:
        for _ in pool.map(fn, starts):    # re-raises the first failure
            pass
