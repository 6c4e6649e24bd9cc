"""The pooling a sentence-transformers checkpoint declares, as the file's metadata.

An embedding model published for sentence-transformers lists its modules in modules.json; its
Pooling module's config (usually 1_Pooling/config.json) says how token rows become one vector:
pooling_mode_mean_tokens, pooling_mode_lasttoken (Qwen3-Embedding and other decoder embedding
models) or pooling_mode_cls_token. The converter records it under llama.cpp's key
(gguf_keys.POOLING_TYPE), which pyklei.runtime.embedding reads back as the model's default.
"""
from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFValueType as T

from pyklei.formats import gguf_keys as K

from .errors import ConversionError

POOLING_MODULE = "sentence_transformers.models.Pooling"
# a Pooling config's flag -> the pooling type's name (K.POOLING_TYPES)
MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last",
         "pooling_mode_cls_token": "cls"}
UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens")


def _pooling_dir(hf_dir: Path) -> Path | None:
    modules = hf_dir / "modules.json"
    if modules.is_file():
        try:
            entries = json.loads(modules.read_text())
        except json.JSONDecodeError as e:
            raise ConversionError(f"{modules}: invalid JSON ({e})") from None
        for m in entries if isinstance(entries, list) else []:
            if isinstance(m, dict) and m.get("type") == POOLING_MODULE and isinstance(m.get("path"), str):
                return hf_dir / m["path"]
        return None
    return hf_dir / "1_Pooling" if (hf_dir / "1_Pooling").is_dir() else None


def declared_pooling(hf_dir) -> str | None:
    """The name of the pooling the checkpoint's sentence-transformers config declares, or None
    (no such config). A mode pyklei does not pool by (max, sqrt-length mean, weighted mean) is a
    ConversionError: its vectors would silently differ from the model's own."""
    d = _pooling_dir(Path(hf_dir))
    if d is None or not (d / "config.json").is_file():
        return None
    p = d / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{p}: invalid JSON ({e})") from None
    bad = [k for k in UNSUPPORTED if cfg.get(k)]
    on = [name for k, name in MODES.items() if cfg.get(k)]
    if bad or len(on) != 1:
        raise ConversionError(f"{p}: pyklei pools by exactly one of {', '.join(MODES)}; this "
                              f"config sets {', '.join(bad + [k for k in MODES if cfg.get(k)]) or 'none'}")
    return on[0]


def pooling_kv(hf_dir, arch: str) -> list:
    """The file's pooling key, where the checkpoint declares one."""
    name = declared_pooling(hf_dir)
    if name is None:
        return []
    return [(K.arch_key(arch, K.POOLING_TYPE), K.POOLING_TYPES[name], T.UINT32, None)]
