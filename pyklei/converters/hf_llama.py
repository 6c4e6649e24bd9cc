"""Hugging Face checkpoints (config.json + safetensors) of every family pyklei runs
(pyklei/formats/families.py) -> a ModelSource.

The config is read by hf_config.py; the tensors are the Llama table's (llama_tensors.py) with
the family's Hugging Face names (Family.hf_part, and Family.hf_nested for a language model
inside an image-text checkpoint), transformed at read time into what a pyklei file holds:
q/k rows (weights, biases, head norms) from rotate-half into interleaved-pair order over the
rotated dimensions, RMSNorm gains as used (Gemma's 1 + w), fused projections (Phi-3's qkv_proj,
gate_up_proj) split into their row blocks, and LongRoPE's attention factor folded into q's and
k's rotated rows."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as T

from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L

from .core import ModelSource, SourceTensor
from .errors import ConversionError
from .hf_config import hparams_from_config, hparams_kv  # noqa: F401  (the converter's API)
from .st_pooling import pooling_kv
from .hf_tokenizer import tokenizer_kv
from .safetensors_mmap import SafetensorsModel

IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp's interleaved-pair order, per head.

    In HF a head's rows are [x_0 … x_{d/2-1}, y_0 … y_{d/2-1}] where (x_i, y_i) is the i-th
    rotated pair; llama.cpp stores them as [x_0, y_0, x_1, y_1, …]. New row 2i+h of a head
    is old row h*d/2 + i (h = 0, 1).
    """
    n = w.shape[0]
    return (w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def permute_qk_rows(w: np.ndarray, n_head: int, rope_dim: int | None = None) -> np.ndarray:
    """permute_qk on the first rope_dim rows of each head only (partial RoPE: the rest of a
    head is not rotated and keeps its order). Weights [n_head*hd, K], biases and head norms
    [n_head*hd]."""
    hd = w.shape[0] // n_head
    if not rope_dim or rope_dim == hd:
        return permute_qk(w, n_head)
    heads = w.reshape(n_head, hd, *w.shape[1:]).copy()
    heads[:, :rope_dim] = permute_qk(heads[:, :rope_dim].reshape(n_head * rope_dim, *w.shape[1:]),
                                     n_head).reshape(n_head, rope_dim, *w.shape[1:])
    return heads.reshape(w.shape)


def scale_rotated_rows(w: np.ndarray, n_head: int, rope_dim: int, gain: float) -> np.ndarray:
    """w with the first rope_dim rows of each head times gain (LongRoPE's attention factor,
    hf_config.fold_longrope); any row order within them, before or after permute_qk_rows."""
    if gain == 1.0:
        return w
    heads = w.reshape(n_head, -1, *w.shape[1:]).copy()
    heads[:, :rope_dim] *= np.float32(gain)
    return heads.reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_qk (llama.cpp order -> HF order)."""
    n = w.shape[0]
    return (w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """Per-frequency divisors for Llama 3 RoPE scaling (llama.cpp's rope_freqs tensor).

    The runtime rotates pair i by pos * theta**(-2i/d) / f[i]. Wavelengths shorter than
    original_context / high_freq_factor keep f = 1, longer than original_context /
    low_freq_factor get f = factor, and the band between interpolates smoothly.
    """
    if high_freq_factor == low_freq_factor:
        raise ConversionError("rope_scaling: high_freq_factor must differ from low_freq_factor")
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    freq = 1.0 / theta ** (i / head_dim)
    wavelen = 2 * math.pi / freq
    low_wl = original_context / low_freq_factor
    high_wl = original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    f = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, mid))
    return f.astype(np.float32)


def _load_config(hf_dir: Path) -> dict:
    p = hf_dir / "config.json"
    if not p.is_file():
        raise ConversionError(f"missing config.json in {hf_dir}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{p}: invalid JSON ({e})") from None


@dataclass(frozen=True)
class HFTensor:
    """Where a tensor of the file comes from in the checkpoint."""
    name: str                  # GGUF name
    shape: tuple[int, ...]     # the file's shape
    kind: str
    hf: str                    # the checkpoint's tensor
    row0: int = 0              # its rows [row0, row0 + shape[0]) (a block of a fused tensor)
    heads: int = 0             # q/k: heads whose rows are permuted (0: none)


def _dims(hp: dict) -> L.Dims:
    return L.Dims(vocab_size=hp["vocab_size"], n_embd=hp["n_embd"], n_layer=hp["n_layer"],
                  n_ff=hp["n_ff"], n_head=hp["n_head"], n_head_kv=hp["n_head_kv"],
                  head_dim=hp["head_dim"], tied=hp["tied"], features=hp["family"].features)


def expected_tensors(hp: dict, prefixes: tuple[str, str] = ("model.", "")) -> list[HFTensor]:
    """The file's tensors (table order) and where each lies in the checkpoint. prefixes: the
    text model's (prefix of "model." names, prefix of "lm_head")."""
    fam, dims = hp["family"], _dims(hp)
    out, next_row = [], {}
    for name, spec, layer in L.for_each_tensor(dims):
        hf = spec.hf_name(layer, fam.hf_part(spec.part, spec.hf))
        if hf is None:
            continue
        hf = prefixes[0] + hf[len("model."):] if hf.startswith("model.") else prefixes[1] + hf
        shape = spec.shape(dims)
        row0 = next_row.get(hf, 0)          # parts sharing a name: consecutive row blocks
        next_row[hf] = row0 + shape[0]
        out.append(HFTensor(name, shape, spec.kind, hf, row0, spec.head_count(dims)))
    return out


def _text_prefixes(hp: dict, st: SafetensorsModel) -> tuple[str, str]:
    """The checkpoint's (model, lm_head) prefixes: the first of the class's candidates under
    which the embedding lies."""
    nested = hp["family"].hf_nested.get(hp["hf_class"])
    if nested is None:
        return "model.", ""
    embd = L.BY_PART["token_embd"].hf_name()[len("model."):]
    for prefixes in nested[1]:
        if prefixes[0] + embd in st:
            return prefixes
    raise ConversionError(f"checkpoint lacks the language model's {embd} under any of "
                          f"{', '.join(p for p, _ in nested[1])}")


def _check_tensors(hp: dict, st: SafetensorsModel, want: list[HFTensor], prefixes) -> None:
    fused: dict[str, tuple[int, ...]] = {}
    for t in want:
        rows = t.row0 + t.shape[0]
        fused[t.hf] = (max(rows, fused.get(t.hf, (0,))[0]),) + t.shape[1:]
    missing = [n for n in fused if n not in st]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConversionError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more} "
                              f"that config.json implies")
    head = prefixes[1] + L.BY_PART["output"].hf_name()
    nested = hp["family"].hf_nested.get(hp["hf_class"]) is not None
    extra = [n for n in st.keys() if n not in fused and not n.endswith(IGNORED_TENSOR_SUFFIXES)
             and not (hp["tied"] and n == head)
             # an image-text checkpoint's other parts (vision tower, projector) are not ours
             and not (nested and not n.startswith(prefixes[0]) and n != head)]
    if extra:
        raise ConversionError(f"checkpoint has tensor(s) config.json does not account for: "
                              f"{', '.join(sorted(extra)[:5])}"
                              f"{' …' if len(extra) > 5 else ''} (unsupported feature or wrong config)")
    for n, shape in fused.items():
        if tuple(st.shape(n)) != shape:
            raise ConversionError(f"config.json does not match the weights: {n} has shape "
                                  f"{list(st.shape(n))}, config implies {list(shape)}")


def _reader(hp: dict, st: SafetensorsModel, t: HFTensor):
    """rows r0:r1 of tensor t as the file holds them (float32)."""
    fam = hp["family"]
    offset = fam.hf_norm_offset if t.kind in (L.NORM, L.HEAD_NORM) else 0.0
    gain = hp.get("qk_rope_gain", 1.0) if t.heads and t.kind == L.LINEAR else 1.0
    if not t.heads:
        def read(r0, r1):
            w = st.read(t.hf, t.row0 + r0, t.row0 + r1)
            return w + np.float32(offset) if offset else w
        return read

    def read_whole(r0, r1):
        w = np.asarray(st.read(t.hf, t.row0, t.row0 + t.shape[0]), np.float32)
        if offset:
            w = w + np.float32(offset)
        w = scale_rotated_rows(w, t.heads, hp["rope_dim"], gain)
        return permute_qk_rows(w, t.heads, hp["rope_dim"])[r0:r1]
    return read_whole


def hf_source(hf_dir, name: str | None = None) -> ModelSource:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"missing input: {hf_dir} is not a directory")
    cfg = _load_config(hf_dir)
    hp = hparams_from_config(cfg)
    st = SafetensorsModel(hf_dir)
    prefixes = _text_prefixes(hp, st)
    want = expected_tensors(hp, prefixes)
    _check_tensors(hp, st, want, prefixes)
    kv = hparams_kv(hp, name or hf_dir.name)
    nested = hp["family"].hf_nested.get(hp["hf_class"])
    text_cfg = {**cfg, **cfg[nested[0]]} if nested else cfg
    kv += tokenizer_kv(hf_dir, text_cfg, hp["vocab_size"])
    kv += pooling_kv(hf_dir, hp["family"].arch)

    tensors = []
    sc = hp["rope_scaling"]
    factors = None
    if sc and sc["rope_type"] == "llama3":
        factors = llama3_rope_factors(hp["rope_dim"], hp["rope_theta"], float(sc["factor"]),
                                      float(sc["low_freq_factor"]), float(sc["high_freq_factor"]),
                                      int(sc["original_max_position_embeddings"]))
    elif sc:
        factors = hp["rope_factors"]
    if factors is not None:
        tensors.append(SourceTensor(K.ROPE_FREQS, factors.shape, "rope_freqs",
                                    lambda r0, r1, f=factors: f[r0:r1], "rope_scaling"))
    for t in want:
        tensors.append(SourceTensor(t.name, t.shape, t.kind, _reader(hp, st, t), t.hf,
                                    whole=bool(t.heads)))
    dtypes = sorted({st.dtype(t.hf) for t in want})
    return ModelSource(kv=kv + [(K.KEY_SOURCE, "hf", T.STRING, None)], tensors=tensors,
                       description=f"{hf_dir} (HF {'/'.join(dtypes).lower()})",
                       notes=list(hp["notes"]))
