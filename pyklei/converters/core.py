"""The format-independent half of the converter: quantization policy and the streaming writer.

A *source* (HF safetensors checkpoint, llama.cpp GGUF) describes the model as metadata
key/values plus an ordered list of `SourceTensor`s whose shapes are known up front and whose
rows can be read on demand as float32. `write_model` then

1. decides each tensor's output format (qsi4c32, qsi8cx, f16, bf16, f32),
2. writes the GGUF header, metadata and tensor infos (all shapes are known),
3. streams the tensor data chunk by chunk of rows (read -> quantize -> write), so memory
   holds one chunk plus the small scale arrays, never the model,
4. writes to a temporary file next to the output and renames it at the end; on any error or
   interrupt the temporary file is removed.
"""
from __future__ import annotations

import fnmatch
import math
import os
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from pyklei.formats import QSI4C32_BLOCK_SIZES
from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L
from pyklei.formats.model_file import HParams, ModelFileError, read_hparams
from pyklei.formats.registry import WEIGHT_FORMATS, WeightFormat, weight_format

from .errors import ConversionError

CONVERTER_VERSION = "2"   # 2: qsi6c32 embedding by default, norm-gain weighted 4-bit scales
EMBEDDING_BITS = {4: "qsi4c32", 6: "qsi6c32", 8: "qsi8cx", 16: "f16"}   # --embedding-bits
DEFAULT_EMBEDDING_BITS = 6
CHUNK_ELEMS = 1 << 23  # rows per chunk: ~8M elements (32 MB of float32)
F16_MAX = 65504.0


@dataclass
class SourceTensor:
    name: str                      # GGUF tensor name (llama.cpp's)
    shape: tuple[int, ...]         # logical numpy shape: (N, K) or (n,)
    kind: str                      # "linear" | "embedding" | "output" | "norm" | "rope_freqs"
    read: Callable[[int, int], np.ndarray]  # rows r0:r1 -> float32 array
    src_name: str = ""             # name in the source (HF name), for messages and --keep
    whole: bool = False            # must be read in one piece (e.g. q/k row permutation)
    # (format name, block size) -> the stored arrays chosen elsewhere (GPTQ:
    # calibration_forward.py), written as given; None (or returning None): rounded here.
    quantized: Callable[[str, int], tuple[np.ndarray, ...] | None] | None = None


@dataclass
class ModelSource:
    kv: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]
    tensors: list[SourceTensor]
    description: str
    close: Callable[[], None] | None = None
    after_tensor: Callable[[], None] | None = None  # e.g. drop mmapped pages from RSS
    notes: list[str] = field(default_factory=list)   # said in the conversion summary
    # A rotated source (rotation.py): x -> x @ Q_f, the transform the forward pass
    # applies to the SwiGLU output before down_proj; None when unrotated.
    ffn_down_input: Callable[[np.ndarray], np.ndarray] | None = None
    # Told {GGUF name: format} of every tensor before any is read: a source whose `quantized`
    # rules depend on other tensors' formats (GPTQ runs a whole layer at once) learns them here.
    before_write: Callable[[dict[str, str]], None] | None = None
    # Given, before any tensor is read, a function that shows one line of status (the progress
    # bar's postfix), or None when there is no bar: a source that works long between two
    # tensors (GPTQ runs a whole layer) says there what it does, instead of printing under the
    # bar and breaking it.
    set_status: Callable[[Callable[[str], None] | None], None] | None = None


def source_hparams(src: ModelSource, group_size: int = 32) -> HParams:
    """The source's hyperparameters, checked as the loader will check the written file."""
    kv = {k: v for k, v, *_ in src.kv}
    types = {k: t for k, _, t, _ in src.kv}
    try:
        return read_hparams(kv, types.get, {t.name for t in src.tensors}, "the source", group_size)
    except ModelFileError as e:
        raise ConversionError(str(e)) from None


@dataclass
class TensorReport:
    name: str
    fmt: str                       # a format name of pyklei.formats.registry ("qsi4c32", ...)
    shape: tuple[int, ...]
    nbytes: int
    rel_rmse: float


@dataclass
class ConversionResult:
    path: Path
    source: str
    tensors: list[TensorReport] = field(default_factory=list)
    file_size: int = 0
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    group_size: int = 32
    notes: list[str] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    def bits_per_weight(self, kinds: tuple[str, ...] | None = None) -> float:
        ts = [t for t in self.tensors if kinds is None or t.fmt in kinds]
        n = sum(math.prod(t.shape) for t in ts)
        return 8.0 * sum(t.nbytes for t in ts) / n if n else 0.0

    def block_linear_bits(self) -> float:
        """Bits per weight of the decoder blocks' linears (what the ladder's --bits counts)."""
        ts = [t for t in self.tensors if L.layer_of(t.name) is not None and len(t.shape) == 2]
        n = sum(math.prod(t.shape) for t in ts)
        return 8.0 * sum(t.nbytes for t in ts) / n if n else 0.0

    def by_format(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.fmt] = out.get(t.fmt, 0) + 1
        return out

    def summary(self) -> str:
        lines = [f"converted {self.source} -> {self.path}"]
        fm = ", ".join(f"{f}: {n}" for f, n in sorted(self.by_format().items()))
        lines.append(f"  tensors: {len(self.tensors)} ({fm})")
        lines.append(f"  parameters: {self.n_params:,}; file size: {self.file_size / 1e6:.1f} MB")
        lines.append(f"  bits per weight: {self.bits_per_weight():.3f} overall, "
                     f"{self.bits_per_weight(('qsi4c32',)):.3f} for qsi4c32 tensors "
                     f"(group size {self.group_size})")
        for fmt in ("qsi4c32", "qsi6c32", "qsi8cx", "f16"):
            errs = [t.rel_rmse for t in self.tensors if t.fmt == fmt]
            if errs:
                worst = max((t for t in self.tensors if t.fmt == fmt), key=lambda t: t.rel_rmse)
                lines.append(f"  relative RMSE ({fmt}): mean {np.mean(errs):.4f}, "
                             f"max {worst.rel_rmse:.4f} ({worst.name})")
        lines.append(f"  time: {self.seconds:.1f} s; peak RSS: {self.peak_rss_mb:.0f} MB")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def parse_keep(keep) -> list[tuple[str, str]]:
    """["PATTERN=FMT", ...], [(PATTERN, FMT), ...] or {PATTERN: FMT} -> [(pattern, format
    name)] (first match wins); FMT is any spelling pyklei.formats.registry.weight_format takes
    (q8, qsi8cx, 8, ...)."""
    if not keep:
        return []
    items = keep.items() if isinstance(keep, dict) else [
        k if isinstance(k, tuple) else _split_keep(k) for k in keep]
    out = []
    for pat, fmt in items:
        try:
            out.append((pat.strip(), weight_format(fmt).name))
        except ValueError as e:
            raise ConversionError(f"--keep {pat}={fmt.strip()}: {e}") from None
    return out


def _split_keep(s: str) -> tuple[str, str]:
    if "=" not in s:
        raise ConversionError(f"--keep expects PATTERN=FORMAT (e.g. 'blk.*.ffn_down.weight=q8'), got {s!r}")
    pat, fmt = s.rsplit("=", 1)
    return pat, fmt


def choose_format(t: SourceTensor, group_size: int, embedding_bits: int,
                  keep: list[tuple[str, str]], used: set | None = None) -> str:
    """Output format of t. Norms, rope_freqs and rotations are always f32 (--keep patterns skip them);
    linear weights default to q4, embeddings/output to --embedding-bits; the first --keep
    pattern matching the GGUF or source name overrides that."""
    if t.kind in ("norm", "head_norm", "bias", "rope_freqs", "rotation"):
        return "f32"
    fmt = "qsi4c32" if t.kind == "linear" else EMBEDDING_BITS[embedding_bits]
    for pat, f in keep:
        if _matches(pat, t):
            fmt = f
            if used is not None:
                used.add(pat)
            break
    if fmt == "qsi4c32":
        n, k = t.shape
        if k % group_size or k % 32:
            ok = [b for b in QSI4C32_BLOCK_SIZES if k % b == 0]
            hint = (f"use --group-size {ok[-1]}" if ok else "no qsi4c32 group size fits")
            raise ConversionError(
                f"{t.name}: input dimension K={k} is not divisible by the group size "
                f"{group_size}; {hint}, or keep this tensor at 8 bits with "
                f"--keep '{t.name}=q8'")
    if fmt == "qsi6c32" and t.shape[-1] % 32:
        raise ConversionError(f"{t.name}: qsi6c32 needs K divisible by 32, K={t.shape[-1]}; keep "
                              f"this tensor at 8 bits with --keep '{t.name}=q8'")
    return fmt


def _matches(pat: str, t: SourceTensor) -> bool:
    return fnmatch.fnmatchcase(t.name, pat) or bool(t.src_name and fnmatch.fnmatchcase(t.src_name, pat))


def _outputs(t: SourceTensor, fmt: str, bl: int):
    """GGUF tensors written for t: [(name, numpy shape, numpy dtype, GGML type)]."""
    names = [t.name, K.scales_name(t.name)]
    return [(nm, st.shape, st.dtype, GGMLQuantizationType(st.ggml_type))
            for nm, st in zip(names, WEIGHT_FORMATS[fmt].stored(t.shape, bl))]


class _DataStream:
    """Appends tensor data to the open GGUF file at the offsets the tensor infos promised."""

    def __init__(self, fout, alignment: int):
        self.f = fout
        self.align = alignment
        self._pad()
        self.data_start = self.f.tell()
        self.offset = 0   # offset of the current tensor within the data section
        self.written = 0

    def _pad(self):
        pad = -self.f.tell() % self.align
        if pad:
            self.f.write(b"\0" * pad)

    def begin(self):
        self._pad()
        assert self.f.tell() - self.data_start == self.offset, "tensor data misplaced"
        self.written = 0

    def write(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        self.f.write(a.data if a.flags.c_contiguous else a.tobytes())
        self.written += a.nbytes

    def end(self, nbytes: int):
        if self.written != nbytes:
            raise AssertionError(f"wrote {self.written} bytes for a {nbytes}-byte tensor")
        self.offset += nbytes + (-nbytes % self.align)


def load_importance(imatrix) -> dict[str, np.ndarray]:
    """An importance matrix: {GGUF tensor name: float [K]} from a dict or an .npz file (as
    written by `pyklei imatrix`); keys starting with '_' are metadata."""
    if imatrix is None:
        return {}
    if isinstance(imatrix, dict):
        return {k: np.asarray(v, np.float32) for k, v in imatrix.items() if not k.startswith("_")}
    path = Path(imatrix)
    if not path.is_file():
        raise ConversionError(f"missing importance matrix file: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: np.asarray(z[k], np.float32) for k in z.files if not k.startswith("_")}
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path} is not an importance matrix (.npz): {e}") from None


def norm_gain_importance(src: ModelSource) -> dict[str, np.ndarray]:
    """Data-free importance for the weights that read an RMSNorm's output: the squared gain
    of that norm per input channel. Input channel c of q/k/v, gate/up and the lm_head is
    rmsnorm(x)[c] * g[c], so a weight error in channel c costs the output ~g[c]^2 times more
    than one in a channel of unit gain (an imatrix measures the rest: the normalized
    activations' own spread). The tied token_embd is weighted for its lm_head role.
    Measured on SmolLM2-135M (docs/FORMAT.md): perplexity 12.006 -> 11.807 on one text, but
    KL divergence to fp32 only 1-2% lower and top-1 agreement 0.2-1.2 points lower, so it is
    an option (norm_weighting=True), not the default."""
    by_name = {t.name: t for t in src.tensors}

    def gain_sq(name):
        t = by_name.get(name)
        if t is None or len(t.shape) != 1:
            return None
        g = np.asarray(t.read(0, t.shape[0]), np.float32).reshape(-1)
        return np.square(g) if np.isfinite(g).all() else None

    out = {}
    for t in src.tensors:
        if t.kind == "embedding" and K.OUTPUT not in by_name:   # the tied lm_head
            norm = L.norm_of(K.OUTPUT)
        else:
            norm = L.norm_of(t.name)
        if norm is None:
            continue
        g2 = gain_sq(norm)
        if g2 is not None and len(t.shape) == 2 and g2.shape == (t.shape[-1],):
            out[t.name] = g2
    return out


def _current_umask() -> int:
    """The process umask. Linux shows it in /proc (since 4.7); elsewhere os.umask can only read
    it by setting it, which is process-wide, so that is the fallback."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_model(src: ModelSource, out_path, *, group_size: int = 32,
                embedding_bits: int = DEFAULT_EMBEDDING_BITS, keep=None, name: str | None = None,
                force: bool = False, progress: bool = True, imatrix=None,
                norm_weighting: bool = False) -> ConversionResult:
    t0 = time.time()
    importance = load_importance(imatrix)
    if norm_weighting:   # a measured imatrix, where given, wins: it includes the gains
        importance = {**norm_gain_importance(src), **importance}
    out_path = Path(out_path)
    if group_size not in QSI4C32_BLOCK_SIZES:
        raise ConversionError(f"--group-size must be one of {QSI4C32_BLOCK_SIZES}, got {group_size}")
    if embedding_bits not in EMBEDDING_BITS:
        raise ConversionError(f"--embedding-bits must be 4, 6, 8 or 16, got {embedding_bits}")
    if out_path.is_dir():
        raise ConversionError(f"output {out_path} is a directory; give a file name")
    if out_path.exists() and not force:
        raise ConversionError(f"{out_path} exists; pass force=True (--force) to overwrite it")
    keep = parse_keep(keep)
    used: set = set()
    plan = [(t, choose_format(t, group_size, embedding_bits, keep, used)) for t in src.tensors]
    for pat, fmt in keep:
        if pat not in used:
            raise ConversionError(
                f"--keep {pat}={fmt} matches no weight matrix (patterns are globs over GGUF "
                f"names like 'blk.*.ffn_down.weight' or HF names; norms are always f32)")
    if src.before_write:
        src.before_write({t.name: fmt for t, fmt in plan})

    arch = next((v for k, v, *_ in src.kv if k == K.GENERAL_ARCHITECTURE), K.ARCH)
    w = GGUFWriter(None, arch)
    w.add_custom_alignment(K.ALIGNMENT)
    for key, val, vtype, sub in src.kv:
        if key in (K.GENERAL_ARCHITECTURE, K.GENERAL_ALIGNMENT, K.KEY_FORMAT_VERSION,
                   K.KEY_BLOCK_SIZE, K.KEY_CONVERTER_VERSION) or key.startswith(K.KEY_FORMAT_PREFIX):
            continue
        if key == K.GENERAL_NAME and name:
            continue
        w.add_key_value(key, val, vtype, sub)
    if name:
        w.add_key_value(K.GENERAL_NAME, name, GGUFValueType.STRING)
    w.add_uint32(K.KEY_FORMAT_VERSION, K.FORMAT_VERSION)
    w.add_uint32(K.KEY_BLOCK_SIZE, group_size)
    w.add_string(K.KEY_CONVERTER_VERSION, CONVERTER_VERSION)
    for t, fmt in plan:
        if WEIGHT_FORMATS[fmt].quantized:
            w.add_string(K.format_key(t.name), fmt)
    outs = []
    for t, fmt in plan:
        o = _outputs(t, fmt, group_size)
        outs.append(o)
        for oname, shape, dtype, gtype in o:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            w.add_tensor_info(oname, shape, np.dtype(dtype), nbytes, raw_dtype=gtype)

    result = ConversionResult(path=out_path, source=src.description, group_size=group_size,
                              notes=list(src.notes))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".part")
    os.close(fd)
    bar = None
    try:
        w.write_header_to_file(Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        stream = _DataStream(w.fout[0], K.ALIGNMENT)
        if progress:
            bar = _ProgressBar(len(plan))
        if src.set_status:
            src.set_status(bar.status if bar is not None else None)
        for (t, fmt), o in zip(plan, outs):
            imp = importance.get(t.name)
            if imp is not None and fmt in ("qsi4c32", "qsi6c32") and imp.shape != (t.shape[-1],):
                raise ConversionError(f"importance for {t.name} has {imp.size} values, the tensor "
                                      f"has K={t.shape[-1]}: the imatrix is for another model")
            rep = _write_tensor(stream, t, fmt, group_size, o, imp)
            result.tensors.append(rep)
            if src.after_tensor:
                src.after_tensor()
            if bar is not None:
                bar.tensor_done(f"{t.name} {fmt} rel.RMSE {rep.rel_rmse:.4f}")
        w.fout[0].flush()
        os.fsync(w.fout[0].fileno())
        w.close()
        if out_path.exists() and not force:  # checked again: it may have appeared meanwhile
            raise ConversionError(f"{out_path} exists; pass force=True (--force) to overwrite it")
        # mkstemp made the file 0600; the model gets the mode any new file gets (0666 less the
        # umask), so that other users and services can read it, as llama.cpp's files.
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, out_path)
    except BaseException as e:
        w.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, ValueError) and not isinstance(e, ConversionError):
            raise ConversionError(f"conversion failed: {e}") from e
        raise
    finally:
        if bar is not None:
            bar.close()
    result.file_size = out_path.stat().st_size
    result.seconds = time.time() - t0
    result.peak_rss_mb = peak_rss_mb()
    return result


class _ProgressBar:
    """The one tqdm bar of a conversion: tensors written, and as its postfix the source's status
    (GPTQ's layer) and the last tensor's error. Nothing else may print while it is open."""

    def __init__(self, total: int):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="tensor", desc="converting", dynamic_ncols=True)
        self.note = self.last = ""

    def status(self, text: str) -> None:
        """The source's status, shown at once (it comes before a long step)."""
        self.note = text
        self._postfix(refresh=True)

    def tensor_done(self, text: str) -> None:
        self.last = text
        self._postfix(refresh=False)       # update() redraws, at most every 0.1 s
        self.bar.update(1)

    def _postfix(self, refresh: bool) -> None:
        self.bar.set_postfix_str(" | ".join(s for s in (self.note, self.last) if s), refresh=refresh)

    def close(self) -> None:
        self.bar.close()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _write_tensor(stream: _DataStream, t: SourceTensor, fmt: str, bl: int, outs,
                  importance: np.ndarray | None = None) -> TensorReport:
    wf: WeightFormat = WEIGHT_FORMATS[fmt]
    rows = t.shape[0]
    row_elems = math.prod(t.shape[1:]) if len(t.shape) > 1 else 1
    step = rows if (t.whole or len(t.shape) == 1) else max(1, CHUNK_ELEMS // row_elems)
    err2 = 0.0
    ref2 = 0.0
    side = []  # scales, written after the qs tensor
    given = t.quantized(fmt, bl) if t.quantized is not None else None
    if given is not None and [a.shape for a in given] != [tuple(o[1]) for o in outs]:
        raise ConversionError(f"{t.name}: the given {fmt} arrays have shapes "
                              f"{[a.shape for a in given]}, the file wants {[o[1] for o in outs]}")
    stream.begin()
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = np.asarray(t.read(r0, r1), dtype=np.float32)
        want = (r1 - r0,) + tuple(t.shape[1:])
        if x.shape != want:
            raise ConversionError(f"{t.name}: source gave shape {x.shape}, expected {want}")
        if not np.isfinite(x).all():
            raise ConversionError(f"{t.name} ({t.src_name or 'source'}) has NaN or Inf values")
        if fmt == "f16":
            big = float(np.abs(x).max()) if x.size else 0.0
            if big > F16_MAX:
                raise ConversionError(f"{t.name}: |value| {big:g} overflows f16; keep it as "
                                      f"bf16 or q8 instead (--keep '{t.name}=bf16')")
        if given is not None:   # rows r0:r1 of the arrays chosen elsewhere
            arrays = [a[r0:r1] for a in given]
        else:                   # formats without scale search ignore the importance
            arrays = wf.quantize(x, bl, importance)
        stream.write(arrays[0])
        side.extend(arrays[1:])
        deq = wf.dequantize(*arrays)
        d = (x - deq).ravel()
        err2 += float(np.dot(d, d))
        xr = x.ravel()
        ref2 += float(np.dot(xr, xr))
        del x, deq, d, xr
    stream.end(math.prod(outs[0][1]) * np.dtype(outs[0][2]).itemsize)
    nbytes = math.prod(outs[0][1]) * np.dtype(outs[0][2]).itemsize
    if len(outs) > 1:
        stream.begin()
        sc = np.concatenate(side, axis=0)
        stream.write(sc)
        n2 = math.prod(outs[1][1]) * np.dtype(outs[1][2]).itemsize
        stream.end(n2)
        nbytes += n2
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
    return TensorReport(t.name, fmt, tuple(t.shape), nbytes, rel)
