"""Leaks: RSS stays flat after a warm-up (loading and freeing models, generating), on the tiny
committed model; the SmolLM2 one is marked slow."""
from __future__ import annotations

import gc
import os

import pytest

from paths import SEED
from pyklei.llm import LLM


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------------------------------------
# Leaks: RSS must stay flat after a warm-up
# ---------------------------------------------------------------------------------------------
LEAK_BOUND_MB = 10.0


def _rss_growth(fn, n, warmup):
    for _ in range(warmup):
        fn()
    gc.collect()
    r0 = rss_mb()
    for _ in range(n):
        fn()
    gc.collect()
    return rss_mb() - r0


def test_no_leak_load_and_free_200():
    def load():
        llm = LLM(SEED, n_threads=1, n_ctx=128)
        llm.model.eval([1, 2, 3])
        del llm

    growth = _rss_growth(load, 200, warmup=20)
    print(f"\nload+free x200: RSS growth {growth:+.1f} MB")
    assert growth < LEAK_BOUND_MB


def test_no_leak_generate_100(llm):
    def gen():
        llm.generate("hello world", max_tokens=16, temperature=0.7, seed=1)

    growth = _rss_growth(gen, 100, warmup=10)
    print(f"\ngenerate x100: RSS growth {growth:+.1f} MB")
    assert growth < LEAK_BOUND_MB


@pytest.mark.slow
def test_no_leak_smollm2(smollm2_q4):
    def load():
        m = LLM(smollm2_q4, n_threads=2, n_ctx=256)
        m.generate("The capital of France is", max_tokens=4, temperature=0)
        del m

    growth = _rss_growth(load, 8, warmup=2)
    big = LLM(smollm2_q4, n_threads=2, n_ctx=256)
    g2 = _rss_growth(lambda: big.generate("The capital of France is", max_tokens=16, temperature=0.5),
                     20, warmup=3)
    print(f"\nSmolLM2: load+generate x8 RSS growth {growth:+.1f} MB, generate x20 {g2:+.1f} MB")
    assert growth < 2 * LEAK_BOUND_MB and g2 < LEAK_BOUND_MB
