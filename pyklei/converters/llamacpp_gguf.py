"""llama.cpp GGUF files of llama models -> a ModelSource.

Tensors of every type the `gguf` package can dequantize (F32, F16, BF16, Q4_0 ... Q8_0, the
K-quants, the IQ types) are dequantized with `gguf.quants.dequantize` (row chunk by row chunk);
q/k are already in llama.cpp's order. Re-quantizing a quantized file adds pyklei's rounding
error to the one the file already has: the conversion summary says so.
Metadata keys are copied with their types, except those describing llama.cpp's own storage
(general.file_type, general.quantization_version, general.alignment, split.*).
"""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import GGUFValueType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L

from .core import ModelSource, SourceTensor
from .errors import ConversionError

PLAIN_TYPES = (Q.F32, Q.F16, Q.BF16)


def _dequantizable(qtype: Q) -> bool:
    """Whether the installed gguf package dequantizes qtype: one zero block, tried once."""
    if qtype in PLAIN_TYPES:
        return True
    if qtype not in _CAN:
        try:
            block, nbytes = GGML_QUANT_SIZES[qtype]
            _CAN[qtype] = dequantize(np.zeros((1, nbytes), np.uint8), qtype).size == block
        except (KeyError, NotImplementedError, ValueError):
            _CAN[qtype] = False
    return _CAN[qtype]


_CAN: dict = {}
DROPPED_KEYS = ("general.file_type", "general.quantization_version", "general.alignment")


def _field_value(f):
    v = f.contents()
    if f.types and f.types[0] == T.ARRAY and f.types[-1] == T.UINT8 and len(f.types) == 2:
        return bytes(v)
    return v


def _eos_kv(fields) -> list:
    """eot_token_id (when absent, found by the token's text) and pyklei.eos_token_ids."""
    from .hf_tokenizer import EOM_TEXTS, EOT_TEXTS

    if "tokenizer.ggml.tokens" not in fields or K.KEY_EOS_IDS in fields:
        return []
    tokens = fields["tokenizer.ggml.tokens"].contents()
    index = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    out, ids = [], []
    for key, texts in (("eos", ()), ("eot", EOT_TEXTS), ("eom", EOM_TEXTS)):
        f = fields.get(f"tokenizer.ggml.{key}_token_id")
        i = int(f.contents()) if f is not None else next((index[t] for t in texts if t in index), None)
        if i is None:
            continue
        if f is None:
            out.append((f"tokenizer.ggml.{key}_token_id", i, T.UINT32, None))
        if i not in ids:
            ids.append(i)
    if ids:
        out.append((K.KEY_EOS_IDS, ids, T.ARRAY, T.UINT32))
    return out


def gguf_source(path, name: str | None = None) -> ModelSource:
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"missing input file: {path}")
    try:
        r = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors on corrupt files
        raise ConversionError(f"{path}: not a readable GGUF file ({e})") from None
    fields = r.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if K.KEY_FORMAT_VERSION in fields:
        raise ConversionError(f"{path} is already a pyklei model file")
    if arch != "llama":
        raise ConversionError(f"unsupported architecture {arch!r} in {path}; only 'llama'")
    kv = []
    for key, f in fields.items():
        if key.startswith("GGUF.") or key.startswith("split.") or key in DROPPED_KEYS:
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == T.ARRAY else None
        if vtype == T.ARRAY and len(f.types) > 2:
            raise ConversionError(f"{path}: nested array key {key!r} is not supported")
        kv.append((key, _field_value(f), vtype, sub))

    def num(key, default=None):
        if key in fields:
            return fields[key].contents()
        if default is None:
            raise ConversionError(f"{path} lacks metadata key {key!r}")
        return default

    n_embd, n_layer = int(num(K.EMBEDDING_LENGTH)), int(num(K.BLOCK_COUNT))
    n_head = int(num(K.HEAD_COUNT))
    n_head_kv = int(num(K.HEAD_COUNT_KV, n_head))
    head_dim = int(num(K.KEY_LENGTH, n_embd // n_head))
    n_ff = int(num(K.FEED_FORWARD_LENGTH))
    by_name = {t.name: t for t in r.tensors}
    if K.TOKEN_EMBD not in by_name:
        raise ConversionError(f"{path} has no {K.TOKEN_EMBD}")
    vocab = int(by_name[K.TOKEN_EMBD].shape[1])
    if K.VOCAB_SIZE not in fields:
        kv.append((K.VOCAB_SIZE, vocab, T.UINT32, None))
    dims = L.Dims(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                  n_head_kv=n_head_kv, head_dim=head_dim, tied=K.OUTPUT not in by_name,
                  has_rope_freqs=K.ROPE_FREQS in by_name)
    expect = {name: (spec.shape(dims), spec.kind) for name, spec, _ in L.for_each_tensor(dims)}
    for t in r.tensors:
        if t.name not in expect:
            raise ConversionError(f"{path}: unsupported tensor {t.name} (not part of a llama model "
                                  f"with {n_layer} blocks)")
    data = getattr(r.data, "_mmap", None)

    def drop_pages():
        # The reader maps the whole file; tell the kernel we are done with the pages read
        # so far, so resident memory stays at a chunk (pages stay in the page cache).
        if data is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                data.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    tensors = []
    requantized: set[str] = set()
    for gname, (shape, kind) in expect.items():
        if gname not in by_name:
            raise ConversionError(f"{path} lacks tensor {gname}")
        t = by_name[gname]
        lshape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if lshape != shape:
            raise ConversionError(f"{path}: {gname} has shape {list(lshape)}, the metadata "
                                  f"implies {list(shape)}")
        if not _dequantizable(t.tensor_type):
            raise ConversionError(
                f"{path}: tensor {gname} has type {t.tensor_type.name}, which the installed gguf "
                f"package cannot dequantize")
        if t.tensor_type not in PLAIN_TYPES:
            requantized.add(t.tensor_type.name)

        def read(r0, r1, t=t, shape=shape):
            raw = np.asarray(t.data[r0:r1] if len(shape) > 1 else t.data)
            if t.tensor_type == Q.BF16:
                out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                out = dequantize(raw, t.tensor_type)
            if len(shape) == 1:
                return np.asarray(out, np.float32).reshape(shape)[r0:r1]
            return np.asarray(out, np.float32).reshape((r1 - r0,) + shape[1:])

        tensors.append(SourceTensor(gname, shape, kind, read, gname))
    # The table's order, except that a block's norms come before its linears: the order
    # imported files have always had (kept, so that a re-conversion stays byte-identical).
    pos = {name: j for j, name in enumerate(expect)}

    def import_rank(s: SourceTensor):
        layer = L.parse_name(s.name)[1]
        block_start = pos[L.BLOCK[0].name(layer)] if layer is not None else pos[s.name]
        return block_start, s.kind != L.NORM, pos[s.name]
    tensors.sort(key=import_rank)
    kv += _eos_kv(fields)
    kv.append((K.KEY_SOURCE, "gguf", T.STRING, None))
    notes = []
    if requantized:
        notes.append(f"the source is already quantized ({', '.join(sorted(requantized))}): "
                     f"re-quantizing adds pyklei's rounding error to the file's own; convert "
                     f"from the original (Hugging Face) weights for the best quality")
    return ModelSource(kv=kv, tensors=tensors, description=f"{path} (llama.cpp GGUF)",
                       after_tensor=drop_pages, notes=notes)
