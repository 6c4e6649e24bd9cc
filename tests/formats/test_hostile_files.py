"""Hostile model files, hand-made, each with its exact error (formats/test_fuzz_loader.py's
fuzzer finds the rest), files that are not regular files, and how fast a large vocabulary's
metadata reads."""
from __future__ import annotations

import struct
import time

import pytest

from child_watch import TIME_SCALE
from paths import SEED, VOCAB_DIR
from pyklei.formats.gguf_reader import GGUFError, read_gguf
from pyklei.formats.model_file import ModelFileError, read_model


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
    vocab = VOCAB_DIR / "ggml-vocab-llama-bpe.gguf"
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
