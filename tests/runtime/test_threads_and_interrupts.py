"""Reliability: threads, Ctrl-C, leaks, generation edge cases, converter failures, hostile files.

Fast tests use the tiny committed model files of tests/fuzz_corpus/ (seed-*.gguf, 64-dim,
one layer: no torch needed); the SmolLM2 ones are marked slow. The fuzzing of the loader is
tests/test_fuzz_loader.py; this file holds hand-made hostile files with their exact errors.

Thread policy (pyklei/model.py): a Model runs one evaluation at a time; a call made while
another thread is inside one raises RuntimeError("model is busy in another thread ...").
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from child_watch import (TIME_SCALE, process_cpu_seconds, sigint_as_in_a_terminal,
                         thread_cpu_seconds, wait_for_thread_work)
from pyklei.formats.gguf_reader import GGUFError, read_gguf
from pyklei.formats.model_file import ModelFileError, read_model
from pyklei.llm import LLM
from pyklei.model import Model

HERE = Path(__file__).resolve().parents[1]   # tests/ (moved to tests/runtime/; split next)
SEED = HERE / "fuzz_corpus" / "seed-tied-q4.gguf"
SEED_SPM = HERE / "fuzz_corpus" / "seed-untied-q8.gguf"
REPO = HERE.parent


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def llm():
    return LLM(SEED, n_threads=1, n_ctx=64)


# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------

def _long_tokens(n):
    return [(i * 7) % 383 + 1 for i in range(n)]


def test_second_thread_is_refused_while_busy():
    model = Model(SEED, n_threads=1, n_ctx=4096, n_batch=256)
    started, errors = threading.Event(), []

    def worker():
        started.set()
        try:
            model.eval(_long_tokens(4096))     # ~1-2 s, off the main thread: no helper thread
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    deadline = time.monotonic() + 10
    while not model._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    busy = 0
    for call in (lambda: model.eval([1, 2]), lambda: model.step(1), lambda: model.logits([1]),
                 model.reset):
        if not model._lock.locked():
            break
        with pytest.raises(RuntimeError, match="model is busy in another thread"):
            call()
        busy += 1
    t.join()
    assert not errors and busy >= 1
    assert model.cached_tokens == _long_tokens(4096)          # the worker's call was not disturbed
    ref = Model(SEED, n_threads=1, n_ctx=64).eval([5, 6, 7])
    np.testing.assert_allclose(model.eval([5, 6, 7]), ref, rtol=0, atol=1e-5)


def test_separate_models_in_threads_agree():
    toks = _long_tokens(40)
    ref = Model(SEED, n_threads=1, n_ctx=64).logits(toks)
    models = [Model(SEED, n_threads=1, n_ctx=64) for _ in range(2)]
    out = [None, None]

    def run(i):
        for _ in range(5):
            out[i] = models[i].logits(toks)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for o in out:
        np.testing.assert_array_equal(o, ref)


# ---------------------------------------------------------------------------------------------
# Interrupts
# ---------------------------------------------------------------------------------------------

def test_interrupt_keeps_the_cached_prefix():
    """request_interrupt once the pass has run 0.3 s of CPU (a small part of the 8003 tokens'
    pass): the eval ends within 2 s of CPU in all. CPU seconds, not wall-clock ones, so that a
    busy machine stretches neither the wait nor the bound."""
    model = Model(SEED, n_threads=1, n_ctx=8192)
    model.eval([1, 2, 3])
    since = thread_cpu_seconds(os.getpid())

    def interrupt_once_running():     # the pass runs in runtime/model.py's helper thread
        wait_for_thread_work(os.getpid(), 0.3, since)
        model.runtime.request_interrupt()

    watcher = threading.Thread(target=interrupt_once_running)
    cpu0 = time.process_time()
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        model.eval([1, 2, 3] + _long_tokens(8000))
    cpu = time.process_time() - cpu0
    watcher.join()
    assert cpu < 2.0 * TIME_SCALE, f"the interrupted eval took {cpu:.2f} s of CPU"
    assert model.cached_tokens == [1, 2, 3]
    ref = Model(SEED, n_threads=1, n_ctx=64).eval([1, 2, 3, 9, 10])
    np.testing.assert_allclose(model.eval([1, 2, 3, 9, 10]), ref, rtol=0, atol=1e-5)
    assert model.last_eval_tokens == 2                        # the prefix was reused


_SIGINT_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from pyklei.llm import LLM
    llm = LLM(sys.argv[1], n_threads=1, n_ctx=8192, n_batch=256)
    toks = [(i * 7) % 383 + 1 for i in range(8192)]
    print("start", flush=True)
    t0 = time.monotonic()
    try:
        llm.model.eval(toks)
        print("completed %.2f" % (time.monotonic() - t0), flush=True)
    except KeyboardInterrupt:
        print("interrupted %.2f" % (time.monotonic() - t0), flush=True)
    sys.stdin.readline()     # idle while the test reads this process's CPU time
    r = llm.generate("hello world", max_tokens=8, temperature=0)
    ref = LLM(sys.argv[1], n_threads=1, n_ctx=64).generate("hello world", max_tokens=8, temperature=0)
    assert r.text == ref.text and r.generation_tokens == 8, (r, ref)
    print("generated ok", flush=True)
""")


def test_sigint_during_long_prefill_returns_promptly():
    """SIGINT to a process in a long prefill (8192 tokens), sent once the pass has run 0.5 s of
    CPU: KeyboardInterrupt within a fraction of a second (the C pass stops at its
    next layer boundary), then the same model generates correctly. "Within" is counted twice:
    in the CPU seconds the child spent after the signal, and in wall-clock seconds times the
    share of a CPU its pass got (1 on a quiet machine), so a busy machine stretches neither."""
    p = subprocess.Popen([sys.executable, "-c", _SIGINT_CHILD, str(SEED)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         preexec_fn=sigint_as_in_a_terminal)
    try:
        assert p.stdout.readline().strip() == "start", p.stderr.read()
        share = wait_for_thread_work(p.pid, 0.5, since=thread_cpu_seconds(p.pid))
        cpu0, t_kill = process_cpu_seconds(p.pid), time.monotonic()
        p.send_signal(signal.SIGINT)
        line = p.stdout.readline().strip()
        latency = time.monotonic() - t_kill
        cpu_latency = process_cpu_seconds(p.pid) - cpu0
        p.stdin.write("go\n")
        p.stdin.flush()
        rest, err = p.communicate(timeout=120 * TIME_SCALE)
    finally:
        if p.poll() is None:
            p.kill()
    assert line.startswith("interrupted"), (line, err)
    assert cpu_latency < 1.0 * TIME_SCALE, f"KeyboardInterrupt took {cpu_latency:.2f} s of CPU"
    assert latency * share < 1.0 * TIME_SCALE, \
        f"KeyboardInterrupt took {latency:.2f} s with {share:.0%} of a CPU"
    assert "generated ok" in rest, err
    print(f"\nSIGINT -> KeyboardInterrupt latency {latency * 1000:.0f} ms with {share:.0%} of a CPU, "
          f"{cpu_latency * 1000:.0f} ms of CPU ({line})")


_SIGINT_LOGITS_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from pyklei.llm import LLM
    llm = LLM(sys.argv[1], n_threads=1, n_ctx=8192, n_batch=256)
    ids = [(i * 7) % 383 + 1 for i in range(300)]
    ref = llm.logits(ids)
    long = [(i * 11) % 383 + 1 for i in range(8192)]
    for rnd in range(int(sys.argv[2])):
        print("start", flush=True)
        try:
            llm.model.eval(long)
            print("completed", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print("diff %r" % float(np.abs(llm.logits(ids) - ref).max()), flush=True)
""")


def test_sigint_during_prefill_leaves_the_same_logits():
    """Issue 13: a real SIGINT during a long prefill, then logits() equal to those computed
    before it, bit for bit, in several rounds at different points of the pass (after 0.3, 0.55
    and 0.8 s of its CPU work). The C pass must have stopped before the model is used again
    (an interrupted Thread.join used to release the model while the pass still wrote into its
    buffers)."""
    rounds = 3
    p = subprocess.Popen([sys.executable, "-c", _SIGINT_LOGITS_CHILD, str(SEED), str(rounds)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         preexec_fn=sigint_as_in_a_terminal)
    try:
        results = []
        for rnd in range(rounds):
            assert p.stdout.readline().strip() == "start", p.stderr.read()
            wait_for_thread_work(p.pid, 0.3 + 0.25 * rnd, since=thread_cpu_seconds(p.pid))
            p.send_signal(signal.SIGINT)
            results.append((p.stdout.readline().strip(), p.stdout.readline().strip()))
        _, err = p.communicate(timeout=120 * TIME_SCALE)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    print(f"\nSIGINT rounds: {results}")
    assert all(r[0] == "interrupted" for r in results), results
    assert all(r[1] == "diff 0.0" for r in results), results


# ---------------------------------------------------------------------------------------------
# Generations taking turns on one model (issue 13; issue 16 gives each its own sequence)
# ---------------------------------------------------------------------------------------------

def _solo(llm, prompt, **kw):
    llm.reset()
    return llm.generate(prompt, **kw).text


def test_interleaved_generators_raise_a_clear_error(llm):
    from pyklei.model import SequenceLostError

    kw = dict(max_tokens=12, temperature=0)
    solo2 = _solo(llm, "good morning", **kw)
    g1 = llm.generate("hello world", stream=True, **kw)
    g2 = llm.generate("good morning", stream=True, **kw)
    first2 = None
    with pytest.raises(SequenceLostError, match="context is gone"):
        for _, r2 in zip(g1, g2):      # g1 resumes after g2 has run: stale
            first2 = first2 or r2
    rest2 = "".join(r.text for r in g2)        # the newer generation is intact
    assert first2.text + rest2 == solo2
    assert llm.generate("good morning", **kw).text == solo2      # the model stays usable


def test_generators_taking_turns_in_two_threads_raise_a_clear_error(llm):
    """Two threads streaming to slow clients: their calls never overlap (no "busy" error), but
    the first one's context is gone once the second has started."""
    from pyklei.model import SequenceLostError

    kw = dict(max_tokens=12, temperature=0)
    gens = [llm.generate("hello world", stream=True, **kw),
            llm.generate("good morning", stream=True, **kw)]
    outcome = {}

    def advance(i):
        try:
            outcome[i] = next(gens[i]).text
        except BaseException as e:  # noqa: BLE001
            outcome[i] = e

    for i in (0, 1, 0):
        t = threading.Thread(target=advance, args=(i,))
        t.start()
        t.join()
    assert isinstance(outcome[0], SequenceLostError), outcome
    assert isinstance(outcome[1], str)


def test_one_generator_after_another_is_fine(llm):
    kw = dict(max_tokens=12, temperature=0)
    a, b = _solo(llm, "hello world", **kw), _solo(llm, "good morning", **kw)
    g1 = llm.generate("hello world", stream=True, **kw)
    assert "".join(r.text for r in g1) == a
    g2 = llm.generate("good morning", stream=True, **kw)
    assert "".join(r.text for r in g2) == b


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


# ---------------------------------------------------------------------------------------------
# Generation edge cases (test_runtime.py covers them on SmolLM2; these run on the tiny model,
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


# ---------------------------------------------------------------------------------------------
# Hostile files: hand-made, each with its exact error (the fuzzer finds the rest)
# ---------------------------------------------------------------------------------------------

def _fields(raw: bytes):
    from test_fuzz_loader import gguf_fields
    return gguf_fields(raw)


def _field(raw: bytes, what: str, nth: int = 0) -> tuple[int, int]:
    hits = [(o, n) for o, n, w in _fields(raw) if w == what]
    return hits[nth]


def _kv_offset(raw: bytes, key: str) -> int:
    """Byte offset of the value type of metadata key `key`."""
    i = raw.index(struct.pack("<Q", len(key)) + key.encode())
    return i + 8 + len(key)


def _put(raw: bytes, off: int, fmt: str, *v) -> bytes:
    b = bytearray(raw)
    struct.pack_into(fmt, b, off, *v)
    return bytes(b)


def _tensor_info(raw: bytes, name: str) -> int:
    """Byte offset of the n_dims field of tensor `name`."""
    n = name.encode()
    i = raw.index(struct.pack("<Q", len(n)) + n)
    while True:   # the info (not a pyklei.format.<name> key): followed by a small n_dims
        o = i + 8 + len(n)
        if struct.unpack_from("<I", raw, o)[0] in (1, 2):
            return o
        i = raw.index(struct.pack("<Q", len(n)) + n, i + 1)


def _hostile_cases():
    raw = SEED.read_bytes()
    n = len(raw)
    kv_n = struct.unpack_from("<Q", raw, 16)[0]
    emb = _tensor_info(raw, "token_embd.weight")        # n_dims, dims[2], type, offset
    norm = _tensor_info(raw, "output_norm.weight")      # n_dims, dims[1], type, offset
    bs = _kv_offset(raw, "pyklei.qsi4c32.block_size")
    nl = _kv_offset(raw, "llama.block_count")
    fmt_q = _kv_offset(raw, "pyklei.format.blk.0.attn_q.weight")
    toks = _kv_offset(raw, "tokenizer.ggml.tokens")
    key0 = 24
    cases = {
        "empty file": (b"", "only 0 bytes"),
        "wrong magic": (b"GGML" + raw[4:], "bad magic"),
        "version 1": (_put(raw, 4, "<I", 1), "GGUF version 1 is not supported"),
        "big-endian version": (_put(raw, 4, ">I", 3), "big-endian"),
        "truncated header": (raw[:20], "only 20 bytes"),
        "truncated metadata": (raw[:400], "truncated"),
        "truncated tensor data": (raw[:n - 64], "truncated file or bad offset: tensor"),
        "n_kv = 2^64-1": (_put(raw, 16, "<Q", 2**64 - 1), "metadata keys"),
        "n_tensors = 2^40": (_put(raw, 8, "<Q", 2**40), "tensors"),
        "n_kv one too many": (_put(raw, 16, "<Q", kv_n + 1), "truncated|not valid UTF-8|unknown|limit"),
        "key length 2^63": (_put(raw, key0, "<Q", 2**63), "limit"),
        "key length past EOF": (_put(raw, key0, "<Q", 60000), "truncated"),
        "key not UTF-8": (raw[:key0 + 8] + b"\xff" + raw[key0 + 9:], "not valid UTF-8"),
        "unknown value type": (_put(raw, nl, "<I", 77), "unknown GGUF value type 77"),
        "string array of 2^60": (_put(raw, toks + 8, "<Q", 2**60), "limit"),
        "string array of 2^23 (too many for file)": (_put(raw, toks + 8, "<Q", 2**23), "cannot fit"),
        "array element type 99": (_put(raw, toks + 4, "<I", 99), "unknown array element type 99"),
        "token string not UTF-8": (_corrupt_token(raw), "not valid UTF-8"),
        "tensor with 5 dims": (_put(raw, norm, "<I", 5), "5 dimensions"),
        "dims product overflows": (_put(_put(raw, emb + 4, "<Q", 2**63), emb + 12, "<Q", 2**63),
                                   "describe more data than"),
        "tensor offset past EOF": (_put(raw, norm + 4 + 8 + 4, "<Q", 1 << 40), "lies outside"),
        "tensor offset misaligned": (_put(raw, norm + 4 + 8 + 4, "<Q", 8), "not a multiple of the alignment"),
        "unknown GGML type": (_put(raw, norm + 4 + 8, "<I", 200), "unknown GGML type 200"),
        "wrong GGML type (I8 norm)": (_put(raw, norm + 4 + 8, "<I", 24), "output_norm.weight has unsupported GGUF type I8"),
        "shape disagrees with hparams": (_put(raw, norm + 4, "<Q", 32), "output_norm.weight has shape"),
        "duplicate tensor": (_rename_tensor(raw, "blk.0.attn_k.weight", "blk.0.attn_q.weight"), "duplicate tensor"),
        "renamed tensor": (_rename_tensor(raw, "output_norm.weight", "output_nxrm.weight"), "unexpected tensor 'output_nxrm.weight'"),
        "block_count 2 (missing layer)": (_put(raw, nl + 4, "<I", 2), "lacks tensor 'blk.1"),
        "block_count 0": (_put(raw, nl + 4, "<I", 0), "out of range"),
        "block_count as float32": (_put(raw, nl, "<I", 6), "expected an integer"),
        "block size 48": (_put(raw, bs + 4, "<I", 48), "is not one of"),
        "weight format 'qsi9'": (_replace_str(raw, fmt_q, b"qsi4c32", b"qsi9c32"), "is not a known format"),
        "weight format qsi8cx on qsi4c32 data": (_set_string(raw, fmt_q, "qsi8cx"), "attn_q.weight has shape"),
        "weight format key is an int": (_int_format_key(raw, fmt_q), "is not a string"),
        "format key for a tensor that does not exist": (_rename_key(raw, "pyklei.format.blk.0.attn_q.weight",
                                                                    "pyklei.format.blk.7.attn_q.weight"), "names no tensor"),
        "duplicate key": (_rename_key(raw, "llama.block_count", "llama.context_length"), "duplicate metadata key"),
        "alignment 3": (_put(raw, _kv_offset(raw, "general.alignment") + 4, "<I", 3), "power of two"),
    }
    return cases


def _corrupt_token(raw: bytes) -> bytes:
    toks = _kv_offset(raw, "tokenizer.ggml.tokens")
    o = toks + 4 + 12                                  # first string of the array
    ln = struct.unpack_from("<Q", raw, o)[0]
    assert ln >= 1
    b = bytearray(raw)
    b[o + 8] = 0xC3                                    # a lone UTF-8 lead byte (then ASCII or end)
    if ln == 1:
        return bytes(b)
    b[o + 9] = 0x28
    return bytes(b)


def _rename_tensor(raw: bytes, old: str, new: str) -> bytes:
    assert len(old) == len(new)
    o = _tensor_info(raw, old) - len(old)
    return raw[:o] + new.encode() + raw[o + len(old):]


def _rename_key(raw: bytes, old: str, new: str) -> bytes:
    i = raw.index(struct.pack("<Q", len(old)) + old.encode())
    return raw[:i] + struct.pack("<Q", len(new)) + new.encode() + raw[i + 8 + len(old):]


def _set_string(raw: bytes, vtype_at: int, value: str) -> bytes:
    """Replaces the string value whose type field is at vtype_at (the file shifts; tensor data
    offsets are relative to the aligned data section, which absorbs a few bytes)."""
    o = vtype_at + 4
    n = struct.unpack_from("<Q", raw, o)[0]
    v = value.encode()
    return raw[:o] + struct.pack("<Q", len(v)) + v + raw[o + 8 + n:]


def _int_format_key(raw: bytes, vtype_at: int) -> bytes:
    """The string value at vtype_at becomes a uint32."""
    o = vtype_at + 4
    n = struct.unpack_from("<Q", raw, o)[0]
    return raw[:vtype_at] + struct.pack("<II", 4, 7) + raw[o + 8 + n:]


def _replace_str(raw: bytes, at: int, old: bytes, new: bytes) -> bytes:
    i = raw.index(old, at)
    return raw[:i] + new + raw[i + len(old):]


HOSTILE = _hostile_cases() if SEED.exists() else {}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_file(tmp_path, name):
    data, match = HOSTILE[name]
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(ModelFileError, match=match) as ei:
        read_model(p)
    assert isinstance(ei.value, GGUFError) and isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert str(p) in msg
    print(f"\n{name}: {msg.replace(str(p) + ': ', '').replace(str(p), '<file>')}")


def test_not_regular_files(tmp_path):
    with pytest.raises(ModelFileError, match="is a directory; pyklei runs one .gguf file"):
        read_model(tmp_path)
    with pytest.raises(ModelFileError, match="no such model file"):
        read_model(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        read_gguf("/dev/zero")
    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf(tmp_path / "missing.gguf")


def test_llama3_vocab_reads_fast():
    vocab = REPO.parent / "shared" / "vocab" / "ggml-vocab-llama-bpe.gguf"
    if not vocab.exists():
        pytest.skip("shared/vocab not available")
    from pyklei.tokenizer import read_gguf_metadata
    best = min(_cpu_timed(lambda: read_gguf_metadata(vocab, prefixes=("tokenizer.",)))
               for _ in range(3))
    meta = read_gguf_metadata(vocab)
    assert len(meta["tokenizer.ggml.tokens"]) == 128256 and len(meta["tokenizer.ggml.merges"]) == 280147
    assert best < 1.0 * TIME_SCALE, f"{best:.2f} s of CPU"


def _cpu_timed(fn):
    """CPU seconds fn() took: what the parser costs, which a busy machine does not stretch."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


# ---------------------------------------------------------------------------------------------
# Converter failures test_convert.py lacks: a bad shard of a sharded checkpoint, configs that
# lie about heads / vocabulary / width
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    pytest.importorskip("torch")
    from models import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("rel") / "hf", head_dim=32, tied=True,
                           tokenizer="bpe", seed=3, hidden_size=64, n_head=2, n_head_kv=1,
                           n_layer=2, intermediate_size=128, vocab_size=384)


def _sharded(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file as load_pt     # bf16: through torch
    from safetensors.torch import save_file as save_pt
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    ts = load_pt(str(src / "model.safetensors"))
    names = sorted(ts)
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_pt({k: ts[k] for k in part}, str(dst / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return dst


def _conv_fails(src: Path, out: Path, match: str):
    from pyklei.converters import ConversionError, convert
    with pytest.raises(ConversionError, match=match) as ei:
        convert(src, out)
    print(f"\n{src.name}: {ei.value}")
    left = [p.name for p in out.parent.iterdir() if p.suffix in (".gguf", ".part") or ".part" in p.name]
    assert left == [], left


def test_converter_bad_shards_and_lying_configs(tiny_hf, tmp_path):
    from pyklei.converters import convert
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    sh = _sharded(tiny_hf, tmp_path / "sharded")
    convert(sh, out)                                    # the sharded copy itself converts
    out.unlink()
    shard2 = sh / "model-00002-of-00002.safetensors"
    good = shard2.read_bytes()
    shard2.write_bytes(good[: len(good) // 2])
    _conv_fails(sh, out, "truncated safetensors")
    shard2.write_bytes(good[:8] + b"{not json" + good[17:])
    _conv_fails(sh, out, "corrupt")
    shard2.write_bytes(b"")
    _conv_fails(sh, out, "safetensors")
    shard2.write_bytes(good)
    for change, match in [
        ({"num_attention_heads": 4}, "does not match|shape"),
        ({"num_key_value_heads": 2}, "does not match|shape"),
        ({"vocab_size": 400}, "does not match|shape|vocab"),
        ({"hidden_size": 128}, "does not match|shape"),
    ]:
        d = tmp_path / ("lie_" + "_".join(change))
        shutil.copytree(tiny_hf, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))
        _conv_fails(d, out, match)


def test_runtime_positions_near_int_max_are_refused():
    """Regression (UBSan, tests/c/test_llama.c): pos0 + n overflowed int in pk_llama_forward's
    context check; now a ValueError."""
    model = Model(SEED, n_threads=1, n_ctx=16)
    for pos0 in (2**31 - 2, 2**31 - 1, 16, -1):
        with pytest.raises(ValueError, match="exceed the context"):
            model.runtime.forward(np.array([1, 2], np.int32), pos0, False)
    assert model.eval([1, 2]).shape == (384,)
