"""Random checkpoints of published shapes, for speed measurements of families no real checkpoint
of which is reachable here (no hub): the config of pyklei_dev/published_configs.py, weights drawn
by transformers' own initialisation (N(0, 0.02), norms 1), bf16 safetensors, and the family's
real tokenizer files (tests/fixtures/tokenizer_references.py: Qwen's 151,643 BPE ranks, Gemma 3's
262,144-piece SentencePiece model), so that llama.cpp's convert_hf_to_gguf.py recognises the
tokenizer as it would the published checkpoint's.

    from random_family import random_checkpoint
    hf_dir = random_checkpoint("Qwen3-1.7B")       # ~/.cache/pyklei/random-Qwen3-1.7B

Speed depends on shapes, not on values, so these measure what the published models would; their
text is noise, so they measure no quality.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)

# architectures[0] -> (transformers model_type, the tokenizer directory's maker)
MODEL_TYPES = {
    "Qwen3ForCausalLM": ("qwen3", "qwen_hf_dir"),
    "Qwen2ForCausalLM": ("qwen2", "qwen_hf_dir"),
    "Gemma3ForCausalLM": ("gemma3_text", "gemma3_hf_dir"),
}


def random_checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of a random checkpoint of `name`'s published shape, made once and cached
    (built in a temporary directory and renamed, so an interrupted run leaves nothing)."""
    import torch
    import transformers

    import tokenizer_references
    from pyklei_dev.assets import cache_dir
    from pyklei_dev.published_configs import PUBLISHED

    out = cache_dir() / f"random-{name}"
    if (out / "config.json").is_file():
        return out
    cfg = dict(PUBLISHED[name])
    if cfg["architectures"][0] not in MODEL_TYPES:
        raise ValueError(f"no random checkpoint recipe for {cfg['architectures'][0]} "
                         f"(known: {', '.join(MODEL_TYPES)})")
    model_type, tokenizer_dir = MODEL_TYPES[cfg["architectures"][0]]
    cfg.pop("model_type", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=f".random-{name}-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok = getattr(tokenizer_references, tokenizer_dir)()
        for f in tok.iterdir():
            if f.name not in ("config.json",):
                shutil.copy(f, tmp / f.name)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


if __name__ == "__main__":
    for n in sys.argv[1:] or ["Qwen3-1.7B", "gemma-3-1b-it"]:
        print(random_checkpoint(n))
