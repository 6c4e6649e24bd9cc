"""Batched decoding: Model.batch against solo runs (bit for bit), and pyklei.engine's continuous
batching (same tokens as stream_generate alone, cancellation, queue limits, shutdown, prefix
reuse). On the tiny random model (tests/conftest.py); generations ignore EOS (eos_ids=[]) so
they run their whole budget."""
import threading
import time

import numpy as np
import pytest

from pyklei.runtime.engine import Engine, EngineClosedError, QueueFullError, RequestFailedError
from pyklei.runtime.generate import stream_generate
from pyklei.runtime.model import Model
from pyklei.runtime.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


# ---- Model.batch ------------------------------------------------------------------------

@pytest.mark.parametrize("n_threads", [1, 2])
def test_batch_rows_equal_solo_rows_bit_for_bit(gguf, n_threads):
    m = Model(gguf, n_threads=n_threads, n_ctx=128, n_batch=16, n_seq=4)
    seqs = _prompts(4, seed=1, lo=20, hi=60)
    solo = []
    for s in seqs:
        m.reset()
        solo.append(m.logits(s))
    m.reset()
    # prefill: different lengths per sequence in one call (more rows than n_batch: chunked)
    cut = [17, 3, 12, 1]
    toks, sid, pos = [], [], []
    for i, (s, c) in enumerate(zip(seqs, cut)):
        toks += s[:c]
        sid += [i] * c
        pos += range(c)
    out = m.batch(toks, sid, pos, list(range(len(toks))))
    assert np.array_equal(out, np.concatenate([solo[i][:c] for i, c in enumerate(cut)]))
    # decode: one row per sequence, each at its own position, with logits for the last rows only
    for k in range(15):
        rows = [(i, s[c + k]) for i, (s, c) in enumerate(zip(seqs, cut)) if c + k < len(s)]
        out = m.batch([t for _, t in rows], [i for i, _ in rows], [cut[i] + k for i, _ in rows],
                      range(len(rows)))
        assert np.array_equal(out, np.array([solo[i][cut[i] + k] for i, _ in rows])), k
    for i, (s, c) in enumerate(zip(seqs, cut)):
        assert m.seq_tokens(i) == s[:c + 15]


@pytest.mark.parametrize("kv_cache", ["f16", "bf16"])   # bf16: an odd prefix ends inside a V pair
def test_copy_seq_continues_like_the_source(gguf, kv_cache):
    m = Model(gguf, n_threads=2, n_ctx=128, n_seq=3, kv_cache=kv_cache)
    s = _prompts(1, seed=2, lo=40, hi=41)[0]
    ref = m.logits(s)
    m.copy_seq(0, 2, 25)
    assert m.seq_tokens(2) == s[:25]
    out = m.batch(s[25:30], [2] * 5, range(25, 30), [4])
    assert np.array_equal(out[0], ref[29])
    with pytest.raises(ValueError, match="holds 40 tokens"):
        m.copy_seq(0, 1, 41)
    with pytest.raises(ValueError, match="outside the model's 3 slots"):
        m.copy_seq(0, 3)


@pytest.mark.parametrize("args,match", [
    (([1, 2], [0, 3], [0, 0], [1]), "sequence id 3 is outside"),
    (([1, 2], [0, -1], [0, 0], [1]), "sequence id -1 is outside"),
    (([1, 2], [0, 0], [0, 2], [1]), "not consecutive"),
    (([1, 2, 3], [0, 1, 0], [0, 0, 1], [2]), "rows of sequence 0 are not consecutive"),
    (([1], [1], [5], [0]), "slot holds 0 tokens"),
    (([1], [0], [0], [1]), "logit_rows"),
    (([1, 2], [0, 0], [0, 1], [1, 0]), "logit_rows"),
    (([1, 600], [0, 0], [0, 1], [1]), "outside the vocabulary"),
    (([1, 2], [0], [0, 1], [1]), "sequence ids|seq_ids"),
    (([], [], [], []), "no tokens"),
])
def test_bad_batch_is_a_clear_error_and_keeps_the_cache(gguf, args, match):
    m = Model(gguf, n_threads=1, n_ctx=16, n_seq=3)
    m.batch([5, 6], [0, 0], [0, 1], [1])
    with pytest.raises(ValueError, match=match):
        m.batch(*args)
    assert m.seq_tokens(0) in ([5, 6], [])    # never a cache that claims tokens it lacks
    with pytest.raises(ValueError, match="beyond the context"):
        m.batch(list(range(17)), [1] * 17, range(17), [16])


# ---- the engine --------------------------------------------------------------------------

def _solo(gguf, tok, prompt, max_tokens, params):
    m = Model(gguf, n_threads=2, n_ctx=256)
    rs = list(stream_generate(m, tok, prompt, max_tokens, params, eos_ids=[]))
    return "".join(r.text for r in rs), rs[-1]


def _collect(stream):
    rs = list(stream)
    return "".join(r.text for r in rs), rs[-1]


def test_16_concurrent_greedy_streams_equal_their_solo_runs(gguf, tok):
    prompts = _prompts(16, seed=3)
    solo = [_solo(gguf, tok, p, 24, GREEDY) for p in prompts]
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=16)
    with Engine(m, tok, n_parallel=16, prefill_chunk=8) as eng:
        streams = [eng.submit(p, max_tokens=24, params=GREEDY, eos_ids=[]) for p in prompts]
        results = [None] * 16

        def consume(i):
            results[i] = _collect(streams[i])

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for (text, last), (stext, slast) in zip(results, solo):
        assert text == stext
        assert last.token == slast.token and last.finish_reason == "length"
        assert last.generation_tokens == 24 and last.prompt_eval_tokens == last.prompt_tokens
    st = eng.stats()
    assert st["completed"] == 16 and st["generated_tokens"] == 16 * 24 and st["running"] == 0


def test_seeded_sampling_is_the_same_alone_and_batched(gguf, tok):
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=100 + i,
                             repetition_penalty=1.1 + 0.1 * i) for i in range(6)]
    solo = [_solo(gguf, tok, p, 20, q)[0] for p, q in zip(prompts, params)]
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=4)
    with Engine(m, tok, n_parallel=4) as eng:    # 6 requests on 4 slots: two wait, then reuse
        streams = [eng.submit(p, max_tokens=20, params=q, eos_ids=[]) for p, q in zip(prompts, params)]
        texts = [_collect(s)[0] for s in streams]
    assert texts == solo
    assert len(set(texts)) == 6


def test_cancel_frees_the_slot(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=256, n_seq=1)
    with Engine(m, tok, n_parallel=1) as eng:
        a = eng.submit([1, 2, 3], max_tokens=250, params=GREEDY, eos_ids=[])
        b = eng.submit([4, 5, 6], max_tokens=5, params=GREEDY, eos_ids=[])
        it = iter(a)
        next(it)
        assert eng.stats()["queued"] == 1
        a.cancel()
        rest = list(it)
        assert rest[-1].finish_reason == "cancelled" and rest[-1].generation_tokens < 250
        assert _collect(b)[1].finish_reason == "length"
        assert list(b) == [] and list(a) == []         # ended streams end at once
        b.cancel()                                     # after the end: nothing happens
        st = eng.stats()
    assert st["cancelled"] == 1 and st["completed"] == 1


def test_queue_full_and_shutdown_cancel(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=256, n_seq=1)
    eng = Engine(m, tok, n_parallel=1, max_queue=2)
    a = eng.submit([1, 2], max_tokens=250, params=GREEDY, eos_ids=[])
    next(iter(a))                                   # a runs: the queue is empty
    queued = [eng.submit([3, 4], max_tokens=250, eos_ids=[]) for _ in range(2)]
    with pytest.raises(QueueFullError, match="max_queue=2"):
        eng.submit([5], max_tokens=4)
    eng.shutdown(cancel=True, timeout=30)
    assert not eng._thread.is_alive()
    for s in [a] + queued:
        assert list(s)[-1].finish_reason == "cancelled"
    assert eng.stats()["cancelled"] == 3
    with pytest.raises(EngineClosedError):
        eng.submit([1])
    eng.shutdown()                                  # idempotent


def test_shutdown_drains_running_and_queued(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=256, n_seq=2)
    eng = Engine(m, tok, n_parallel=2)
    streams = [eng.submit(p, max_tokens=10, params=GREEDY, eos_ids=[]) for p in _prompts(5, seed=5)]
    eng.shutdown(timeout=60)
    assert not eng._thread.is_alive()
    assert [list(s)[-1].finish_reason for s in streams] == ["length"] * 5
    want = dict(queued=0, running=0, n_parallel=2, completed=5, cancelled=0, failed=0,
                generated_tokens=50, prompt_tokens=sum(s.prompt_tokens for s in streams),
                drafted_tokens=0, accepted_tokens=0, kv_used_tokens=0, kv_capacity_tokens=512)
    st = eng.stats()
    assert {k: st[k] for k in want} == want
    assert st["prefix_cache_queries"] == st["prompt_tokens"]


def test_prefix_reuse_runs_only_new_tokens(gguf, tok):
    base = _prompts(1, seed=6, lo=30, hi=31)[0]
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=2)
    with Engine(m, tok, n_parallel=2) as eng:
        first = _collect(eng.submit(base, max_tokens=4, params=GREEDY, eos_ids=[]))[1]
        assert first.prompt_eval_tokens == 30
        # the idle slot kept warm: only the 3 new tokens run
        text, r = _collect(eng.submit(base + [7, 8, 9], max_tokens=6, params=GREEDY, eos_ids=[]))
        assert r.prompt_eval_tokens == 3 and r.prompt_tokens == 33
        assert text == _solo(gguf, tok, base + [7, 8, 9], 6, GREEDY)[0]
        # copied from a running slot: a long request holds base, a second one shares it
        long = eng.submit(base, max_tokens=200, params=GREEDY, eos_ids=[])
        next(iter(long))
        text, r = _collect(eng.submit(base + [11, 12], max_tokens=6, params=GREEDY, eos_ids=[]))
        assert r.prompt_eval_tokens == 2
        assert text == _solo(gguf, tok, base + [11, 12], 6, GREEDY)[0]
        long.cancel()


def test_prefixes_are_reused_only_within_a_cache_partition(gguf, tok):
    """A prompt cached by partition "a" runs whole for partition "b" (and for None), and
    cached for "a" again: neither prompt_eval_tokens nor the slot's contents cross partitions.
    A request that ends in the step it was placed still marks its slot as used (LRU), so the
    next partition's request takes another slot and "a"'s prefix survives."""
    base = _prompts(1, seed=7, lo=30, hi=31)[0]
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=3)
    with Engine(m, tok, n_parallel=3) as eng:
        def run(prompt, part):
            return _collect(eng.submit(prompt, max_tokens=1, params=GREEDY, eos_ids=[],
                                       cache_partition=part))[1].prompt_eval_tokens
        assert run(base, "a") == 30
        assert run(base, "b") == 30          # not "a"'s
        assert run(base, None) == 30
        assert run(base + [5], "b") == 1     # "b"'s own
        assert run(base + [6], "a") == 1     # "a"'s survived
        with pytest.raises(TypeError):
            eng.submit(base, max_tokens=1, cache_partition=["unhashable"])


def test_the_choices_of_one_request_share_one_turn(gguf, tok):
    """Two submissions of 6 choices fill 2 slots and the queue; a newcomer takes the next free
    slot (its submission has none running), before the other choices queued before it."""
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=2)
    gate, real = threading.Event(), Model.batch

    def held(self, *a):            # the first step waits until every request is queued
        gate.wait(60)
        return real(self, *a)
    with Engine(m, tok, n_parallel=2) as eng:
        placed, place = [], eng._place
        eng._place = lambda r: (placed.append(r.stream), place(r))
        Model.batch = held
        try:
            big = [eng.submit_choices(p, [SamplingParams(temperature=0.7, seed=i)
                                          for i in range(6)], max_tokens=8, eos_ids=[])
                   for p in _prompts(2, seed=8)]
            small = eng.submit(_prompts(1, seed=9)[0], max_tokens=1, params=GREEDY, eos_ids=[])
        finally:
            Model.batch = real
            gate.set()
        for s in [s for b in big for s in b] + [small]:
            _collect(s)
    # admitted third (after each big request's first choice), not after the 10 choices queued
    # before it
    assert placed[:3] == [big[0][0], big[1][0], small], placed


def test_drafted_rows_per_step_are_bounded(gguf, tok, monkeypatch):
    """Requests drafting by prompt lookup on a repetitive prompt draft MAX_DRAFT_ROWS rows a
    step at most, all of them together."""
    import pyklei.runtime.engine as engine_mod
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 8
    drafted = []                  # per decode step: rows beyond one per sequence
    real = Model.batch

    def counting(self, tokens, seqs, pos, out_rows):
        decode = [int(sq) for sq, p in zip(seqs, pos) if p >= len(prompt)]
        if decode:
            drafted.append(len(decode) - len(set(decode)))
        return real(self, tokens, seqs, pos, out_rows)
    monkeypatch.setattr(Model, "batch", counting)
    m = Model(gguf, n_threads=2, n_ctx=256, n_seq=3)
    with Engine(m, tok, n_parallel=3, speculative="lookup") as eng:
        streams = [eng.submit(prompt, max_tokens=60, params=GREEDY, eos_ids=[]) for _ in range(3)]
        for s in streams:
            _collect(s)
    assert max(drafted) > 0                                   # it did draft
    assert max(drafted) <= engine_mod.MAX_DRAFT_ROWS, drafted


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(prompt=[]), ValueError, "empty"),
    (dict(prompt=[1] * 300), ValueError, "exceeds the context"),
    (dict(prompt=[1], max_tokens=300), ValueError, "max_tokens"),
    (dict(prompt=[1, 512], max_tokens=4), ValueError, "outside the vocabulary"),
    (dict(prompt=[1], max_tokens=-5), ValueError, "max_tokens"),
    (dict(prompt=[1], max_tokens=4, stop=[3]), TypeError, "stop"),
])
def test_submit_checks_at_the_call(gguf, tok, kwargs, err, match):
    m = Model(gguf, n_threads=1, n_ctx=256, n_seq=1)
    with Engine(m, tok, n_parallel=1) as eng:
        prompt = kwargs.pop("prompt")
        with pytest.raises(err, match=match):
            eng.submit(prompt, **kwargs)
        assert eng.stats()["queued"] == 0


def test_engine_arguments(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=64, n_seq=2)
    with pytest.raises(ValueError, match="n_seq=2"):
        Engine(m, tok, n_parallel=3)
    with pytest.raises(ValueError, match="max_queue"):
        Engine(m, tok, max_queue=0)
    with pytest.raises(TypeError, match="prefill_chunk"):
        Engine(m, tok, n_parallel=1, prefill_chunk=2.5)


def test_max_tokens_zero_and_ttft(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=64, n_seq=1)
    with Engine(m, tok, n_parallel=1) as eng:
        t0 = time.perf_counter()
        (r,) = list(eng.submit([1, 2, 3], max_tokens=0))
        assert r.finish_reason == "length" and r.generation_tokens == 0 and r.prompt_eval_tokens == 3
        r = _collect(eng.submit([1, 2, 3, 4], max_tokens=3, params=GREEDY, eos_ids=[]))[1]
        assert 0 < r.time_to_first_token < time.perf_counter() - t0
        assert r.prompt_eval_tokens == 1     # [1, 2, 3] was cached


# ---- the real model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_q4):
    import pyklei
    return pyklei.load(smollm2_q4, n_threads=2, n_ctx=512, n_seq=4)


def test_smollm2_batch_rows_equal_solo_rows(smol):
    m = smol.model
    seqs = [smol.encode(t) for t in ("The capital of France is", "def fib(n):\n    return",
                                     "Three colours: red,")]
    solo = []
    for s in seqs:
        m.reset()
        solo.append(m.logits(s))
    m.reset()
    toks = [t for s in seqs for t in s]
    sid = [i for i, s in enumerate(seqs) for _ in s]
    pos = [p for s in seqs for p in range(len(s))]
    assert np.array_equal(m.batch(toks, sid, pos, range(len(toks))), np.concatenate(solo))
    m.reset()


def test_generate_batch_equals_generate(smol):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Python is"]
    solo = [smol.generate(p, max_tokens=16, temperature=0.0) for p in prompts]
    seeded = smol.generate(prompts[1], max_tokens=16, temperature=0.9, seed=7)
    batch = smol.generate_batch(prompts, max_tokens=16, temperature=0.0)
    assert [r.text for r in batch] == [r.text for r in solo]
    assert "Paris" in batch[0].text
    assert smol.generate_batch([prompts[1]] * 3, max_tokens=16, temperature=0.9,
                               seed=7)[2].text == seeded.text
    with pytest.raises(TypeError, match="list of prompts"):
        smol.generate_batch("one prompt")
    with pytest.raises(ValueError, match="max_tokens"):   # checked before anything runs
        smol.generate_batch(["ok", "x"], max_tokens=600)
    assert smol.generate_batch([]) == []


def test_a_failed_step_reaches_the_streams_and_the_engine_goes_on(gguf, tok):
    m = Model(gguf, n_threads=1, n_ctx=64, n_seq=1)
    real = m.batch
    m.batch = lambda *a: (_ for _ in ()).throw(RuntimeError("model is busy in another thread"))
    with Engine(m, tok, n_parallel=1) as eng:
        with pytest.raises(RuntimeError, match="busy"):
            list(eng.submit([1, 2, 3], max_tokens=4))
        m.batch = real
        assert _collect(eng.submit([1, 2, 3], max_tokens=4, params=GREEDY, eos_ids=[]))[1].generation_tokens == 4


def test_a_request_that_fails_to_sample_fails_alone(gguf, tok, monkeypatch):
    """Logits that turn NaN for one request (its sampler raises) end that request with
    RequestFailedError at that step; the three beside it in the same batches finish with the
    tokens they get alone, and the engine serves the next request."""
    import pyklei.runtime.engine as engine_mod
    from pyklei.runtime.sampler import NonFiniteLogitsError

    prompts = _prompts(4, seed=7)
    solo = [_solo(gguf, tok, p, 20, GREEDY) for p in prompts]
    poisoned = prompts[2]

    class Poisoned(engine_mod.Generation):
        def feed(self, logits, drafted=None):
            if self.history[:len(poisoned)] == poisoned and self.n_gen == 5:
                logits = np.full_like(logits, np.nan)   # as a NaN from a penalty would
            return super().feed(logits, drafted)

    monkeypatch.setattr(engine_mod, "Generation", Poisoned)
    m = Model(gguf, n_threads=2, n_ctx=128, n_seq=4)
    with Engine(m, tok, n_parallel=4, prefill_chunk=8) as eng:
        streams = [eng.submit(p, max_tokens=20, params=GREEDY, eos_ids=[]) for p in prompts]
        results = [None] * 4

        def consume(i):
            try:
                results[i] = _collect(streams[i])
            except RequestFailedError as e:
                results[i] = e

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        err = results[2]
        assert isinstance(err, RequestFailedError) and "NaN" in str(err)
        assert isinstance(err.__cause__, NonFiniteLogitsError)
        for i in (0, 1, 3):
            assert results[i][0] == solo[i][0] and results[i][1].generation_tokens == 20
        assert _collect(eng.submit(prompts[0], max_tokens=20, params=GREEDY,
                                   eos_ids=[]))[0] == solo[0][0]
    st = eng.stats()
    assert st["failed"] == 1 and st["completed"] == 4 and st["running"] == 0


def test_profiler_and_statistics_count_batches(gguf):
    m = Model(gguf, n_threads=1, n_ctx=64, n_seq=2)
    m.runtime.profile_ops(True)
    m.runtime.collect_stats(True)
    m.batch([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], [2, 4])
    ops, calls = m.runtime.op_profile()
    _, rows, lm_rows = m.runtime.stats()
    assert calls == 1 and ops["attention"] > 0 and ops["lm_head"] > 0
    assert rows == 5 and lm_rows == 2


def _rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_kv_slots_cost_memory_only_where_written(gguf):
    before = _rss_mb()
    m = Model(gguf, n_threads=1, n_ctx=4096, n_seq=16, kv_cache="f32")   # 2 KiB/token/slot: 128 MiB
    assert m.state_bytes > 128 * 2**20
    m.batch([1, 2, 3, 4], [0, 0, 15, 15], [0, 1, 0, 1], [3])
    assert _rss_mb() - before < 32
