"""Hugging Face tokenizer files -> llama.cpp's tokenizer.ggml.* metadata.

Two kinds are supported:
- byte-level BPE from tokenizer.json (Llama 3, Qwen2/2.5/3, SmolLM2, GPT-2 style): tokenizer.ggml.model =
  "gpt2", tokens are the vocabulary strings as stored (byte-level alphabet, e.g. "Ġthe"),
  merges "a b", pre-tokenizer named as llama.cpp names it (see `detect_pre`);
- SentencePiece from tokenizer.model: tokenizer.ggml.model = "llama", pre "default", tokens,
  scores and types from the model proto.
A tokenizer.model wins over tokenizer.json when both are present (as in llama.cpp).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFValueType as T

from pyklei.formats.end_of_generation import end_of_generation_ids, turn_token_id
from pyklei.formats.gguf_keys import KEY_EOS_IDS, KEY_SPM_MODEL

from .errors import ConversionError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 / Qwen2.5 / Qwen3: Llama 3's regex with single digits (\p{N}), behind an NFC normalizer.
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# The normalizer each pre-tokenizer's tokenizer.json has ("NFC" or None); pyklei's tokenizer
# applies the one its tokenizer.ggml.pre implies, so any other is refused here.
NORMALIZERS = {"llama-bpe": None, "smollm": None, "gpt2": None, "qwen2": "NFC"}

KV = list[tuple[str, Any, T, Any]]


def _load_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: invalid JSON in {what} ({e})") from None


def _describe(pt) -> str:
    if pt is None:
        return "none"
    typ = pt.get("type")
    if typ == "Sequence":
        return "Sequence[" + ", ".join(_describe(p) for p in pt.get("pretokenizers", [])) + "]"
    args = {k: v for k, v in pt.items() if k != "type"}
    if "pattern" in args and isinstance(args["pattern"], dict):
        args["pattern"] = next(iter(args["pattern"].values()))
    return f"{typ}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def detect_pre(pre_tokenizer) -> str:
    """llama.cpp's name for a tokenizer.json pre_tokenizer, identified by its structure.

    Split(Llama 3 regex, Isolated) + ByteLevel(use_regex=False) -> "llama-bpe";
    Split(Qwen2 regex, Isolated) + ByteLevel(use_regex=False) -> "qwen2" (llama.cpp's name);
    Digits(individual_digits=True) + ByteLevel(use_regex=True) -> "smollm";
    ByteLevel(use_regex=True) alone -> "gpt2". Anything else is an error naming it.
    """
    pt = pre_tokenizer or {}
    seq = pt.get("pretokenizers", []) if pt.get("type") == "Sequence" else [pt]
    types = [p.get("type") for p in seq]

    def bytelevel(p, regex):
        return (p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)
                and bool(p.get("use_regex", True)) == regex)

    if types == ["Split", "ByteLevel"]:
        sp, bl = seq
        pat = sp.get("pattern") or {}
        split = sp.get("behavior") == "Isolated" and not sp.get("invert", False) and bytelevel(bl, False)
        if split and pat.get("Regex") == LLAMA3_REGEX:
            return "llama-bpe"
        if split and pat.get("Regex") == QWEN2_REGEX:
            return "qwen2"
    if types == ["Digits", "ByteLevel"]:
        dg, bl = seq
        if dg.get("individual_digits") and bytelevel(bl, True):
            return "smollm"
    if types == ["ByteLevel"] and bytelevel(seq[0], True):
        return "gpt2"
    raise ConversionError(
        f"unsupported tokenizer pre-tokenizer {_describe(pre_tokenizer)}; supported: Llama 3 "
        f"(Split regex + ByteLevel -> llama-bpe), Qwen2 (Split regex + ByteLevel -> qwen2), "
        f"SmolLM (Digits + ByteLevel -> smollm), GPT-2 (ByteLevel -> gpt2)")


def check_normalizer(normalizer, pre: str) -> None:
    """A tokenizer.json normalizer other than the one the pre-tokenizer's family has (NFC for
    Qwen, none for the others) would change ids pyklei cannot reproduce: refused, named."""
    typ = (normalizer or {}).get("type")
    if typ != NORMALIZERS[pre]:
        raise ConversionError(f"unsupported tokenizer normalizer {typ or 'none'} with the {pre} "
                              f"pre-tokenizer (pyklei applies {NORMALIZERS[pre] or 'none'})")


def _content(tok) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def chat_templates(hf_dir: Path, tok_cfg: dict) -> KV:
    tmpl = tok_cfg.get("chat_template")
    jinja = hf_dir / "chat_template.jinja"
    if tmpl is None and jinja.is_file():
        tmpl = jinja.read_text(encoding="utf-8")
    cj = hf_dir / "chat_template.json"
    if tmpl is None and cj.is_file():
        tmpl = _load_json(cj, "chat_template.json").get("chat_template")
    kv: KV = []
    if isinstance(tmpl, list):  # [{"name": ..., "template": ...}]
        for item in tmpl:
            nm, tx = item.get("name"), item.get("template")
            if nm == "default":
                kv.append(("tokenizer.chat_template", tx, T.STRING, None))
            elif nm and tx:
                kv.append((f"tokenizer.chat_template.{nm}", tx, T.STRING, None))
        names = [i.get("name") for i in tmpl if i.get("name") != "default"]
        if names:
            kv.append(("tokenizer.chat_templates", names, T.ARRAY, T.STRING))
    elif tmpl:
        kv.append(("tokenizer.chat_template", str(tmpl), T.STRING, None))
    return kv


def tokenizer_kv(hf_dir, config: dict, vocab_size: int) -> KV:
    """All tokenizer.* metadata for the checkpoint in hf_dir, plus pyklei.eos_token_ids."""
    hf_dir = Path(hf_dir)
    tc_path = hf_dir / "tokenizer_config.json"
    tok_cfg = _load_json(tc_path, "tokenizer_config.json") if tc_path.is_file() else {}
    gc_path = hf_dir / "generation_config.json"
    gen_cfg = _load_json(gc_path, "generation_config.json") if gc_path.is_file() else {}
    if (hf_dir / "tokenizer.model").is_file():
        kv, tokens, types = _spm(hf_dir, tok_cfg, vocab_size)
        default_add_bos = True
    elif (hf_dir / "tokenizer.json").is_file():
        kv, tokens, types, default_add_bos = _bpe(hf_dir, tok_cfg, vocab_size)
    else:
        raise ConversionError(f"missing tokenizer: neither tokenizer.json nor tokenizer.model in {hf_dir}")
    index = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)

    def special(name: str, *fallbacks) -> int | None:
        text = _content(tok_cfg.get(f"{name}_token"))
        if text is not None and text in index:
            return index[text]
        for f in fallbacks:
            ids = _ids(f)
            if ids:
                return ids[0]
        return None

    bos = special("bos", config.get("bos_token_id"), gen_cfg.get("bos_token_id"))
    eos = special("eos", gen_cfg.get("eos_token_id"), config.get("eos_token_id"))
    unk = special("unk")
    pad = special("pad", config.get("pad_token_id"), gen_cfg.get("pad_token_id"))
    eos_all = []
    for i in ([eos] + _ids(gen_cfg.get("eos_token_id")) + _ids(config.get("eos_token_id"))):
        if i is not None and i not in eos_all:
            eos_all.append(i)
    for i in eos_all:
        if not 0 <= i < vocab_size:
            raise ConversionError(f"EOS token id {i} is outside the vocabulary (size {vocab_size})")
    eot = turn_token_id(tokens, types, "eot", prefer=eos_all)
    eom = turn_token_id(tokens, types, "eom")

    for key, v in (("bos", bos), ("eos", eos), ("unknown", unk), ("padding", pad),
                   ("eot", eot), ("eom", eom)):
        if v is not None:
            if not 0 <= v < vocab_size:
                raise ConversionError(f"{key} token id {v} is outside the vocabulary (size {vocab_size})")
            kv.append((f"tokenizer.ggml.{key}_token_id", int(v), T.UINT32, None))
    add_bos = tok_cfg.get("add_bos_token")
    if add_bos is None:
        add_bos = default_add_bos
    kv.append(("tokenizer.ggml.add_bos_token", bool(add_bos), T.BOOL, None))
    kv.append(("tokenizer.ggml.add_eos_token", bool(tok_cfg.get("add_eos_token", False)), T.BOOL, None))
    # every id that ends generation, by the one rule (pyklei.formats.end_of_generation)
    eos_all = end_of_generation_ids({k: v for k, v, *_ in kv} | {KEY_EOS_IDS: eos_all})
    if eos_all:
        kv.append((KEY_EOS_IDS, [int(i) for i in eos_all], T.ARRAY, T.UINT32))
    kv += chat_templates(hf_dir, tok_cfg)
    return kv


def _added_tokens(tok_cfg: dict, tj: dict | None):
    """id -> (content, special) from tokenizer.json's added_tokens and tokenizer_config's
    added_tokens_decoder."""
    out = {}
    for at in (tj or {}).get("added_tokens", []):
        out[int(at["id"])] = (at["content"], bool(at.get("special", False)))
    for i, at in (tok_cfg.get("added_tokens_decoder") or {}).items():
        out.setdefault(int(i), (at["content"], bool(at.get("special", False))))
    return out


def _bpe(hf_dir: Path, tok_cfg: dict, vocab_size: int):
    tj = _load_json(hf_dir / "tokenizer.json", "tokenizer.json")
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(
            f"unsupported tokenizer.json model type {model.get('type')!r}; only byte-level BPE "
            f"(or a SentencePiece tokenizer.model) is supported")
    pre = detect_pre(tj.get("pre_tokenizer"))
    check_normalizer(tj.get("normalizer"), pre)
    vocab: dict[str, int] = model.get("vocab") or {}
    added = _added_tokens(tok_cfg, tj)
    tokens: list[str | None] = [None] * vocab_size
    types = [UNUSED] * vocab_size
    for text, i in vocab.items():
        if i >= vocab_size:
            raise ConversionError(
                f"tokenizer has token id {i} ({text!r}) but config.json vocab_size is {vocab_size}")
        tokens[i] = text
        types[i] = NORMAL
    for i, (text, special) in added.items():
        if i >= vocab_size:
            raise ConversionError(
                f"tokenizer has added token id {i} ({text!r}) but the vocabulary size is {vocab_size}")
        tokens[i] = text
        types[i] = CONTROL if special else USER_DEFINED
    for i in range(vocab_size):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
    merges = []
    for m in model.get("merges") or []:
        merges.append(m if isinstance(m, str) else " ".join(m))
    kv: KV = [
        ("tokenizer.ggml.model", "gpt2", T.STRING, None),
        ("tokenizer.ggml.pre", pre, T.STRING, None),
        ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
        ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
    ]
    if merges:
        kv.append(("tokenizer.ggml.merges", merges, T.ARRAY, T.STRING))
    # add_bos default: does the post-processor put the BOS token in front of a single text?
    add_bos = False
    pp = tj.get("post_processor") or {}
    pps = pp.get("processors", []) if pp.get("type") == "Sequence" else [pp]
    bos_text = _content(tok_cfg.get("bos_token"))
    for p in pps:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            if single and "SpecialToken" in single[0]:
                first = single[0]["SpecialToken"]["id"]
                add_bos = bos_text is None or first == bos_text
    return kv, tokens, types, add_bos


def _spm(hf_dir: Path, tok_cfg: dict, vocab_size: int):
    import sentencepiece as spm

    path = hf_dir / "tokenizer.model"
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except Exception as e:  # sentencepiece raises OSError/RuntimeError on corrupt files
        raise ConversionError(f"{path}: cannot load the SentencePiece model ({e})") from None
    n = sp.GetPieceSize()
    if n > vocab_size:
        raise ConversionError(
            f"tokenizer.model has {n} pieces but config.json vocab_size is {vocab_size}")
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.IdToPiece(i))
        scores.append(float(sp.GetScore(i)))
        if sp.IsUnknown(i):
            types.append(UNKNOWN)
        elif sp.IsControl(i):
            types.append(CONTROL)
        elif sp.IsUnused(i):
            types.append(UNUSED)
        elif sp.IsByte(i):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    for i in range(n, vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(UNUSED)
    added = _added_tokens(tok_cfg, None)
    aj = hf_dir / "added_tokens.json"
    if aj.is_file():
        for text, i in _load_json(aj, "added_tokens.json").items():
            added.setdefault(int(i), (text, False))
    for i, (text, special) in added.items():
        if i >= vocab_size:
            raise ConversionError(
                f"added token id {i} ({text!r}) is outside the vocabulary (size {vocab_size})")
        if i >= n or tokens[i] != text:
            tokens[i] = text
            scores[i] = -1000.0
            types[i] = CONTROL if special else USER_DEFINED
        elif not special and types[i] == NORMAL:
            # a piece the checkpoint lists as an added token (Gemma's "\n\n", "<div>", "▁▁"):
            # Hugging Face matches it whole, and the sentencepiece API cannot tell it apart
            types[i] = USER_DEFINED
    pieces = sp.EncodeAsPieces("a")
    add_space_prefix = bool(pieces) and pieces[0].startswith("\u2581")
    kv: KV = [
        ("tokenizer.ggml.model", "llama", T.STRING, None),
        ("tokenizer.ggml.pre", "default", T.STRING, None),
        ("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING),
        ("tokenizer.ggml.scores", scores, T.ARRAY, T.FLOAT32),
        ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
        ("tokenizer.ggml.add_space_prefix", add_space_prefix, T.BOOL, None),
        (KEY_SPM_MODEL, path.read_bytes(), T.ARRAY, T.UINT8),
    ]
    return kv, tokens, types
