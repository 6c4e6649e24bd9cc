"""Streaming detokenization: token ids in, text out one token at a time (see the class doc)."""
from __future__ import annotations

import codecs
from typing import Iterable


class StreamingDetokenizer:
    """Turns token ids into text one token at a time, never emitting a broken UTF-8 sequence.

    ``add_token(id)`` returns the text that became final with this token (possibly ``""``):
    bytes of a UTF-8 sequence that is not complete yet are held back until the next tokens
    complete it (mlx-lm style). ``finalize()`` returns what is held back, invalid bytes as
    U+FFFD; ``finalize(drop_incomplete=True)`` drops instead the bytes of a character that the
    last token left unfinished (a reply cut by max_tokens in the middle of an emoji ends before
    it, not in U+FFFD). With the default, the concatenation of all returned strings equals ``tokenizer.decode(ids)`` for any
    ids of byte-level BPE vocabularies, and for SentencePiece ones whenever runs of byte tokens
    are valid UTF-8 (``decode`` then follows Hugging Face in turning a whole invalid run into
    U+FFFD, which a stream cannot know in advance). The leading space of a SentencePiece text
    is stripped where ``decode`` strips it (a dummy-prefix vocabulary). ``text`` holds
    everything emitted so far.
    """

    # The tokenizer makes its detokenizers (Tokenizer.detokenizer), so this module does not
    # import it back: it reads the tokenizer's special_ids, model and byte pieces.
    def __init__(self, tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._strip_space = tokenizer.strips_leading_space
        self.reset()

    def reset(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False
        self.tokens: list[int] = []
        self._chunks: list[str] = []
        self.dropped = b""      # the unfinished character finalize(drop_incomplete=True) dropped

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def add_token(self, token_id: int) -> str:
        token_id = int(token_id)
        self.tokens.append(token_id)
        if token_id in self._skip:
            return ""
        return self._emit(self._dec.decode(self.tokenizer._pieces[token_id]))

    def add_tokens(self, ids: Iterable[int]) -> str:
        return "".join(self.add_token(i) for i in ids)

    def finalize(self, drop_incomplete: bool = False) -> str:
        """The text still held back. The decoder only ever holds the prefix of a character that
        further bytes could complete (an invalid byte is U+FFFD at once), so with
        drop_incomplete these bytes (``dropped``, at most 3) are discarded: no more tokens
        will come to complete them."""
        if drop_incomplete:
            self.dropped = self._dec.getstate()[0]
            self._dec.reset()
            return ""
        return self._emit(self._dec.decode(b"", final=True))

    def _emit(self, s: str) -> str:
        if s and not self._started:
            self._started = True
            if self._strip_space and s.startswith(" "):
                s = s[1:]
        if s:
            self._chunks.append(s)
        return s
