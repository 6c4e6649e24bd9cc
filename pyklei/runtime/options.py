"""The options' schemas: one record per option -- type, default, range or choices, CLI flags and
help -- read by the code that takes the option, the CLI that makes flags of it and the server
that checks requests with it, so each rule and message is written once.

    MODEL_OPTIONS      Model / LLM / pyklei.load keywords and the CLI's "model" flags (here)
    ENGINE_OPTIONS     Engine's keywords: parallel sequences, queue, prefill chunk (here)
    SERVER_OPTIONS     pyklei.server.run.serve's port, connection cap, timeouts, models_max (here)
    SAMPLING_OPTIONS   max_tokens and SamplingParams' fields (pyklei.runtime.sampler)

    check_model_options(n_ctx=2048, kv_cache="f16")   # TypeError / ValueError naming the option
    check_options(ENGINE_OPTION, n_parallel=4)        # the same, for any table
    default(ENGINE_OPTION, "max_queue")               # 64
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .activation_policy import ACTIVATIONS
from .kv_policy import KV_CACHES


@dataclass(frozen=True)
class Option:
    """One option: its type, default and range (or choices), and how the CLI shows it.

    The range is [lo, hi] with either end open (lo_open / hi_open) or absent (None); floats
    must also be finite. `choices`: the values a str option takes. `optional`: None is a value
    (seed: random; max_tokens: until the context is full; n_ctx: the model's)."""
    name: str                     # the keyword (and SamplingParams field, request field)
    kind: type                    # int, float or str
    default: object
    flags: tuple[str, ...]        # CLI flags; argparse stores the value under `name`
    metavar: str
    what: str                     # the value's name in the CLI's messages: "invalid top-p '2': ..."
    help: str                     # CLI help, then " (" + default_help + ")"
    default_help: str = "default %(default)s"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False
    note: str = ""                # after the range in messages: "top_k must be >= 0 (0 disables it)"
    choices: tuple[str, ...] = ()

    def check_type(self, v) -> None:
        if v is None and self.optional:
            return
        if self.kind is str:
            if not isinstance(v, str):
                raise TypeError(f"{self.name} must be a string, one of {', '.join(self.choices)}; "
                                f"got {v!r}")
            return
        ok = (int, np.integer) if self.kind is int else (int, float, np.integer, np.floating)
        if isinstance(v, bool) or not isinstance(v, ok):
            raise TypeError(f"{self.name} must be {'an integer' if self.kind is int else 'a number'}"
                            f"{' or None' if self.optional else ''}, got {v!r}")

    def check_range(self, v) -> None:
        if v is None:
            return
        if self.choices:
            if v not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, "
                                 f"got {v!r}")
            return
        try:
            bad = self.kind is float and not math.isfinite(v)
        except OverflowError:           # an int too large for a float (JSON allows 10**400)
            raise ValueError(f"{self.name} must be a finite number, got an integer of "
                             f"{len(str(abs(v)))} digits") from None
        if self.lo is not None:
            bad |= v <= self.lo if self.lo_open else v < self.lo
        if self.hi is not None:
            bad |= v >= self.hi if self.hi_open else v > self.hi
        if bad:
            raise ValueError(f"{self.name} must be {self.range_text()}{self.note}, got {v}")

    def check(self, v):
        """v if it is a valid value; else a TypeError or ValueError that names the option."""
        self.check_type(v)
        self.check_range(v)
        return v

    def range_text(self) -> str:
        """'>= 0', '> 0' or 'in (0, 1]' ('' when any value goes)."""
        def num(x):
            return str(x) if self.kind is int else f"{x:g}"
        lo, hi = self.lo, self.hi
        if hi is None:
            return "" if lo is None else f"{'>' if self.lo_open else '>='} {num(lo)}"
        return (f"in {'(' if self.lo_open else '['}{'-inf' if lo is None else num(lo)}, "
                f"{num(hi)}{')' if self.hi_open else ']'}")


#: What pyklei.load / LLM / Model take besides the path. Defaults are LLM's (Model's n_seq is 1:
#: a bare model serves one sequence unless asked). The context's upper bound is the file's
#: context length, which only the model knows: Model checks it.
MODEL_OPTIONS: tuple[Option, ...] = (
    Option("n_threads", int, None, ("-t", "--threads"), "N", "thread count",
           "threads", "default: the physical cores this process may use", lo=1, optional=True,
           note=" (None: the physical cores)"),
    Option("n_ctx", int, None, ("-c", "--ctx-size"), "N", "context size",
           "context size in tokens", "default: the model's, at most 4096", lo=2, optional=True,
           note=" (None: the model's, at most 4096)"),
    Option("n_batch", int, 256, ("-b", "--batch-size"), "N", "batch size",
           "prompt tokens per forward pass (prefill chunk)", lo=1),
    # 2 bytes a value by default, as llama.cpp's f16: half the memory, KLD within the noise of
    # the activations' rounding (benchmarks/results/kv-cache.md); "auto" picks bf16 or f16 by
    # what the attention reads fastest (kv_policy.py); q8 is smaller and faster but costs about
    # +1% KLD against f16 (docs/CLI.md)
    Option("kv_cache", str, "auto", ("--kv-cache",), "{auto,f32,f16,bf16,q8}", "KV cache type",
           "KV cache precision (q8: int8 with an f16 scale per 32 values, as llama.cpp's q8_0; "
           "bf16: as the bf16 attention reads it, no conversion)",
           "default %(default)s: bf16 on a CPU with AVX-512 BF16, where attention runs in "
           "bf16; f16 elsewhere", choices=KV_CACHES),
    Option("activations", str, "auto", ("--activations",), "{auto,qai8dx2,qai8dx,qsi8d32}", "activations",
           "activation quantization: qai8dx2 (two int8 planes, accurate on any file), qai8dx "
           "(one plane per row, KleidiAI's scheme: faster prefill, a little less accurate) or "
           "qsi8d32 (one plane, a scale per block of 32, as llama.cpp's Q8_0)",
           "default %(default)s: one plane per row on a rotated file, a scale per block of 32 "
           "on any other; the figures in docs/QUALITY.md", choices=ACTIVATIONS),
    Option("n_seq", int, 4, (), "N", "sequence count",      # no flag: serve's --parallel sets it
           "KV cache slots: sequences decoded together (pyklei.engine)", lo=1),
)
MODEL_OPTION = {o.name: o for o in MODEL_OPTIONS}


#: What pyklei.runtime.engine.Engine takes besides the model and tokenizer, and `pyklei serve`'s
#: flags for them. As many parallel sequences as an LLM has KV cache slots by default; a prefill
#: chunk as long as the model's (serve's --batch-size sets both).
ENGINE_OPTIONS: tuple[Option, ...] = (
    Option("n_parallel", int, MODEL_OPTION["n_seq"].default, ("--parallel", "-np"), "N",
           "parallel count", "sequences decoded together",
           "pyklei.engine's n_parallel; default %(default)s", lo=1),
    Option("max_queue", int, 64, ("--max-queue",), "N", "queue size",
           "requests that may wait for a sequence; more get 429", lo=1),
    Option("prefill_chunk", int, MODEL_OPTION["n_batch"].default, (), "N", "prefill chunk",
           "prompt tokens per step of the request being prefilled", lo=1),
    # 1 GiB: SmolLM2's f16 K/V for ~46k tokens, a Llama 3 8B's for ~8k; llama.cpp's server
    # defaults to 8 GiB. Memory is taken only as blocks are saved.
    Option("cache_ram", int, 1024, ("--cache-ram",), "MB", "prefix cache size",
           "host memory for the prefix cache that outlives a slot (pyklei.runtime.prefix_cache): "
           "the 32-token blocks finished requests leave in their slots, LRU-evicted, copied "
           "back into a slot when a prompt starts with them; 0 turns it off", lo=0,
           note=" (0 turns the cache off)"),
    Option("cache_disk", int, 8192, ("--cache-disk",), "MB", "prefix cache disk size",
           "disk space for the prefix cache's files in --cache-dir (least recently used out)",
           lo=1),
)
ENGINE_OPTION = {o.name: o for o in ENGINE_OPTIONS}

#: What pyklei.server.run.serve takes for its socket, connections, deadlines (seconds) and
#: resident models, and `pyklei serve`'s flags for them.
SERVER_OPTIONS: tuple[Option, ...] = (
    Option("port", int, 8000, ("--port",), "PORT", "port",
           "port; 0 picks a free one, which the first line printed names", lo=0, hi=65535),
    Option("drain_timeout", float, 30.0, ("--drain-timeout",), "S", "drain timeout",
           "on SIGTERM or Ctrl-C, seconds to let replies finish before cancelling them", lo=0),
    Option("max_connections", int, 2048, ("--max-connections",), "N", "connection count",
           "open connections at most; more get 503 at once",
           "default %(default)s, lowered to fit the open-file limit", lo=1),
    Option("timeout_header", float, 10.0, ("--timeout-header",), "S", "header timeout",
           "seconds a request's headers may take to arrive; slower connections are closed",
           lo=0, lo_open=True),
    Option("timeout_body", float, 60.0, ("--timeout-body",), "S", "body timeout",
           "seconds a request's body may take to arrive; slower uploads get 408",
           lo=0, lo_open=True),
    Option("timeout_write", float, 30.0, ("--timeout-write",), "S", "write timeout",
           "seconds a streamed reply may wait for its client to read; then the request is "
           "cancelled", lo=0, lo_open=True),
    Option("timeout_idle", float, 5.0, ("--timeout-idle",), "S", "idle timeout",
           "seconds a kept-alive connection may wait for its next request", lo=0, lo_open=True),
    # Two: on a CPU the models share the same cores and memory bandwidth, so more resident
    # models add no throughput, only memory (weights plus a KV cache of n_parallel x n_ctx
    # each); two let an app alternate between a pair (chat and code, big and small) without
    # reloading, and bound memory at the two largest.
    Option("models_max", int, 2, ("--models-max",), "N", "model count",
           "with several models: at most N loaded at once; loading another unloads the least "
           "recently used idle one, never one with requests (the request gets 503 instead)",
           lo=1),
)
SERVER_OPTION = {o.name: o for o in SERVER_OPTIONS}


def default(table: dict[str, Option], name: str):
    return table[name].default


def model_default(name: str):
    return MODEL_OPTION[name].default


def check_options(table: dict[str, Option], **values) -> None:
    """Checks keywords against a table of options: types first (a string where a number goes
    would otherwise fail far from the call), then ranges and choices."""
    opts = [(table[k], v) for k, v in values.items()]
    for o, v in opts:
        o.check_type(v)
    for o, v in opts:
        o.check_range(v)


def check_model_options(**values) -> None:
    """check_options against MODEL_OPTIONS."""
    check_options(MODEL_OPTION, **values)
