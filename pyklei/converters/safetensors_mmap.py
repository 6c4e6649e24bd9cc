"""A small, strict safetensors reader that never loads a whole file.

safetensors layout: an 8-byte little-endian header length H, H bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data; offsets are relative to byte 8 + H. We validate the header against the file size and
read tensors (or row ranges of them) through a short-lived ``np.memmap`` of just those bytes,
so the pages touched are unmapped again and the process's RSS stays at one chunk.
numpy has no bfloat16, so BF16 data is widened to float32 by bit shifting.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from .errors import ConversionError

_DTYPES = {
    "BF16": (np.uint16, 2),
    "F16": (np.float16, 2),
    "F32": (np.float32, 4),
}
_MAX_HEADER = 100 << 20


class SafetensorsFile:
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConversionError(f"missing safetensors file: {self.path}")
        self.file_size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{self.path}: truncated safetensors file (no header)")
            hlen = int.from_bytes(head, "little")
            if hlen <= 1 or hlen > _MAX_HEADER or 8 + hlen > self.file_size:
                raise ConversionError(
                    f"{self.path}: corrupt or truncated safetensors file (header length {hlen}, "
                    f"file size {self.file_size})")
            raw = f.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ConversionError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + hlen
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ConversionError(f"{self.path}: corrupt safetensors entry for {name!r}") from None
            if dtype not in _DTYPES:
                raise ConversionError(
                    f"{self.path}: tensor {name!r} has dtype {dtype}; supported: bf16, f16, f32")
            nbytes = math.prod(shape) * _DTYPES[dtype][1]
            if end - begin != nbytes or begin < 0:
                raise ConversionError(
                    f"{self.path}: corrupt safetensors entry for {name!r}: shape {list(shape)} "
                    f"{dtype} needs {nbytes} bytes, offsets give {end - begin}")
            if self.data_start + end > self.file_size:
                raise ConversionError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte "
                    f"{self.data_start + end} but the file has {self.file_size} bytes")
            self.tensors[name] = (dtype, shape, begin, end)

    def keys(self):
        return self.tensors.keys()

    def __contains__(self, name):
        return name in self.tensors

    def shape(self, name) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name) -> str:
        return self.tensors[name][0]

    def read(self, name, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows r0:r1 (along the first axis) of tensor `name` as a new float32 array."""
        dtype, shape, begin, _ = self.tensors[name]
        np_dtype, itemsize = _DTYPES[dtype]
        rows = shape[0] if shape else 1
        r1 = rows if r1 is None else r1
        if not 0 <= r0 <= r1 <= rows:
            raise IndexError(f"rows {r0}:{r1} out of range for {name} {shape}")
        row_elems = math.prod(shape[1:]) if len(shape) > 1 else 1
        count = (r1 - r0) * row_elems
        out_shape = ((r1 - r0),) + tuple(shape[1:]) if shape else ()
        if count == 0:
            return np.zeros(out_shape, np.float32)
        mm = np.memmap(self.path, dtype=np_dtype, mode="r",
                       offset=self.data_start + begin + r0 * row_elems * itemsize, shape=(count,))
        if dtype == "BF16":
            out = (mm.astype(np.uint32) << 16).view(np.float32)
        else:
            out = mm.astype(np.float32)
        del mm  # the only reference: the mapping goes away now, and with it its RSS
        return out.reshape(out_shape)


class SafetensorsModel:
    """All tensors of a checkpoint directory: model.safetensors, or shards listed in
    model.safetensors.index.json (every listed shard must exist)."""

    def __init__(self, hf_dir):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        self.where: dict[str, SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: corrupt shard index ({e})") from None
            files: dict[str, SafetensorsFile] = {}
            for shard in sorted(set(weight_map.values())):
                p = hf_dir / shard
                if not p.is_file():
                    raise ConversionError(
                        f"missing shard {shard} (listed in {index.name}) in {hf_dir}")
                files[shard] = SafetensorsFile(p)
            for name, shard in weight_map.items():
                if name not in files[shard]:
                    raise ConversionError(
                        f"{index.name} says {name!r} is in {shard}, but that shard lacks it")
                self.where[name] = files[shard]
        else:
            single = hf_dir / "model.safetensors"
            if not single.is_file():
                found = sorted(p.name for p in hf_dir.glob("*.safetensors"))
                if found:
                    raise ConversionError(
                        f"{hf_dir} has {found} but no model.safetensors.index.json to say "
                        f"which tensors they hold")
                raise ConversionError(
                    f"missing model weights: no model.safetensors or model.safetensors.index.json "
                    f"in {hf_dir} (only safetensors checkpoints are supported)")
            f = SafetensorsFile(single)
            for name in f.keys():
                self.where[name] = f

    def __contains__(self, name):
        return name in self.where

    def keys(self):
        return self.where.keys()

    def shape(self, name):
        return self.where[name].shape(name)

    def dtype(self, name):
        return self.where[name].dtype(name)

    def read(self, name, r0=0, r1=None):
        return self.where[name].read(name, r0, r1)


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write numpy arrays as a safetensors file, streaming one tensor at a time.

    `tensors` maps name -> (dtype string "BF16"|"F16"|"F32", shape, producer) where
    producer() returns the raw array (uint16 bits for BF16) of that shape, or an iterator of
    consecutive row chunks of it; producers are called in order while writing, so only one
    tensor (or chunk) is in memory at a time.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, (dtype, shape, _) in tensors.items():
        n = math.prod(shape) * _DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(hbytes).to_bytes(8, "little"))
        f.write(hbytes)
        for name, (dtype, shape, produce) in tensors.items():
            out = produce()
            chunks = [out] if isinstance(out, np.ndarray) else out
            want = _DTYPES[dtype][0]
            rows = 0
            for a in chunks:
                a = np.ascontiguousarray(a)
                if a.dtype != want or tuple(a.shape[1:]) != tuple(shape[1:]):
                    raise ValueError(f"{name}: producer gave {a.dtype} {a.shape}, "
                                     f"expected {np.dtype(want)} {tuple(shape)}")
                a.tofile(f)
                rows += a.shape[0] if a.ndim else 1
            if rows != (shape[0] if shape else 1):
                raise ValueError(f"{name}: producer gave {rows} rows, expected {tuple(shape)}")
        f.flush()
        os.fsync(f.fileno())
