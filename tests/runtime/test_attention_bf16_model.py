"""The forward pass with attention in bf16 (PYKLEI_ATTENTION=bf16; the kernels:
tests/kernels/test_attention_bf16.py), on the tiny random model (tests/conftest.py; GQA group 2,
head size 64): batched prefill and decode rows equal solo runs bit for bit, past a chunk of
PK_ATTEND_CHUNK positions, for the f16, q8 and bf16 caches; the logits move from f32's by
bf16's rounding only."""
import numpy as np
import pytest

from pyklei import _ext
from pyklei.runtime.model import Model


@pytest.mark.parametrize("kv_cache", ["f16", "q8", "bf16"])
def test_bf16_batch_rows_equal_solo_rows_and_stay_near_f32(gguf, kv_cache, monkeypatch):
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 512, size=n).tolist() for n in (530, 41, 17)]   # 530: two chunks
    monkeypatch.setenv("PYKLEI_ATTENTION", "f32")
    f32 = Model(gguf, n_threads=2, n_ctx=600, n_batch=32, kv_cache=kv_cache).logits(seqs[0])
    monkeypatch.setenv("PYKLEI_ATTENTION", "bf16")   # read when a model is made
    m = Model(gguf, n_threads=2, n_ctx=600, n_batch=32, n_seq=3, kv_cache=kv_cache)
    solo = []
    for s in seqs:
        m.reset()
        solo.append(m.logits(s))
    m.reset()
    cut = [520, 30, 9]
    toks, sid, pos = [], [], []
    for i, (s, c) in enumerate(zip(seqs, cut)):
        toks += s[:c]
        sid += [i] * c
        pos += range(c)
    out = m.batch(toks, sid, pos, list(range(len(toks))))
    assert np.array_equal(out, np.concatenate([solo[i][:c] for i, c in enumerate(cut)]))
    for k in range(8):   # decode rows, each sequence at its own depth
        rows = [(i, s[c + k]) for i, (s, c) in enumerate(zip(seqs, cut)) if c + k < len(s)]
        out = m.batch([t for _, t in rows], [i for i, _ in rows], [cut[i] + k for i, _ in rows], range(len(rows)))
        assert np.array_equal(out, np.array([solo[i][cut[i] + k] for i, _ in rows])), k
    if _ext.attention_bf16_runs():
        assert not np.array_equal(solo[0], f32)
    # bf16's rounding of q, K, V and the weights (2^-9 relative) moves a random model's logits a
    # little; a wrong pairing or a missed position would move them by their own size
    assert np.abs(solo[0] - f32).max() < 0.05 * np.abs(f32).max()
    assert (solo[0].argmax(-1) == f32.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("attention", ["", "bf16", "f32"])
def test_auto_kv_cache_is_bf16_where_bf16_attention_reads_it(gguf, attention, monkeypatch):
    """kv_cache="auto" (the default) resolves to the cache the attention reads fastest: bf16
    where bf16 dot products run (AVX-512 BF16, PYKLEI_ATTENTION not f32), f16 elsewhere; the
    model runs exactly as with that type asked for by name."""
    from pyklei.runtime.kv_policy import choose_kv_cache
    monkeypatch.setenv("PYKLEI_ATTENTION", attention)
    want = "bf16" if attention != "f32" and _ext.attention_bf16_runs() else "f16"
    assert choose_kv_cache("auto") == want
    assert choose_kv_cache("q8") == "q8"
    with pytest.raises(ValueError, match="kv_cache must be one of auto, f32, f16, bf16, q8"):
        choose_kv_cache("fp8")
    toks = list(range(40, 90))
    auto = Model(gguf, n_threads=1, n_ctx=64)
    assert auto.kv_cache == want
    named = Model(gguf, n_threads=1, n_ctx=64, kv_cache=want)
    assert np.array_equal(auto.logits(toks), named.logits(toks))


def test_the_attention_choice_is_logged_once_per_model(gguf):
    """PYKLEI_LOG=kernels: making a model with kv_cache="auto" logs the attention's arithmetic
    once. The KV policy asks the same C function quietly; the forward pass says it."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYKLEI_ATTENTION"}
    env["PYKLEI_LOG"] = "kernels"
    code = f"from pyklei.runtime.model import Model; print(Model({str(gguf)!r}, n_threads=1, n_ctx=64).kv_cache)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("bf16" if _ext.attention_bf16_runs() else "f16")
    assert out.stderr.count("pyklei: attention dot products in") == 1, out.stderr
