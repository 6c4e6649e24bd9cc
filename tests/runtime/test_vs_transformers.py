"""The runtime against transformers (float32, on the same dequantized weights) and the API.

Stated tolerances (measured values in parentheses, this machine):
- tiny random Llama 3.2-style models, 200 positions (beyond original_max_position_embeddings
  = 64), qai8dx2 activations: max |Δlogit| <= 5e-3 (4e-4) with logits of std ~0.8, top-1
  100%; qai8dx: max |Δlogit| <= 0.3 (0.11), top-1 >= 90% (96%); qsi8d32 (a scale per block
  of 32): the same bounds as qai8dx.
- cached decode == uncached forward: max |Δ| <= 1e-4 (0.0).
- SmolLM2-135M-Instruct, 600 positions of English prose: top-1 agreement >= 98% (100%) and
  max |Δlogit| <= 0.25 (0.023) with qai8dx2.
These with attention in f32 (PYKLEI_ATTENTION=f32). The default where AVX-512 BF16 runs reads
the f16 cache with bf16 dot products: tiny models with qai8dx2, max |Δlogit| <= 0.05 (0.016),
top-1 >= 97% (98.5%), qai8dx as in f32; SmolLM2 top-1 >= 98% (99.7%), max |Δlogit| <= 0.6
(0.41).
"""
import numpy as np
import pytest

from hf_reference import dequantized_hf_model, hf_logits

import pyklei
from pyklei import _ext
from pyklei.runtime.model import Model

TOKENS = list(range(3, 203))


@pytest.fixture(scope="module", params=[64, 128], ids=["hd64", "hd128"])
def tiny(request, tiny64, tiny128):
    hf, gguf = tiny64 if request.param == 64 else tiny128
    return gguf, hf_logits(dequantized_hf_model(gguf, hf), TOKENS)


@pytest.mark.usefixtures("f32_attention")
@pytest.mark.parametrize("activations,max_diff,min_top1",
                         [("qai8dx2", 5e-3, 1.0), ("qai8dx", 0.3, 0.9), ("qsi8d32", 0.3, 0.9)])
def test_tiny_logits_match_transformers(tiny, activations, max_diff, min_top1):
    gguf, ref = tiny
    m = Model(gguf, n_threads=2, n_ctx=256, n_batch=64, activations=activations)
    out = m.logits(TOKENS)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= max_diff
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= min_top1


@pytest.mark.parametrize("n_threads", [1, 2])
def test_cached_decode_equals_uncached(tiny, n_threads):
    gguf, _ = tiny
    m = Model(gguf, n_threads=n_threads, n_ctx=256, n_batch=48)
    full = m.logits(TOKENS)
    m.reset()
    np.testing.assert_allclose(m.eval(TOKENS[:100]), full[99], atol=1e-4, rtol=0)
    steps = np.array([m.step(t) for t in TOKENS[100:]])
    np.testing.assert_allclose(steps[:-1], full[100:-1], atol=1e-4, rtol=0)


def test_prefix_reuse_runs_only_new_tokens(tiny):
    gguf, _ = tiny
    m = Model(gguf, n_threads=2, n_ctx=256)
    a = m.eval(TOKENS[:50])
    assert m.last_eval_tokens == 50
    b = m.eval(TOKENS[:80])
    assert m.last_eval_tokens == 30
    m.eval(TOKENS[:40] + [7, 8])                       # diverges at 40: reruns from there
    assert m.last_eval_tokens == 2
    np.testing.assert_allclose(m.eval(TOKENS[:50]), a, atol=1e-5)
    assert b.shape == (m.vocab_size,)


def test_context_overflow_is_an_error(tiny):
    gguf, _ = tiny
    m = Model(gguf, n_ctx=32)
    with pytest.raises(ValueError, match="context of 32"):
        m.eval(list(range(3, 40)))
    m.eval(list(range(3, 35)))
    with pytest.raises(ValueError, match="full"):
        m.step(5)


# bf16 attention over the bf16 cache is the default where AVX-512 BF16 runs (kv_cache "auto").
# Its max |dlogit| bound is the widest: measured 0.615 against the f16 cache's 0.299 at the same
# median (0.062) and p99 of the positions' maxima 0.21 against 0.18. Any rounding change moves
# this model's logits by ~0.06 (the two caches differ from each other as much as f32 and bf16
# attention do), so the maximum over 600 x 49152 logits is one position's tail; the KLD against
# fp32, paired on the same positions, is level (docs/QUALITY.md, "Attention in bf16 at depth").
@pytest.mark.parametrize("attention,kv_cache,max_diff", [("f32", "f16", 0.25), ("bf16", "f16", 0.6),
                                                         ("bf16", "bf16", 0.75)])
def test_smollm2_agreement_with_transformers(smollm2_q4, smollm2_hf_path, attention, kv_cache,
                                             max_diff, monkeypatch):
    if attention == "bf16" and not _ext.attention_bf16_runs():
        pytest.skip("needs AVX-512 BF16")
    monkeypatch.setenv("PYKLEI_ATTENTION", attention)
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in ("types", "specialnames", "execmodel"))
    tok = pyklei.Tokenizer.from_gguf(smollm2_q4)
    ids = tok.encode(text, add_bos=False)[:600]
    assert len(ids) == 600
    ref = hf_logits(dequantized_hf_model(smollm2_q4, smollm2_hf_path), ids)
    # two planes (~16-bit activations): the bounds check the forward pass, not the int8
    # activations' rounding (auto runs qsi8d32 on this unrotated file; docs/QUALITY.md)
    out = Model(smollm2_q4, n_threads=2, n_ctx=1024, activations="qai8dx2",
                kv_cache=kv_cache).logits(ids)
    agree = (out.argmax(-1) == ref.argmax(-1)).mean()
    diff = np.abs(out - ref).max()
    print(f"SmolLM2 ({attention} attention, {kv_cache} cache) top-1 agreement {agree:.4f} over {len(ids)} "
          f"positions, max |dlogit| {diff:.4f}")
    assert agree >= 0.98
    assert diff <= max_diff


@pytest.mark.skipif(not _ext.attention_bf16_runs(), reason="needs AVX-512 BF16 (elsewhere the "
                    "default reads the f16 cache in f32, tested above)")
@pytest.mark.parametrize("activations,max_diff,min_top1",
                         [("qai8dx2", 0.05, 0.97), ("qai8dx", 0.3, 0.9)])
def test_tiny_bf16_attention_against_transformers(tiny, activations, max_diff, min_top1,
                                                  monkeypatch):
    """The default path where AVX-512 BF16 runs: the f16 cache read with bf16 dot products (q,
    K, V and the weights rounded to bf16, 8 bits of mantissa), so wider bounds than f32
    attention's above."""
    monkeypatch.delenv("PYKLEI_ATTENTION", raising=False)
    gguf, ref = tiny
    out = Model(gguf, n_threads=2, n_ctx=256, n_batch=64, activations=activations).logits(TOKENS)
    diff, top1 = np.abs(out - ref).max(), (out.argmax(-1) == ref.argmax(-1)).mean()
    print(f"tiny, bf16 attention, {activations}: max |dlogit| {diff:.4f}, top-1 {top1:.3f}")
    assert diff <= max_diff and top1 >= min_top1


# ---- the API on the real model ------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(smollm2_q4):
    return pyklei.load(smollm2_q4, n_threads=2, n_ctx=512)


def test_greedy_generation_knows_paris(llm):
    r = llm.generate("The capital of France is", max_tokens=8, temperature=0.0)
    assert "Paris" in r.text
    assert r.finish_reason == "length" and r.generation_tokens == 8
    assert r.prompt_tokens == 5 and r.time_to_first_token > 0 and r.peak_rss_mb > 0


def test_stream_pieces_join_to_the_whole(llm):
    whole = llm.generate("Once upon a time", max_tokens=24, temperature=0.0).text
    pieces = [r.text for r in llm.generate("Once upon a time", max_tokens=24, temperature=0.0, stream=True)]
    assert "".join(pieces) == whole


def test_same_seed_same_text(llm):
    kw = dict(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = llm.generate("My favourite food is", **kw).text
    b = llm.generate("My favourite food is", **kw).text
    c = llm.generate("My favourite food is", **dict(kw, seed=99)).text
    assert a == b and a != c


def test_stop_strings_cut_text_while_streaming(llm):
    whole = llm.generate("The capital of France is", max_tokens=16, temperature=0.0).text
    stop = whole.strip().split()[2]              # a word in the middle of the reply
    r = llm.generate("The capital of France is", max_tokens=16, temperature=0.0, stop=[stop])
    assert r.finish_reason == "stop" and stop not in r.text
    assert whole.startswith(r.text)
    streamed = "".join(x.text for x in llm.generate("The capital of France is", max_tokens=16,
                                                    temperature=0.0, stop=[stop], stream=True))
    assert streamed == r.text


def test_chat_uses_template_and_reuses_prefix(llm):
    msgs = [{"role": "user", "content": "Name three colours."}]
    r1 = llm.chat(msgs, max_tokens=24, temperature=0.0)
    assert r1.text.strip()
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And two more?"}]
    r2 = llm.chat(msgs, max_tokens=8, temperature=0.0)
    assert r2.prompt_eval_tokens < r2.prompt_tokens / 2    # the first turn came from the cache


def test_eos_stops_generation(llm):
    r = llm.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=64,
                 temperature=0.0)
    assert r.finish_reason == "stop" and r.generation_tokens < 64 and "Paris" in r.text


def test_logits_api(llm):
    ids = llm.encode("Hello world, this is a test.")
    out = llm.logits(ids)
    assert out.shape == (len(ids), llm.model.vocab_size) and out.dtype == np.float32


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
    (dict(bogus=1), TypeError, "bogus"),
])
def test_bad_arguments(llm, kwargs, err, match):
    with pytest.raises(err, match=match):
        llm.generate("Hi", **kwargs)


def test_edge_cases(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="integers"):
        llm.generate([1, 2.5])
    r = llm.generate("Hi", max_tokens=0)
    assert r.text == "" and r.finish_reason == "length" and r.generation_tokens == 0
    with pytest.raises(ValueError, match="context"):
        llm.generate("word " * 600, max_tokens=4)
    assert "Paris" in llm.generate("The capital of France is", max_tokens=6, temperature=0).text
