"""Past its K/V store the last layer runs only the rows whose output is asked for (the C
forward pass, keep_out_rows in pyklei_ext/model/pk_llama.c; llama.cpp prunes its graph so):
the logits and hidden states of those rows are the bits of a pass that computes every row,
a chunk that only fills the cache still writes the last layer's K/V, and a pass that
collects activation statistics keeps every row. On the tiny random model, as converted
(unrotated) and rotated (the final norm's rotation reads the kept rows)."""
import numpy as np
import pytest

from pyklei.runtime.model import Model


@pytest.fixture(scope="module", params=["plain", "rotated"])
def tiny_file(request, tiny64, tmp_path_factory):
    hf, plain = tiny64
    if request.param == "plain":
        return plain
    from pyklei.converters import convert
    out = tmp_path_factory.mktemp("rotated") / "tiny-rotated.gguf"
    convert(hf, out, rotate=True)
    return out


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


@pytest.mark.parametrize("n_threads", [1, 2])
def test_last_row_is_the_all_rows_pass_bit_for_bit(tiny_file, n_threads):
    # 50 tokens in chunks of 16: three chunks only fill the cache, the last asks for one row
    m = Model(tiny_file, n_threads=n_threads, n_ctx=128, n_batch=16)
    toks = _tokens(50)
    every = m.logits(toks)                      # every row's logits: no row is dropped
    m.reset()
    assert np.array_equal(m.eval(toks), every[-1])
    # the cache those passes left holds every position of every layer: a continuation, one
    # token at a time and as a second prefill, gets the logits of one pass over it all
    more = _tokens(20, seed=1)
    whole = m.logits(toks + more)
    m.reset()
    m.eval(toks)
    for i, t in enumerate(more[:3]):
        assert np.array_equal(m.step(t), whole[len(toks) + i]), i
    assert np.array_equal(m.eval(toks + more), whole[-1])
    m.close()


def test_batch_rows_asked_for_equal_the_all_rows_pass(tiny_file):
    m = Model(tiny_file, n_threads=2, n_ctx=128, n_batch=32, n_seq=3)
    seqs = [_tokens(n, seed=s) for s, n in ((2, 21), (3, 9), (4, 30))]
    toks = [t for s in seqs for t in s]
    sid = [i for i, s in enumerate(seqs) for _ in s]
    pos = [p for s in seqs for p in range(len(s))]
    every = m.batch(toks, sid, pos, range(len(toks)))
    hidden = m.hidden_states(toks, sid, pos, range(len(toks)))
    rows = [0, 20, 21, 25, 29, len(toks) - 1]   # first, ends of slots, inside them; across chunks
    assert np.array_equal(m.batch(toks, sid, pos, rows), every[rows])
    assert np.array_equal(m.hidden_states(toks, sid, pos, rows), hidden[rows])
    # no row asked for: the cache is filled all the same, so a next row per slot continues it
    m.batch(toks, sid, pos, [])
    nxt = [_tokens(1, seed=10 + i)[0] for i in range(3)]
    got = m.batch(nxt, [0, 1, 2], [len(s) for s in seqs], [0, 1, 2])
    for i, s in enumerate(seqs):
        m.reset()
        assert np.array_equal(got[i], m.logits(s + [nxt[i]])[-1]), i
    m.close()


def test_activation_statistics_still_see_every_row(tiny_file):
    """With statistics on, the last layer's inputs are summed over every row of a prefill
    whether one row's logits or all are asked for (only the lm_head's input differs)."""
    m = Model(tiny_file, n_threads=1, n_ctx=64, n_batch=16)
    rt = m.runtime
    toks = _tokens(40, seed=5)
    got = []
    for run in (m.logits, m.eval):
        m.reset()
        rt.collect_stats(True)   # zeroes
        run(toks)
        got.append(rt.stats_sections())
    rt.collect_stats(False)
    (every, rows_a, lm_a), (last, rows_b, lm_b) = got
    assert rows_a == rows_b == len(toks) and (lm_a, lm_b) == (len(toks), 1)
    for name in every:
        if name != "lm_head_in":
            assert np.array_equal(every[name], last[name]), name
    m.close()
