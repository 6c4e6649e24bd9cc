"""Speculative decoding (issue 25): Model.verify gives every row the logits of a decode step
bit for bit, and truncate_seq rolls a slot back."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyklei.llm import LLM
from pyklei.model import Model, SequenceLostError
from pyklei.sampler import SamplingParams

HERE = Path(__file__).resolve().parent
SEED = HERE / "fuzz_corpus" / "seed-tied-q4.gguf"
SMOLLM2 = Path.home() / ".cache" / "pyklei" / "smollm2-135m-instruct-q4.gguf"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
    return LLM(SEED, n_threads=1, n_ctx=512, n_seq=2)


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is not cached")
    return LLM(SMOLLM2, n_threads=1, n_ctx=2048, n_seq=1)


def _repetitive_prompt(seed: int, n: int = 60) -> list[int]:
    """Random tokens with a stretch repeated, so that lookup finds n-grams to draft from."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 384, size=n).tolist()
    return a + a[: n // 2] + rng.integers(0, 384, size=5).tolist() + a[5:25]


def _run(llm, prompt, spec, **kw):
    llm.reset()
    rs = list(stream_generate(llm.model, llm.tokenizer, prompt, speculative=spec,
                              eos_ids=kw.pop("eos_ids", llm.eos_ids), **kw))
    return rs, llm.model.cached_tokens


def _tokens(rs):
    return [r.token for r in rs], "".join(r.text for r in rs), rs[-1].finish_reason


# ---- Model.verify / truncate_seq --------------------------------------------------------------

@pytest.mark.parametrize("n_threads", [1, 2])
def test_verify_rows_are_decode_steps_bit_for_bit(n_threads):
    m = Model(SEED, n_threads=n_threads, n_ctx=256, n_seq=2)
    prompt = _repetitive_prompt(1)
    tail = [5, 17, 200, 3, 3, 99, 1]
    m.eval(prompt)
    steps = [m.step(t) for t in tail]
    m.reset()
    m.eval(prompt)
    rows = m.verify(tail)
    assert rows.shape == (len(tail), m.vocab_size)
    for a, b in zip(steps, rows):
        assert np.array_equal(a, b)
    assert m.cached_tokens == prompt + tail
    # roll back past a "rejected" position and continue: the stale K/V are never read
    m.truncate_seq(0, len(prompt) + 3)
    assert m.cached_tokens == prompt + tail[:3]
    assert np.array_equal(m.step(tail[3]), steps[3])
    again = m.verify([77, 78, 79])
    m.reset()
    m.eval(prompt + tail[:4])
    assert np.array_equal(again[0], m.step(77))
    # another slot, from a copied prefix
    m.copy_seq(0, 1, len(prompt))
    rows1 = m.verify(tail, seq=1)
    assert all(np.array_equal(a, b) for a, b in zip(steps, rows1))
    assert m.seq_tokens(1) == prompt + tail


def test_verify_and_truncate_check_their_arguments(tiny):
    m = tiny.model
    m.reset()
    m.eval([1, 2, 3])
    with pytest.raises(ValueError, match="cannot keep 5 positions: slot 0 holds 3 tokens"):
        m.truncate_seq(0, 5)
    with pytest.raises(ValueError, match="outside the model's 2 slots"):
        m.verify([1], seq=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.verify([1, 384])
    with pytest.raises(ValueError, match="would pass the context of 512 tokens"):
        m.verify([1] * 510)
    assert m.cached_tokens == [1, 2, 3]          # refused calls change nothing
    owner = object()
    m.eval([1, 2, 3], owner=owner)
    m.logits([4, 5])                             # somebody else used the cache
    with pytest.raises(SequenceLostError):
        m.verify([6], owner=owner)
    with pytest.raises(SequenceLostError):
        m.truncate_seq(0, 1, owner=owner)
