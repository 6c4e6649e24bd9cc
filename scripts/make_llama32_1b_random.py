#!/usr/bin/env python
"""Write a random bf16 checkpoint with Llama 3.2 1B's exact configuration (1.24 B parameters),
or with --shape 3b / 8b Llama 3.2 3B's (3.21 B) or Llama 3.1 8B's (8.03 B).

1B: hidden 2048, 16 layers, 32 heads / 8 KV heads (head_dim 64), ffn 8192, vocab 128256, tied
embeddings, llama3 RoPE scaling (factor 32, low 1, high 4, original context 8192, theta
500000). 3B: hidden 3072, 28 layers, 24 / 8 heads of 128, ffn 8192, tied, the same RoPE.
8B: hidden 4096, 32 layers, 32 / 8 heads of 128, ffn 14336, an untied lm_head, RoPE factor 8. Weights are N(0, 0.02) (norms 1 + N(0, 0.02)), generated with numpy chunk by chunk
and written straight into two safetensors shards plus model.safetensors.index.json — no
torch/transformers, so it stays frugal. The tokenizer is synthetic but shaped like Llama 3's:
byte-level BPE with the Llama 3 pre-tokenizer, 128000 regular tokens built from 127744 valid
merges, and the 256 special tokens at 128000+ (<|begin_of_text|>, <|eot_id|> = 128009, …).

Output: $PYKLEI_CACHE/llama32-1b-random (llama32-3b-random, llama31-8b-random; default
~/.cache/pyklei), built in a temporary
directory and renamed, skipped when it already exists. Used by the slow converter test and
for measuring peak RSS / time of `pyklei convert`.

Runs on the installed pyklei (`pip install -e .` in a checkout, or a regular install) and, with
none installed, on the checkout's own: it needs only the converters and the format layer, which
import without the compiled extension.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# The repository root, appended: pyklei_dev/ (not installed; its __init__.py says why), and the
# checkout's pyklei when none is installed (an installed one comes first).
sys.path.append(str(Path(__file__).resolve().parents[1]))
from pyklei.converters.safetensors_mmap import write_safetensors  # noqa: E402
from pyklei.formats import f32_to_bf16  # noqa: E402
from pyklei_dev.assets import cache_dir  # noqa: E402

NAME = "llama32-1b-random"
H, L, NH, NKV, HD, FF, V = 2048, 16, 32, 8, 64, 8192, 128256
TIED = True
N_REGULAR = 128000
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": HD,
    "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": FF,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": NH, "num_hidden_layers": L, "num_key_value_heads": NKV,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": V,
}


# --shape: (directory, hidden, layers, heads, KV heads, head_dim, ffn, tied, RoPE factor)
SHAPES = {"1b": (NAME, 2048, 16, 32, 8, 64, 8192, True, 32.0),
          "3b": ("llama32-3b-random", 3072, 28, 24, 8, 128, 8192, True, 32.0),
          "8b": ("llama31-8b-random", 4096, 32, 32, 8, 128, 14336, False, 8.0)}


def use_shape(shape: str) -> None:
    """Point the module's shape (NAME, H, L, ..., CONFIG) at one of SHAPES."""
    global NAME, H, L, NH, NKV, HD, FF, TIED
    NAME, H, L, NH, NKV, HD, FF, TIED, factor = SHAPES[shape]
    CONFIG.update(head_dim=HD, hidden_size=H, intermediate_size=FF, num_attention_heads=NH,
                  num_hidden_layers=L, num_key_value_heads=NKV, tie_word_embeddings=TIED)
    CONFIG["rope_scaling"] = dict(CONFIG["rope_scaling"], factor=factor)


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tokenizer_files(out: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tokens = byte_alphabet()
    seen = set(tokens)
    merges = []
    while len(tokens) < N_REGULAR:
        a, b = rng.integers(0, len(tokens), 2)
        t = tokens[a] + tokens[b]
        if t in seen or len(t) > 16:
            continue
        seen.add(t)
        tokens.append(t)
        merges.append(f"{tokens[a]} {tokens[b]}")
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(specials))]
    added = [{"id": N_REGULAR + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(specials)]
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                                                      "ids": [128000],
                                                      "tokens": ["<|begin_of_text|>"]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    tc = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
          "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
          "clean_up_tokenization_spaces": True,
          "chat_template": (
              "{{ bos_token }}{% for message in messages %}<|start_header_id|>"
              "{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}"
              "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>"
              "assistant<|end_header_id|>\n\n{% endif %}"),
          "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                   for a in added}}
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
         "do_sample": True, "temperature": 0.6, "top_p": 0.9}, indent=1))


def tensor_list() -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (V, H))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (NH * HD, H)),
                (p + "self_attn.k_proj.weight", (NKV * HD, H)),
                (p + "self_attn.v_proj.weight", (NKV * HD, H)),
                (p + "self_attn.o_proj.weight", (H, NH * HD)),
                (p + "post_attention_layernorm.weight", (H,)),
                (p + "mlp.gate_proj.weight", (FF, H)),
                (p + "mlp.up_proj.weight", (FF, H)),
                (p + "mlp.down_proj.weight", (H, FF))]
    out.append(("model.norm.weight", (H,)))
    if not TIED:
        out.append(("lm_head.weight", (V, H)))
    return out


def producer(rng, shape, norm: bool):
    def chunks():
        rows = shape[0]
        step = max(1, (1 << 22) // (shape[1] if len(shape) > 1 else 1))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            x = rng.standard_normal((n,) + shape[1:], dtype=np.float32) * np.float32(0.02)
            if norm:
                x += np.float32(1)
            yield f32_to_bf16(x)
    return chunks


def build(out: Path, seed: int = 0) -> Path:
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part"))
    try:
        (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
        tokenizer_files(tmp, seed)
        rng = np.random.default_rng(seed)
        tl = tensor_list()
        # shards of at most ~5 GB, as published checkpoints are cut
        per = max(1, L // max(2, -(-sum(int(np.prod(sh)) * 2 for _, sh in tl) // (5 << 30))))
        cuts = [0] + [1 + 9 * i for i in range(per, L, per)] + [len(tl)]
        shards = [tl[a:b] for a, b in zip(cuts, cuts[1:])]
        weight_map = {}
        total = 0
        for k, part in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(tmp / fname, {
                n: ("BF16", s, producer(rng, s, n.endswith("norm.weight"))) for n, s in part},
                metadata={"format": "pt"})
            for n, s in part:
                weight_map[n] = fname
                total += int(np.prod(s)) * 2
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main() -> None:
    # argparse so that --help prints this text instead of writing 2.5 GB
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    use_shape(ap.parse_args().shape)
    out = cache_dir() / NAME
    if (out / "model.safetensors.index.json").is_file():
        print(out)
        return
    t0 = time.time()
    build(out)
    n = sum(int(np.prod(s)) for _, s in tensor_list())
    print(f"{out}: {n:,} parameters, {time.time() - t0:.0f} s", file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
