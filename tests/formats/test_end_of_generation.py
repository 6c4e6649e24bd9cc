"""The one end-of-generation rule (pyklei.formats.end_of_generation) on each family's vocabulary:
every end-of-turn token, whichever ids the file names, and the same set from the tokenizer, the
model-file reader's rule (strict) and the importers' eot_token_id."""
from __future__ import annotations

import numpy as np
import pytest

from pyklei.formats.end_of_generation import (EndOfGenerationError, end_of_generation_ids,
                                              turn_token_id)
from pyklei.formats.gguf_keys import (KEY_EOS_IDS, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN,
                                      TOKEN_USER_DEFINED)

C, N, U = TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED

# family -> (vocabulary [(text, type)], the eos_token_id its llama.cpp file names, the ids that
# must end generation)
FAMILIES = {
    "gemma3": ([("<pad>", C), ("<eos>", C), ("<bos>", C), ("<start_of_turn>", C),
                ("<end_of_turn>", C), ("</s>", U), ("hello", N)], 1, {1, 4}),
    "qwen3": ([("hello", N), ("<|endoftext|>", C), ("<|im_start|>", C), ("<|im_end|>", C),
               ("<think>", U), ("</think>", U)], 1, {1, 3}),
    "llama3": ([("hello", N), ("<|begin_of_text|>", C), ("<|end_of_text|>", C), ("<|eot_id|>", C),
                ("<|eom_id|>", C), ("<|start_header_id|>", C)], 2, {2, 3, 4}),
    "mistral": ([("<unk>", C), ("<s>", C), ("</s>", C), ("[INST]", C), ("hello", N)], 2, {2}),
    "phi3": ([("hello", N), ("<|endoftext|>", C), ("<|assistant|>", U), ("<|end|>", U),
              ("<|user|>", U)], 1, {1, 3}),
    "smollm3": ([("<|im_start|>", C), ("<|im_end|>", C), ("<|end_of_text|>", C), ("hi", N)], 1, {1, 2}),
}


def _meta(vocab, eos, **extra):
    return {"tokenizer.ggml.tokens": [t for t, _ in vocab],
            "tokenizer.ggml.token_type": np.array([ty for _, ty in vocab], np.int32),
            "tokenizer.ggml.eos_token_id": eos, **extra}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_end_of_turn_token_of_each_family(family):
    vocab, eos, want = FAMILIES[family]
    ids = end_of_generation_ids(_meta(vocab, eos))
    assert ids[0] == eos and set(ids) == want and len(ids) == len(set(ids))
    # lists as the model-file reader gets them
    as_lists = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in _meta(vocab, eos).items()}
    assert end_of_generation_ids(as_lists, strict=True) == ids


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tokenizer_stops_on_the_same_ids(family):
    from pyklei.text.tokenizer import Tokenizer

    vocab, eos, _ = FAMILIES[family]
    vocab = vocab + [("<unk-test>", TOKEN_UNKNOWN)]     # sentencepiece needs one
    meta = _meta(vocab, eos, **{"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": False,
                                "tokenizer.ggml.scores": np.zeros(len(vocab), np.float32),
                                "tokenizer.ggml.unknown_token_id": len(vocab) - 1})
    assert list(Tokenizer.from_metadata(meta).eos_ids) == end_of_generation_ids(meta)


def test_named_ids_come_first_in_order_without_repeats():
    vocab, _, _ = FAMILIES["llama3"]
    meta = _meta(vocab, 3, **{"tokenizer.ggml.eot_token_id": 3, "tokenizer.ggml.eom_token_id": 4,
                             KEY_EOS_IDS: np.array([5, 2, 3], np.uint32)})
    assert end_of_generation_ids(meta) == [3, 4, 5, 2]


def test_a_gemma_html_tag_or_a_plain_word_never_stops():
    vocab = [("</s>", U), ("<|im_end|>", N), ("<end_of_turn>", U), ("<|im_end|>x", C)]
    assert end_of_generation_ids(_meta(vocab, None)) == []
    assert end_of_generation_ids(_meta([("<|im_end|>", U)], None)) == [0]   # <|...|> user-defined


@pytest.mark.parametrize("key, value", [
    ("tokenizer.ggml.eos_token_id", 99), ("tokenizer.ggml.eot_token_id", -1),
    ("tokenizer.ggml.eos_token_id", True), (KEY_EOS_IDS, [0, 99]), (KEY_EOS_IDS, 3)])
def test_strict_refuses_what_is_not_an_id_and_lenient_leaves_it_out(key, value):
    vocab, _, _ = FAMILIES["mistral"]
    meta = {**_meta(vocab, 2), key: value}
    with pytest.raises(EndOfGenerationError, match=key.split(".")[-1]):
        end_of_generation_ids(meta, strict=True)
    assert 2 in end_of_generation_ids(meta)


@pytest.mark.parametrize("family, role, want", [
    ("gemma3", "eot", 4), ("qwen3", "eot", 3), ("llama3", "eot", 3), ("llama3", "eom", 4),
    ("phi3", "eot", 3), ("mistral", "eot", None), ("smollm3", "eot", 1)])
def test_the_importers_turn_token(family, role, want):
    vocab, _, _ = FAMILIES[family]
    tokens, types = [t for t, _ in vocab], [ty for _, ty in vocab]
    assert turn_token_id(tokens, types, role) == want


@pytest.mark.parametrize("broken", [
    {"tokenizer.ggml.tokens": 7}, {"tokenizer.ggml.token_type": 3},
    {"tokenizer.ggml.token_type": ["a", "b"]}, {"tokenizer.ggml.tokens": None}])
def test_a_broken_files_metadata_gives_no_crash(broken):
    vocab, _, _ = FAMILIES["qwen3"]
    meta = {**_meta(vocab, None), **broken}
    assert isinstance(end_of_generation_ids(meta), list)
