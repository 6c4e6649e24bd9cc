"""The one GGUF parser of pyklei: a hardened, read-only reader over a memory map.

    g = read_gguf("model.gguf")                 # metadata + tensor infos + data views
    g.metadata["general.architecture"], g.tensors["token_embd.weight"].data
    meta = read_gguf_metadata("vocab.gguf", prefixes=("tokenizer.",))   # key/values only

A GGUF file is untrusted input that ends up in C code, so every read is bounds-checked and
every count is checked against what the file could possibly hold *before* anything is
allocated. Whatever is wrong, the caller gets a :class:`GGUFError` (a ValueError) that names
the problem, the key or tensor, and the byte offset:

- wrong magic, unsupported version (v2/v3 little-endian are read), header or metadata cut short;
- counts (keys, tensors, array lengths, string lengths, dimensions) beyond the limits below or
  beyond the bytes left in the file;
- unknown value types, arrays nested too deep, duplicate keys, strings that are not UTF-8
  (keys and tensor names always; values unless ``strings="lenient"``);
- general.alignment that is not a power of two (uint32);
- duplicate tensor names, unknown GGML types, more than 4 dimensions, a first dimension not a
  multiple of the type's block, data offsets not aligned, and tensor data (offset + size,
  computed with Python integers, so no overflow) that does not lie inside the file.

Tensor data are numpy views of the read-only map: nothing is copied, and no view can reach
outside the file. (If another process truncates the file while it is mapped, the OS may still
raise SIGBUS on access; that is outside what a reader can prevent.)

The GGUF layout (ggml's gguf.h): magic "GGUF", uint32 version, uint64 tensor count, uint64
key/value count; key/values (string key, uint32 type, value); tensor infos (string name,
uint32 n_dims, uint64 dims[n_dims] (fastest-varying first), uint32 ggml type, uint64 offset
relative to the data section); padding to general.alignment (default 32); tensor data.
Strings are uint64 length + bytes; arrays are uint32 element type + uint64 count + elements.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = [
    "GGUFError", "GGUFFile", "GGUFTensorInfo", "read_gguf", "read_gguf_metadata",
    "GGML_TYPES", "VALUE_TYPE_NAMES",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Limits: generous for real models (Llama 3: ~30 keys, 128k tokens, 280k merges; the largest
# llama.cpp models have a few thousand tensors), small enough that a hostile header cannot
# make the reader allocate gigabytes. Lengths are also always bounded by the bytes left.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_LEN = 1 << 24          # elements of one metadata array
MAX_KEY_LEN = 1 << 16            # bytes of a key (the GGUF spec's limit)
MAX_TENSOR_NAME_LEN = 1 << 10
MAX_DIMS = 4                     # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2              # array of arrays of scalars at most
MAX_ALIGNMENT = 1 << 20

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
VALUE_TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32",
                    INT32: "int32", FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array",
                    UINT64: "uint64", INT64: "int64", FLOAT64: "float64"}
_SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
           FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
_SCALAR_STRUCT = {t: struct.Struct(f) for t, f in _SCALAR.items()}
_NP = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4",
       FLOAT32: "<f4", BOOL: "u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}

# GGML tensor types: id -> (name, elements per block, bytes per block, numpy dtype of the
# plain types or None). The block sizes are those of the GGUF/ggml specification.
GGML_TYPES: dict[int, tuple[str, int, int, Any]] = {
    0: ("F32", 1, 4, np.float32), 1: ("F16", 1, 2, np.float16),
    2: ("Q4_0", 32, 18, None), 3: ("Q4_1", 32, 20, None), 6: ("Q5_0", 32, 22, None),
    7: ("Q5_1", 32, 24, None), 8: ("Q8_0", 32, 34, None), 9: ("Q8_1", 32, 40, None),
    10: ("Q2_K", 256, 84, None), 11: ("Q3_K", 256, 110, None), 12: ("Q4_K", 256, 144, None),
    13: ("Q5_K", 256, 176, None), 14: ("Q6_K", 256, 210, None), 15: ("Q8_K", 256, 292, None),
    16: ("IQ2_XXS", 256, 66, None), 17: ("IQ2_XS", 256, 74, None), 18: ("IQ3_XXS", 256, 98, None),
    19: ("IQ1_S", 256, 50, None), 20: ("IQ4_NL", 32, 18, None), 21: ("IQ3_S", 256, 110, None),
    22: ("IQ2_S", 256, 82, None), 23: ("IQ4_XS", 256, 136, None),
    24: ("I8", 1, 1, np.int8), 25: ("I16", 1, 2, np.int16), 26: ("I32", 1, 4, np.int32),
    27: ("I64", 1, 8, np.int64), 28: ("F64", 1, 8, np.float64), 29: ("IQ1_M", 256, 56, None),
    30: ("BF16", 1, 2, np.uint16),     # bf16 as its uint16 bit patterns
    34: ("TQ1_0", 256, 54, None), 35: ("TQ2_0", 256, 66, None),
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARR_HDR = struct.Struct("<IQ")


class GGUFError(ValueError):
    """The file is not a well-formed GGUF file (the message says what, where and why)."""


@dataclass
class GGUFTensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]       # numpy order: GGUF dims reversed
    offset: int                  # absolute byte offset of the data in the file
    nbytes: int
    data: np.ndarray | None = None   # plain types: a read-only view [shape]; block types: uint8 [nbytes]

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0] if self.ggml_type in GGML_TYPES else f"type {self.ggml_type}"


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    types: dict[str, tuple[int, int | None]]     # key -> (GGUF value type, array element type)
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)   # in file order
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0
    size: int = 0
    buffer: Any = None           # the mmap; keep a reference while tensor views are used


class _Reader:
    """Bounds-checked cursor over a buffer (an mmap)."""

    __slots__ = ("buf", "size", "path", "strings", "arrays")

    def __init__(self, buf, size: int, path: Path, strings: str, arrays: str):
        self.buf, self.size, self.path, self.strings, self.arrays = buf, size, path, strings, arrays

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, o: int, n: int, what: str) -> int:
        """End offset of n bytes at o, or an error if they are not all in the file."""
        end = o + n
        if end > self.size:
            raise self.fail(f"truncated GGUF file: {what} at byte {o} needs {n} bytes, the file has "
                            f"{self.size} bytes")
        return end

    def u32(self, o: int, what: str) -> tuple[int, int]:
        self.need(o, 4, what)
        return _U32.unpack_from(self.buf, o)[0], o + 4

    def u64(self, o: int, what: str) -> tuple[int, int]:
        self.need(o, 8, what)
        return _U64.unpack_from(self.buf, o)[0], o + 8

    def raw_string(self, o: int, what: str, limit: int | None = None) -> tuple[bytes, int]:
        n, o = self.u64(o, f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} at byte {o - 8} is {n} bytes long (limit {limit})")
        end = self.need(o, n, what)
        return self.buf[o:end], end

    def text(self, o: int, what: str, limit: int | None = None) -> tuple[str, int]:
        """A string that must be UTF-8 (keys, tensor names)."""
        b, end = self.raw_string(o, what, limit)
        try:
            return b.decode("utf-8"), end
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {o + 8} is not valid UTF-8 ({e.reason} at byte "
                            f"{o + 8 + e.start})") from None

    def decode(self, b: bytes, key: str, where: int):
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            if self.strings == "lenient":
                return b
            raise self.fail(f"metadata {key!r}: string at byte {where} is not valid UTF-8 "
                            f"({e.reason} at byte {where + e.start})") from None

    # ---- values -------------------------------------------------------------------------
    def value(self, vtype: int, o: int, key: str, want: bool, depth: int = 0) -> tuple[Any, int]:
        st = _SCALAR_STRUCT.get(vtype)
        if st is not None:
            self.need(o, st.size, f"value of {key!r}")
            return (st.unpack_from(self.buf, o)[0] if want else None), o + st.size
        if vtype == STRING:
            b, end = self.raw_string(o, f"string value of {key!r}")
            return (self.decode(b, key, o + 8) if want else None), end
        if vtype == ARRAY:
            return self.array(o, key, want, depth)
        raise self.fail(f"metadata {key!r}: unknown GGUF value type {vtype} at byte {o - 4}")

    def array(self, o: int, key: str, want: bool, depth: int) -> tuple[Any, int]:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"metadata {key!r}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels "
                            f"at byte {o}")
        self.need(o, 12, f"array header of {key!r}")
        itype, n = _ARR_HDR.unpack_from(self.buf, o)
        o += 12
        if n > MAX_ARRAY_LEN:
            raise self.fail(f"metadata {key!r}: array of {n} elements at byte {o - 12} "
                            f"(limit {MAX_ARRAY_LEN})")
        left = self.size - o
        if itype in _NP:
            dt = np.dtype(_NP[itype])
            end = self.need(o, n * dt.itemsize, f"array data of {key!r} ({n} x {VALUE_TYPE_NAMES[itype]})")
            if not want:
                return None, end
            a = np.frombuffer(self.buf, dtype=dt, count=n, offset=o).copy()
            if itype == BOOL:
                a = a.astype(bool)
            if self.arrays == "list":
                return (bytes(a) if itype == UINT8 else a.tolist()), end
            return a, end
        if itype == STRING:
            if n * 8 > left:   # every string needs at least its 8-byte length
                raise self.fail(f"truncated or corrupt file: metadata {key!r}: array of {n} strings at byte {o - 12} cannot fit "
                                f"in the {left} bytes left")
            return self.string_array(o, n, key, want)
        if itype == ARRAY:
            if n * 12 > left:
                raise self.fail(f"truncated or corrupt file: metadata {key!r}: array of {n} arrays at byte {o - 12} cannot fit "
                                f"in the {left} bytes left")
            out = [] if want else None
            for _ in range(n):
                v, o = self.array(o, key, want, depth + 1)
                if want:
                    out.append(v)
            return out, o
        raise self.fail(f"metadata {key!r}: unknown array element type {itype} at byte {o - 12}")

    def string_array(self, o: int, n: int, key: str, want: bool) -> tuple[Any, int]:
        # the hot loop of a 128k-token vocabulary: keep it tight
        buf, size, unpack = self.buf, self.size, _U64.unpack_from
        items = [] if want else None
        append = items.append if want else None
        for i in range(n):
            if o + 8 > size:
                self.need(o, 8, f"length of string {i} of {key!r}")
            ln = unpack(buf, o)[0]
            o += 8
            end = o + ln
            if end > size:
                self.need(o, ln, f"string {i} of {key!r}")
            if want:
                append(buf[o:end])
            o = end
        if not want:
            return None, o
        try:
            # the common case: every string is UTF-8
            out = [b.decode("utf-8") for b in items]
        except UnicodeDecodeError:
            out = []
            for i, b in enumerate(items):
                try:
                    out.append(b.decode("utf-8"))
                except UnicodeDecodeError as e:
                    if self.strings == "lenient":
                        out.append(b)
                    else:
                        raise self.fail(f"metadata {key!r}: string {i} of the array is not valid "
                                        f"UTF-8 ({e.reason})") from None
        return out, o


def _open(path: Path):
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise GGUFError(f"cannot open {path}: {e.strerror or e}") from None
    with fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError(f"{path} is not a regular file")
        if st.st_size < 24:
            raise GGUFError(f"{path} is not a GGUF file (only {st.st_size} bytes; the header alone "
                            f"is 24)")
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), st.st_size


def _header(r: _Reader) -> tuple[int, int, int]:
    buf = r.buf
    if buf[:4] != GGUF_MAGIC:
        raise r.fail(f"not a GGUF file (bad magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    version = _U32.unpack_from(buf, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian GGUF?)" if version > 0xFFFF else ""
        raise r.fail(f"GGUF version {version} is not supported{hint}; pyklei reads versions 2 and "
                     f"3, little-endian")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    if n_kv > MAX_KV or n_kv * 13 > r.size - 24:
        raise r.fail(f"truncated or corrupt GGUF header: {n_kv} metadata keys (limit {MAX_KV}, and each needs "
                     f"at least 13 of the {r.size - 24} bytes after the header)")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > r.size - 24:
        raise r.fail(f"truncated or corrupt GGUF header: {n_tensors} tensors (limit {MAX_TENSORS}, and each "
                     f"needs at least 24 of the {r.size - 24} bytes after the header)")
    return version, n_tensors, n_kv


def _metadata(r: _Reader, n_kv: int, prefixes) -> tuple[dict, dict, int, int]:
    md: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None]] = {}
    seen: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    o = 24
    for i in range(n_kv):
        k0 = o
        key, o = r.text(o, f"metadata key {i}", MAX_KEY_LEN)
        if key in seen:
            raise r.fail(f"duplicate metadata key {key!r} at byte {k0}")
        seen.add(key)
        vtype, o = r.u32(o, f"value type of {key!r}")
        want = prefixes is None or key.startswith(prefixes) or key == "general.alignment"
        sub = None
        if vtype == ARRAY:
            sub, _ = r.u32(o, f"array element type of {key!r}")
        val, o = r.value(vtype, o, key, want)
        if key == "general.alignment":
            if vtype != UINT32 or not 0 < val <= MAX_ALIGNMENT or val & (val - 1):
                raise r.fail(f"general.alignment = {val!r} ({VALUE_TYPE_NAMES.get(vtype, vtype)}) "
                             f"is not a uint32 power of two <= {MAX_ALIGNMENT}")
            alignment = val
            if not (prefixes is None or key.startswith(prefixes)):
                continue
        if want:
            md[key] = val
            types[key] = (vtype, sub)
    return md, types, alignment, o


def read_gguf(path: str | os.PathLike, *, tensors: bool = True, prefixes: Sequence[str] | None = None,
              strings: str = "strict", arrays: str = "numpy") -> GGUFFile:
    """Parses and validates a GGUF file.

    tensors: also read the tensor infos and make data views (False: stop after the metadata).
    prefixes: decode only the keys that start with one of these (the others are still walked
    and validated, but not kept).
    strings: "strict" (a string value that is not UTF-8 is an error) or "lenient" (kept as bytes).
    arrays: "numpy" (numeric arrays as numpy arrays) or "list" (Python lists; uint8 as bytes).
    """
    if strings not in ("strict", "lenient") or arrays not in ("numpy", "list"):
        raise ValueError("strings must be 'strict'/'lenient' and arrays 'numpy'/'list'")
    path = Path(path)
    buf, size = _open(path)
    keep = False
    try:
        r = _Reader(buf, size, path, strings, arrays)
        version, n_tensors, n_kv = _header(r)
        md, types, alignment, o = _metadata(r, n_kv, tuple(prefixes) if prefixes is not None else None)
        g = GGUFFile(path=path, version=version, metadata=md, types=types, alignment=alignment,
                     size=size)
        if tensors:
            g.tensors, g.data_offset = _tensor_infos(r, o, n_tensors, alignment)
            g.buffer = buf
            keep = True
        return g
    finally:
        if not keep:
            try:
                buf.close()
            except BufferError:   # a numpy view still exports it: the GC closes it later
                pass


def _tensor_infos(r: _Reader, o: int, n_tensors: int, alignment: int):
    infos = []
    names: dict[str, int] = {}
    for i in range(n_tensors):
        t0 = o
        name, o = r.text(o, f"name of tensor {i}", MAX_TENSOR_NAME_LEN)
        if name in names:
            raise r.fail(f"duplicate tensor {name!r} (infos at bytes {names[name]} and {t0})")
        names[name] = t0
        nd, o = r.u32(o, f"dimension count of tensor {name!r}")
        if nd > MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {nd} dimensions (at most {MAX_DIMS}) at byte {o - 4}")
        r.need(o, 8 * nd + 12, f"dimensions, type and offset of tensor {name!r}")
        dims = struct.unpack_from(f"<{nd}Q", r.buf, o)
        o += 8 * nd
        gtype, rel = struct.unpack_from("<IQ", r.buf, o)
        o += 12
        infos.append((name, dims, gtype, rel, t0))
    data_offset = o + (-o % alignment)
    if n_tensors and data_offset > r.size:
        raise r.fail(f"truncated GGUF file: the tensor data would start at byte {data_offset}, the "
                     f"file has {r.size} bytes")
    out: dict[str, GGUFTensorInfo] = {}
    for name, dims, gtype, rel, t0 in infos:
        if gtype not in GGML_TYPES:
            raise r.fail(f"tensor {name!r} (info at byte {t0}) has unknown GGML type {gtype}")
        tname, blk, bsize, dt = GGML_TYPES[gtype]
        if dims and dims[0] % blk:
            raise r.fail(f"tensor {name!r}: first dimension {dims[0]} is not a multiple of the "
                         f"{tname} block of {blk}")
        # overflow-safe size: Python integers, and a stop as soon as the product cannot fit
        n_el = 1
        for d in dims:
            n_el *= d
            if n_el * bsize > r.size * blk:
                raise r.fail(f"tensor {name!r}: dimensions {list(dims)} ({tname}) describe more "
                             f"data than the {r.size}-byte file holds")
        if any(d > (1 << 62) for d in dims):   # possible only with a zero dimension elsewhere
            raise r.fail(f"tensor {name!r}: dimension too large in {list(dims)}")
        nbytes = n_el // blk * bsize
        if rel % alignment:
            raise r.fail(f"tensor {name!r}: data offset {rel} is not a multiple of the alignment "
                         f"{alignment}")
        start = data_offset + rel
        if start + nbytes > r.size:
            raise r.fail(f"truncated file or bad offset: tensor {name!r} data at bytes "
                         f"[{start}, {start + nbytes}) lies outside "
                         f"the {r.size}-byte file (offset {rel} in the data section at byte "
                         f"{data_offset}, {nbytes} bytes)")
        shape = tuple(reversed(dims))
        if dt is not None:
            data = np.frombuffer(r.buf, dtype=dt, count=n_el, offset=start).reshape(shape)
        else:
            data = np.frombuffer(r.buf, dtype=np.uint8, count=nbytes, offset=start)
        out[name] = GGUFTensorInfo(name, gtype, shape, start, nbytes, data)
    return out, data_offset


def read_gguf_metadata(path: str | os.PathLike, prefixes: Sequence[str] | None = None, *,
                       strings: str = "strict", arrays: str = "numpy") -> dict[str, Any]:
    """The key/value metadata of a GGUF file (the tensor infos are not read)."""
    return read_gguf(path, tensors=False, prefixes=prefixes, strings=strings, arrays=arrays).metadata
