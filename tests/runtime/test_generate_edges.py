"""Generation edge cases on the tiny committed model: what generate and the model refuse, and
with which message, and stop strings across tokens (runtime/test_vs_transformers.py covers the
rest on SmolLM2)."""
from __future__ import annotations

import numpy as np
import pytest

from paths import SEED
from pyklei.model import Model


# ---------------------------------------------------------------------------------------------
# Generation edge cases (test_vs_transformers.py covers them on SmolLM2; these run on the tiny model,
# plus what it lacks)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,kw,match", [
    ("", {}, "empty"),
    ([], {}, "empty"),
    (list(range(1, 70)), {"max_tokens": 0}, "exceeds the context"),     # prompt > n_ctx
    (list(range(1, 60)), {"max_tokens": 10}, "exceeds the context"),    # prompt + max_tokens
    ([1, 2, 384], {"max_tokens": 4}, "outside the vocabulary"),
    ([1, -1], {"max_tokens": 4}, "outside the vocabulary"),
    ([1, 2**70], {"max_tokens": 4}, "outside the vocabulary"),
    ([1, 2.0], {"max_tokens": 4}, "token ids must be integers"),
    ("hi", {"top_k": -1}, "top_k"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"min_p": 1.0}, "min_p"),
    ("hi", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("hi", {"repetition_window": -1}, "repetition_window"),
    ("hi", {"temperature": float("nan")}, "temperature"),
    ("hi", {"temperature": float("inf")}, "temperature"),
    ("hi", {"max_tokens": 2.5}, "max_tokens"),
])
def test_generate_rejects(llm, prompt, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompt, **kw)
    assert llm.generate("hi", max_tokens=2, temperature=0).generation_tokens == 2   # still usable


def test_generate_edges(llm):
    r = llm.generate([1, 2, 3], max_tokens=0)
    assert (r.text, r.finish_reason, r.generation_tokens) == ("", "length", 0)
    ids = list(range(1, 64))                                    # n_ctx - 1 tokens + 1 new
    r = llm.generate(ids, max_tokens=1, temperature=0)
    assert r.generation_tokens == 1 and r.finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="do not fit the context"):
        llm.model.eval(list(range(1, 66)))
    llm.model.eval(list(range(1, 65)))                         # exactly n_ctx
    with pytest.raises(ValueError, match="context of 64 tokens is full"):
        llm.model.step(1)


def test_model_rejects_bad_token_values():
    model = Model(SEED, n_threads=1, n_ctx=16)
    for bad, match in [([1.5, 2], "must be integers"), ([True], "must be integers"),
                       (["a"], "must be integers"), ([[1, 2], [3]], "sequence of token ids"),
                       ([2**70], "must be integers"), ([], "no tokens")]:
        with pytest.raises(ValueError, match=match):
            model.eval(bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.step(10**6)
    assert model.eval([1, 2]).shape == (384,)


def test_stop_string_spanning_tokens(llm):
    kw = dict(max_tokens=24, temperature=1.0)
    for seed in range(50):   # find a sample whose text has a stop candidate across a token boundary
        pieces = [r.text for r in llm.generate("hello world", stream=True, seed=seed, **kw)]
        text = "".join(pieces)
        ends = np.cumsum([len(p) for p in pieces])
        cands = [int(b) for i, b in enumerate(ends[:-1]) if pieces[i] and pieces[i + 1]
                 and text.find(text[b - 1:b + 1]) == b - 1]
        if cands:
            break
    else:
        pytest.skip("no sample with a usable stop string")
    b = cands[0]
    stop = text[b - 1:b + 1]           # last char of one token's text + first char of the next
    streamed = list(llm.generate("hello world", stream=True, seed=seed, stop=stop, **kw))
    assert "".join(r.text for r in streamed) == text[:b - 1]
    assert streamed[-1].finish_reason == "stop"
    assert llm.generate("hello world", seed=seed, stop=["\x00never", stop], **kw).text == text[:b - 1]


def test_runtime_positions_near_int_max_are_refused():
    """Regression (UBSan, tests/c/test_llama.c): pos0 + n overflowed int in pk_llama_forward's
    context check; now a ValueError."""
    model = Model(SEED, n_threads=1, n_ctx=16)
    for pos0 in (2**31 - 2, 2**31 - 1, 16, -1):
        with pytest.raises(ValueError, match="exceed the context"):
            model.runtime.forward(np.array([1, 2], np.int32), pos0, False)
    assert model.eval([1, 2]).shape == (384,)
