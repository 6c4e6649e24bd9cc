"""Regenerates the fuzz seed corpus: two very small pyklei model files.

    python tests/fuzz_corpus/make_seeds.py        # writes tests/fuzz_corpus/seed-*.gguf

seed-tied-q4.gguf:  tied embeddings (qsi8cx), qsi4c32 layers, llama3 rope_freqs, BPE tokenizer.
seed-untied-q8.gguf: untied, 4-bit embedding and lm_head, ffn_down kept as qsi8cx, no rope_freqs,
                     SentencePiece tokenizer.
seed-tied-q6.gguf:  tied embeddings as qsi6c32 (the converter's default since version 2).
Both are deterministic (fixed seeds) and a few tens of KB, so the corpus stays < 200 KB.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))          # tests/models.py
sys.path.append(str(HERE.parents[1]))  # pyklei_dev/ (not installed: its __init__.py)


def main() -> None:
    from models import make_tiny_llama
    from pyklei.converters import convert

    small = dict(hidden_size=64, n_head=2, n_head_kv=1, n_layer=1, intermediate_size=128,
                 vocab_size=384)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = make_tiny_llama(tmp / "a", head_dim=32, tied=True, tokenizer="bpe", seed=1, **small)
        convert(hf, HERE / "seed-tied-q4.gguf", force=True, name="seed-a", embedding_bits=8)
        convert(hf, HERE / "seed-tied-q6.gguf", force=True, name="seed-c", embedding_bits=6)
        hf = make_tiny_llama(tmp / "b", head_dim=32, tied=False, tokenizer="spm", seed=2,
                             rope_scaling=False, **small)
        convert(hf, HERE / "seed-untied-q8.gguf", force=True, name="seed-b", embedding_bits=4,
                keep=["blk.0.ffn_down.weight=q8"])
    for p in sorted(HERE.glob("seed-*.gguf")):
        print(p.name, p.stat().st_size)


if __name__ == "__main__":
    main()
