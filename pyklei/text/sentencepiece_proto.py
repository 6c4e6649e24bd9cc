"""A SentencePiece ModelProto serialized by hand (field numbers of sentencepiece_model.proto),
for GGUF files that carry a SentencePiece vocabulary as llama.cpp's arrays only: the tokenizer
rebuilds the model sentencepiece loads from tokens, scores and token types."""
from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from ..formats.gguf_keys import TOKEN_BYTE, TOKEN_NORMAL, TOKEN_USER_DEFINED


def _varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_len(field_no: int, payload: bytes) -> bytes:
    return _varint(field_no << 3 | 2) + _varint(len(payload)) + payload


def _pb_int(field_no: int, v: int) -> bytes:
    return _varint(field_no << 3) + _varint(int(v))


def _pb_float(field_no: int, v: float) -> bytes:
    return _varint(field_no << 3 | 5) + struct.pack("<f", v)


def sentencepiece_model_proto(tokens: Sequence[str], scores: np.ndarray, types: np.ndarray,
                               unk_id: int, bos_id: int, eos_id: int, add_dummy_prefix: bool) -> bytes:
    parts = []
    n = len(tokens)
    # ModelProto.pieces (1): SentencePiece{piece=1, score=2, type=3}
    for i, (tok, score, ty) in enumerate(zip(tokens, scores.tolist(), types.tolist())):
        ty = int(ty) if int(ty) in (1, 2, 3, 4, 5, 6) else TOKEN_NORMAL
        if ty == TOKEN_USER_DEFINED and tok and not tok.strip(" \u2581"):
            # A user-defined run of spaces ("▁▁" in the checkpoint, real spaces in llama.cpp's
            # file). Hugging Face merges such runs by BPE, in vocabulary order, ahead of every
            # ordinary piece (transformers' GGUF Gemma tokenizer does the same): a normal piece
            # "▁▁" scored above all others (ordinary scores are <= 0) merges the same way,
            # where a user-defined one would be matched greedily (40 spaces: 31 + 9, not 16 + 24).
            tok, score, ty = "\u2581" * len(tok), float(n - i), TOKEN_NORMAL
        body = _pb_len(1, tok.encode("utf-8")) + _pb_float(2, float(score))
        if ty != TOKEN_NORMAL:
            body += _pb_int(3, ty)
        parts.append(_pb_len(1, body))
    has_bytes = bool(np.any(types == TOKEN_BYTE))
    # TrainerSpec (2): model_type=3 (BPE=2), vocab_size=4, byte_fallback=35, unk/bos/eos/pad ids 40-43
    trainer = (_pb_int(3, 2) + _pb_int(4, len(tokens)) + _pb_int(35, int(has_bytes))
               + _pb_int(40, unk_id) + _pb_int(41, bos_id) + _pb_int(42, eos_id) + _pb_int(43, -1))
    parts.append(_pb_len(2, trainer))
    # NormalizerSpec (3): name=1, add_dummy_prefix=3, remove_extra_whitespaces=4, escape_whitespaces=5
    norm = (_pb_len(1, b"identity") + _pb_int(3, int(add_dummy_prefix)) + _pb_int(4, 0) + _pb_int(5, 1))
    parts.append(_pb_len(3, norm))
    return b"".join(parts)
