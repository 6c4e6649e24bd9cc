"""Tokenizers read from a GGUF file alone, giving the same ids as the Hugging Face tokenizers.

``Tokenizer.from_gguf(path)`` reads the ``tokenizer.ggml.*`` metadata of a pyklei or a
llama.cpp GGUF file and builds one of two back ends:

* ``tokenizer.ggml.model = gpt2`` -- byte-level BPE, run by **tiktoken**. The pre-tokenizer
  (the regex that cuts text into words before BPE) is chosen by ``tokenizer.ggml.pre``:

  ==========================  ======================================================
  ``tokenizer.ggml.pre``      Hugging Face pre-tokenizer it reproduces
  ==========================  ======================================================
  ``llama-bpe``, ``llama3``,  Llama 3: ``Split`` on its regex + ``ByteLevel(use_regex=False)``
  ``llama-v3``
  ``smollm``                  SmolLM/SmolLM2: ``Digits(individual_digits=True)`` +
                              ``ByteLevel(add_prefix_space=False, use_regex=True)``
  ``gpt2``, ``gpt-2``         GPT-2: ``ByteLevel(add_prefix_space=False, use_regex=True)``
  ``qwen2``,                  Qwen2/2.5/3: ``NFC`` normalizer, then ``Split`` on Llama 3's
  ``deepseek-r1-qwen``        regex with single digits + ``ByteLevel(use_regex=False)``
  ==========================  ======================================================

  Any other value raises :class:`TokenizerError`; pyklei never guesses a pre-tokenizer.
  tiktoken merges the adjacent pair whose concatenation has the lowest rank, and we use the
  token id as the rank. That is the Hugging Face BPE (merge the pair that comes first in the
  merge list) whenever every merged token's id grows with the position of its first merge,
  which is checked when the file is loaded (it holds for Llama 3, SmolLM2 and Qwen).

* ``tokenizer.ggml.model = llama`` -- SentencePiece, run by **sentencepiece**. A ModelProto
  (BPE, byte fallback when the vocabulary has byte tokens, identity normalizer, a dummy
  prefix as ``tokenizer.ggml.add_space_prefix`` says (Llama 2: yes; Gemma: no), no removal of
  extra whitespace) is serialized from the tokens, scores and types (a tiny hand-written
  protobuf encoder: no ``protobuf`` dependency). A pyklei file may carry the original
  ``tokenizer.model`` bytes under ``gguf_keys.KEY_SPM_MODEL`` (a uint8 array); they are used
  as they are when present, unless the vocabulary has user-defined runs of spaces (Gemma's),
  which Hugging Face merges by BPE where sentencepiece would match them whole
  (sentencepiece_proto.py).

Special tokens
    Tokens of type CONTROL and UNKNOWN are *special*: ``encode(..., parse_special=True)``
    turns their exact text into their id (longest match first), ``parse_special=False``
    encodes that text as ordinary text. USER_DEFINED tokens are always matched in text, as
    Hugging Face does for non-special added tokens. For SentencePiece vocabularies every
    piece of text between special tokens gets its own dummy-prefix space, as Hugging Face's
    ``LlamaTokenizerFast`` (``Prepend("▁")`` normalizer) does.

BOS / EOS
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` decide when present. When a file lacks
    ``add_bos_token``: SentencePiece vocabularies and the Llama 3 pre-tokenizers add BOS (as
    their Hugging Face tokenizers do), other byte-level vocabularies don't.

Bytes a vocabulary lacks
    Byte-level BPE: a byte with no token is dropped, as Hugging Face's BPE does when the
    model has no ``unk_token`` (SmolLM2 lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xf1,
    0xf2 among the bytes that can occur in UTF-8 text). SentencePiece: byte fallback tokens
    ``<0xXX>`` when the vocabulary has them, else the unknown token.

Decoding follows the Hugging Face decoders: ByteLevel (UTF-8, invalid sequences become
U+FFFD) for byte-level BPE; ``Replace("▁", " ")`` + ``ByteFallback`` + ``Fuse`` +
``Strip(" ", 1, 0)`` for SentencePiece (the strip only with a dummy prefix: Gemma's decoder
keeps a text's leading space).
"""
from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from ..formats.end_of_generation import END_OF_TURN_TEXTS, end_of_generation_ids
from ..formats.gguf_keys import (KEY_EOS_IDS, KEY_SPM_MODEL, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL,
                                 TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED)
from ..formats.gguf_reader import GGUFError
from ..formats.gguf_reader import read_gguf_metadata as _read_gguf_metadata
from .detokenizer import StreamingDetokenizer
from .sentencepiece_proto import sentencepiece_model_proto as _sentencepiece_model_proto

__all__ = [
    "Tokenizer",
    "StreamingDetokenizer",
    "TokenizerError",
    "read_gguf_metadata",
    "END_OF_TURN_TOKENS",
]

#: Kept under its old name: the texts live in pyklei.formats.end_of_generation.
END_OF_TURN_TOKENS = frozenset(END_OF_TURN_TEXTS)


class TokenizerError(ValueError):
    """A GGUF file whose tokenizer pyklei cannot build (missing keys, unknown pre-tokenizer...)."""


# ---------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------
# gguf.GGUFReader parses every array element into its own numpy view, which takes ~11 s for the
# Llama 3 vocabulary (128k tokens + 280k merges). pyklei's own hardened GGUF parser
# (pyklei.formats.gguf_reader, shared with the model loader) reads the key/value section in
# ~0.2 s and stops before the tensor infos.


def read_gguf_metadata(path: str | os.PathLike, prefixes: Sequence[str] | None = None) -> dict[str, Any]:
    """The key/value metadata of a GGUF file.

    Scalars become Python values, strings ``str`` (``bytes`` if not UTF-8), numeric arrays numpy
    arrays, string arrays lists of ``str``. With ``prefixes``, only keys starting with one of them
    are decoded (the others are skipped, but still bounds-checked). Raises
    :class:`TokenizerError` for a file that is not a well-formed GGUF v2/v3 file.
    """
    try:
        return _read_gguf_metadata(path, prefixes, strings="lenient", arrays="numpy")
    except GGUFError as e:
        raise TokenizerError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Byte-level BPE helpers
# ---------------------------------------------------------------------------------------------

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters used in byte-level vocabularies."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_B2U = _byte_to_unicode()
_U2B = {u: b for b, u in _B2U.items()}

# Pre-tokenizer regexes (tiktoken / fancy-regex syntax), each reproducing a Hugging Face
# pre-tokenizer chain exactly.
_GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual_digits=True) isolates every \p{N} character before the GPT-2 regex runs on
# the pieces between them. In one regex: a digit is its own word, and a whitespace run followed
# by a digit ends where the piece ended, hence the lookahead (?![^\s\p{N}]) in place of (?!\S).
_SMOLLM_PAT = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
_LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen2 / Qwen2.5 / Qwen3 (and their distills): Llama 3's regex with single digits.
_QWEN2_PAT = _LLAMA3_PAT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> (regex, add BOS when the file does not say)
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "llama-bpe": (_LLAMA3_PAT, True),
    "llama3": (_LLAMA3_PAT, True),
    "llama-v3": (_LLAMA3_PAT, True),
    "smollm": (_SMOLLM_PAT, False),
    "gpt2": (_GPT2_PAT, False),
    "gpt-2": (_GPT2_PAT, False),
    "qwen2": (_QWEN2_PAT, False),
    "deepseek-r1-qwen": (_QWEN2_PAT, False),
}
# Pre-tokenizers whose Hugging Face tokenizer has an NFC normalizer (Qwen's): the text between
# special tokens is NFC-normalized before it is split.
_NFC_PRE = frozenset({"qwen2", "deepseek-r1-qwen"})

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _meta_int(meta: dict, key: str) -> int | None:
    v = meta.get(key)
    return None if v is None else int(v)


def token_ids(ids, vocab_size: int) -> list[int]:
    """A list of token ids, each an integer in [0, vocab_size): bytes and strings are refused
    (iterating them would give character codes), as are floats and bools."""
    if isinstance(ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"token ids must be a sequence of integers, got {type(ids).__name__} "
                        f"(pass text as a str prompt)")
    try:
        ids = list(ids)
    except TypeError:
        raise TypeError(f"token ids must be a sequence of integers, got {ids!r}") from None
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {int(t)} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


@dataclass
class Tokenizer:
    """A tokenizer built from GGUF metadata. Build it with :meth:`from_gguf`."""

    model: str                       # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None                  # tokenizer.ggml.pre
    tokens: list[str]                # vocabulary texts, as stored
    token_types: np.ndarray          # int32 GGUF token types
    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None = None
    path: str | None = None
    _pieces: list[bytes] = field(default_factory=list, repr=False)   # token id -> bytes it decodes to
    _special: dict[str, int] = field(default_factory=dict, repr=False)  # CONTROL/UNKNOWN text -> id
    _user: dict[str, int] = field(default_factory=dict, repr=False)     # USER_DEFINED text -> id
    _special_re: Any = field(default=None, repr=False)
    _user_re: Any = field(default=None, repr=False)
    _all_re: Any = field(default=None, repr=False)   # special and user-defined texts
    _enc: Any = field(default=None, repr=False)     # tiktoken.Encoding
    _sp: Any = field(default=None, repr=False)      # sentencepiece.SentencePieceProcessor
    _drop_from: int = field(default=0, repr=False)  # tiktoken ranks >= this are bytes the vocab lacks
    _missing: bytes = field(default=b"", repr=False)   # bytes the byte-level vocabulary lacks
    _missing_re: Any = field(default=None, repr=False)  # finds characters whose UTF-8 has such a byte
    _split_re: Any = field(default=None, repr=False)
    _sp_byte: np.ndarray | None = field(default=None, repr=False)  # SPM: byte value of <0xXX> tokens, else -1
    _token_to_id: dict[str, int] | None = field(default=None, repr=False)
    _max_token_chars: int | None = field(default=None, repr=False)
    _nfc: bool = field(default=False, repr=False)    # NFC-normalize text first (Qwen's normalizer)
    strips_leading_space: bool = field(default=False, repr=False)  # SPM dummy prefix undone in decode

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build the tokenizer of a GGUF file (pyklei's or llama.cpp's) from its metadata alone."""
        meta = read_gguf_metadata(path, prefixes=("tokenizer.", "general.architecture", KEY_SPM_MODEL,
                                                  KEY_EOS_IDS))
        return cls.from_metadata(meta, path=str(path))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str | None = None) -> "Tokenizer":
        where = path or "metadata"
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{where}: no tokenizer (tokenizer.ggml.model is missing)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError(f"{where}: tokenizer.ggml.tokens is missing or empty")
        if any(isinstance(t, bytes) for t in tokens):
            raise TokenizerError(f"{where}: tokenizer.ggml.tokens holds texts that are not UTF-8")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = (np.full(n, TOKEN_NORMAL, np.int32) if types is None else np.asarray(types, np.int32))
        if len(types) != n:
            raise TokenizerError(f"{where}: {len(types)} token types for {n} tokens")

        def tid(key: str) -> int | None:
            v = _meta_int(meta, key)
            return v if v is not None and 0 <= v < n else None

        bos, eos, unk, pad = (tid("tokenizer.ggml.bos_token_id"), tid("tokenizer.ggml.eos_token_id"),
                              tid("tokenizer.ggml.unknown_token_id"), tid("tokenizer.ggml.padding_token_id"))
        pre = meta.get("tokenizer.ggml.pre")
        if model == "gpt2":
            if pre not in _PRE_TOKENIZERS:
                raise TokenizerError(
                    f"{where}: unknown pre-tokenizer tokenizer.ggml.pre={pre!r} for a byte-level BPE "
                    f"vocabulary; pyklei knows {sorted(_PRE_TOKENIZERS)}")
            default_bos = _PRE_TOKENIZERS[pre][1]
        elif model == "llama":
            default_bos = True
        else:
            raise TokenizerError(f"{where}: tokenizer.ggml.model={model!r} is not supported "
                                 "(pyklei reads 'gpt2' byte-level BPE and 'llama' SentencePiece)")
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_bos = default_bos if add_bos is None else bool(add_bos)
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if add_bos and bos is None:
            raise TokenizerError(f"{where}: the tokenizer adds BOS but has no valid tokenizer.ggml.bos_token_id")

        # eos_ids: the one end-of-generation rule (pyklei.formats.end_of_generation), which LLM,
        # Engine, stream_generate and the server all stop on.
        eos_list = end_of_generation_ids(meta)

        template = meta.get("tokenizer.chat_template")
        if isinstance(template, bytes):
            template = template.decode("utf-8", "replace")

        special = {tokens[i]: i for i in np.nonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN))[0].tolist()
                   if tokens[i]}
        user = {tokens[i]: i for i in np.nonzero(types == TOKEN_USER_DEFINED)[0].tolist() if tokens[i]}
        if model == "llama":    # runs of spaces are merged by the BPE, not matched (_build_spm)
            user = {t: i for t, i in user.items() if not _space_run(t)}

        self = cls(model=model, pre=pre, tokens=list(tokens), token_types=types, bos_id=bos, eos_id=eos,
                   eos_ids=tuple(eos_list), unk_id=unk, pad_id=pad, add_bos=add_bos, add_eos=add_eos,
                   chat_template=template or None, path=path, _special=special, _user=user,
                   _nfc=model == "gpt2" and pre in _NFC_PRE)
        self._special_re = _alternation(special)
        self._user_re = _alternation(user)
        self._all_re = _alternation({**user, **special})
        if model == "gpt2":
            self._build_bpe(meta, where)
        else:
            self._build_spm(meta, where)
        return self

    def _build_bpe(self, meta: dict, where: str) -> None:
        import tiktoken

        tokens, types = self.tokens, self.token_types
        n = len(tokens)
        pieces: list[bytes] = [b""] * n
        byte_level: list[bytes | None] = [None] * n
        u2b = _U2B
        for i, t in enumerate(tokens):
            ty = types[i]
            if ty == TOKEN_NORMAL or ty == TOKEN_BYTE or ty == TOKEN_UNUSED:
                try:
                    b = bytes([u2b[c] for c in t])
                except KeyError:
                    b = None
                byte_level[i] = b
                pieces[i] = b if b is not None else t.encode("utf-8")
            else:  # CONTROL, UNKNOWN, USER_DEFINED decode to their text
                pieces[i] = t.encode("utf-8")
        self._pieces = pieces

        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise TokenizerError(f"{where}: a byte-level BPE vocabulary needs tokenizer.ggml.merges")
        # Only single bytes and the results of merges take part in BPE. Check that the ids of merge
        # results grow with their first merge, so that id order == merge order (see module doc).
        tok_id = {t: i for i, t in enumerate(tokens)}
        produced: set[int] = set()
        last = -1
        for m in merges:
            a, sep, b = m.partition(" ")
            r = tok_id.get(a + b) if sep else None
            if r is None or r in produced:
                continue
            if r < last:
                raise TokenizerError(
                    f"{where}: merge {m!r} makes token {r} after token {last}; pyklei's tiktoken back end "
                    "needs token ids in merge order")
            produced.add(r)
            last = r
        ranks: dict[bytes, int] = {}
        for i, b in enumerate(byte_level):
            if b is None or b in ranks:
                continue
            if len(b) == 1 or i in produced:
                ranks[b] = i
        # Bytes the vocabulary lacks get ranks past the vocabulary; their ids are dropped after
        # encoding (Hugging Face's BPE without unk_token drops them too). Without this, tiktoken
        # panics (pyo3 PanicException, a BaseException) on them.
        self._drop_from = max(n, max(ranks.values()) + 1)
        missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
        for byte in missing:
            ranks[bytes([byte])] = self._drop_from + byte
        self._missing = bytes(missing)
        self._missing_re = _chars_with_bytes(missing)
        pat = _PRE_TOKENIZERS[self.pre][0]
        self._enc = tiktoken.Encoding(name=f"pyklei-{self.pre}", pat_str=pat, mergeable_ranks=ranks,
                                      special_tokens={})

    def _build_spm(self, meta: dict, where: str) -> None:
        import sentencepiece as spm

        tokens, types = self.tokens, self.token_types
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
        add_prefix = True if add_prefix is None else bool(add_prefix)
        # Hugging Face's decoder strips the first space only where the normalizer added one
        # (Llama 2's Prepend("▁")); Gemma's adds none and keeps a text's own leading space.
        self.strips_leading_space = add_prefix
        raw = meta.get(KEY_SPM_MODEL)
        # A checkpoint's own model is used as it is, unless it has user-defined runs of spaces
        # (Gemma's "▁▁"...): sentencepiece would match those greedily where Hugging Face merges
        # them by BPE, so the model is rebuilt from the arrays (sentencepiece_proto says how).
        if raw is not None and not any(types[i] == TOKEN_USER_DEFINED and _space_run(t)
                                       for i, t in enumerate(tokens)):
            proto = raw.tobytes() if isinstance(raw, np.ndarray) else bytes(raw)
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise TokenizerError(f"{where}: a SentencePiece vocabulary needs tokenizer.ggml.scores")
            if self.unk_id is None:
                unk = np.nonzero(types == TOKEN_UNKNOWN)[0]
                if len(unk) == 0:
                    raise TokenizerError(f"{where}: a SentencePiece vocabulary needs an unknown token")
                self.unk_id = int(unk[0])
            proto = _sentencepiece_model_proto(
                tokens, np.asarray(scores, np.float32), types, self.unk_id,
                -1 if self.bos_id is None else self.bos_id, -1 if self.eos_id is None else self.eos_id,
                add_prefix)
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on a bad model
            raise TokenizerError(f"{where}: sentencepiece refused the model built from the GGUF: {e}") from e
        if sp.get_piece_size() != len(tokens):
            raise TokenizerError(f"{where}: sentencepiece model has {sp.get_piece_size()} pieces, "
                                 f"the GGUF {len(tokens)} tokens")
        self._sp = sp
        byte_of = np.full(len(tokens), -1, np.int32)
        pieces: list[bytes] = []
        for i, t in enumerate(tokens):
            if types[i] == TOKEN_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                byte_of[i] = int(t[3:5], 16)
                pieces.append(bytes([byte_of[i]]))
            else:
                pieces.append(t.replace("\u2581", " ").encode("utf-8"))
        self._sp_byte = byte_of
        self._pieces = pieces

    # ---- properties ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of CONTROL and UNKNOWN tokens (skipped by ``decode(..., skip_special=True)``)."""
        return frozenset(self._special.values())

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_ids

    def id_to_token(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (e.g. ``'Ġhello'``, ``'▁hello'``)."""
        return self.tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        """Inverse of :meth:`id_to_token` (``None`` if absent)."""
        if self._token_to_id is None:
            self._token_to_id = {t: i for i, t in reversed(list(enumerate(self.tokens)))}
        return self._token_to_id.get(token)

    def token_to_piece(self, token_id: int) -> bytes:
        """The bytes the token stands for in decoded text (llama.cpp's token_to_piece).

        A SentencePiece word-start token gives its leading space (``'▁the'`` -> ``b' the'``); the
        single space that :meth:`decode` strips at the start of a text is not removed here.
        """
        return self._pieces[token_id]

    # ---- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        ``add_bos`` / ``add_eos``: ``None`` follows the file's metadata (see the module doc).
        ``parse_special``: turn the text of CONTROL/UNKNOWN tokens into their ids (True) or
        encode it as ordinary text (False). USER_DEFINED tokens are matched either way.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        text = _valid_unicode(text)
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos):
            if self.bos_id is None:
                raise TokenizerError("this tokenizer has no BOS token")
            ids.append(self.bos_id)
        rx = self._all_re if parse_special else self._user_re
        if rx is None:
            if text:
                ids.extend(self._encode_ordinary(text))
        else:
            table = {**self._user, **self._special} if parse_special else self._user
            pos = 0
            for m in rx.finditer(text):
                if m.start() > pos:
                    ids.extend(self._encode_ordinary(text[pos:m.start()]))
                ids.append(table[m.group()])
                pos = m.end()
            if pos < len(text):
                ids.extend(self._encode_ordinary(text[pos:]))
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Iterable[str], **kw: Any) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]

    def _encode_ordinary(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        if self._enc is None:
            return self._sp.encode(text)
        if self._missing_re is not None and self._missing_re.search(text):
            return self._encode_dropping_missing(text)
        return self._enc.encode_ordinary(text)

    def _encode_dropping_missing(self, text: str) -> list[int]:
        # Hugging Face's BPE drops a byte it has no token for from the word *before* merging, so
        # its neighbours may merge across the gap; tiktoken would keep it as a separate part.
        # Split with the same regex (the `regex` package, a dependency of tiktoken), delete the
        # missing bytes from each word, then BPE each word with tiktoken.
        import regex

        if self._split_re is None:
            self._split_re = regex.compile(_PRE_TOKENIZERS[self.pre][0])
        table = bytes.maketrans(b"", b"")
        ids: list[int] = []
        for m in self._split_re.finditer(text):
            word = m.group().encode("utf-8").translate(table, self._missing)
            if word:
                ids.extend(self._enc._encode_single_piece(word))
        return ids

    # ---- decoding -----------------------------------------------------------------------------
    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``, as the Hugging Face tokenizer's ``decode`` gives it.

        ``skip_special`` leaves out CONTROL and UNKNOWN tokens (``skip_special_tokens``).
        """
        ids = token_ids(ids, self.vocab_size)
        if skip_special:
            sp = self.special_ids
            ids = [i for i in ids if i not in sp]
        pieces = self._pieces
        if self._sp is None:
            return b"".join([pieces[i] for i in ids]).decode("utf-8", "replace")
        # SentencePiece: Hugging Face's ByteFallback decodes each run of <0xXX> tokens as UTF-8,
        # or turns every byte of the run into U+FFFD when the run is not valid UTF-8.
        byte_of = self._sp_byte
        out: list[str] = []
        run = bytearray()
        for i in ids:
            b = byte_of[i]
            if b >= 0:
                run.append(b)
                continue
            if run:
                out.append(_decode_run(run))
                run.clear()
            out.append(pieces[i].decode("utf-8"))
        if run:
            out.append(_decode_run(run))
        text = "".join(out)
        return text[1:] if self.strips_leading_space and text.startswith(" ") else text

    def detokenizer(self, skip_special: bool = False) -> "StreamingDetokenizer":
        """A fresh :class:`StreamingDetokenizer` for this tokenizer."""
        return StreamingDetokenizer(self, skip_special=skip_special)

    # ---- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, parse_special_in_content: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the file's own chat template (see :mod:`pyklei.text.chat_template`).

        With ``tokenize=True`` the text is encoded with no added BOS (templates that want a BOS
        write ``{{ bos_token }}`` themselves, as with Hugging Face), and special tokens are
        recognised only where the template writes them: the text of a CONTROL or UNKNOWN token
        inside a message (any role: a client's system prompt, a user's paste, a tool result,
        assistant history) or inside ``tools`` / ``documents`` is encoded as ordinary text, so
        ``<|im_end|>`` in a web page cannot close its turn and open a system one. Prompts whose
        messages hold no such text get the tokens they always had. USER_DEFINED tokens are
        matched everywhere, as :meth:`encode` does. ``parse_special_in_content=True`` parses
        special tokens in content too (the whole text encoded with ``parse_special=True``): for
        trusted callers who write control tokens into messages on purpose.

        ``tokenize=False`` returns the rendered text, in which content and template cannot be
        told apart any more: encode it only if the content is trusted.
        """
        from .chat_template import ChatTemplateError, ContentMarks, render

        def rendered(msgs, **kw):
            return render(self.chat_template, msgs, add_generation_prompt=add_generation_prompt,
                          bos_token=self._token_text(self.bos_id),
                          eos_token=self._token_text(self.eos_id), **kw)

        if not tokenize:
            return rendered(messages, **kwargs)
        if parse_special_in_content or self._special_re is None:
            return self.encode(rendered(messages, **kwargs), add_bos=False, parse_special=True)
        marks = ContentMarks(self._special_re)
        text = rendered(marks.wrap(messages),
                        **{k: marks.wrap(v) if k in ("tools", "documents") else v
                           for k, v in kwargs.items()})
        if not marks.count:      # nothing was marked: the plain path, token for token
            return self.encode(text, add_bos=False, parse_special=True)
        segments = marks.segments(text)
        if segments is None:
            raise ChatTemplateError(
                "the chat template altered message content that holds special-token text, so "
                "it cannot be kept from being read as control tokens; remove that text, or pass "
                "parse_special_in_content=True if the content is trusted")
        return self._encode_segments(segments)

    def _encode_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of the concatenated (text, is_content) segments: special tokens parsed in
        the template's text, only USER_DEFINED ones in content (encode(parse_special=False)),
        and each run of ordinary text between token matches encoded as one piece, across
        segment boundaries, so that content encodes as it would between its neighbours."""
        ids: list[int] = []
        ordinary: list[str] = []
        every = {**self._user, **self._special}
        for text, is_content in segments:
            text = _valid_unicode(text)
            rx, table = (self._user_re, self._user) if is_content else (self._all_re, every)
            pos = 0
            for m in (rx.finditer(text) if rx is not None else ()):
                ordinary.append(text[pos:m.start()])
                run = "".join(ordinary)
                if run:
                    ids.extend(self._encode_ordinary(run))
                ordinary.clear()
                ids.append(table[m.group()])
                pos = m.end()
            ordinary.append(text[pos:])
        run = "".join(ordinary)
        if run:
            ids.extend(self._encode_ordinary(run))
        return ids

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokens[token_id]

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its stored text (a special
        token's, matched in the text as written) or the bytes it decodes to. A text of C
        characters is thus at least C / max_token_chars tokens (the normalizer is the
        identity), which lets a server refuse a text too long for its context without
        tokenizing it."""
        if self._max_token_chars is None:
            self._max_token_chars = max(max(map(len, self.tokens)), max(map(len, self._pieces)), 1)
        return self._max_token_chars


def _space_run(token: str) -> bool:
    """A token of spaces only, spelled as spaces (llama.cpp) or as "▁" (the checkpoint)."""
    return bool(token) and not token.strip(" \u2581")


def _valid_unicode(text: str) -> str:
    """``text`` with lone surrogates turned into U+FFFD (as tiktoken does), in every back end."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _chars_with_bytes(missing: Sequence[int]):
    """A regex finding the characters whose UTF-8 encoding contains one of the ``missing`` bytes."""
    if not missing:
        return None
    if any(0x80 <= b < 0xC0 for b in missing):
        return re.compile(r"[^\x00-\x7f]|[" + "".join(re.escape(chr(b)) for b in missing if b < 0x80) + "]"
                          if any(b < 0x80 for b in missing) else r"[^\x00-\x7f]")
    parts = []
    for b in missing:
        if b < 0x80:
            lo = hi = b
        elif 0xC2 <= b <= 0xDF:
            lo = (b - 0xC0) << 6
            hi = lo + 0x3F
        elif 0xE0 <= b <= 0xEF:
            lo = max((b - 0xE0) << 12, 0x800)
            hi = ((b - 0xE0) << 12) + 0xFFF
        elif 0xF0 <= b <= 0xF4:
            lo = max((b - 0xF0) << 18, 0x10000)
            hi = min(((b - 0xF0) << 18) + 0x3FFFF, 0x10FFFF)
        else:  # 0xC0, 0xC1, 0xF5-0xFF never occur in UTF-8
            continue
        if 0xD800 <= lo <= 0xDFFF or 0xD800 <= hi <= 0xDFFF:
            lo, hi = (lo, 0xD7FF) if lo < 0xD800 else (0xE000, hi)
        parts.append(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}")
    return re.compile("[" + "".join(parts) + "]") if parts else None


def _decode_run(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def _alternation(words: dict[str, int]):
    """A regex matching any of ``words``, longest first (leftmost-longest like Hugging Face)."""
    if not words:
        return None
    return re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
