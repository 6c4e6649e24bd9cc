"""llama.cpp GGUF files of the families pyklei runs (pyklei/formats/families.py) -> a ModelSource.

Tensors of every type the `gguf` package can dequantize (F32, F16, BF16, Q4_0 ... Q8_0, the
K-quants, the IQ types) are dequantized with `gguf.quants.dequantize` (row chunk by row chunk).
A Llama or SmolLM3 file's q/k rows are already in the interleaved order pyklei's RoPE rotates;
the other families' are in rotate-half order, permuted here as the HF converter permutes them.
llama.cpp stores Gemma's RMSNorm gains as 1 + w already, which is what pyklei's files hold, and
Phi-3's projections fused (attn_qkv, and ffn_up holding gate and up: Family.gguf_fused), split
here. What llama.cpp keeps as rules of a family rather than in the file (Gemma 3's pattern of
sliding-window layers and their RoPE base, its linear RoPE scaling on the global layers alone,
its GeGLU and embedding scale; SmolLM3's layers without RoPE) becomes the file's own keys here
(_family_kv); Phi-3's LongRoPE (its factors and attention factor) is folded as the HF converter
folds it (hf_config.fold_longrope). llama.cpp writes a Mistral checkpoint as a "llama" file,
without its sliding window, and runs it so: it is imported as the Llama it says it is.
Re-quantizing a quantized file adds pyklei's rounding error to the one the file already has:
the conversion summary says so.
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
from .hf_config import fold_longrope, rope_scaling_kv
from .hf_llama import permute_qk_rows, scale_rotated_rows

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


# The llama.cpp architectures imported (families.py names): llama.cpp files a Mistral checkpoint
# as "llama" (convert_hf_to_gguf.py), so no llama.cpp file says "mistral".
GGUF_ARCHS = tuple(a for a in FAMILIES if a != "mistral")
# llama.cpp's Gemma 3 rules (src/llama-model.cpp): every 6th layer attends globally, the
# others a sliding window with RoPE base 10000 and no RoPE scaling; GeGLU; embeddings times
# sqrt(n_embd).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp's SmolLM3 rule (src/models/smollm3.cpp, not in the file): every 4th layer has no
# RoPE, as SmolLM3-3B's no_rope_layers
SMOLLM3_NO_ROPE_EVERY = 4
# Phi-3's LongRoPE in a llama.cpp file (convert_hf_to_gguf.py's Phi3MiniModel): both factor sets
# as tensors, the attention factor and the original context as keys
PHI3_LONG, PHI3_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
PHI3_ROPE_KEYS = ("phi3.rope.scaling.attn_factor", "phi3.rope.scaling.original_context_length")


def _linear_factor(arch: str, fields, path) -> float:
    """The linear RoPE scaling factor of a llama.cpp file (1.0: none), as llama.cpp reads it:
    rope.scaling.factor, or the older rope.scale_linear; 0 means none. Any other scaling key
    is refused (Phi-3's LongRoPE keys are _phi3_longrope's)."""
    tkey, fkey = K.arch_key(arch, K.LLAMACPP_ROPE_SCALING_TYPE), K.arch_key(arch, K.LLAMACPP_ROPE_SCALING_FACTOR)
    # Phi-3 scales by LongRoPE alone
    allowed = (tkey, *PHI3_ROPE_KEYS) if arch == "phi3" else (tkey, fkey)
    for key in fields:
        if key.startswith(f"{arch}.rope.scaling.") and key not in allowed:
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


def _family_kv(arch: str, fields, n_layer: int, n_embd: int, head_dim: int, path,
               context: int = 0) -> list:
    """The family hyperparameters (gguf_keys) of a llama.cpp file, which llama.cpp keeps as
    rules of the architecture; refuses what the rules here do not cover. Linear RoPE scaling:
    llama.cpp scales every layer, Gemma 3's global layers only. context: the file's context
    length as imported (Phi-3's window is none at or beyond it)."""
    factor = _linear_factor(arch, fields, path)
    every = [] if factor == 1.0 else [(K.KEY_LAYER_ROPE_FACTOR, [factor] * n_layer, T.ARRAY, T.FLOAT32)]
    if arch == "smollm3":
        return _smollm3_kv(fields, n_layer, path) + every
    if arch == "phi3":
        return _phi3_kv(fields, n_layer, context, path) + every
    if arch != "gemma3":
        return every
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


def _smollm3_kv(fields, n_layer: int, path) -> list:
    """SmolLM3: RoPE base 0 (none) on llama.cpp's no-RoPE layers. llama.cpp's smollm3 has no
    sliding window; a file that names one is refused (which layers it meant is not known)."""
    window_key = "smollm3.attention.sliding_window"
    if window_key in fields and int(fields[window_key].contents()):
        raise ConversionError(f"{path}: unsupported feature: {window_key} in a smollm3 file "
                              f"(llama.cpp's smollm3 has no sliding window)")
    base = float(fields[K.arch_key("smollm3", K.ROPE_FREQ_BASE)].contents()) \
        if K.arch_key("smollm3", K.ROPE_FREQ_BASE) in fields else 10000.0
    bases = [base if (i + 1) % SMOLLM3_NO_ROPE_EVERY else 0.0 for i in range(n_layer)]
    return [(K.KEY_LAYER_ROPE_BASE, bases, T.ARRAY, T.FLOAT32)] if 0.0 in bases else []


def _phi3_kv(fields, n_layer: int, context: int, path) -> list:
    """Phi-3: its sliding window (0: none) on every layer, as transformers' Phi3 applies it
    (llama.cpp disables it), none where it reaches the context; only LongRoPE scaling."""
    kind_key = "phi3.rope.scaling.type"
    if kind_key in fields and fields[kind_key].contents() not in ("longrope", "none"):
        raise ConversionError(f"{path}: unsupported feature: {kind_key} = "
                              f"{fields[kind_key].contents()!r} (pyklei imports 'longrope')")
    window_key = "phi3.attention.sliding_window"
    window = int(fields[window_key].contents()) if window_key in fields else 0
    return ([(K.KEY_LAYER_WINDOW, [window] * n_layer, T.ARRAY, T.UINT32)]
            if 0 < window < context else [])


def _phi3_longrope(fields, by_name, rope_dim: int, context: int, path) -> dict | None:
    """A Phi-3 file's LongRoPE as hf_config.fold_longrope keeps it (rope_factors, qk_rope_gain,
    context_length, notes), or None where the file has no factors."""
    if PHI3_LONG not in by_name and PHI3_SHORT not in by_name:
        return None
    for name in (PHI3_SHORT, PHI3_LONG):
        if name not in by_name:
            raise ConversionError(f"{path}: LongRoPE without tensor {name}")
    orig_key = "phi3.rope.scaling.original_context_length"
    if orig_key not in fields:
        raise ConversionError(f"{path}: LongRoPE factors without {orig_key!r}")
    af_key = "phi3.rope.scaling.attn_factor"
    # llama.cpp's default, as its loader reads the key (hparams.rope_attn_factor)
    af = float(fields[af_key].contents()) if af_key in fields else 1.0
    short, long = (np.asarray(dequantize(np.asarray(by_name[n].data), by_name[n].tensor_type),
                              np.float32).reshape(-1) for n in (PHI3_SHORT, PHI3_LONG))
    rope = dict(rope_dim=rope_dim, context_length=context, notes=[])
    fold_longrope(rope, short, af, int(fields[orig_key].contents()), f"{path}: rope_factors_{{}}.weight",
                  long=long)
    return rope


def _fused_sources(fam, by_name, n_layer: int, dims) -> dict:
    """{tensor of the table: (the file's fused tensor holding it, its first row)} for the
    family's fused tensors (Family.gguf_fused) the file holds: those whose rows are their
    parts' sum."""
    shapes = {name: spec.shape(dims) for name, spec, _ in L.for_each_tensor(dims)}
    out = {}
    for i in range(n_layer):
        for fused, parts in fam.gguf_fused.items():
            t = by_name.get(L.blk(i, fused))
            names = [L.blk(i, p) for p in parts]
            if t is None or any(n not in shapes for n in names):
                continue
            if int(t.shape[-1]) == sum(shapes[n][0] for n in names):
                row = 0
                for n in names:
                    out[n] = (t, row)
                    row += shapes[n][0]
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
    fam = family(arch)
    if fam is None or arch not in GGUF_ARCHS:
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
    context = int(num(K.CONTEXT_LENGTH, 2048))
    by_name = {t.name: t for t in r.tensors}
    if K.TOKEN_EMBD not in by_name:
        raise ConversionError(f"{path} has no {K.TOKEN_EMBD}")
    vocab = int(by_name[K.TOKEN_EMBD].shape[1])
    if K.arch_key(arch, K.VOCAB_SIZE) not in fields:
        kv.append((K.arch_key(arch, K.VOCAB_SIZE), vocab, T.UINT32, None))
    longrope = _phi3_longrope(fields, by_name, rope_dim, context, path) if arch == "phi3" else None
    notes = []
    if longrope:
        # the file says what pyklei's HF conversion says: the context of the short factors,
        # the attention factor folded into q/k (so not kept as llama.cpp's key)
        context = longrope["context_length"]
        notes += longrope["notes"]
        kv = [(k, context if k == K.arch_key(arch, K.CONTEXT_LENGTH) else v, vt, sub)
              for k, v, vt, sub in kv if k not in PHI3_ROPE_KEYS]
        kv += rope_scaling_kv("longrope", int(fields[PHI3_ROPE_KEYS[1]].contents()),
                              longrope.get("rope_long_factors"))
    kv += _family_kv(arch, fields, n_layer, n_embd, head_dim, path, context=context)
    dims = L.Dims(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                  n_head_kv=n_head_kv, head_dim=head_dim, tied=K.OUTPUT not in by_name,
                  has_rope_freqs=K.ROPE_FREQS in by_name or longrope is not None,
                  features=fam.features)
    expect = {name: (spec.shape(dims), spec.kind) for name, spec, _ in L.for_each_tensor(dims)}
    heads = {name: spec.head_count(dims) if fam.gguf_neox else 0
             for name, spec, _ in L.for_each_tensor(dims)}
    gain = longrope["qk_rope_gain"] if longrope else 1.0
    fused = _fused_sources(fam, by_name, n_layer, dims)
    known = set(expect) | {t.name for t, _ in fused.values()}
    if longrope:
        known |= {PHI3_LONG, PHI3_SHORT}
    for t in r.tensors:
        if t.name not in known:
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
        if longrope and gname == K.ROPE_FREQS:    # rope_dim / 2 divisors, as the HF converter's
            f = longrope["rope_factors"]
            tensors.append(SourceTensor(gname, f.shape, kind, lambda r0, r1, f=f: f[r0:r1], gname))
            continue
        if gname in fused:
            t, row0 = fused[gname]
        elif gname in by_name:
            t, row0 = by_name[gname], 0
        else:
            alt = [f for f, parts in fam.gguf_fused.items()
                   if L.parse_name(gname) and L.parse_name(gname)[0].part in parts]
            also = f" (nor its fused {L.blk(L.layer_of(gname), alt[0])} with its rows)" if alt else ""
            raise ConversionError(f"{path} lacks tensor {gname}{also}")
        lshape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if gname not in fused and lshape != shape or gname in fused and lshape[1:] != shape[1:]:
            raise ConversionError(f"{path}: {t.name} has shape {list(lshape)}, the metadata "
                                  f"implies {list(shape)}")
        if not _dequantizable(t.tensor_type):
            raise ConversionError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}, which the installed gguf "
                f"package cannot dequantize")
        if t.tensor_type not in PLAIN_TYPES:
            requantized.add(t.tensor_type.name)

        def read(r0, r1, t=t, shape=shape, row0=row0):
            raw = np.asarray(t.data[row0 + r0:row0 + r1] if len(shape) > 1 else t.data)
            if t.tensor_type == Q.BF16:
                out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                out = dequantize(raw, t.tensor_type)
            if len(shape) == 1:
                return np.asarray(out, np.float32).reshape(shape)[r0:r1]
            return np.asarray(out, np.float32).reshape((r1 - r0,) + shape[1:])

        if heads[gname]:   # rotate-half rows -> interleaved pairs: the whole tensor at once
            def read(r0, r1, plain=read, shape=shape, n=heads[gname], kind=kind):
                w = plain(0, shape[0])
                if kind == L.LINEAR:       # LongRoPE's attention factor (none: 1)
                    w = scale_rotated_rows(w, n, rope_dim, gain)
                return permute_qk_rows(w, n, rope_dim)[r0:r1]
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
    if requantized:
        notes.append(f"the source is already quantized ({', '.join(sorted(requantized))}): "
                     f"re-quantizing adds pyklei's rounding error to the file's own; convert "
                     f"from the original (Hugging Face) weights for the best quality")
    return ModelSource(kv=kv, tensors=tensors, description=f"{path} (llama.cpp GGUF)",
                       after_tensor=drop_pages, notes=notes)
