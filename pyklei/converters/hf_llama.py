"""Hugging Face LlamaForCausalLM checkpoints (config.json + safetensors) -> a ModelSource."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as T

from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L

from .core import ModelSource, SourceTensor
from .errors import ConversionError
from .hf_tokenizer import tokenizer_kv
from .safetensors_mmap import SafetensorsModel

SUPPORTED_ARCHS = ("LlamaForCausalLM",)
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


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None), from transformers 4 (rope_theta + rope_scaling) or
    transformers 5 (rope_parameters) config files."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        theta = float(rp["rope_theta"])
        kind = rp.get("rope_type", rp.get("type", "default"))
        scaling = None if kind == "default" else dict(rp)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            return theta, None
        if kind != "llama3":
            raise ConversionError(
                f"unsupported feature: rope scaling of type {kind!r} (only 'llama3' is supported)")
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in scaling:
                raise ConversionError(f"rope scaling 'llama3' lacks {k!r} in config.json")
    return theta, scaling


def hparams_from_config(cfg: dict) -> dict:
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs):
        what = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
        raise ConversionError(
            f"unsupported architecture {what}; supported: {', '.join(SUPPORTED_ARCHS)}")
    for feat in ("attention_bias", "mlp_bias"):
        if cfg.get(feat):
            raise ConversionError(f"unsupported feature: {feat}=true (bias terms)")
    if cfg.get("quantization_config"):
        raise ConversionError("unsupported feature: a pre-quantized checkpoint "
                              f"(quantization_config {cfg['quantization_config'].get('quant_method')!r}); "
                              "convert the original bf16/f16/f32 weights")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"unsupported feature: hidden_act={act!r} (only 'silu')")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError("unsupported feature: partial_rotary_factor != 1")
    try:
        h = int(cfg["hidden_size"])
        nh = int(cfg["num_attention_heads"])
        hp = dict(
            vocab_size=int(cfg["vocab_size"]),
            n_embd=h,
            n_layer=int(cfg["num_hidden_layers"]),
            n_ff=int(cfg["intermediate_size"]),
            n_head=nh,
            n_head_kv=int(cfg.get("num_key_value_heads") or nh),
            head_dim=int(cfg.get("head_dim") or h // nh),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}") from None
    if hp["n_head"] % hp["n_head_kv"]:
        raise ConversionError(f"num_attention_heads={nh} is not a multiple of "
                              f"num_key_value_heads={hp['n_head_kv']}")
    if hp["head_dim"] % 2:
        raise ConversionError(f"head_dim={hp['head_dim']} must be even for RoPE")
    hp["rope_theta"], hp["rope_scaling"] = _rope(cfg)
    return hp


def hparams_kv(hp: dict, name: str):
    kv = [
        ("general.type", "model", T.STRING, None),
        (K.GENERAL_NAME, name, T.STRING, None),
        (K.CONTEXT_LENGTH, hp["context_length"], T.UINT32, None),
        (K.EMBEDDING_LENGTH, hp["n_embd"], T.UINT32, None),
        (K.BLOCK_COUNT, hp["n_layer"], T.UINT32, None),
        (K.FEED_FORWARD_LENGTH, hp["n_ff"], T.UINT32, None),
        (K.HEAD_COUNT, hp["n_head"], T.UINT32, None),
        (K.HEAD_COUNT_KV, hp["n_head_kv"], T.UINT32, None),
        (K.KEY_LENGTH, hp["head_dim"], T.UINT32, None),
        (K.VALUE_LENGTH, hp["head_dim"], T.UINT32, None),
        (K.RMS_EPS, hp["rms_eps"], T.FLOAT32, None),
        (K.ROPE_FREQ_BASE, hp["rope_theta"], T.FLOAT32, None),
        (K.ROPE_DIM, hp["head_dim"], T.UINT32, None),
        (K.VOCAB_SIZE, hp["vocab_size"], T.UINT32, None),
    ]
    sc = hp.get("rope_scaling")
    if sc:
        kv += [
            (K.ROPE_SCALING_TYPE, "llama3", T.STRING, None),
            (K.ROPE_SCALING_FACTOR, float(sc["factor"]), T.FLOAT32, None),
            (K.ROPE_SCALING_LOW, float(sc["low_freq_factor"]), T.FLOAT32, None),
            (K.ROPE_SCALING_HIGH, float(sc["high_freq_factor"]), T.FLOAT32, None),
            (K.ROPE_SCALING_ORIG_CTX, int(sc["original_max_position_embeddings"]), T.UINT32, None),
        ]
    return kv


def expected_tensors(hp: dict) -> dict[str, tuple[str, tuple[int, ...], str, int]]:
    """HF name -> (GGUF name, shape, kind, q/k heads to permute or 0), in file order."""
    dims = L.Dims(vocab_size=hp["vocab_size"], n_embd=hp["n_embd"], n_layer=hp["n_layer"],
                  n_ff=hp["n_ff"], n_head=hp["n_head"], n_head_kv=hp["n_head_kv"],
                  head_dim=hp["head_dim"], tied=hp["tied"])
    return {spec.hf_name(layer): (name, spec.shape(dims), spec.kind, spec.head_count(dims))
            for name, spec, layer in L.for_each_tensor(dims) if spec.hf is not None}


def hf_source(hf_dir, name: str | None = None) -> ModelSource:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"missing input: {hf_dir} is not a directory")
    cfg = _load_config(hf_dir)
    hp = hparams_from_config(cfg)
    st = SafetensorsModel(hf_dir)
    want = expected_tensors(hp)
    missing = [n for n in want if n not in st]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConversionError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more} "
                              f"that config.json implies")
    extra = [n for n in st.keys() if n not in want and not n.endswith(IGNORED_TENSOR_SUFFIXES)
             and not (hp["tied"] and n == L.BY_PART["output"].hf_name())]
    if extra:
        raise ConversionError(f"checkpoint has tensor(s) config.json does not account for: "
                              f"{', '.join(sorted(extra)[:5])}"
                              f"{' …' if len(extra) > 5 else ''} (unsupported feature or wrong config)")
    for n, (_, shape, _, _) in want.items():
        if tuple(st.shape(n)) != shape:
            raise ConversionError(f"config.json does not match the weights: {n} has shape "
                                  f"{list(st.shape(n))}, config implies {list(shape)}")
    kv = hparams_kv(hp, name or hf_dir.name)
    kv += tokenizer_kv(hf_dir, cfg, hp["vocab_size"])

    tensors = []
    sc = hp["rope_scaling"]
    if sc:
        factors = llama3_rope_factors(hp["head_dim"], hp["rope_theta"], float(sc["factor"]),
                                      float(sc["low_freq_factor"]), float(sc["high_freq_factor"]),
                                      int(sc["original_max_position_embeddings"]))
        tensors.append(SourceTensor(K.ROPE_FREQS, factors.shape, "rope_freqs",
                                    lambda r0, r1, f=factors: f[r0:r1], "rope_scaling"))
    for n, (gname, shape, kind, heads) in want.items():
        if heads:
            read = (lambda r0, r1, n=n, heads=heads: permute_qk(st.read(n), heads)[r0:r1])
        else:
            read = (lambda r0, r1, n=n: st.read(n, r0, r1))
        tensors.append(SourceTensor(gname, shape, kind, read, n, whole=bool(heads)))
    dtypes = sorted({st.dtype(n) for n in want})
    return ModelSource(kv=kv + [(K.KEY_SOURCE, "hf", T.STRING, None)], tensors=tensors,
                       description=f"{hf_dir} (HF {'/'.join(dtypes).lower()})")
