"""Threads, Ctrl-C and generations taking turns on one model, on the tiny committed model files
of tests/fixtures/fuzz_corpus/ (64-dim, one layer: no torch needed).

Thread policy (pyklei/runtime/model.py): a Model runs one evaluation at a time; a call made while
another thread is inside one raises RuntimeError("model is busy in another thread ...").
Ctrl-C ends a prefill at a chunk's end and leaves the cache as it was before that chunk. The
other reliability tests: runtime/test_leaks.py, runtime/test_generate_edges.py,
formats/test_hostile_files.py, converters/test_converter_failures.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from child_watch import (TIME_SCALE, process_cpu_seconds, sigint_as_in_a_terminal,
                         thread_cpu_seconds, wait_for_thread_work)
from paths import ROOT, SEED
from pyklei.model import Model


# ---------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------

def _long_tokens(n):
    return [(i * 7) % 383 + 1 for i in range(n)]


# The long passes below collect activation statistics, so that the seed model's one layer runs
# on every row: without them a prefill's last layer stops at the K/V store for the rows whose
# logits are not asked for (pyklei_ext/model/pk_llama.c, keep_out_rows), and a one-layer
# model's cache-filling pass is then over before it can be interrupted.


def test_second_thread_is_refused_while_busy():
    model = Model(SEED, n_threads=1, n_ctx=4096, n_batch=256)
    model.runtime.collect_stats(True)   # the whole layer on every row (above)
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
    model.runtime.collect_stats(True)   # the whole layer on every row (above)
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
    llm.model.runtime.collect_stats(True)   # the whole layer on every row (see the test file)
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
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
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
    llm.model.runtime.collect_stats(True)   # the whole layer on every row (see the test file)
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
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
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
