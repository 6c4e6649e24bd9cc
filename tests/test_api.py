"""The Python API's edges (issue 13): it checks what the CLI checks, with the same messages, and
a user walking the REPL never gets silently wrong text or an error from deep inside numpy.

Runs on the tiny committed model (tests/fixtures/fuzz_corpus/seed-tied-q4.gguf: byte-level BPE, 384
tokens, a chat template, 131072-token context); the CLI side runs `python -m pyklei` on it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paths import ROOT, SEED
import pyklei
from pyklei.llm import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM(SEED, n_threads=1, n_ctx=64)


def pyklei_cli(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "pyklei", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, **kw)


# ---- token ids ------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, err, match", [
    ([-1], ValueError, r"token id -1 is outside the vocabulary \[0, 384\)"),
    ([999999], ValueError, "token id 999999 is outside the vocabulary"),
    ([1, 2.5], ValueError, "token ids must be integers"),
    (b"Hi", TypeError, "got bytes"),
    ("Hi", TypeError, "got str"),
])
def test_decode_checks_ids(llm, ids, err, match):
    with pytest.raises(err, match=match):
        llm.decode(ids)
    with pytest.raises(err, match=match):
        llm.tokenizer.decode(ids)


def test_bytes_are_not_a_prompt(llm):
    for prompt in (b"Hi", bytearray(b"Hi")):
        with pytest.raises(TypeError, match="token ids must be a sequence of integers"):
            llm.generate(prompt)
    assert llm.decode(llm.encode("Hi", add_bos=False)) == "Hi"


# ---- load -----------------------------------------------------------------------------------

def test_load_checks_like_the_cli(tmp_path):
    with pytest.raises(ValueError, match="context size 200000 exceeds the model's context length "
                                         "of 131072 tokens"):
        pyklei.load(SEED, n_ctx=200000)
    with pytest.raises(ValueError, match="is a directory; pyklei runs one .gguf file .*pyklei convert"):
        pyklei.load(tmp_path)
    with pytest.raises(TypeError, match="n_ctx must be an integer"):
        pyklei.load(SEED, n_ctx="512")
    # the CLI says the same
    r = pyklei_cli("generate", SEED, "-p", "hi", "-c", "200000")
    assert r.returncode == 2 and "exceeds the model's context length of 131072" in r.stderr
    r = pyklei_cli("generate", tmp_path, "-p", "hi")
    assert r.returncode == 2 and "is a directory; pyklei runs one .gguf file" in r.stderr


# ---- max_tokens -----------------------------------------------------------------------------

def test_max_tokens_none_or_negative_runs_to_the_end_of_the_context(llm):
    ids = llm.encode("hello world")
    for mt in (None, -1):
        r = llm.generate(ids, max_tokens=mt, temperature=0)
        assert r.max_tokens == llm.n_ctx - len(ids)
        assert r.generation_tokens <= r.max_tokens
        if r.finish_reason == "length":
            assert len(ids) + r.generation_tokens == llm.n_ctx
    r = pyklei_cli("generate", SEED, "-p", "hello world", "-c", "64", "-n", "-1", "--temperature",
                   "0", "--stats", "-t", "1")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("value, err, match", [
    (2.5, TypeError, "max_tokens must be an integer or None, got 2.5"),
    ("8", TypeError, "max_tokens must be an integer or None"),
    (True, TypeError, "max_tokens must be an integer or None"),
    (100, ValueError, r"exceeds the context of 64 tokens.*--max-tokens"),
])
def test_max_tokens_is_checked(llm, value, err, match):
    with pytest.raises(err, match=match):
        llm.generate("hi", max_tokens=value)


def test_cli_max_tokens_errors_read_the_same():
    r = pyklei_cli("generate", SEED, "-p", "hi", "-c", "64", "-n", "100")
    assert r.returncode == 2 and "exceeds the context of 64 tokens" in r.stderr
    r = pyklei_cli("generate", SEED, "-p", "hi", "-n", "2.5")
    assert r.returncode == 2 and "--max-tokens" in r.stderr and "expected an integer" in r.stderr


# ---- sampling options -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(top_p=None), "top_p must be a number"),
    (dict(seed="1"), "seed must be an integer"),
    (dict(stop=[1]), "stop must be a string or a list of strings"),
])
def test_sampling_types(llm, kw, match):
    with pytest.raises(TypeError, match=match):
        llm.generate("hi", max_tokens=2, **kw)


# ---- chat -----------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": None}], r"message 0 \(user\): 'content' must be a string, got None"),
    ([{"role": "user"}], "'content' must be a string"),
    ([{"content": "hi"}], "message 0 has no 'role'"),
    ([{"role": "user", "content": "hi"}, "hello"], "message 1 must be a dict"),
])
def test_chat_checks_messages(llm, messages, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.chat(messages)


def test_chat_trims_max_tokens_to_the_context(llm):
    msgs = [{"role": "user", "content": "Say something."}]
    ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    r = llm.chat(msgs, temperature=0)               # the default max_tokens=512 > n_ctx of 64
    assert r.max_tokens == llm.n_ctx - len(ids) < 512
    r = llm.chat(msgs, max_tokens=3, temperature=0)
    assert r.max_tokens == 3 and r.generation_tokens <= 3
    with pytest.raises(ValueError, match="no room to generate"):
        llm.chat([{"role": "user", "content": "word " * 80}])


# ---- streaming ------------------------------------------------------------------------------

def test_stream_never_yields_empty_text_before_the_end(llm):
    """Byte tokens that end inside a UTF-8 character (an emoji is 4 bytes) add to the next
    response; the random model samples such tokens often at temperature 1."""
    merged = 0
    for seed in range(8):
        kw = dict(max_tokens=40, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        rs = list(llm.generate("\N{GRINNING FACE} hi", stream=True, **kw))
        assert all(r.text for r in rs[:-1]), [r.text for r in rs]
        assert "".join(r.text for r in rs) == llm.generate("\N{GRINNING FACE} hi", **kw).text
        steps = [b.generation_tokens - a.generation_tokens for a, b in zip(rs, rs[1:])]
        merged += sum(s > 1 for s in steps)
    assert merged > 0, "no response covered several tokens: the test did not exercise merging"


# ---- lifetime -------------------------------------------------------------------------------

def test_repr_reset_close_and_with():
    with pyklei.load(SEED, n_threads=1, n_ctx=64) as m:
        m.generate("hello", max_tokens=2, temperature=0)
        text = repr(m)
        assert text.startswith("<pyklei.LLM 'seed-a': 1 layers, vocab 384, n_ctx=64") and "cached" in text
        assert m.model.cached_tokens
        m.reset()
        assert m.model.cached_tokens == []
    assert repr(m) == "<pyklei.LLM (closed)>"
    for call in (lambda: m.generate("hi", max_tokens=1), lambda: m.logits([1]), m.reset):
        with pytest.raises(RuntimeError, match="the model is closed"):
            call()
    m.close()                                        # twice is fine


_CLOSE_CHILD = """
import os, sys
import pyklei
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
m = pyklei.load(sys.argv[1], n_threads=1, n_ctx=16384, n_batch=512, kv_cache="f32")
m.model.eval([(i * 7) % 383 + 1 for i in range(16384)])   # fills the 4 MB KV cache
before = rss_mb()
m.close()
print(before - rss_mb())
"""


def test_close_releases_memory():
    # a fresh process: glibc returns large blocks to the system at free() there, while in a
    # long test process its adaptive mmap threshold may keep them in the heap
    r = subprocess.run([sys.executable, "-c", _CLOSE_CHILD, str(SEED)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    freed = float(r.stdout)
    print(f"\nclose() freed {freed:.1f} MB")
    assert freed > 3.0


# ---- the CLI as a Unix tool -----------------------------------------------------------------

def test_generate_into_a_closed_pipe_exits_quietly():
    """`pyklei generate ... | head -c 50`: the reader goes away; pyklei stops without a message,
    with 141 (128 + SIGPIPE, what a shell reports for `cat`), not the internal-error code 1."""
    def cmd(seed):
        return [sys.executable, "-m", "pyklei", "generate", str(SEED), "-p", "hello", "-c", "8192",
                "-n", "-1", "--temperature", "1", "--seed", str(seed), "-t", "1"]
    # the random model samples its EOS often: a seed whose whole reply is long, so that pyklei
    # is still writing when the reader goes away (a seeded reply is the same run to run)
    for seed in range(20):
        whole = subprocess.run(cmd(seed), capture_output=True, cwd=ROOT, timeout=120)
        assert whole.returncode == 0, whole.stderr
        if len(whole.stdout) >= 2000:
            break
    else:
        pytest.skip("no seed gave 2000 bytes of text")
    p = subprocess.Popen(cmd(seed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    head = p.stdout.read(50)
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert head == whole.stdout[:50]
    assert rc == 141, (rc, err)
    assert err == ""
