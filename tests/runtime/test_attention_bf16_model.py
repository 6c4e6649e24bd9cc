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
