"""The prefix cache that outlives a slot (pyklei.runtime.prefix_cache): Model.export_kv /
import_kv give a restored prefix the logits of computing it, bit for bit, for every KV cache
type; the engine's next turn prefills only what its blocks lack after other requests used every
slot, with the same tokens as without the cache; LRU under a budget; the disk tier across a
restart, bound to the model; partitions never share. On the tiny random model (tests/conftest.py)."""
import numpy as np
import pytest

from pyklei.runtime.engine import Engine
from pyklei.runtime.model import Model
from pyklei.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache, engine_cache
from pyklei.runtime.sampler import SamplingParams
from pyklei.text.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, seed=7)


def _tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 512, size=n).tolist()


# ---- Model.export_kv / import_kv ---------------------------------------------------------

@pytest.mark.parametrize("kv", ["f32", "f16", "q8", "bf16"])
def test_imported_rows_give_the_logits_of_computing_them(gguf, kv):
    m = Model(gguf, n_threads=2, n_ctx=128, n_seq=3, kv_cache=kv)
    s = _tokens(75, seed=1)
    ref = m.logits(s)                               # slot 0 computed all of s
    whole = m.export_kv(0, 0, 64)
    assert len(whole) == m.kv_rows_bytes(64)
    m.import_kv(1, 0, s[:64], whole)                # one piece
    m.import_kv(2, 0, s[:32], m.export_kv(0, 0, 32))  # and block by block
    m.import_kv(2, 32, s[32:64], m.export_kv(0, 32, 64))
    for slot in (1, 2):
        assert m.seq_tokens(slot) == s[:64]
        out = m.batch(s[64:75], [slot] * 11, range(64, 75), range(11))
        assert np.array_equal(out, ref[64:75]), slot


def test_export_import_refuse_bad_rows(gguf):
    m = Model(gguf, n_threads=1, n_ctx=128, n_seq=2)
    s = _tokens(40, seed=2)
    m.logits(s)
    data = m.export_kv(0, 0, 32)
    with pytest.raises(ValueError, match="units of 16"):
        m.export_kv(0, 0, 20)
    with pytest.raises(ValueError, match="holds 40 tokens, not positions up to 48"):
        m.export_kv(0, 0, 48)
    with pytest.raises(ValueError, match="holds 0 tokens; rows continue from at most there"):
        m.import_kv(1, 32, s[:32], data)
    with pytest.raises(ValueError, match="bytes are not the K/V"):
        m.import_kv(1, 0, s[:16], data)
    assert m.seq_tokens(1) == []


# ---- the engine's cache ------------------------------------------------------------------

def _run(engine, prompt, params, max_tokens=20, partition=None):
    """The last response, with `tokens`: every token sampled (from the responses' logprobs)."""
    *resps, last = engine.submit(prompt, max_tokens=max_tokens, params=params, eos_ids=[],
                                 logprobs=0, cache_partition=partition)
    last.tokens = [lp.token for r in resps + [last] for lp in r.logprobs or ()]
    assert len(last.tokens) == max_tokens
    return last


def _conversation(engine, params, partition=None, other=None):
    """Turn 1, then requests filling every slot, then turn 2 (turn 1's prompt and reply and
    new tokens): (turn 1's, turn 2's) last responses."""
    first = _tokens(100, seed=3)
    one = _run(engine, first, params, partition=partition)
    others = [engine.submit(_tokens(60, seed=10 + i), max_tokens=5, params=GREEDY, eos_ids=[],
                            cache_partition=other) for i in range(engine.n_parallel)]
    for s in others:
        list(s)
    two = _run(engine, first + one.tokens + _tokens(9, seed=4), params, partition=partition)
    return one, two


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_next_turn_prefills_only_its_new_tokens_after_slots_are_reused(gguf, tok, params):
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=2)
    with Engine(m, tok, n_parallel=2, cache_ram=0) as plain:
        p1, p2 = _conversation(plain, params)
    with Engine(m, tok, n_parallel=2, cache_ram=16) as cached:
        c1, c2 = _conversation(cached, params)
        stats = cached.stats()
    assert p2.prompt_eval_tokens == p2.prompt_tokens        # the slots lost it: all of it ran
    # the slot held turn 1's prompt and reply but its last token: its whole blocks come back
    held = 100 + len(c1.tokens) - 1
    assert c2.prompt_eval_tokens == c2.prompt_tokens - held // BLOCK_TOKENS * BLOCK_TOKENS
    assert c2.prompt_eval_tokens < 9 + BLOCK_TOKENS
    assert (c1.tokens, c2.tokens) == (p1.tokens, p2.tokens)
    assert stats["prefix_cache_restored"] == held // BLOCK_TOKENS * BLOCK_TOKENS
    assert stats["prefix_cache_hits"] >= stats["prefix_cache_restored"]
    assert 0 < stats["prefix_cache_bytes"] <= stats["prefix_cache_capacity_bytes"] == 16 << 20


def test_partitions_never_share_blocks(gguf, tok):
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=2)
    with Engine(m, tok, n_parallel=2, cache_ram=16) as engine:
        first = _tokens(100, seed=3)
        _run(engine, first, GREEDY, partition=("key0", None))
        for i in range(2):
            _run(engine, _tokens(60, seed=10 + i), GREEDY, max_tokens=2)
        for other in (("key1", None), ("key0", "salt"), None):
            assert _run(engine, first, GREEDY, partition=other).prompt_eval_tokens == 100
        assert _run(engine, first, GREEDY, partition=("key0", None)).prompt_eval_tokens == 4


def test_lru_keeps_a_chains_head_within_the_budget(gguf):
    m = Model(gguf, n_threads=1, n_ctx=256, n_seq=1)
    cache = PrefixCache(m, ram_bytes=4 * m.kv_rows_bytes(BLOCK_TOKENS))
    a, b, c = (_tokens(3 * BLOCK_TOKENS + 5, seed=s) for s in (20, 21, 22))

    def save(tokens):
        m.reset()
        m.logits(tokens)
        cache.save(0, None)

    def cached(tokens):
        m.reset()
        return cache.restore(0, tokens, None, 0)

    save(a)
    save(b)       # 6 blocks for 4: a's deeper blocks go first, its head stays
    assert cache.ram_used == 4 * cache.block_bytes
    assert cached(a) == BLOCK_TOKENS and cached(b) == 3 * BLOCK_TOKENS
    assert m.seq_tokens(0) == b[:3 * BLOCK_TOKENS]
    cached(a)     # a used last: c's three blocks push out b's, not a's head
    save(c)
    assert cached(a) == BLOCK_TOKENS and cached(b) == 0 and cached(c) == 3 * BLOCK_TOKENS
    assert cache.counts["evicted_blocks"] == 5


def test_disk_tier_survives_a_restart_and_stays_with_its_model(gguf, tiny128, tok, tmp_path):
    prompt = _tokens(100, seed=5)
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=1)
    with Engine(m, tok, n_parallel=1, cache_dir=tmp_path) as engine:
        first = _run(engine, prompt, GREEDY)
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) == (100 + 20 - 1) // BLOCK_TOKENS and not list(tmp_path.glob("*/*.tmp*"))
    m.close()
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=1)       # "restarted": nothing in its slot
    with Engine(m, tok, n_parallel=1, cache_dir=tmp_path) as engine:
        again = _run(engine, prompt, GREEDY)
        assert engine.prefix_cache.counts["disk_reads"] == 3
    assert again.prompt_eval_tokens == 100 - 3 * BLOCK_TOKENS and again.tokens == first.tokens
    # another model never reads them: its own folder (and a header naming the model)
    other = Model(tiny128[1], n_threads=2, n_ctx=256, n_seq=1)
    with Engine(other, Tokenizer.from_gguf(tiny128[1]), n_parallel=1, cache_dir=tmp_path) as e:
        assert _run(e, prompt, GREEDY).prompt_eval_tokens == 100
    assert len(list(tmp_path.iterdir())) == 2
    # a damaged file is a miss, not an error; the disk budget drops the least recently used
    size = files[1].stat().st_size
    files[0].write_bytes(b"garbage")
    m2 = Model(gguf, n_threads=2, n_ctx=256, n_seq=1)
    cache = engine_cache(m2, 16, tmp_path, 64)
    assert cache.restore(0, prompt, None, 0) == 0
    cache.close()
    small = PrefixCache(m2, 16 << 20, tmp_path, disk_bytes=2 * size)
    assert small.disk_used <= 2 * size and len(list(small.disk_dir.glob("*.kv"))) == 2


def test_cache_options_are_checked(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=64, n_seq=1)
    with pytest.raises(ValueError, match="cache_ram must be >= 0"):
        Engine(m, tok, n_parallel=1, cache_ram=-1)
    with pytest.raises(ValueError, match="cache_dir needs cache_ram > 0"):
        Engine(m, tok, n_parallel=1, cache_ram=0, cache_dir="/tmp/x")
    with Engine(m, tok, n_parallel=1, cache_ram=0) as e:
        assert e.prefix_cache is None and e.stats()["prefix_cache_capacity_bytes"] == 0
