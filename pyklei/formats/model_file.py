"""A strict reader of pyklei model files (GGUF, see docs/FORMAT.md "GGUF container").

    mf = read_model("model.gguf")
    mf.hparams.n_layer, mf.tokenizer["tokenizer.ggml.tokens"], mf.eos_token_ids
    w = mf.tensor("blk.0.attn_q.weight")     # w.format == "qsi4c32", w.qs, w.scales (views)
    mf.tensor("token_embd.weight").dequantize()

Tensor arrays are numpy views over one read-only np.memmap of the file: nothing is copied.
Everything the runtime relies on is validated here, with errors that say what is wrong
(ModelFileError, a ValueError): the format version, the architecture, hyperparameters, the
presence, GGUF type and shape of every tensor of the model, and the data alignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_keys as K
from .bf16 import bf16_to_f32
from .qsi4c32 import QSI4C32_BLOCK_SIZES, dequantize_qsi4c32
from .qsi8cx import dequantize_qsi8cx


class ModelFileError(ValueError):
    """The file is not a valid pyklei model file (message says why)."""


@dataclass(frozen=True)
class HParams:
    vocab_size: int
    context_length: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    tied: bool                 # True: token_embd.weight is also the lm_head (no output.weight)
    has_rope_freqs: bool       # llama3 RoPE scaling factors in rope_freqs.weight
    block_size: int            # pyklei.qsi4c32.block_size (default qsi4c32 group size)


@dataclass
class Tensor:
    name: str
    format: str                  # "qsi4c32" | "qsi8cx" | "f32" | "f16" | "bf16"
    shape: tuple[int, ...]       # logical shape: (N, K) for matrices, (n,) for vectors
    data: np.ndarray | None = None     # f32/f16 values, bf16 as uint16 bits (plain formats)
    qs: np.ndarray | None = None       # qsi4c32: uint8 [N, K/2]; qsi8cx: int8 [N, K]
    scales: np.ndarray | None = None   # qsi4c32: uint16 bf16 bits [N, K/bl]; qsi8cx: f32 [N]

    @property
    def block_size(self) -> int | None:
        if self.format != K.QSI4C32:
            return None
        return self.shape[1] // self.scales.shape[1]

    def dequantize(self) -> np.ndarray:
        """float32 copy of the logical tensor."""
        if self.format == K.QSI4C32:
            return dequantize_qsi4c32(self.qs, self.scales)
        if self.format == K.QSI8CX:
            return dequantize_qsi8cx(self.qs, self.scales)
        if self.format == "bf16":
            return bf16_to_f32(self.data)
        return np.asarray(self.data, dtype=np.float32).copy()


@dataclass
class ModelFile:
    path: Path
    hparams: HParams
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    eos_token_ids: list[int] = field(default_factory=list)
    metadata_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # GGUF (type, array type)
    _mmap: Any = None

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def layer(self, i: int, part: str) -> Tensor:
        return self.tensor(K.blk(i, part))

    @property
    def tokenizer(self) -> dict[str, Any]:
        return {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}

    @property
    def output(self) -> Tensor:
        """The lm_head weight: output.weight, or token_embd.weight when tied."""
        return self.tensors.get(K.OUTPUT) or self.tensors[K.TOKEN_EMBD]


# GGUF value types and the tensor types a pyklei file may hold (ids from the GGUF spec).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
GGML_F32, GGML_F16, GGML_I8, GGML_BF16 = 0, 1, 24, 30
_GGML = {GGML_F32: ("F32", np.float32), GGML_F16: ("F16", np.float16),
         GGML_I8: ("I8", np.int8), GGML_BF16: ("BF16", np.uint16)}
GGUF_MAGIC = b"GGUF"


@dataclass
class _RawTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # numpy order (GGUF dims reversed)
    offset: int              # absolute file offset
    data: np.ndarray | None = None

    @property
    def type_name(self) -> str:
        return _GGML.get(self.ggml_type, (f"type {self.ggml_type}",))[0]


class _Parser:
    """Minimal GGUF v2/v3 parser over an mmapped buffer: fast for 100k+ token vocabularies."""

    def __init__(self, buf, path):
        self.b, self.pos, self.path = buf, 0, path

    def take(self, n: int):
        if self.pos + n > len(self.b):
            raise ModelFileError(f"{self.path}: truncated GGUF file (needs byte {self.pos + n}, "
                                 f"has {len(self.b)})")
        v = self.b[self.pos:self.pos + n]
        self.pos += n
        return v

    def scalar(self, t: int):
        import struct
        fmt = _SCALARS[t]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: invalid UTF-8 string at byte {self.pos - n}") from None

    def value(self, t: int):
        if t in _SCALARS:
            return self.scalar(t)
        if t == STRING:
            return self.string()
        if t == ARRAY:
            st, n = self.scalar(4), self.scalar(10)
            if st == STRING:
                return [self.string() for _ in range(n)]
            if st in _NP:
                a = np.frombuffer(self.take(n * np.dtype(_NP[st]).itemsize), dtype=_NP[st])
                return bytes(a) if st == 0 else a.tolist()
            raise ModelFileError(f"{self.path}: unsupported GGUF array element type {st}")
        raise ModelFileError(f"{self.path}: unknown GGUF value type {t}")


def _parse(path: Path):
    """-> (metadata, {key: (type, subtype)}, [tensors with data views], mmap)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    p = _Parser(buf, path)
    if bytes(p.take(4)) != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (bad magic)")
    version = p.scalar(4)
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (need 3)")
    n_tensors, n_kv = p.scalar(10), p.scalar(10)
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ModelFileError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    md, types = {}, {}
    for _ in range(n_kv):
        key = p.string()
        t = p.scalar(4)
        types[key] = (t, None)
        if t == ARRAY:  # peek the element type
            types[key] = (t, int(np.frombuffer(p.b[p.pos:p.pos + 4], np.uint32)[0]))
        md[key] = p.value(t)
    infos = []
    for _ in range(n_tensors):
        name = p.string()
        nd = p.scalar(4)
        if nd > 4:
            raise ModelFileError(f"{path}: tensor {name} has {nd} dimensions")
        dims = [p.scalar(10) for _ in range(nd)]
        gt, off = p.scalar(4), p.scalar(10)
        infos.append((name, gt, tuple(reversed(dims)), off))
    align = int(md.get(K.GENERAL_ALIGNMENT, 32))
    start = p.pos + (-p.pos % align)
    tensors = []
    for name, gt, shape, off in infos:
        t = _RawTensor(name, gt, shape, start + off)
        if gt in _GGML:
            dt = _GGML[gt][1]
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            if t.offset + nbytes > len(mm):
                raise ModelFileError(f"{path}: truncated file: tensor {name} ends at byte "
                                     f"{t.offset + nbytes}, the file has {len(mm)}")
            t.data = mm[t.offset:t.offset + nbytes].view(dt).reshape(shape)
        tensors.append(t)
    return md, types, tensors, mm


def read_model(path) -> ModelFile:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"no such model file: {path}")
    try:
        md, types, raw_list, mm = _parse(path)
    except ModelFileError:
        raise
    except Exception as e:  # struct errors and the like on corrupt files
        raise ModelFileError(f"{path}: not a readable GGUF file ({e})") from None
    ver = md.get(K.KEY_FORMAT_VERSION)
    if ver is None:
        raise ModelFileError(f"{path} is not a pyklei model file (no {K.KEY_FORMAT_VERSION}); "
                             f"convert it with `pyklei convert {path.name} -o OUT.gguf`")
    if ver != K.FORMAT_VERSION:
        raise ModelFileError(f"{path} has pyklei format version {ver}; this pyklei reads "
                             f"version {K.FORMAT_VERSION} (re-convert the model)")
    if md.get(K.GENERAL_ARCHITECTURE) != K.ARCH:
        raise ModelFileError(f"{path}: architecture {md.get(K.GENERAL_ARCHITECTURE)!r}, expected 'llama'")
    if md.get(K.GENERAL_ALIGNMENT, 32) % K.ALIGNMENT:
        raise ModelFileError(f"{path}: general.alignment {md.get(K.GENERAL_ALIGNMENT)} is not a "
                             f"multiple of {K.ALIGNMENT}")

    def need(key, typ=int):
        if key not in md:
            raise ModelFileError(f"{path} lacks metadata key {key!r}")
        try:
            return typ(md[key])
        except (TypeError, ValueError):
            raise ModelFileError(f"{path}: metadata {key!r} = {md[key]!r} is not {typ.__name__}") from None

    raw = {}
    for t in raw_list:
        if t.name in raw:
            raise ModelFileError(f"{path}: duplicate tensor {t.name!r}")
        raw[t.name] = t
    n_embd, n_head = need(K.EMBEDDING_LENGTH), need(K.HEAD_COUNT)
    head_dim = int(md.get(K.KEY_LENGTH, n_embd // max(n_head, 1)))
    hp = HParams(
        vocab_size=need(K.VOCAB_SIZE),
        context_length=need(K.CONTEXT_LENGTH),
        n_embd=n_embd,
        n_layer=need(K.BLOCK_COUNT),
        n_ff=need(K.FEED_FORWARD_LENGTH),
        n_head=n_head,
        n_head_kv=int(md.get(K.HEAD_COUNT_KV, n_head)),
        head_dim=head_dim,
        rms_eps=need(K.RMS_EPS, float),
        rope_theta=float(md.get(K.ROPE_FREQ_BASE, 10000.0)),
        rope_dim=int(md.get(K.ROPE_DIM, head_dim)),
        tied=K.OUTPUT not in raw,
        has_rope_freqs=K.ROPE_FREQS in raw,
        block_size=need(K.KEY_BLOCK_SIZE),
    )
    for fld in ("vocab_size", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim"):
        if getattr(hp, fld) <= 0:
            raise ModelFileError(f"{path}: {fld} = {getattr(hp, fld)} must be positive")
    if hp.n_head % hp.n_head_kv:
        raise ModelFileError(f"{path}: head_count {hp.n_head} is not a multiple of head_count_kv {hp.n_head_kv}")
    if hp.rope_dim != hp.head_dim:
        raise ModelFileError(f"{path}: partial RoPE (rope.dimension_count {hp.rope_dim} != head_dim "
                             f"{hp.head_dim}) is not supported")
    if hp.block_size not in QSI4C32_BLOCK_SIZES:
        raise ModelFileError(f"{path}: {K.KEY_BLOCK_SIZE} = {hp.block_size} is not one of {QSI4C32_BLOCK_SIZES}")

    h, v, f, hd = hp.n_embd, hp.vocab_size, hp.n_ff, hp.head_dim
    expect = {K.TOKEN_EMBD: (v, h), K.OUTPUT_NORM: (h,)}
    for i in range(hp.n_layer):
        expect.update({
            K.blk(i, "attn_norm"): (h,), K.blk(i, "ffn_norm"): (h,),
            K.blk(i, "attn_q"): (hp.n_head * hd, h), K.blk(i, "attn_k"): (hp.n_head_kv * hd, h),
            K.blk(i, "attn_v"): (hp.n_head_kv * hd, h), K.blk(i, "attn_output"): (h, hp.n_head * hd),
            K.blk(i, "ffn_gate"): (f, h), K.blk(i, "ffn_up"): (f, h), K.blk(i, "ffn_down"): (h, f),
        })
    if not hp.tied:
        expect[K.OUTPUT] = (v, h)
    if hp.has_rope_freqs:
        expect[K.ROPE_FREQS] = (hd // 2,)
    companions = {K.scales_name(n) for n in expect}
    for name in raw:
        if name not in expect and name not in companions:
            raise ModelFileError(f"{path}: unexpected tensor {name!r}")
    align = int(md.get(K.GENERAL_ALIGNMENT, 32))

    def dims(t):  # numpy-order dims
        return t.shape

    def get(name, gtype, shape):
        t = raw.get(name)
        if t is None:
            raise ModelFileError(f"{path} lacks tensor {name!r}")
        if t.ggml_type != gtype:
            raise ModelFileError(f"{path}: tensor {name} has GGUF type {t.type_name}, "
                                 f"expected {_GGML[gtype][0]}")
        if dims(t) != tuple(shape):
            raise ModelFileError(f"{path}: tensor {name} has shape {list(dims(t))}, expected {list(shape)}")
        if t.offset % align or t.offset % K.ALIGNMENT:
            raise ModelFileError(f"{path}: tensor {name} data is not {align}-byte aligned")
        return t.data

    tensors: dict[str, Tensor] = {}
    plain = {GGML_F32: ("f32", np.float32), GGML_F16: ("f16", np.float16),
             GGML_BF16: ("bf16", np.uint16)}
    for name, shape in expect.items():
        fmt = md.get(K.format_key(name))
        if fmt == K.QSI4C32:
            if len(shape) != 2:
                raise ModelFileError(f"{path}: {name} cannot be qsi4c32 (shape {list(shape)})")
            n, k = shape
            sc_t = raw.get(K.scales_name(name))
            if sc_t is None:
                raise ModelFileError(f"{path}: qsi4c32 tensor {name} lacks {K.scales_name(name)}")
            nb = dims(sc_t)[-1] if len(dims(sc_t)) == 2 else 0
            if nb <= 0 or k % nb or (k // nb) not in QSI4C32_BLOCK_SIZES:
                raise ModelFileError(f"{path}: {K.scales_name(name)} shape {list(dims(sc_t))} does "
                                     f"not give a valid block size for K={k}")
            qs = get(name, GGML_I8, (n, k // 2)).view(np.uint8)
            sc = get(K.scales_name(name), GGML_BF16, (n, nb))
            tensors[name] = Tensor(name, fmt, shape, qs=qs, scales=sc)
        elif fmt == K.QSI8CX:
            if len(shape) != 2:
                raise ModelFileError(f"{path}: {name} cannot be qsi8cx (shape {list(shape)})")
            n, k = shape
            qs = get(name, GGML_I8, (n, k))
            sc = get(K.scales_name(name), GGML_F32, (n,))
            tensors[name] = Tensor(name, fmt, shape, qs=qs, scales=sc)
        elif fmt is None:
            t = raw.get(name)
            if t is None:
                raise ModelFileError(f"{path} lacks tensor {name!r}")
            if t.ggml_type not in plain or (len(shape) == 1 and t.ggml_type != GGML_F32):
                raise ModelFileError(f"{path}: tensor {name} has unsupported GGUF type "
                                     f"{t.type_name} (and no {K.format_key(name)} key)")
            pf, _ = plain[t.ggml_type]
            data = get(name, t.ggml_type, shape)
            tensors[name] = Tensor(name, pf, shape, data=data)
        else:
            raise ModelFileError(f"{path}: {K.format_key(name)} = {fmt!r} is not a known format")
    toks = md.get("tokenizer.ggml.tokens")
    if toks is None:
        raise ModelFileError(f"{path} has no tokenizer (tokenizer.ggml.tokens)")
    if len(toks) != hp.vocab_size:
        raise ModelFileError(f"{path}: {len(toks)} tokens but vocab_size {hp.vocab_size}")
    eos = md.get(K.KEY_EOS_IDS)
    eos_ids = [int(i) for i in eos] if eos is not None else []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in md and int(md[key]) not in eos_ids:
            eos_ids.append(int(md[key]))
    for i in eos_ids:
        if not 0 <= i < hp.vocab_size:
            raise ModelFileError(f"{path}: EOS id {i} outside the vocabulary")
    return ModelFile(path=path, hparams=hp, metadata=md, tensors=tensors, eos_token_ids=eos_ids,
                     metadata_types=types, _mmap=mm)
