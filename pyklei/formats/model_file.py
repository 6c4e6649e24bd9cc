"""A strict reader of pyklei model files (GGUF, see docs/FORMAT.md "GGUF container").

    mf = read_model("model.gguf")
    mf.hparams.n_layer, mf.tokenizer["tokenizer.ggml.tokens"], mf.eos_token_ids
    w = mf.tensor("blk.0.attn_q.weight")     # w.format == "qsi4c32", w.qs, w.scales (views)
    mf.tensor("token_embd.weight").dequantize()

Tensor arrays are numpy views over one read-only memory map of the file: nothing is copied.
The GGUF container itself is parsed (and bounds-checked) by pyklei.formats.gguf_reader.
Everything the runtime relies on is validated here, with errors that say what is wrong
(ModelFileError, a ValueError): the format version, the architecture, hyperparameters, the
presence, GGUF type and shape of every tensor of the model, and the data alignment.
"""
from __future__ import annotations


import mmap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import gguf_keys as K
from .end_of_generation import EndOfGenerationError, end_of_generation_ids
from .gguf_reader import VALUE_TYPE_NAMES, GGUFError, read_gguf, read_gguf_metadata
from .families import FAMILIES, family
from .llama_tensors import for_each_tensor
from .qsi4c32 import QSI4C32_BLOCK_SIZES
from .registry import GGML_I8, GGML_TYPE_NAMES, PLAIN_BY_GGML, WEIGHT_FORMATS
from .rotation import Rotation, check_rotation, split_size

ROTATION_PARTS = ("residual", "value_heads", "ffn_down")   # the values KEY_ROTATION may list


class ModelFileError(GGUFError):
    """The file is not a valid pyklei model file (message says why); a ValueError."""


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
    # The family (families.py) and what its file says beyond Llama (gguf_keys, "Family
    # hyperparameters"); a Llama file has the defaults.
    arch: str = "llama"
    features: frozenset = frozenset()
    layer_window: tuple = ()        # per layer: sliding window, 0 = every position; () = all 0
    layer_rope_base: tuple = ()     # per layer: RoPE base, 0 = no RoPE; () = all rope_theta
    layer_rope_factor: tuple = ()   # per layer: linear RoPE scaling (frequencies / it); () = all 1
    activation: str = "silu"
    embedding_scale: float = 1.0
    attention_scale: float = 0.0    # 0: 1/sqrt(head_dim)
    logit_softcap: float = 0.0      # 0: none
    # LongRoPE: the divisors in place of rope_freqs for a context longer than rope_long_from
    rope_long_factors: tuple = ()
    rope_long_from: int = 0
    pooling: str | None = None      # the embedding pooling the file declares (gguf_keys.POOLING_TYPES' name)

    def window(self, layer: int) -> int:
        return self.layer_window[layer] if self.layer_window else 0

    def rope_base(self, layer: int) -> float:
        return self.layer_rope_base[layer] if self.layer_rope_base else self.rope_theta

    def rope_factor(self, layer: int) -> float:
        return self.layer_rope_factor[layer] if self.layer_rope_factor else 1.0


@dataclass
class Tensor:
    name: str
    format: str                  # a name of registry.WEIGHT_FORMATS: "qsi4c32", ..., "f32"
    shape: tuple[int, ...]       # logical shape: (N, K) for matrices, (n,) for vectors
    data: np.ndarray | None = None     # f32/f16 values, bf16 as uint16 bits (plain formats)
    qs: np.ndarray | None = None       # qsi4c32: uint8 [N, K/2]; qsi6c32: uint8 [N, 3K/4]; qsi8cx: int8 [N, K]
    scales: np.ndarray | None = None   # qsi4c32/qsi6c32: uint16 bf16 bits [N, K/bl]; qsi8cx: f32 [N]

    @property
    def block_size(self) -> int | None:
        """Block length along K of a quantized tensor (the row for qsi8cx); None if plain."""
        if self.scales is None:
            return None
        return WEIGHT_FORMATS[self.format].block_length_of(self.shape[1], self.scales.shape)

    def dequantize(self) -> np.ndarray:
        """float32 copy of the logical tensor."""
        fmt = WEIGHT_FORMATS[self.format]
        if fmt.quantized:
            return fmt.dequantize(self.qs, self.scales)
        return fmt.dequantize(self.data)


@dataclass
class ModelFile:
    path: Path
    hparams: HParams
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    eos_token_ids: list[int] = field(default_factory=list)
    metadata_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # GGUF (type, array type)
    # Online rotations of a rotated file (gguf_keys KEY_ROTATION): "ffn_down" [n_ff] and, tied
    # only, "output" [n_embd]; empty for an unrotated file.
    rotations: dict[str, Rotation] = field(default_factory=dict)
    _mmap: Any = None      # the read-only map every tensor array is a view of (close() ends it)

    @property
    def rotated(self) -> bool:
        """Whether every matmul input is rotated (KEY_ROTATION lists all of ROTATION_PARTS, as
        pyklei's converter writes by default): the outlier channels are spread out."""
        val = self.metadata.get(K.KEY_ROTATION) or ""
        return set(val.split(",")) >= set(ROTATION_PARTS)

    def release_pages(self, array: np.ndarray) -> int:
        """Drops this process's resident pages of `array`, a view of this file's map that the
        caller has copied what it needs from. The mapping stays valid: a page read again is
        faulted back in from the file. Only whole pages inside the array go. -> bytes released
        (0 once closed, or where the OS has no MADV_DONTNEED)."""
        mm = self._mmap
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        view = np.frombuffer(mm, np.uint8, count=1)
        start = array.ctypes.data - view.ctypes.data
        del view
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, (start + array.nbytes) // page * page
        if hi <= lo:
            return 0
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return hi - lo

    def close(self) -> None:
        """Forgets the tensors and unmaps the file. A tensor view the caller still holds keeps
        the map alive until it goes (the map is then unmapped with it). Idempotent."""
        mm, self._mmap = self._mmap, None
        self.tensors.clear()
        if mm is not None:
            try:
                mm.close()
            except BufferError:   # the caller still holds a tensor view: unmapped with it
                pass

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


GGUF_MAGIC = b"GGUF"
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}      # GGUF integer value types
_NUM_TYPES = _INT_TYPES | {6, 12}            # ... and float32/float64
_I32_MAX = 2**31 - 1


def _parse(path: Path):
    """-> (metadata, {key: (type, subtype)}, {name: GGUFTensorInfo with data views}, mmap)."""
    g = read_gguf(path, tensors=True, arrays="list")
    return g.metadata, g.types, g.tensors, g.buffer


def check_model_path(path) -> Path:
    """The path of an existing model file, or a ModelFileError that says what to do instead."""
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory; pyklei runs one .gguf file (convert a Hugging "
                             f"Face checkpoint with `pyklei convert {path} -o model.gguf`)")
    if not path.is_file():
        raise ModelFileError(f"no such model file: {path}")
    return path


def is_model_file(path) -> bool:
    """Whether the GGUF file at `path` says it is a pyklei model file (its format version key;
    the rest unread): not, for a llama.cpp GGUF."""
    return K.KEY_FORMAT_VERSION in read_gguf_metadata(path, prefixes=(K.KEY_FORMAT_VERSION,))


def read_model(path) -> ModelFile:
    path = check_model_path(path)
    try:
        md, types, raw, mm = _parse(path)
    except ModelFileError:
        raise
    except GGUFError as e:   # the GGUF layer's message already names the file
        raise ModelFileError(str(e)) from None
    def vtype(key):
        return types.get(key, (None, None))[0]

    ver = md.get(K.KEY_FORMAT_VERSION)
    if ver is None:
        raise ModelFileError(f"{path} is not a pyklei model file (no {K.KEY_FORMAT_VERSION}); "
                             f"convert it with `pyklei convert {path} -o OUT.gguf`")
    if vtype(K.KEY_FORMAT_VERSION) not in _INT_TYPES or ver != K.FORMAT_VERSION:
        raise ModelFileError(f"{path} has pyklei format version {ver!r}; this pyklei reads "
                             f"version {K.FORMAT_VERSION} (re-convert the model)")
    if family(md.get(K.GENERAL_ARCHITECTURE)) is None:
        raise ModelFileError(f"{path}: architecture {md.get(K.GENERAL_ARCHITECTURE)!r}, expected one "
                             f"of {', '.join(FAMILIES)}")
    align = md.get(K.GENERAL_ALIGNMENT, 32)       # the GGUF layer checked it is a power of two
    if align % K.ALIGNMENT:
        raise ModelFileError(f"{path}: general.alignment {align} is not a multiple of {K.ALIGNMENT}")

    hp = read_hparams(md, vtype, raw, str(path))
    expect = {name: spec.shape(hp) for name, spec, _ in for_each_tensor(hp)}
    online = _rotation_tensors(path, md, vtype, hp)
    for prefix, n in online.values():
        m, _ = split_size(n)
        expect[K.rot_signs(prefix)] = (n,)
        expect[K.rot_mix(prefix)] = (m, m)
    companions = {K.scales_name(n) for n in expect}
    for name in raw:
        if name not in expect and name not in companions:
            raise ModelFileError(f"{path}: unexpected tensor {name!r}")
    for key in md:
        if key.startswith(K.KEY_FORMAT_PREFIX) and key[len(K.KEY_FORMAT_PREFIX):] not in expect:
            raise ModelFileError(f"{path}: format key {key!r} names no tensor of this model")

    def dims(t):  # numpy-order dims
        return t.shape

    def get(name, gtype, shape):
        t = raw.get(name)
        if t is None:
            raise ModelFileError(f"{path} lacks tensor {name!r}")
        if t.ggml_type != gtype:
            raise ModelFileError(f"{path}: tensor {name} has GGUF type {t.type_name}, "
                                 f"expected {GGML_TYPE_NAMES[gtype]}")
        if dims(t) != tuple(shape):
            raise ModelFileError(f"{path}: tensor {name} has shape {list(dims(t))}, expected {list(shape)}")
        if t.offset % align or t.offset % K.ALIGNMENT:
            raise ModelFileError(f"{path}: tensor {name} data at byte {t.offset} is not {align}-byte aligned")
        return t.data

    tensors: dict[str, Tensor] = {}
    for name, shape in expect.items():
        fname = md.get(K.format_key(name))
        if fname is None:      # a plain tensor: its own GGUF type says what it is
            t = raw.get(name)
            if t is None:
                raise ModelFileError(f"{path} lacks tensor {name!r}")
            fmt = PLAIN_BY_GGML.get(t.ggml_type)
            if fmt is None or (len(shape) == 1 and fmt.name != "f32"):
                raise ModelFileError(f"{path}: tensor {name} has unsupported GGUF type "
                                     f"{t.type_name} (and no {K.format_key(name)} key)")
            if K.scales_name(name) in raw:
                raise ModelFileError(f"{path}: unexpected tensor {K.scales_name(name)!r} ({name} "
                                     f"has no {K.format_key(name)} key)")
            tensors[name] = Tensor(name, fmt.name, shape, data=get(name, t.ggml_type, shape))
            continue
        if vtype(K.format_key(name)) != 8:
            raise ModelFileError(f"{path}: {K.format_key(name)} = {fname!r} is not a string")
        fmt = WEIGHT_FORMATS.get(fname)
        if fmt is None or not fmt.quantized:
            raise ModelFileError(f"{path}: {K.format_key(name)} = {fname!r} is not a known format")
        if len(shape) != 2:
            raise ModelFileError(f"{path}: {name} cannot be {fmt.name} (shape {list(shape)})")
        sc_t = raw.get(K.scales_name(name))
        if sc_t is None:
            raise ModelFileError(f"{path}: {fmt.name} tensor {name} lacks {K.scales_name(name)}")
        n, k = shape
        qs = get(name, GGML_I8, (n, fmt.qs_cols(k)))
        bl = fmt.block_length_of(k, dims(sc_t))
        if bl is None:
            raise ModelFileError(f"{path}: {K.scales_name(name)} shape {list(dims(sc_t))} does "
                                 f"not give a valid block size for K={k}")
        sc_st = fmt.stored(shape, bl)[1]
        sc = get(K.scales_name(name), sc_st.ggml_type, sc_st.shape)
        tensors[name] = Tensor(name, fmt.name, shape, qs=qs.view(fmt.qs_dtype), scales=sc)
    rotations = {}
    for key, (prefix, n) in online.items():
        signs, mix = tensors[K.rot_signs(prefix)], tensors[K.rot_mix(prefix)]
        if signs.format != "f32" or mix.format != "f32":
            raise ModelFileError(f"{path}: rotation tensors {prefix}.* must be f32")
        try:
            rotations[key] = check_rotation(prefix, n, signs.data, mix.data)
        except ValueError as e:
            raise ModelFileError(f"{path}: {e}") from None
    toks = md.get("tokenizer.ggml.tokens")
    if toks is None:
        raise ModelFileError(f"{path} has no tokenizer (tokenizer.ggml.tokens)")
    if types["tokenizer.ggml.tokens"] != (9, 8):
        raise ModelFileError(f"{path}: tokenizer.ggml.tokens is not an array of strings")
    if len(toks) != hp.vocab_size:
        raise ModelFileError(f"{path}: {len(toks)} tokens but vocab_size {hp.vocab_size}")

    try:        # the one end-of-generation rule, the tokenizer's too
        eos_ids = end_of_generation_ids(md, strict=True)
    except EndOfGenerationError as e:
        raise ModelFileError(f"{path}: {e}") from None
    return ModelFile(path=path, hparams=hp, metadata=md, tensors=tensors, eos_token_ids=eos_ids,
                     metadata_types=types, rotations=rotations, _mmap=mm)


def read_hparams(md: dict, vtype: Callable[[str], int | None], tensor_names, where: str,
                 block_size: int | None = None) -> HParams:
    """The llama hyperparameters of GGUF metadata md, checked: GGUF types, ranges, and what the
    runtime needs (ModelFileError naming `where`). vtype(key): the GGUF value type of md[key].
    tensor_names: the tensors there are (tied = no output.weight). block_size: None reads
    K.KEY_BLOCK_SIZE (a pyklei file); a converter's source, which has none yet, passes its own."""
    def need(key, typ=int, default=None, lo=1, hi=_I32_MAX):
        """A numeric hyperparameter: the right GGUF type, finite, within [lo, hi]."""
        if key not in md:
            if default is None:
                raise ModelFileError(f"{where} lacks metadata key {key!r}")
            return default
        v, t = md[key], vtype(key)
        if t not in (_INT_TYPES if typ is int else _NUM_TYPES):
            raise ModelFileError(f"{where}: metadata {key!r} = {v!r} has GGUF type "
                                 f"{VALUE_TYPE_NAMES.get(t, t)}, expected "
                                 f"{'an integer' if typ is int else 'a number'}")
        v = typ(v)
        if not lo <= v <= hi:   # NaN fails this too
            raise ModelFileError(f"{where}: metadata {key!r} = {v!r} is out of range [{lo}, {hi}]")
        return v

    arch = md.get(K.GENERAL_ARCHITECTURE, K.ARCH)
    fam = family(arch)
    if fam is None:
        raise ModelFileError(f"{where}: architecture {arch!r} is not one of {', '.join(FAMILIES)}")

    def a(key):   # a Llama key as this family's file spells it
        return K.arch_key(arch, key)

    n_embd, n_head = need(a(K.EMBEDDING_LENGTH)), need(a(K.HEAD_COUNT))
    head_dim = need(a(K.KEY_LENGTH), default=max(n_embd // n_head, 1))
    n_layer = need(a(K.BLOCK_COUNT), hi=1 << 16)
    rope_theta = need(a(K.ROPE_FREQ_BASE), float, default=10000.0, lo=1.0, hi=1e30)
    hp = HParams(
        vocab_size=need(a(K.VOCAB_SIZE)),
        context_length=need(a(K.CONTEXT_LENGTH)),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=need(a(K.FEED_FORWARD_LENGTH)),
        n_head=n_head,
        n_head_kv=need(a(K.HEAD_COUNT_KV), default=n_head),
        head_dim=head_dim,
        rms_eps=need(a(K.RMS_EPS), float, lo=1e-30, hi=1.0),
        rope_theta=rope_theta,
        rope_dim=need(a(K.ROPE_DIM), default=head_dim),
        tied=K.OUTPUT not in tensor_names,
        has_rope_freqs=K.ROPE_FREQS in tensor_names,
        block_size=need(K.KEY_BLOCK_SIZE) if block_size is None else block_size,
        arch=arch,
        features=fam.features,
        layer_window=_layer_array(md, vtype, K.KEY_LAYER_WINDOW, n_layer, int, 0, _I32_MAX, where),
        layer_rope_base=_layer_array(md, vtype, K.KEY_LAYER_ROPE_BASE, n_layer, float, 0.0, 1e30, where),
        layer_rope_factor=_layer_array(md, vtype, K.KEY_LAYER_ROPE_FACTOR, n_layer, float, 1e-30, 1e30,
                                       where),
        activation=_choice(md, vtype, K.KEY_ACTIVATION, K.ACTIVATIONS, where),
        embedding_scale=need(K.KEY_EMBEDDING_SCALE, float, default=1.0, lo=1e-30, hi=1e30),
        attention_scale=need(K.KEY_ATTENTION_SCALE, float, default=0.0, lo=1e-30, hi=1e30),
        logit_softcap=need(K.KEY_LOGIT_SOFTCAP, float, default=0.0, lo=1e-30, hi=1e30),
        pooling=_pooling(md, vtype, a(K.POOLING_TYPE), where),
    )
    _check_llamacpp_linear_scaling(md, vtype, a, hp, where)
    if K.KEY_ROPE_LONG_FACTORS in md:
        hp = _rope_long(md, vtype, hp, need, where)
    if hp.n_head % hp.n_head_kv:
        raise ModelFileError(f"{where}: head_count {hp.n_head} is not a multiple of head_count_kv {hp.n_head_kv}")
    if need(a(K.VALUE_LENGTH), default=hp.head_dim) != hp.head_dim:
        raise ModelFileError(f"{where}: attention.value_length {md[a(K.VALUE_LENGTH)]} differs from "
                             f"key_length {hp.head_dim}; pyklei needs equal K and V head sizes")
    if hp.head_dim % 2:
        raise ModelFileError(f"{where}: head dimension {hp.head_dim} is odd (RoPE rotates pairs)")
    if hp.rope_dim % 2 or hp.rope_dim > hp.head_dim:
        raise ModelFileError(f"{where}: rope.dimension_count {hp.rope_dim} must be even and at most "
                             f"head_dim {hp.head_dim}")
    if hp.block_size not in QSI4C32_BLOCK_SIZES:
        raise ModelFileError(f"{where}: {K.KEY_BLOCK_SIZE} = {hp.block_size} is not one of {QSI4C32_BLOCK_SIZES}")
    # the C runtime indexes with int: every row length must fit one
    for what, n in (("n_head * head_dim", hp.n_head * hp.head_dim),
                    ("n_head_kv * head_dim", hp.n_head_kv * hp.head_dim)):
        if n > _I32_MAX:
            raise ModelFileError(f"{where}: {what} = {n} is too large")
    return hp


def _check_llamacpp_linear_scaling(md, vtype, a, hp: HParams, where) -> None:
    """llama.cpp's linear-scaling keys, where a file says "linear", must give the one factor the
    per-layer factors (the runtime's) scale by: llama.cpp's tools read those keys."""
    fkey, tkey = a(K.LLAMACPP_ROPE_SCALING_FACTOR), a(K.LLAMACPP_ROPE_SCALING_TYPE)
    if md.get(tkey) != "linear":
        return
    if fkey in md and vtype(fkey) not in _NUM_TYPES:
        raise ModelFileError(f"{where}: metadata {fkey!r} = {md[fkey]!r} is not a number")
    factor = np.float32(md.get(fkey) or 1.0)     # llama.cpp: 0 or absent is no scaling
    scaled = {np.float32(f) for f in hp.layer_rope_factor if f != 1.0}
    if scaled != ({factor} if factor != 1.0 else set()):
        raise ModelFileError(f"{where}: {fkey} = {float(factor)!r} disagrees with "
                             f"{K.KEY_LAYER_ROPE_FACTOR} (scaled layers' factors: "
                             f"{sorted(float(f) for f in scaled) or 'none'})")


def _pooling(md, vtype, key, where) -> str | None:
    """The name of the file's pooling type (llama.cpp's integer key), None when absent."""
    if key not in md:
        return None
    names = {v: k for k, v in K.POOLING_TYPES.items()}
    v = md[key]
    if vtype(key) not in _INT_TYPES or v not in names:
        raise ModelFileError(f"{where}: metadata {key!r} = {v!r} is not a pooling type "
                             f"({', '.join(f'{i} {n}' for n, i in K.POOLING_TYPES.items())})")
    return names[v]


def _rope_long(md, vtype, hp: HParams, need, where) -> HParams:
    """hp with LongRoPE's long factors (gguf_keys.KEY_ROPE_LONG_FACTORS), checked: rope_dim / 2
    positive divisors beside rope_freqs' short ones, and the context past which they apply."""
    f = _array(md, vtype, K.KEY_ROPE_LONG_FACTORS, hp.rope_dim // 2, "rope_dim / 2", float, 1e-30, 1e30,
               where)
    if not hp.has_rope_freqs:
        raise ModelFileError(f"{where}: {K.KEY_ROPE_LONG_FACTORS} without the short factors ({K.ROPE_FREQS})")
    start = need(K.ROPE_SCALING_ORIG_CTX, hi=hp.context_length)
    return replace(hp, rope_long_factors=f, rope_long_from=start)


def _layer_array(md, vtype, key, n_layer, typ, lo, hi, where) -> tuple:
    """A per-layer array of family hyperparameters (gguf_keys), checked; () when absent."""
    return _array(md, vtype, key, n_layer, "one per layer", typ, lo, hi, where) if key in md else ()


def _array(md, vtype, key, n, what, typ, lo, hi, where) -> tuple:
    """The array md[key] of n numbers (`what` says why n) of typ within [lo, hi], checked."""
    v = md[key]
    if vtype(key) != 9 or not isinstance(v, list) or len(v) != n:
        raise ModelFileError(f"{where}: {key} must be an array of {n} values ({what})")
    try:
        out = tuple(typ(x) for x in v)
    except (TypeError, ValueError):
        raise ModelFileError(f"{where}: {key} holds a value that is not a number") from None
    if not all(lo <= x <= hi for x in out):
        raise ModelFileError(f"{where}: {key} holds a value out of range [{lo}, {hi}]")
    return out


def _choice(md, vtype, key, choices, where) -> str:
    """A string key that must be one of choices (the first when absent)."""
    if key not in md:
        return choices[0]
    if vtype(key) != 8 or md[key] not in choices:
        raise ModelFileError(f"{where}: {key} = {md[key]!r}; expected one of {', '.join(choices)}")
    return md[key]


def _rotation_tensors(path, md, vtype, hp: HParams) -> dict[str, tuple[str, int]]:
    """The online rotations KEY_ROTATION implies: {"ffn_down" | "output": (prefix, size)}."""
    if K.KEY_ROTATION not in md:
        return {}
    val = md[K.KEY_ROTATION]
    if vtype(K.KEY_ROTATION) != 8:
        raise ModelFileError(f"{path}: {K.KEY_ROTATION} = {val!r} is not a string")
    parts = val.split(",") if val else []
    bad = [p for p in parts if p not in ROTATION_PARTS]
    if bad or len(set(parts)) != len(parts):
        raise ModelFileError(f"{path}: {K.KEY_ROTATION} = {val!r}; expected a comma list of "
                             f"{', '.join(ROTATION_PARTS)} (each once)")
    out = {}
    if "ffn_down" in parts:
        out["ffn_down"] = (K.ROT_FFN_DOWN, hp.n_ff)
    if "residual" in parts and hp.tied:   # an untied lm_head has the final gain folded in
        out["output"] = (K.ROT_OUTPUT, hp.n_embd)
    return out
