"""pyklei.tokenizer against independent references built with the `tokenizers` package.

The references are assembled here from each GGUF's vocabulary and merges with the pre-tokenizer,
normalizer and decoder that the model's Hugging Face tokenizer.json uses; expected ids never
come from pyklei. Vocabularies: SmolLM2-135M-Instruct (llama.cpp's GGUF, from pyklei_dev.assets),
Llama 3 and Llama 2 (vocabulary-only GGUFs in ../shared/vocab beside the repository).
"""
from __future__ import annotations

import functools
import importlib.util
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from paths import DATA, VOCAB_DIR
from pyklei.text.tokenizer import StreamingDetokenizer, Tokenizer, TokenizerError, read_gguf_metadata

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers  # noqa: E402

LLAMA3 = VOCAB_DIR / "ggml-vocab-llama-bpe.gguf"
LLAMA2 = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"


def _load_corpus() -> list[str]:
    spec = importlib.util.spec_from_file_location("tokenizer_corpus", DATA / "tokenizer_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.corpus()


CORPUS = _load_corpus()


# ------------------------------------------------------------------------------------------------
# Vocabulary files
# ------------------------------------------------------------------------------------------------

def _smollm2_path() -> Path:
    try:
        from pyklei_dev.assets import smollm2_gguf
        return smollm2_gguf()
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 GGUF unavailable ({e})")


def _shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path.name} not found in {VOCAB_DIR} (the shared/ folder beside the repository)")
    return path


VOCABS = {
    "smollm2": _smollm2_path,
    "llama3": lambda: _shared(LLAMA3),
    "llama2": lambda: _shared(LLAMA2),
}


@functools.lru_cache(maxsize=None)
def _ours(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(VOCABS[name]())


@functools.lru_cache(maxsize=None)
def _meta(name: str) -> dict:
    return read_gguf_metadata(VOCABS[name](), prefixes=("tokenizer.",))


# ------------------------------------------------------------------------------------------------
# Independent references (Hugging Face `tokenizers`)
# ------------------------------------------------------------------------------------------------
# Llama 3's tokenizer.json: Split(regex, isolated) + ByteLevel(add_prefix_space=False,
# use_regex=False), BPE with ignore_merges=true, ByteLevel decoder.
HF_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _added_tokens(meta: dict) -> list[AddedToken]:
    toks, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    out = []
    for i, t in enumerate(toks):
        if types[i] in (2, 3):  # UNKNOWN, CONTROL: special added tokens
            out.append(AddedToken(t, special=True, normalized=False))
        elif types[i] == 4:
            out.append(AddedToken(t, special=False, normalized=False))
    return out


def _byte_level_reference(meta: dict, kind: str) -> "tokenizers.Tokenizer":
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    if kind == "llama3":
        bpe = models.BPE(vocab, merges, ignore_merges=True)
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(HF_LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # SmolLM2: tokenizer.json has no unk_token and ignore_merges=false
        bpe = models.BPE(vocab, merges)
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(_added_tokens(meta))
    return tok


def _spm_merges(tokens: list[str], types, scores) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary, ordered as transformers' LlamaConverter
    orders them: by the merged piece's score (highest first), then longer left, longer right
    piece first; ties keep vocabulary order (merged id, then left id, right id)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, piece in enumerate(tokens):
        if len(piece) < 2:
            continue
        local = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right, float(scores[i])))
        local.sort()
        found.extend(local)
    found.sort(key=lambda m: (m[4], len(m[2]), len(m[3])), reverse=True)
    return [(left, right) for _, _, left, right, _ in found]


def _llama2_reference(meta: dict) -> "tokenizers.Tokenizer":
    # LlamaTokenizerFast (legacy): Prepend("▁") + Replace(" ", "▁"), BPE with byte_fallback and
    # fuse_unk, no pre-tokenizer; decoder Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0).
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab, _spm_merges(tokens, types, meta["tokenizer.ggml.scores"]), unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_tokens(_added_tokens(meta))
    return tok


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    meta = _meta(name)
    if name == "llama2":
        return _llama2_reference(meta)
    return _byte_level_reference(meta, name)


def _ref_ids(ref, texts: list[str], parse_special: bool) -> list[list[int]]:
    ref.encode_special_tokens = not parse_special
    try:
        return [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    finally:
        ref.encode_special_tokens = False


def _roundtrip_text(name: str, text: str) -> str:
    """``text`` without what cannot round-trip. SentencePiece (and Hugging Face's Llama 2
    tokenizer) write spaces as "▁", so a literal "▁" comes back as a space; SmolLM2 has no token
    for a few bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xf1, 0xf2), dropped as Hugging Face
    drops them. Those characters are removed."""
    if name == "llama2":
        return text.replace("\u2581", "")
    rx = _ours(name)._missing_re
    return text if rx is None else rx.sub("", text)


# ------------------------------------------------------------------------------------------------
# Identity with the references on the corpus
# ------------------------------------------------------------------------------------------------

def test_corpus_is_large_and_varied():
    total = sum(len(t.encode("utf-8")) for t in CORPUS)
    assert total >= 100_000, total
    joined = "".join(CORPUS)
    for needle in ("<|im_end|>", "<|eot_id|>", "</s>", "😀", "天", "ж", "\r\n", "     ", "1234567890"):
        assert needle in joined


@pytest.mark.parametrize("parse_special", [True, False], ids=["special", "plain"])
@pytest.mark.parametrize("name", list(VOCABS))
def test_ids_identical_to_tokenizers(name, parse_special):
    ours, ref = _ours(name), _reference(name)
    expected = _ref_ids(ref, CORPUS, parse_special)
    mismatches = []
    for text, exp in zip(CORPUS, expected):
        got = ours.encode(text, add_bos=False, parse_special=parse_special)
        if got != exp:
            mismatches.append((text, got, exp))
    assert not mismatches, (f"{len(mismatches)}/{len(CORPUS)} texts differ; first: "
                            f"{mismatches[0][0]!r}\n ours {mismatches[0][1][:40]}\n ref  {mismatches[0][2][:40]}")


@pytest.mark.parametrize("name", list(VOCABS))
def test_roundtrip_and_decode_match_reference(name):
    ours, ref = _ours(name), _reference(name)
    changed = 0
    for text in CORPUS:
        clean = _roundtrip_text(name, text)
        changed += clean != text
        assert ours.decode(ours.encode(clean, add_bos=False, parse_special=False)) == clean
        ids = ours.encode(text, add_bos=False, parse_special=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)
        ids = ours.encode(text, add_bos=False, parse_special=True)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)
    assert changed < len(CORPUS) // 2


@pytest.mark.parametrize("name", list(VOCABS))
def test_decode_arbitrary_ids_matches_reference(name):
    """Random id sequences, including lone bytes of multi-byte characters: same text as HF."""
    ours, ref = _ours(name), _reference(name)
    rng = random.Random(7)
    n = ours.vocab_size
    low = [i for i in range(min(n, 600))]  # byte tokens live there in all three vocabularies
    for _ in range(300):
        ids = [rng.choice(low) if rng.random() < 0.6 else rng.randrange(n) for _ in range(rng.randint(1, 30))]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), ids


def test_bos_and_metadata():
    smol = _ours("smollm2")
    assert smol.pre == "smollm" and not smol.add_bos and smol.bos_id == 1
    assert smol.encode("Hi") == smol.encode("Hi", add_bos=False)
    assert smol.encode("Hi", add_bos=True)[0] == 1
    assert smol.eos_ids[0] == 2 and set(smol.eos_ids) == {0, 2}  # <|im_end|>, <|endoftext|>
    l3 = _ours("llama3")
    assert l3.vocab_size == 128256 and l3.add_bos and l3.encode("Hi")[0] == 128000
    assert l3.eos_ids[0] == 128001 and 128009 in l3.eos_ids  # <|end_of_text|>, <|eot_id|>
    assert 128008 not in l3.eos_ids  # a reserved token is not an end of turn
    l2 = _ours("llama2")
    assert l2.vocab_size == 32000 and l2.add_bos and l2.eos_ids == (2,)
    assert l2.encode("Hello")[:1] == [1]
    assert l2.encode("Hello", add_bos=False) == _reference("llama2").encode("Hello", add_special_tokens=False).ids


def test_special_parsing_switch():
    l3 = _ours("llama3")
    text = "<|start_header_id|>user<|end_header_id|>"
    assert l3.encode(text, add_bos=False) == [128006, 882, 128007]
    plain = l3.encode(text, add_bos=False, parse_special=False)
    assert 128006 not in plain and l3.decode(plain) == text
    l2 = _ours("llama2")
    assert l2.encode("a</s>b", add_bos=False) == _reference("llama2").encode("a</s>b", add_special_tokens=False).ids
    assert 2 in l2.encode("a</s>b", add_bos=False)
    assert 2 not in l2.encode("a</s>b", add_bos=False, parse_special=False)


def test_missing_bytes_dropped_like_hf():
    smol, ref = _ours("smollm2"), _reference("smollm2")
    text = "a\x04b\x06c \U00040000 d"
    assert smol.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert smol.decode(smol.encode(text)) == "abc \ufffd\ufffd\ufffd d" == ref.decode(smol.encode(text))


def test_token_pieces():
    smol = _ours("smollm2")
    i = smol.encode(" hello")[0]
    assert smol.id_to_token(i) == "Ġhello" and smol.token_to_piece(i) == b" hello"
    assert smol.token_to_id("Ġhello") == i
    l2 = _ours("llama2")
    assert l2.token_to_piece(l2.token_to_id("<0x0A>")) == b"\n"
    assert l2.token_to_piece(l2.token_to_id("▁the")) == b" the"


# ------------------------------------------------------------------------------------------------
# Streaming detokenizer
# ------------------------------------------------------------------------------------------------
STREAM_TEXT = "Zażółć 😀👨‍👩‍👧 中文 ✨é\n🇫🇷 end \U0010fffd"


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte of ``data``: its single-byte token."""
    by_piece = {}
    for i in range(tok.vocab_size):
        p = tok.token_to_piece(i)
        if len(p) == 1 and tok.token_types[i] in (1, 6):
            if tok.model != "llama" or tok.token_types[i] == 6:
                by_piece.setdefault(p, i)
    return [by_piece[bytes([b])] for b in data]


@pytest.mark.parametrize("name", list(VOCABS))
def test_streaming_byte_by_byte(name):
    tok = _ours(name)
    data = STREAM_TEXT.encode("utf-8")
    ids = _byte_ids(tok, data)
    det = tok.detokenizer()
    chunks = [det.add_token(i) for i in ids]
    chunks.append(det.finalize())
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == STREAM_TEXT
    # Text only appears once its last byte has arrived.
    done = 0
    for k, c in enumerate(chunks[:-1]):
        done += len(c.encode("utf-8"))
        assert data[:k + 1].startswith(data[:done]) and k + 1 - done <= 3


@pytest.mark.parametrize("name", list(VOCABS))
def test_streaming_matches_decode_on_corpus(name):
    tok = _ours(name)
    for text in CORPUS[::5]:
        ids = tok.encode(text, add_bos=False, parse_special=True)
        det = StreamingDetokenizer(tok)
        out = "".join(det.add_token(i) for i in ids) + det.finalize()
        assert out == tok.decode(ids) == det.text


@pytest.mark.parametrize("name", list(VOCABS))
def test_finalize_drops_an_unfinished_character(name):
    """A stream cut after any byte of STREAM_TEXT ends with the characters whose last byte
    arrived: finalize(drop_incomplete=True) drops the rest (at most 3 bytes), where the default
    finalize turns them into U+FFFD as decode() does."""
    tok = _ours(name)
    data = STREAM_TEXT.encode("utf-8")
    ids = _byte_ids(tok, data)
    cuts_inside = 0
    for k in range(1, len(data) + 1):
        whole = data[:k].decode("utf-8", "ignore")     # complete characters only
        det = tok.detokenizer()
        out = det.add_tokens(ids[:k]) + det.finalize(drop_incomplete=True)
        assert out == det.text == (whole.lstrip(" ") if tok.model == "llama" else whole), k
        assert det.dropped == data[len(whole.encode("utf-8")):k] and len(det.dropped) <= 3
        cuts_inside += bool(det.dropped)
        if tok.model != "llama":    # (SentencePiece's decode makes a whole invalid run one U+FFFD)
            det = tok.detokenizer()
            assert det.add_tokens(ids[:k]) + det.finalize() == tok.decode(ids[:k])
    assert cuts_inside > 10     # STREAM_TEXT has enough multi-byte characters to cut


def test_finalize_drop_keeps_invalid_bytes_and_resets():
    """Only an unfinished character at the end is dropped: a byte that can never be valid was
    U+FFFD when it came. The detokenizer goes on afresh after finalize."""
    smol = _ours("smollm2")
    det = smol.detokenizer()
    assert det.add_tokens(_byte_ids(smol, b"a\x80\xe2\x82")) == "a\ufffd"
    assert det.finalize(drop_incomplete=True) == "" and det.dropped == b"\xe2\x82"
    assert det.add_tokens(_byte_ids(smol, b"\xac")) == "\ufffd"     # a lone continuation byte
    assert det.finalize(drop_incomplete=True) == "" and det.dropped == b""


def test_generation_never_ends_in_a_partial_character():
    """pyklei.generate.Generation with SmolLM2's real vocabulary, the model replaced by logits
    that pick the byte tokens of "Hi 😀": cut by max_tokens after each byte, and ended by EOS
    after each byte, the reply holds only complete characters."""
    from pyklei.runtime.generate import Generation
    from pyklei.runtime.request import make_request
    from pyklei.runtime.sampler import SamplingParams

    smol = _ours("smollm2")
    data = "Hi 😀".encode("utf-8")
    ids = _byte_ids(smol, data)
    eos = smol.eos_ids[0]

    def run(picks, max_tokens, stream_text):
        gen = Generation(smol, make_request(4096, smol, [1, 2], max_tokens,
                                            SamplingParams(temperature=0.0)))
        for t in picks:
            logits = np.zeros(smol.vocab_size, np.float32)
            logits[t] = 1.0
            r = gen.feed(logits)
            if r is not None:
                stream_text.append(r.text)
            if gen.done:
                return r
        raise AssertionError("the generation did not end")

    for k in range(1, len(data) + 1):
        expect = data[:k].decode("utf-8", "ignore")
        parts: list[str] = []
        r = run(ids[:k], k, parts)
        assert r.finish_reason == "length" and "".join(parts) == expect, k
        parts = []
        r = run(ids[:k] + [eos], k + 1, parts)
        assert r.finish_reason == "stop" and "".join(parts) == expect, k


def test_streaming_invalid_bytes_and_skip_special():
    smol = _ours("smollm2")
    ids = _byte_ids(smol, b"\xe2\x82") + smol.encode("x<|im_end|>")
    det = smol.detokenizer(skip_special=True)
    out = det.add_tokens(ids) + det.finalize()
    assert out == smol.decode(ids, skip_special=True) == "\ufffdx"


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def _write_gguf(path: Path, kv: dict) -> Path:
    """A minimal GGUF v3 with string / string-array / uint32 metadata and no tensors."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)))
    for k, v in kv.items():
        out += s(k)
        if isinstance(v, str):
            out += struct.pack("<I", 8) + s(v)
        elif isinstance(v, int):
            out += struct.pack("<II", 4, v)
        else:
            out += struct.pack("<IIQ", 9, 8, len(v)) + b"".join(s(x) for x in v)
    path.write_bytes(bytes(out))
    return path


def test_unknown_pre_tokenizer_is_an_error(tmp_path):
    p = _write_gguf(tmp_path / "x.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen9",
                                          "tokenizer.ggml.tokens": ["a", "b", "ab"],
                                          "tokenizer.ggml.merges": ["a b"]})
    with pytest.raises(TokenizerError, match="unknown pre-tokenizer.*qwen9"):
        Tokenizer.from_gguf(p)


def test_small_synthetic_bpe(tmp_path):
    p = _write_gguf(tmp_path / "x.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                                          "tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>"],
                                          "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 3})
    tok = Tokenizer.from_gguf(p)
    assert tok.encode("abba c", parse_special=False) == [2, 1, 0]  # unknown bytes dropped
    assert tok.eos_ids == (3,)


def test_wrong_files(tmp_path):
    bad = tmp_path / "notgguf.bin"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_gguf(bad)
    with pytest.raises(TokenizerError, match="cannot open"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(_write_gguf(tmp_path / "t.gguf", {"tokenizer.ggml.model": "gpt2"}).read_bytes()[:30])
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf(trunc)
    no_tok = _write_gguf(tmp_path / "n.gguf", {"general.architecture": "llama"})
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf(no_tok)
    other = _write_gguf(tmp_path / "o.gguf", {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="not supported"):
        Tokenizer.from_gguf(other)


def test_encode_rejects_bytes():
    with pytest.raises(TypeError):
        _ours("smollm2").encode(b"abc")


@pytest.mark.parametrize("name", list(VOCABS))
def test_lone_surrogates_become_replacement_characters(name):
    tok = _ours(name)
    assert tok.encode("a\ud800b", add_bos=False) == tok.encode("a\ufffdb", add_bos=False)


@pytest.mark.parametrize("name", ["smollm2", "llama3"])
def test_byte_level_roundtrip_with_special_parsing(name):
    tok = _ours(name)
    for text in CORPUS:
        clean = _roundtrip_text(name, text)
        assert tok.decode(tok.encode(clean, add_bos=False, parse_special=True)) == clean


def test_metadata_reader_matches_gguf_writer(tmp_path):
    """The private fast GGUF metadata reader against a file written by the `gguf` package."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -5)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "😀"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert (meta["t.u32"], meta["t.i64"], meta["t.f32"], meta["t.bool"], meta["t.str"]) == (7, -5, 1.5, True, "héllo")
    assert meta["t.strs"] == ["a", "", "😀"]
    assert meta["t.ints"].tolist() == [1, 2, 3] and meta["t.floats"].tolist() == [0.5, -1.25]
    assert read_gguf_metadata(path, prefixes=("t.s",)).keys() == {"t.str", "t.strs"}


def test_raw_sentencepiece_model_is_accepted():
    """A pyklei file may carry the original tokenizer.model bytes (KEY_SPM_MODEL)."""
    import numpy as np
    from pyklei.formats.gguf_keys import KEY_SPM_MODEL
    from pyklei.text import tokenizer as T
    meta = dict(_meta("llama2"))
    raw = T._sentencepiece_model_proto(meta["tokenizer.ggml.tokens"], np.asarray(meta["tokenizer.ggml.scores"]),
                                       np.asarray(meta["tokenizer.ggml.token_type"]), 0, 1, 2, True)
    meta[KEY_SPM_MODEL] = np.frombuffer(raw, np.uint8)
    del meta["tokenizer.ggml.scores"]
    tok = Tokenizer.from_metadata(meta)
    for text in CORPUS[::20]:
        assert tok.encode(text) == _ours("llama2").encode(text)
