"""A sliding-window layer keeps only a ring of its last positions (issue 42: Gemma 3 at a 32k
context must not hold 32k positions in its local layers). pk_llama_ring: the window and a
chunk's rows, rounded up to 512 positions; the model's other layers keep every position.

What must hold: logits are bit-identical to a model whose ring is long enough never to wrap
(same file, same rows: a row's bits do not depend on where its K/V sit); a slot goes back a
few positions (a shorter prompt reused, a rejected draft) and continues exactly; a slot asked
to go back further than its rings still hold is recomputed, never read half-overwritten."""
from __future__ import annotations

import numpy as np
import pytest
from models import make_tiny_family

from pyklei.converters import convert
from pyklei.runtime.engine import Engine
from pyklei.runtime.model import Model
from pyklei.runtime.sampler import SamplingParams
from pyklei.text.tokenizer import Tokenizer

WINDOW = 24
N = 1400           # past two wraps of a 512-position ring


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    d = tmp_path_factory.mktemp("ring")
    hf = make_tiny_family(d / "hf", "gemma3", seed=3, sliding_window=WINDOW, max_position_embeddings=2048)
    out = d / "gemma3-tiny.gguf"
    convert(hf, out, keep=["*=q8"], embedding_bits=8)
    return out


def _tokens(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


@pytest.mark.parametrize("kv_cache", ["f16", "bf16"])   # bf16: V's pairs of positions in the ring
def test_the_ring_changes_no_bit(windowed, kv_cache):
    toks = _tokens(N)
    with Model(windowed, n_threads=2, n_ctx=N + 16, n_batch=16, kv_cache=kv_cache) as ring, \
         Model(windowed, n_threads=2, n_ctx=N + 16, n_batch=N, kv_cache=kv_cache) as whole:
        rings = ring.runtime.rings
        assert any(rings) and not any(whole.runtime.rings), (rings, whole.runtime.rings)
        assert all(r == 512 for r, w in zip(rings, [ring.hparams.window(i) for i in range(len(rings))]) if w)
        assert ring.state_bytes < whole.state_bytes
        np.testing.assert_array_equal(ring.logits(toks), whole.logits(toks))


def test_going_back_reuses_what_the_ring_holds_and_recomputes_the_rest(windowed):
    toks = _tokens(N, seed=1)
    with Model(windowed, n_threads=2, n_ctx=N + 64, n_batch=16) as m, \
         Model(windowed, n_threads=2, n_ctx=N + 64, n_batch=N + 64) as fresh:
        m.eval(toks)
        near = toks[:N - 10] + _tokens(20, seed=2)          # 10 positions back: held
        assert m.reusable_prefix(0, N - 10) == N - 10
        np.testing.assert_array_equal(m.eval(near), fresh.logits(near)[-1])
        assert m.last_eval_tokens == 20
        far = toks[:300] + _tokens(20, seed=3)              # 1100 back: overwritten
        assert m.reusable_prefix(0, 300) == 0
        np.testing.assert_array_equal(m.eval(far), fresh.logits(far)[-1])
        assert m.last_eval_tokens == len(far)
        m.eval(toks)
        with pytest.raises(ValueError, match="cannot go back"):
            m.truncate_seq(0, 300)
        m.truncate_seq(0, N - 5)                            # a rejected draft's few rows


def test_the_engine_copies_only_prefixes_the_ring_holds(windowed):
    toks = _tokens(N - 200, seed=4)
    with Model(windowed, n_threads=2, n_ctx=N, n_batch=16, n_seq=2) as m, \
         Model(windowed, n_threads=2, n_ctx=N, n_batch=N) as fresh:
        eng = Engine(m, Tokenizer.from_metadata(m.file.metadata), n_parallel=2)
        greedy = SamplingParams(temperature=0.0)
        list(eng.submit(toks, max_tokens=4, params=greedy))
        # shares its first 600 tokens with the first prompt, which the rings of that slot no
        # longer hold: it runs from scratch, and its first token is a fresh model's
        second = toks[:600] + _tokens(30, seed=5)
        out = list(eng.submit(second, max_tokens=1, params=greedy, eos_ids=[]))
        assert out[-1].token == int(np.argmax(fresh.eval(second)))
        eng.shutdown()


@pytest.mark.parametrize("kv_cache", ["f16", "bf16"])
def test_kv_rows_move_through_the_ring_and_a_ring_file_is_not_prefix_cached(windowed, kv_cache):
    """export_kv reads only positions the rings still hold; import_kv writes each at p % ring,
    as the forward pass does, so rows exported while they were held restore a slot that
    continues bit for bit. The engine's prefix cache skips such files (a finished request's
    early positions are gone from its rings: pyklei.runtime.prefix_cache)."""
    from pyklei.runtime.prefix_cache import cacheable, engine_cache
    toks = _tokens(1040, seed=4)
    with Model(windowed, n_threads=2, n_ctx=1100, n_batch=16, n_seq=2, kv_cache=kv_cache) as m:
        m.eval(toks[:512])
        first = m.export_kv(0, 0, 512)
        m.eval(toks[:1024])
        second = m.export_kv(0, 512, 1024)
        with pytest.raises(ValueError, match="rings .* no longer hold position 0"):
            m.export_kv(0, 0, 512)
        ref = m.logits(toks)[1024:]                    # slot 0 computes all of it
        m.import_kv(1, 0, toks[:512], first)
        m.import_kv(1, 512, toks[512:1024], second)
        out = m.batch(toks[1024:], [1] * 16, range(1024, 1040), range(16))
        np.testing.assert_array_equal(out, ref)
        assert "sliding-window" in cacheable(m) and engine_cache(m, 16) is None
