"""llama.cpp GGUF files of the families pyklei runs (pyklei/formats/families.py) -> a ModelSource.

Tensors of every type the `gguf` package can dequantize (F32, F16, BF16, Q4_0 ... Q8_0, the
K-quants, the IQ types) are dequantized with `gguf.quants.dequantize` (row chunk by row chunk).
A Llama file's q/k rows are already in the interleaved order pyklei's RoPE rotates; the other
families' are in rotate-half order, permuted here as the HF converter permutes them. llama.cpp
stores Gemma's RMSNorm gains as 1 + w already, which is what pyklei's files hold. What llama.cpp
keeps as rules of a family rather than in the file (Gemma 3's pattern of sliding-window layers
and their RoPE base, its linear RoPE scaling on the global layers alone, its GeGLU and
embedding scale) becomes the file's own keys here (_family_kv). Re-quantizing a quantized file
adds pyklei's rounding error to the one the file already has: the conversion summary says so.
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
from pyklei.formats.end_of_generation import EOS_ID_KEYS, end_of_generation_ids, turn_token_id
from pyklei.formats.families import FAMILIES, family
from pyklei.formats.gguf_keys import TOKEN_CONTROL

from .core import ModelSource, SourceTensor
from .errors import ConversionError
from .hf_llama import permute_qk_rows

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
    """eot/eom_token_id (when absent, found by the token's text) and pyklei.eos_token_ids, by
    the one end-of-generation rule (pyklei.formats.end_of_generation)."""
    if "tokenizer.ggml.tokens" not in fields or K.KEY_EOS_IDS in fields:
        return []
    meta = {key: fields[key].contents() for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                    *EOS_ID_KEYS) if key in fields}
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_CONTROL] * len(meta["tokenizer.ggml.tokens"])
    out = []
    for role in ("eot", "eom"):
        key = f"tokenizer.ggml.{role}_token_id"
        if key not in meta:
            i = turn_token_id(meta["tokenizer.ggml.tokens"], types, role)
            if i is not None:
                meta[key] = i
                out.append((key, i, T.UINT32, None))
    ids = end_of_generation_ids(meta)
    if ids:
        out.append((K.KEY_EOS_IDS, ids, T.ARRAY, T.UINT32))
    return out


# The llama.cpp architectures imported (families.py names): Mistral's llama.cpp files say
# "llama"; SmolLM3's and Phi-3's keep rules this importer does not know yet.
GGUF_ARCHS = tuple(a for a in FAMILIES if a not in ("mistral", "smollm3", "phi3"))
# llama.cpp's Gemma 3 rules (src/llama-model.cpp): every 6th layer attends globally, the
# others a sliding window with RoPE base 10000 and no RoPE scaling; GeGLU; embeddings times
# sqrt(n_embd).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _linear_factor(arch: str, fields, path) -> float:
    """The linear RoPE scaling factor of a llama.cpp file (1.0: none), as llama.cpp reads it:
    rope.scaling.factor, or the older rope.scale_linear; 0 means none. Any other scaling is
    refused."""
    tkey, fkey = K.arch_key(arch, K.LLAMACPP_ROPE_SCALING_TYPE), K.arch_key(arch, K.LLAMACPP_ROPE_SCALING_FACTOR)
    for key in fields:
        if key.startswith(f"{arch}.rope.scaling.") and key not in (tkey, fkey):
            raise ConversionError(f"{path}: unsupported feature: RoPE scaling ({key}) in a "
                                  f"{arch} file")
    kind = fields[tkey].contents() if tkey in fields else "linear"
    old = f"{arch}.rope.scale_linear"
    key = fkey if fkey in fields else old if old in fields else None
    factor = float(fields[key].contents()) if key else 0.0
    if factor == 0.0 or (kind == "none" and factor == 1.0):
        return 1.0
    if kind != "linear" or not (0.0 < factor < float("inf")):
        raise ConversionError(f"{path}: unsupported feature: RoPE scaling {kind!r} with factor "
                              f"{factor:g} ({key}; pyklei imports 'linear' with a positive factor)")
    return factor


def _family_kv(arch: str, fields, n_layer: int, n_embd: int, head_dim: int, path) -> list:
    """The family hyperparameters (gguf_keys) of a llama.cpp file, which llama.cpp keeps as
    rules of the architecture; refuses what the rules here do not cover. Linear RoPE scaling:
    llama.cpp scales every layer, Gemma 3's global layers only."""
    factor = _linear_factor(arch, fields, path)
    if arch != "gemma3":
        return ([] if factor == 1.0 else
                [(K.KEY_LAYER_ROPE_FACTOR, [factor] * n_layer, T.ARRAY, T.FLOAT32)])
    window_key = f"{arch}.attention.sliding_window"
    if window_key not in fields:
        raise ConversionError(f"{path} lacks {window_key!r}")
    window = int(fields[window_key].contents())
    base = float(fields[K.arch_key(arch, K.ROPE_FREQ_BASE)].contents())
    local = [(i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(n_layer)]
    kv = [
        (K.KEY_LAYER_WINDOW, [window if lo else 0 for lo in local], T.ARRAY, T.UINT32),
        (K.KEY_LAYER_ROPE_BASE, [GEMMA3_LOCAL_ROPE_BASE if lo else base for lo in local],
         T.ARRAY, T.FLOAT32),
        (K.KEY_ACTIVATION, "gelu_tanh", T.STRING, None),
        (K.KEY_EMBEDDING_SCALE, float(np.float32(n_embd ** 0.5)), T.FLOAT32, None),
    ]
    if factor != 1.0:
        kv.append((K.KEY_LAYER_ROPE_FACTOR, [1.0 if lo else factor for lo in local],
                   T.ARRAY, T.FLOAT32))
    return kv


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
    fam = family(arch)
    if fam is None or arch in ("mistral", "smollm3", "phi3"):
        raise ConversionError(f"unsupported architecture {arch!r} in {path}; pyklei imports "
                              f"llama.cpp files of {', '.join(GGUF_ARCHS)}")
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
        key = K.arch_key(arch, key)
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
    rope_dim = int(num(K.ROPE_DIM, head_dim))
    by_name = {t.name: t for t in r.tensors}
    if K.TOKEN_EMBD not in by_name:
        raise ConversionError(f"{path} has no {K.TOKEN_EMBD}")
    vocab = int(by_name[K.TOKEN_EMBD].shape[1])
    if K.arch_key(arch, K.VOCAB_SIZE) not in fields:
        kv.append((K.arch_key(arch, K.VOCAB_SIZE), vocab, T.UINT32, None))
    kv += _family_kv(arch, fields, n_layer, n_embd, head_dim, path)
    dims = L.Dims(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                  n_head_kv=n_head_kv, head_dim=head_dim, tied=K.OUTPUT not in by_name,
                  has_rope_freqs=K.ROPE_FREQS in by_name, features=fam.features)
    expect = {name: (spec.shape(dims), spec.kind) for name, spec, _ in L.for_each_tensor(dims)}
    heads = {name: spec.head_count(dims) if fam.gguf_neox else 0
             for name, spec, _ in L.for_each_tensor(dims)}
    for t in r.tensors:
        if t.name not in expect:
            raise ConversionError(f"{path}: unsupported tensor {t.name} (not part of a {arch} model "
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

        if heads[gname]:   # rotate-half rows -> interleaved pairs: the whole tensor at once
            def read(r0, r1, plain=read, shape=shape, n=heads[gname]):
                return permute_qk_rows(plain(0, shape[0]), n, rope_dim)[r0:r1]
        tensors.append(SourceTensor(gname, shape, kind, read, gname, whole=bool(heads[gname])))
    # The table's order, except that a block's norms come before its linears: the order
    # imported files have always had (kept, so that a re-conversion stays byte-identical).
    pos = {name: j for j, name in enumerate(expect)}

    def import_rank(s: SourceTensor):
        layer = L.parse_name(s.name)[1]
        block_start = pos[L.BLOCK[0].name(layer)] if layer is not None else pos[s.name]
        return block_start, s.kind not in (L.NORM, L.HEAD_NORM, L.BIAS), pos[s.name]
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
