"""The options' schemas (pyklei.options): one rule per option, the same in the Python API and
on the command line (issue 23 part 4)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pyklei.runtime.options import MODEL_OPTIONS, check_model_options


def test_model_options_are_checked_by_their_rule():
    check_model_options(n_threads=None, n_ctx=None, n_batch=1, kv_cache="f16",
                        activations="qai8dx", n_seq=8)
    bad = [(dict(n_ctx=1), ValueError, r"n_ctx must be >= 2"),
           (dict(n_ctx="2048"), TypeError, r"n_ctx must be an integer or None"),
           (dict(n_batch=0), ValueError, r"n_batch must be >= 1"),
           (dict(n_threads=True), TypeError, r"n_threads must be an integer"),
           (dict(kv_cache="q8_0"), ValueError, r"kv_cache must be one of auto, f32, f16, bf16, q8, got 'q8_0'"),
           (dict(kv_cache=16), TypeError, r"kv_cache must be a string"),
           (dict(activations="int8"), ValueError, r"activations must be one of auto, qai8dx2"),
           (dict(n_seq=0), ValueError, r"n_seq must be >= 1")]
    for kw, err, msg in bad:
        with pytest.raises(err, match=msg):
            check_model_options(**kw)


def test_the_model_and_the_cli_use_the_same_rules(tiny64):
    from pyklei.runtime.model import Model
    tiny_gguf = tiny64[1]
    with pytest.raises(ValueError, match="n_ctx must be >= 2"):
        Model(tiny_gguf, n_ctx=1)
    with pytest.raises(ValueError, match="kv_cache must be one of auto, f32, f16"):
        Model(tiny_gguf, kv_cache="fp8")
    help_text = subprocess.run([sys.executable, "-m", "pyklei", "generate", "--help"],
                               capture_output=True, text=True, check=True).stdout
    for o in MODEL_OPTIONS:
        for flag in o.flags:
            assert flag in help_text, flag
    r = subprocess.run([sys.executable, "-m", "pyklei", "generate", str(tiny_gguf), "-p", "x",
                        "-c", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid context size '1': must be >= 2" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "pyklei", "generate", str(tiny_gguf), "-p", "x",
                        "--kv-cache", "fp8"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice: 'fp8'" in r.stderr, r.stderr


def test_engine_server_and_serve_flags_read_one_table():
    """The engine's and the server's numbers (parallel sequences, queue, prefill chunk, port,
    connections, timeouts): one default and one rule each, which Engine, serve() and `pyklei
    serve`'s flags all take from pyklei.runtime.options."""
    import inspect

    from pyklei.cli import build_parser
    from pyklei.runtime.engine import Engine
    from pyklei.runtime.options import (ENGINE_OPTION, ENGINE_OPTIONS, MODEL_OPTION, SERVER_OPTIONS,
                                        check_options)
    from pyklei.server.run import serve

    engine = inspect.signature(Engine).parameters
    server = inspect.signature(serve).parameters
    args = build_parser().parse_args(["serve", "m.gguf"])
    for o in ENGINE_OPTIONS:
        assert engine[o.name].default == server[o.name].default == o.default, o.name
        if o.flags:
            assert getattr(args, o.name) == o.default, o.name
    for o in SERVER_OPTIONS:
        assert server[o.name].default == getattr(args, o.name) == o.default, o.name
    assert ENGINE_OPTION["prefill_chunk"].default == MODEL_OPTION["n_batch"].default
    assert ENGINE_OPTION["n_parallel"].default == MODEL_OPTION["n_seq"].default
    with pytest.raises(ValueError, match="max_queue must be >= 1, got 0"):
        check_options(ENGINE_OPTION, max_queue=0)
