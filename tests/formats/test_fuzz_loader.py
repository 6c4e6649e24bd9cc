"""Fuzzing the model loader: mutated pyklei GGUF files must fail with a ValueError, never crash.

Inputs are mutations of the small real model files in tests/fixtures/fuzz_corpus/ (seed-*.gguf, made by
tests/fixtures/fuzz_corpus/make_seeds.py; crash-*.gguf are minimized regressions): byte flips, runs of
random bytes, truncations, inserted and deleted bytes, and "structured" mutations that set a
GGUF header field (counts, string/array lengths, value types, tensor dims/types/offsets, u32
hyperparameter values) to an interesting value (0, 1, 2^31, 2^32-1, 2^63, 2^64-1, the file
size...). For each input:

- pyklei.formats.model_file.read_model and the tokenizer's read_gguf_metadata may only raise
  ValueError (GGUFError, ModelFileError, TokenizerError) or OSError;
- a file that read_model accepts is loaded into a Model (the C runtime) and runs a 2-token
  forward pass, which may only raise ValueError: this is what proves the C side never reads
  outside the file (every array it gets is a bounds-checked view of the map).

Anything else (a crash, MemoryError, RecursionError, OverflowError, TypeError...) fails.

CI runs a bounded, derandomized session (PYKLEI_FUZZ_EXAMPLES, default 250; a time budget of
PYKLEI_FUZZ_SECONDS, default 40 s). A longer, random session:

    PYKLEI_FUZZ_EXAMPLES=100000 PYKLEI_FUZZ_SECONDS=300 PYKLEI_FUZZ_RANDOM=1 \\
        python tests/formats/test_fuzz_loader.py

prints how many inputs ran and how they ended, and saves any failing input (shrunk by
hypothesis) as tests/fixtures/fuzz_corpus/crash-<sha>.gguf, to be kept as a regression.
"""
from __future__ import annotations

import collections
import hashlib
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paths import FUZZ_CORPUS

CORPUS = FUZZ_CORPUS
SEEDS = sorted(CORPUS.glob("seed-*.gguf"))
CRASHERS = sorted(CORPUS.glob("crash-*.gguf"))
EXAMPLES = int(os.environ.get("PYKLEI_FUZZ_EXAMPLES", "250"))
BUDGET = float(os.environ.get("PYKLEI_FUZZ_SECONDS", "40"))
RANDOM = bool(os.environ.get("PYKLEI_FUZZ_RANDOM"))

STATS: collections.Counter = collections.Counter()
_WORK = Path(tempfile.mkdtemp(prefix="pyklei_fuzz_"))


# ---------------------------------------------------------------------------------------------
# The seeds' structure: offsets of every GGUF header field (an independent little walker)
# ---------------------------------------------------------------------------------------------

def gguf_fields(raw: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, what) of the header fields of a well-formed GGUF file."""
    out = [(4, 4, "version"), (8, 8, "n_tensors"), (16, 8, "n_kv")]
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    o = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(o, what):
        out.append((o, 8, what + ".len"))
        n = struct.unpack_from("<Q", raw, o)[0]
        return o + 8 + n

    for _ in range(n_kv):
        o = string(o, "key")
        vt = struct.unpack_from("<I", raw, o)[0]
        out.append((o, 4, "value_type"))
        o += 4
        if vt in sizes:
            if sizes[vt] in (4, 8):
                out.append((o, sizes[vt], "value"))
            o += sizes[vt]
        elif vt == 8:
            o = string(o, "value")
        else:   # array
            et, n = struct.unpack_from("<IQ", raw, o)
            out += [(o, 4, "array.type"), (o + 4, 8, "array.len")]
            o += 12
            if et == 8:
                for i in range(n):
                    o = string(o, "array.str") if i < 4 else o + 8 + struct.unpack_from("<Q", raw, o)[0]
            else:
                o += n * sizes[et]
    for _ in range(n_tensors):
        o = string(o, "tensor.name")
        nd = struct.unpack_from("<I", raw, o)[0]
        out.append((o, 4, "tensor.n_dims"))
        o += 4
        for _ in range(nd):
            out.append((o, 8, "tensor.dim"))
            o += 8
        out += [(o, 4, "tensor.type"), (o + 4, 8, "tensor.offset")]
        o += 12
    return out


SEED_BYTES = [p.read_bytes() for p in SEEDS]
SEED_FIELDS = [gguf_fields(b) for b in SEED_BYTES]
HEADER_END = [max(o + n for o, n, _ in f) for f in SEED_FIELDS]


def interesting(size: int, n_file: int) -> list[int]:
    top = (1 << (8 * size)) - 1
    vals = {0, 1, 2, 3, 7, 8, 31, 32, 63, 64, 255, 4096, n_file, n_file - 1, n_file + 1,
            top, top - 1, top >> 1, (top >> 1) + 1, 1 << (8 * size - 2)}
    if size == 8:
        vals |= {1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40}
    return sorted(v for v in vals if 0 <= v <= top)


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------

@st.composite
def mutated_file(draw) -> bytes:
    i = draw(st.integers(0, len(SEEDS) - 1))
    data = bytearray(SEED_BYTES[i])
    fields, hdr = SEED_FIELDS[i], HEADER_END[i]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["field", "field", "field", "flip", "flip", "bytes",
                                     "truncate", "insert", "delete"]))
        n = len(data)
        if n == 0:
            break
        # most mutations hit the header (metadata + tensor infos), where the parser works
        limit = min(n, hdr) if draw(st.integers(0, 9)) < 8 else n
        pos = draw(st.integers(0, max(limit - 1, 0)))
        if kind == "field":
            off, size, _what = draw(st.sampled_from(fields))
            if off + size <= n:
                v = draw(st.sampled_from(interesting(size, n)) | st.integers(0, (1 << (8 * size)) - 1))
                data[off:off + size] = v.to_bytes(size, "little")
        elif kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "bytes":
            b = draw(st.binary(min_size=1, max_size=16))
            data[pos:pos + len(b)] = b
        elif kind == "truncate":
            del data[draw(st.integers(0, n - 1)):]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        else:
            del data[pos:pos + draw(st.integers(1, 64))]
    return bytes(data)


# ---------------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------------

def check_file(path: Path) -> str:
    """Loads `path` every way pyklei does; returns how it ended ("rejected: ..." / "ran").
    Lets through only ValueError/OSError from the loaders and the runtime."""
    from pyklei.formats.model_file import read_model
    from pyklei.runtime.model import Model
    from pyklei.text.tokenizer import read_gguf_metadata

    try:
        read_gguf_metadata(path, prefixes=("tokenizer.", "general.architecture"))
    except (ValueError, OSError):
        pass
    try:
        mf = read_model(path)
    except (ValueError, OSError) as e:
        return "rejected: " + type(e).__name__
    del mf
    try:
        model = Model(path, n_threads=1, n_ctx=8, n_batch=2)
    except ValueError:
        return "model refused"
    toks = [0, min(1, model.vocab_size - 1)]
    try:
        model.eval(toks)
    except ValueError:
        return "forward refused"
    return "ran"


def _run_one(data: bytes) -> None:
    if time.monotonic() - _T0[0] > BUDGET:
        STATS["skipped (time budget)"] += 1
        return
    path = _WORK / "input.gguf"      # survives a crash: the last input is the crasher
    path.write_bytes(data)
    try:
        outcome = check_file(path)
    except BaseException:
        if os.environ.get("PYKLEI_FUZZ_SAVE"):
            h = hashlib.sha256(data).hexdigest()[:12]
            (CORPUS / f"crash-{h}.gguf").write_bytes(data)
        raise
    STATS["inputs"] += 1
    STATS[outcome.split(":")[0] if outcome.startswith("rejected") else outcome] += 1


_T0 = [time.monotonic()]
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                     suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.mark.skipif(not SEEDS, reason="no seed files in tests/fixtures/fuzz_corpus")
def test_seeds_are_valid_and_run():
    for p in SEEDS:
        assert check_file(p) == "ran", p


@pytest.mark.parametrize("path", CRASHERS, ids=[p.name for p in CRASHERS])
def test_regressions(path):
    check_file(path)


@pytest.mark.skipif(not SEEDS, reason="no seed files in tests/fixtures/fuzz_corpus")
def test_fuzz_loader():
    _T0[0] = time.monotonic()
    STATS.clear()

    @_SETTINGS
    @given(mutated_file())
    def fuzz(data):
        _run_one(data)

    fuzz()
    print(f"\nfuzz: {dict(STATS)} in {time.monotonic() - _T0[0]:.1f} s")
    assert STATS["inputs"] > 0


if __name__ == "__main__":   # a long session (see the module doc): random batches until the budget
    t0 = time.monotonic()
    total: collections.Counter = collections.Counter()
    batch = settings(_SETTINGS, max_examples=min(EXAMPLES, 500), derandomize=False)

    @batch
    @given(mutated_file())
    def fuzz_batch(data):
        _run_one(data)

    try:
        while time.monotonic() - t0 < BUDGET and total["inputs"] < EXAMPLES:
            STATS.clear()
            fuzz_batch()
            total.update(STATS)
            print(f"[{time.monotonic() - t0:5.0f} s] {dict(total)}", file=sys.stderr, flush=True)
    finally:
        total.update(STATS) if not total else None
        print(f"{total['inputs']} inputs in {time.monotonic() - t0:.0f} s: {dict(total)}", file=sys.stderr)
