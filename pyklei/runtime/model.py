"""The model runtime: a pyklei GGUF file memory-mapped into the C forward pass.

    model = Model("smollm2.gguf", n_threads=2, n_ctx=2048)
    logits = model.eval(tokens)             # last position; reuses the cached prefix
    all_logits = model.logits(tokens)       # every position, from an empty cache

Activations are quantized per row at run time: `activations="qai8dx2"` adds a residual int8
plane to KleidiAI's qai8dx, which an unrotated SmolLM2's outlier channels need to agree with
float references (docs/FORMAT.md); `"qai8dx"` is the single-plane scheme (half the integer
work of prefill; what it costs in accuracy is measured in docs/QUALITY.md, "Activations");
`"qsi8d32"` is one plane with a scale per block of 32 along K; `"auto"` (default) is the
choice for the file (activation_policy.choose_activations: qai8dx on a rotated file, qsi8d32
on any other).

Weights are memory-mapped. Kernels that stream a repacked layout (the x86 AVX-512 and AMX
kernels read qsi4c32/qsi6c32 as "p16", panels of 16 rows with offset nibbles, and qsi8cx as
"p4", 4-row tiles: docs/FORMAT.md, "Runtime layouts") get a copy made at load, and
the mapped pages of those weights are then released (`released_bytes`), so each weight is
resident once. The kernel layer also owns a float per weight row (R, the row sums of
docs/FORMAT.md); `weights_owned_bytes` reports all of it.

Threads: a Model runs one evaluation at a time. A call (eval/step/logits/reset) made while
another thread is inside one is refused at once with RuntimeError("model is busy in another
thread ...") rather than queued: interleaving two threads' calls on one KV cache would mix
their contexts even if serialised, so sharing a model needs the caller's own coordination
(or one Model per thread).

Owners: a generation continues the cache with `step`; if anything else used the model in
between (another generation's eval, a logits call, a reset), its context is gone. A caller
that passes `owner=` to eval and step gets SequenceLostError from such a step instead of a
continuation of somebody else's context.

Ctrl-C: the C forward pass runs without the GIL, and Python only runs its signal handlers
between bytecodes, so a long prefill on the main thread runs in a helper thread while the
main thread waits; on KeyboardInterrupt the pass is asked to stop at its next layer boundary
(`LlamaRuntime.request_interrupt`), and KeyboardInterrupt is raised once the helper thread
has left the C pass. The cache keeps the tokens before that call, so the model stays usable.

Sequences: `n_seq` KV cache slots (default 1). eval/step/logits use slot 0; `batch` runs rows
of several slots in one pass (every weight streamed once for all of them: the engine of
pyklei.runtime.engine decodes many requests so), and each row gets the same logits, bit for bit, as
it would alone. `copy_seq` copies a slot's cached prefix into another; `export_kv` and
`import_kv` move a slot's K/V rows out to bytes and back (the engine's prefix cache,
pyklei.runtime.prefix_cache, keeps prefixes so beyond the life of a slot). `verify` runs a drafted
continuation of a slot with the logits of every row, and `truncate_seq` forgets a slot's
rejected tail (speculative decoding: pyklei.runtime.speculative). A slot costs memory only for the
positions it has held: 2 * n_layer * n_head_kv * head_dim bytes per token times 4 (f32), 2
(kv_cache="f16" or "bf16": the default "auto" picks one of them) or 1 + 2/32 (q8: int8 with
an f16 scale per 32 values); SmolLM2: 45, 22.5 or 12 KiB per token.

`close()` (or `with Model(...) as m:`) frees the KV cache, the repacked weights and the map.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..formats.llama_tensors import (BLOCK_LINEARS, BLOCK_NORMS, BLOCK_VECTORS, OUTPUT_NORM, ROPE_FREQS,
                                     TOKEN_EMBD)
from ..formats.model_file import ModelFileError, Tensor, read_model
from ..formats.registry import QUANTIZED, WEIGHT_FORMATS
from .activation_policy import choose_activations
from .kv_policy import choose_kv_cache
from .kernels import load_ext
from .options import check_model_options, model_default

_ext = load_ext()

#: The largest head_dim a model may have: the attention scratch of the C forward pass
#: (pyklei_ext/model/pk_llama.c) holds this many floats per head. Python's one place for it.
MAX_HEAD_DIM = 512

# Forwards of at least this many tokens run in a helper thread when called on the main thread,
# so Ctrl-C is seen while the C pass runs (a one-token decode step is short: run directly).
_THREADED_MIN_TOKENS = 2
# verify() runs a draft of at most this many rows directly, as step does: a helper thread per
# call would cost a visible share of a pass that lasts about one decode step.
_VERIFY_DIRECT_ROWS = 32


class SequenceLostError(RuntimeError):
    """A generation tried to continue a KV cache that another call has since used."""


class _Release:
    __slots__ = ("lock",)

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lock.release()
        return False


# (pk_llama_layer field, tensor part) of a block's linears, as the C model takes them
_LINEARS = tuple((s.field, s.part) for s in BLOCK_LINEARS)


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings count once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for c in cpus:
        try:
            base = f"/sys/devices/system/cpu/cpu{c}/topology/"
            cores.add((Path(base + "physical_package_id").read_text().strip(),
                       Path(base + "core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(c)))
    return max(1, len(cores) or (os.cpu_count() or 1))


def _qweight(t: Tensor) -> _ext.QWeight:
    if not WEIGHT_FORMATS[t.format].quantized:
        raise ModelFileError(f"{t.name} is stored as {t.format}; linear weights must be one of "
                             f"{', '.join(QUANTIZED)} (re-convert the model)")
    return _ext.QWeight(t.format, t.qs, t.scales, t.block_size)


def _check_int(name: str, v, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {v!r}")


#: bytes one cached K or V value takes, per kv_cache type (q8: int8 and an f16 scale per 32)
KV_VALUE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8": 1.0 + 2.0 / 32}


class Model:
    def __init__(self, path, n_threads: int | None = None, n_ctx: int | None = None,
                 n_batch: int = model_default("n_batch"), kv_cache: str = model_default("kv_cache"),
                 activations: str = model_default("activations"), n_seq: int = 1):
        """pyklei.runtime.options.MODEL_OPTIONS are the options' rules (n_seq 1 here: a bare model
        serves one sequence unless asked; LLM's default is the table's)."""
        t0 = time.perf_counter()
        check_model_options(n_threads=n_threads, n_ctx=n_ctx, n_batch=n_batch, kv_cache=kv_cache,
                            activations=activations, n_seq=n_seq)
        self.file = read_model(path)
        hp = self.file.hparams
        self.hparams = hp
        if n_ctx is not None and n_ctx > hp.context_length:   # before the KV cache is allocated
            raise ValueError(f"context size {n_ctx} exceeds the model's context length of "
                             f"{hp.context_length} tokens")
        self.n_threads = n_threads or physical_cores()
        self.n_ctx = n_ctx or min(hp.context_length, 4096)
        # qai8dx2: two int8 planes per activation row, ~16-bit precision; qai8dx: one plane
        # (KleidiAI's scheme), half the integer work, close once the file is rotated; qsi8d32:
        # one plane, a scale per block (the "auto" choice on unrotated files; docs/QUALITY.md).
        activations = choose_activations(self.file, activations)
        kv_cache = choose_kv_cache(kv_cache)    # "auto": bf16 where bf16 attention reads it
        self.ops = _ext.Ops(self.n_threads, activations)
        self.activations = activations

        self.released_bytes = 0
        emb = self.file.tensor(TOKEN_EMBD)
        if emb.qs is not None:
            emb_spec = (emb.format, emb.qs, emb.scales, emb.block_size)
        else:
            emb_spec = (emb.format, emb.data, None, 0)
        # The output weight first: it is the largest, and packing holds one weight twice.
        out = self.file.output
        if out.qs is not None:
            self.lm_head = _qweight(out)
            self._release_mapped_pages(self.lm_head, out)
        else:
            # The kernels take quantized weights only: an f16/f32 lm_head is quantized to
            # qsi8cx here, once (n_vocab * n_embd bytes of memory).
            from ..formats import quantize_qsi8cx
            qs, s = quantize_qsi8cx(out.dequantize())
            self.lm_head = _ext.QWeight("qsi8cx", qs, s)
        layers = []
        for i in range(hp.n_layer):
            layer = {s.field: self.file.layer(i, s.part).data for s in BLOCK_NORMS}
            layer.update({s.field: self.file.tensor(s.name(i)).data for s in BLOCK_VECTORS
                          if s.feature in hp.features})
            base = hp.rope_base(i)
            layer.update(window=hp.window(i), rope_theta=base, rope_factor=hp.rope_factor(i),
                         no_rope=int(base == 0.0))
            for key, part in _LINEARS:
                t = self.file.layer(i, part)
                layer[key] = _qweight(t)
                self._release_mapped_pages(layer[key], t)
            layers.append(layer)
        self._layers = layers

        rope_freqs = self.file.tensor(ROPE_FREQS).data if hp.has_rope_freqs else None
        if hp.rope_long_factors and self.n_ctx > hp.rope_long_from:
            # LongRoPE: a context past the original length rotates by the long factors, all
            # of it, as llama.cpp picks them by its context (gguf_keys.KEY_ROPE_LONG_FACTORS)
            rope_freqs = np.asarray(hp.rope_long_factors, np.float32)
        if hp.head_dim > MAX_HEAD_DIM:
            raise ModelFileError(f"{path}: head_dim {hp.head_dim} is larger than pyklei supports "
                                 f"({MAX_HEAD_DIM})")
        rt_hp = dict(n_vocab=hp.vocab_size, n_embd=hp.n_embd, n_layer=hp.n_layer, n_head=hp.n_head,
                     n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_ff=hp.n_ff,
                     rms_eps=hp.rms_eps, rope_theta=hp.rope_theta, n_ctx=self.n_ctx,
                     n_batch=n_batch, kv_cache=kv_cache, n_seq=n_seq, activation=hp.activation,
                     rope_dim=hp.rope_dim, embedding_scale=hp.embedding_scale,
                     attention_scale=hp.attention_scale, logit_softcap=hp.logit_softcap)
        self.runtime = _ext.LlamaRuntime(self.ops, rt_hp, emb_spec, self.lm_head,
                                         self.file.tensor(OUTPUT_NORM).data, rope_freqs,
                                         layers, {k: (r.signs, r.mix) for k, r in
                                                  self.file.rotations.items()})
        self._lock = threading.Lock()        # one evaluation at a time (see the module doc)
        self.n_seq = n_seq
        self.kv_cache = kv_cache
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]   # per slot: tokens whose K/V
                                              # are in the cache, in order (slot 0: _cached)
        # Sliding-window layers whose cache is a ring (pk_llama_ring): (ring, window). A slot
        # whose positions reached _high[s] holds such a layer's positions >= _high[s] - ring
        # only, so it can go back (a shorter prefix reused, a draft rejected) only as far as
        # reusable_prefix says.
        self._rings = [(r, hp.window(l)) for l, r in enumerate(self.runtime.rings) if r]
        self._high = [0] * n_seq
        self._owner = None                    # who last wrote the cache (see "Owners" above)
        self.last_eval_tokens = 0             # tokens the last eval() actually ran
        self.load_seconds = time.perf_counter() - t0

    def _release_mapped_pages(self, w, t: Tensor) -> None:
        """Drops this process's mapped pages of a weight the kernels only read from a repacked
        copy (QWeight.reads_canonical False): packing read them once, and keeping them would
        count the weight twice in RSS. Done weight by weight, so the peak holds one weight
        twice, not the model. The mapping stays valid: a page read again (an embedding row, a
        forced kernel) is faulted back in. Adds to `released_bytes`."""
        if not w.reads_canonical:
            self.released_bytes += self.file.release_pages(t.qs)

    # ---- introspection -----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    @property
    def weights_owned_bytes(self) -> int:
        ws = [self.lm_head] + [l[k] for l in self._layers for k, _ in _LINEARS]
        return sum(w.owned_bytes for w in ws)

    @property
    def state_bytes(self) -> int:
        return self.runtime.state_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes in one slot (K and V of every layer and KV head)."""
        hp = self.hparams
        return round(2 * hp.n_layer * hp.n_head_kv * hp.head_dim * KV_VALUE_BYTES[self.kv_cache])

    @property
    def cached_tokens(self) -> list[int]:
        return list(self._cached)

    @property
    def _cached(self) -> list[int]:
        return self._seqs[0]

    @_cached.setter
    def _cached(self, tokens: list[int]) -> None:
        self._seqs[0] = tokens

    def seq_tokens(self, seq: int) -> list[int]:
        """The tokens whose K/V slot `seq` holds, in position order."""
        self._check_seq(seq)
        return list(self._seqs[seq])

    def _check_seq(self, seq) -> int:
        _check_int("sequence id", seq)
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence id {seq} is outside the model's {self.n_seq} slots "
                             f"[0, {self.n_seq}) (load with a larger n_seq)")
        return int(seq)

    # ---- lifetime ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.runtime is None

    def close(self) -> None:
        """Frees the KV cache, the kernels' weight copies and the file mapping now, rather than
        when the garbage collector gets to them. Later calls raise RuntimeError. Idempotent."""
        if self.runtime is None:
            return
        with self._busy():
            self.runtime = None
            self._layers = []
            self.lm_head = None
            self._seqs = [[] for _ in range(self.n_seq)]
            self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- evaluation --------------------------------------------------------------------
    def reset(self) -> None:
        """Forgets the KV cache contents (every slot)."""
        with self._busy():
            self._seqs = [[] for _ in range(self.n_seq)]
            self._high = [0] * self.n_seq
            self._owner = None

    def reusable_prefix(self, seq: int, n: int) -> int:
        """n when slot `seq` can continue at position n, its first n cached tokens intact;
        else 0. Only a sliding-window layer's ring (Gemma 3, Mistral at a long context) limits
        it: a slot that reached position e no longer holds that layer's positions before
        e - ring, which a row at n attends from n - window + 1 on. Going back fewer than
        n_batch positions is always possible (the ring holds a window and a chunk)."""
        n = min(n, len(self._seqs[seq]))
        if n and any(max(0, n - window + 1) < self._high[seq] - ring for ring, window in self._rings):
            return 0
        return n

    def _cut(self, seq: int, n: int, what: str) -> None:
        """Keeps the first n tokens of slot seq (ValueError naming `what` where a ring lost them)."""
        if n < len(self._seqs[seq]) and self.reusable_prefix(seq, n) != n:
            raise ValueError(f"{what}: slot {seq} cannot go back to position {n}: its sliding-window "
                             f"layers no longer hold the positions a row there attends (at most "
                             f"{self.runtime.n_batch} positions back; reusable_prefix says how far)")
        del self._seqs[seq][n:]
        if n == 0:
            self._high[seq] = 0

    def _writes(self, seq: int, end: int) -> None:
        """Positions up to end of slot seq are (being) written."""
        if end > self._high[seq]:
            self._high[seq] = end

    def _busy(self):
        """Context manager holding the evaluation lock; refuses (RuntimeError) if taken."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("model is busy in another thread (a Model runs one evaluation at a "
                               "time; use one Model per thread or serialise the calls)")
        if self.runtime is None:
            self._lock.release()
            self.check_open()
        return _Release(self._lock)

    def check_open(self) -> None:
        if self.runtime is None:
            raise RuntimeError("the model is closed (close() or the end of its `with` block)")

    def _check(self, tokens, one_sequence: bool = True) -> np.ndarray:
        try:
            toks = np.asarray(tokens).reshape(-1)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tokens must be a sequence of token ids ({e})") from None
        if toks.size and toks.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers in [0, {self.vocab_size}), got "
                             f"{toks.dtype} values")
        if toks.size == 0:
            raise ValueError("no tokens to evaluate")
        if one_sequence and toks.size > self.n_ctx:
            raise ValueError(f"{toks.size} tokens do not fit the context of {self.n_ctx} tokens "
                             f"(load with a larger n_ctx, up to {self.hparams.context_length})")
        bad = (toks < 0) | (toks >= self.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(toks[bad][0])} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return toks.astype(np.int32)

    def _run(self, toks: np.ndarray, pos0: int, all_logits: bool):
        return self._run_c(len(toks), lambda: self.runtime.forward(toks, pos0, all_logits))

    def _run_c(self, n_rows: int, call):
        """call() (a C pass), interruptible by Ctrl-C when called on the main thread."""
        if n_rows < _THREADED_MIN_TOKENS or threading.current_thread() is not threading.main_thread():
            return call()
        box: dict = {}
        # Set by the helper thread once it has left the C pass, whatever happened there. The wait
        # is on this event, never on Thread.join/is_alive: a join interrupted by Ctrl-C can mark
        # a thread that still runs as stopped (CPython 3.10-3.12, threading._wait_for_tstate_lock
        # releases the running thread's lock), and releasing the model then would let the next
        # call run while the interrupted pass still writes into the KV cache and scratch buffers.
        left_c = threading.Event()

        def work():
            try:
                box["out"] = call()
            except BaseException as e:  # handed to the caller below
                box["err"] = e
            finally:
                left_c.set()

        threading.Thread(target=work, name="pyklei-forward", daemon=True).start()
        try:
            while not left_c.wait(0.1):
                pass
        except BaseException:
            # KeyboardInterrupt (or another async exception): stop the C pass at its next
            # layer boundary and wait until it has left, so that nothing still runs on our
            # buffers when the lock is released; further Ctrl-Cs while waiting are absorbed.
            while not left_c.is_set():
                try:
                    self.runtime.request_interrupt()   # repeated: forward() clears it on entry
                    left_c.wait(0.005)
                except BaseException:
                    pass
            raise
        if "err" in box:
            raise box["err"]
        return box["out"]

    def _forward(self, toks: np.ndarray, pos0: int, all_logits: bool):
        self._writes(0, pos0 + toks.size)
        try:
            out = self._run(toks, pos0, all_logits)
        except BaseException:
            self._cached = self._cached[:pos0]   # positions >= pos0 may be half written
            raise
        if out is None:
            self._cached = self._cached[:pos0]
            raise KeyboardInterrupt
        return out

    def eval(self, tokens: Sequence[int], owner: object = None) -> np.ndarray:
        """Logits [n_vocab] after `tokens`, reusing the longest cached prefix: a chat turn
        only runs its new tokens. `owner` (any object) marks the cache as that caller's."""
        with self._busy():
            self._owner = None
            out = self._eval(tokens)
            self._owner = owner
            return out

    def _eval(self, tokens: Sequence[int]) -> np.ndarray:
        toks = self._check(tokens)
        n = 0
        limit = min(len(self._cached), len(toks) - 1)   # at least one token runs for logits
        while n < limit and self._cached[n] == toks[n]:
            n += 1
        n = self.reusable_prefix(0, n)
        self._cut(0, n, "eval")
        logits = self._forward(toks[n:], n, False)
        self._cached.extend(int(t) for t in toks[n:])
        self.last_eval_tokens = len(toks) - n
        return logits

    def step(self, token: int, owner: object = None) -> np.ndarray:
        """Decode one token after the cached ones: logits [n_vocab] (the generation hot path).
        With `owner`, raises SequenceLostError unless that owner's eval/step wrote the cache
        last."""
        with self._busy():
            self._check_owner(owner)
            self._owner = None
            out = self._step(token)
            self._owner = owner
            return out

    def _check_owner(self, owner) -> None:
        if owner is not None and self._owner is not owner:
            raise SequenceLostError(
                "this generation's context is gone: another call used the model since its "
                "last step (a second generation, logits() or reset() on the same model). "
                "Finish or close one generation before starting the next, or load one model "
                "per concurrent generation")

    def _step(self, token: int) -> np.ndarray:
        pos = len(self._cached)
        if pos >= self.n_ctx:
            raise ValueError(f"the context of {self.n_ctx} tokens is full")
        if isinstance(token, (int, np.integer)) and not isinstance(token, bool) and 0 <= token < self.vocab_size:
            tok = np.array([token], np.int32)   # the per-token path, without _check's array work
        else:
            tok = self._check([token])
        logits = self._forward(tok, pos, False)
        self._cached.append(int(tok[0]))
        return logits

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [len(tokens), n_vocab]: logits at every position, computed from scratch."""
        with self._busy():
            self._owner = None
            return self._logits(tokens)

    def _logits(self, tokens: Sequence[int]) -> np.ndarray:
        toks = self._check(tokens)
        self._cut(0, 0, "logits")
        out = self._forward(toks, 0, True)
        self._cached = [int(t) for t in toks]
        return out

    # ---- several sequences ---------------------------------------------------------------
    def batch(self, tokens, seq_ids, positions, logit_rows) -> np.ndarray:
        """Runs row i = token tokens[i] of slot seq_ids[i] at position positions[i], all rows in
        one pass, and returns float32 logits [len(logit_rows), n_vocab] for the rows logit_rows
        (ascending). The rows of a slot are consecutive with consecutive positions starting at
        most at the slot's cached length (starting before it drops the cached tokens from
        there: they are rewritten). A bad id, slot or position is a ValueError, before any work."""
        with self._busy():
            return self._batch(tokens, seq_ids, positions, logit_rows)

    def hidden_states(self, tokens, seq_ids, positions, rows) -> np.ndarray:
        """batch() with the final hidden states in place of logits: float32 [len(rows), n_embd],
        the output of the final RMSNorm for the rows `rows` (the lm_head does not run; a
        rotated file's rotation is undone, so the values are the checkpoint's). Each row's
        values are the same bits whatever else runs in the pass. Embeddings are pooled from
        these (pyklei.runtime.embedding). The same rules and KV cache effects as batch()."""
        with self._busy():
            return self._batch(tokens, seq_ids, positions, rows, hidden=True)

    def _batch(self, tokens, seq_ids, positions, logit_rows, hidden: bool = False) -> np.ndarray:
        toks = self._check(tokens, one_sequence=False)
        arrays = []
        for name, v in (("seq_ids", seq_ids), ("positions", positions), ("logit_rows", logit_rows)):
            a = np.asarray(v).reshape(-1)
            if a.size and a.dtype.kind not in "iu":
                raise ValueError(f"{name} must be integers, got {a.dtype} values")
            if name != "logit_rows" and a.size != toks.size:
                raise ValueError(f"{toks.size} tokens but {a.size} {name}")
            arrays.append(a.astype(np.int64))
        seq, pos, rows = arrays
        if rows.size and (rows.min() < 0 or rows.max() >= toks.size or (np.diff(rows) <= 0).any()):
            raise ValueError(f"logit_rows must be ascending row indices in [0, {toks.size}), got "
                             f"{rows.tolist()}")
        starts = [0] + [i for i in range(1, toks.size) if seq[i] != seq[i - 1]]
        runs = []   # (slot, first row, end row, first position)
        for k, a in enumerate(starts):
            b = starts[k + 1] if k + 1 < len(starts) else toks.size
            s = self._check_seq(int(seq[a]))
            if any(r[0] == s for r in runs):
                raise ValueError(f"the rows of sequence {s} are not consecutive (rows of one "
                                 f"sequence must follow each other)")
            p0 = int(pos[a])
            if not 0 <= p0 <= len(self._seqs[s]):
                raise ValueError(f"sequence {s} starts at position {p0}, but its slot holds "
                                 f"{len(self._seqs[s])} tokens (positions continue from at most there)")
            if (pos[a:b] != np.arange(p0, p0 + b - a)).any():
                raise ValueError(f"the positions of sequence {s} are not consecutive: "
                                 f"{pos[a:b].tolist()}")
            if p0 + (b - a) > self.n_ctx:
                raise ValueError(f"sequence {s} would reach position {p0 + b - a - 1}, beyond the "
                                 f"context of {self.n_ctx} tokens")
            runs.append((s, a, b, p0))
        for s, a, b, p0 in runs:
            self._cut(s, p0, "batch")
            self._writes(s, p0 + b - a)
        if any(r[0] == 0 for r in runs):
            self._owner = None
        call = lambda: self.runtime.forward_batch(toks, seq.astype(np.int32), pos.astype(np.int32),
                                                  rows.astype(np.int32), hidden)
        try:
            out = self._run_c(toks.size, call)
        except BaseException:
            for s, a, b, p0 in runs:   # positions >= p0 may be half written
                self._seqs[s] = self._seqs[s][:p0]
            raise
        for s, a, b, p0 in runs:
            self._seqs[s] = self._seqs[s][:p0] + (toks[a:b].tolist() if out is not None else [])
        if out is None:
            raise KeyboardInterrupt
        return out

    # ---- speculative decoding: check a draft, keep the agreeing prefix --------------------
    def verify(self, tokens: Sequence[int], seq: int = 0, owner: object = None) -> np.ndarray:
        """Runs `tokens` (the last sampled token, then the drafted ones) after the cached tokens
        of slot `seq`, in one pass, and returns float32 logits [len(tokens), n_vocab] for every
        row: row i is what step(tokens[i]) would have given after tokens[:i], bit for bit (the
        kernels give a row the same bits whatever the row count). The slot then holds all of
        `tokens`; truncate_seq drops the rejected tail. `owner` as for step (slot 0 only)."""
        with self._busy():
            seq = self._check_seq(seq)
            if seq == 0:
                self._check_owner(owner)
                self._owner = None
            toks = self._check(tokens)
            pos0 = len(self._seqs[seq])
            if pos0 + toks.size > self.n_ctx:
                raise ValueError(f"verifying {toks.size} tokens after {pos0} would pass the "
                                 f"context of {self.n_ctx} tokens")
            rows = np.arange(toks.size, dtype=np.int32)
            self._writes(seq, pos0 + toks.size)
            # a draft is a few rows: run on this thread, as a decode step does (no helper thread)
            call = lambda: self.runtime.forward_batch(toks, np.full(toks.size, seq, np.int32),
                                                      rows + pos0, rows)
            try:
                out = call() if toks.size <= _VERIFY_DIRECT_ROWS else self._run_c(toks.size, call)
            except BaseException:
                self._seqs[seq] = self._seqs[seq][:pos0]   # positions >= pos0 may be half written
                raise
            if out is None:
                self._seqs[seq] = self._seqs[seq][:pos0]
                raise KeyboardInterrupt
            self._seqs[seq].extend(toks.tolist())
            if seq == 0:
                self._owner = owner
            return out

    def truncate_seq(self, seq: int, n: int, owner: object = None) -> None:
        """Keeps the first n cached tokens of slot `seq` and forgets the rest (a rejected
        draft). Bookkeeping only: the K/V of the forgotten positions stay in memory but are
        never read, since a row at position p attends to positions <= p of its slot, and every
        position after n is written again before any row reads it. `owner` as for step (slot
        0: the owner keeps the cache)."""
        with self._busy():
            seq = self._check_seq(seq)
            _check_int("n", n)
            have = len(self._seqs[seq])
            if not 0 <= n <= have:
                raise ValueError(f"cannot keep {n} positions: slot {seq} holds {have} tokens")
            if seq == 0:
                self._check_owner(owner)
            self._cut(seq, n, "truncate_seq")

    def copy_seq(self, src: int, dst: int, n: int | None = None) -> None:
        """Makes slot dst hold the first n (default: all) cached tokens of slot src, by copying
        their K/V (a shared prefix then runs once)."""
        with self._busy():
            src, dst = self._check_seq(src), self._check_seq(dst)
            have = len(self._seqs[src])
            n = have if n is None else n
            _check_int("n", n)
            if not 0 <= n <= have:
                raise ValueError(f"cannot copy {n} positions: slot {src} holds {have} tokens")
            if self.reusable_prefix(src, n) != n:
                raise ValueError(f"copy_seq: slot {src}'s first {n} positions are no longer whole in its "
                                 f"sliding-window layers (reusable_prefix says how far it can go back)")
            if dst == 0:
                self._owner = None
            self.runtime.kv_copy(src, dst, n)
            self._seqs[dst] = self._seqs[src][:n]
            self._high[dst] = self._high[src] if n else 0

    # ---- a slot's K/V rows out of the cache and back (pyklei.runtime.prefix_cache) ----------
    @property
    def kv_row_block(self) -> int:
        """export_kv / import_kv move positions in units of this many (the K cache's blocks)."""
        return self.runtime.kv_row_block

    def kv_rows_bytes(self, n: int) -> int:
        """Bytes export_kv returns for n positions (n a multiple of kv_row_block)."""
        return self.runtime.kv_rows_bytes(n)

    def export_kv(self, seq: int, a: int, b: int) -> bytes:
        """The K/V of every layer for positions [a, b) of slot `seq`, in the cache's own type
        (f32, f16, bf16, q8 and its scales): bytes that import_kv of this model takes back bit for bit.
        a and b are multiples of kv_row_block, and the slot holds at least b tokens, whose
        positions its sliding-window rings (if any) still keep."""
        with self._busy():
            seq = self._check_seq(seq)
            self._check_rows(a, b)
            if b > len(self._seqs[seq]):
                raise ValueError(f"export_kv: slot {seq} holds {len(self._seqs[seq])} tokens, "
                                 f"not positions up to {b}")
            lost = [ring for ring, _ in self._rings if a < self._high[seq] - ring]
            if lost:
                raise ValueError(f"export_kv: slot {seq}'s sliding-window rings ({lost[0]} "
                                 f"positions) no longer hold position {a}")
            return self.runtime.kv_export(seq, a, b)

    def import_kv(self, seq: int, a: int, tokens: Sequence[int], data) -> None:
        """Makes slot `seq` hold its first a tokens, then `tokens` at positions [a, a + n),
        their K/V written from `data` (export_kv's bytes for those positions): a row after
        them gets the logits, bit for bit, it would after computing them."""
        with self._busy():
            seq = self._check_seq(seq)
            toks = self._check(tokens)
            self._check_rows(a, a + toks.size)
            if a > len(self._seqs[seq]):
                raise ValueError(f"import_kv: slot {seq} holds {len(self._seqs[seq])} tokens; "
                                 f"rows continue from at most there, not from {a}")
            if a + toks.size > self.n_ctx:
                raise ValueError(f"import_kv: positions up to {a + toks.size} pass the context "
                                 f"of {self.n_ctx} tokens")
            self._cut(seq, a, "import_kv")
            if seq == 0:
                self._owner = None
            self._writes(seq, a + toks.size)
            self.runtime.kv_import(seq, a, a + toks.size, memoryview(data).cast("B"))
            self._seqs[seq].extend(toks.tolist())

    def _check_rows(self, a, b) -> None:
        _check_int("a", a)
        _check_int("b", b)
        blk = self.kv_row_block
        if not 0 <= a <= b or a % blk or b % blk:
            raise ValueError(f"K/V rows move in units of {blk} positions: [{a}, {b}) is not "
                             f"one (both ends multiples of {blk}, a <= b)")
