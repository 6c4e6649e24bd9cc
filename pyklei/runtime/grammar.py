"""Constrained decoding: a JSON schema, a grammar or a regex decides which tokens may come next.

    c = constraint(tokenizer, json_schema={"type": "object", "properties": {...}})
    logits = c.apply(logits, eos_ids)     # forbidden tokens -> -inf (a copy)
    c.advance(token)                      # the sampled token moves the grammar on
    c.is_done()                           # the grammar admits no more text: stop

llguidance (MIT; the engine behind llama.cpp's and vLLM's "guidance" backends) compiles the
schema or grammar and computes, per step, the set of tokens whose bytes keep the text a prefix
of some sentence of the grammar. It needs the vocabulary as bytes: pyklei's own
``Tokenizer.token_to_piece`` (both vocabulary kinds), with CONTROL/UNKNOWN tokens marked special
(llguidance's convention: their text behind the byte 0xFF, which UTF-8 never holds) so that a
grammar never spells ``<|im_end|>`` out of ordinary text and only names them on purpose.
Consequence of that convention: a byte-fallback token that stands for the lone byte 0xFF
(Llama 3 and Llama 2 have one) looks special to llguidance and is never allowed, which costs
nothing since 0xFF occurs in no UTF-8 text.

End of generation: the end-of-sequence tokens are allowed exactly where the grammar accepts
(the text so far is a whole sentence), and when it can take no more text (a closed JSON object)
the generation ends there, without waiting for the model to choose EOS.

SentencePiece vocabularies: a token's bytes are its text with "▁" as a space, so the first
token of a reply is seen with its leading space, which the decoder strips. A JSON grammar
does not allow leading whitespace, so the model starts with "{" rather than "▁{".

llguidance is optional (the ``grammar`` extra: ``pip install -e '.[grammar]'`` in a checkout); importing this module works without
it, building a constraint does not.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any, Sequence

import numpy as np

from ..text.json_schema import close_objects
from .request import check_depth

__all__ = ["Constraint", "GrammarError", "JSON_OBJECT", "close_objects", "constraint", "llg_tokenizer"]

#: {"type": "json_object"}: any JSON object (OpenAI's JSON mode).
JSON_OBJECT = {"type": "object"}

# Whitespace the compiled schema allows between JSON tokens: none or one space, or a newline and
# an indentation of at most 20 (llama.cpp's json-schema-to-grammar bounds it alike). Unbounded
# (llguidance's default) lets a small model spend its budget on whitespace; none at all
# (`{"a": 1}` only) forbids the pretty-printed layout instruct models write, and SmolLM2 then
# wrote worse JSON (odd keys, runaway strings) in a trial. A schema's own "x-guidance" options
# override these.
_JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": r"[ ]?|\n[ \t]{0,20}",
                "item_separator": ",", "key_separator": ":"}

_INSTALL = ("constrained decoding needs llguidance: pip install llguidance (in a pyklei "
            "checkout: pip install -e '.[grammar]')")

# What one grammar may cost, so that no request's grammar can stall the others (a server
# compiles untrusted schemas). Its text: a schema of 3,000 properties is 115 KB and compiles in
# ~0.2 s on one core; 10,000 (390 KB) took 1.7 s. Its masks: llguidance's lexer fuel per step
# (~14k units a ms: 50k is ~4 ms, where the default 200k let `^a{100000}$` cost 18-35 ms a
# step) and for building a regex's first states (~50k a ms). A grammar over a limit is a
# GrammarError that says which.
MAX_GRAMMAR_BYTES = 128 << 10
MAX_SCHEMA_DEPTH = 64            # nesting of a JSON schema given as text (as a server's body)
_LIMITS = dict(step_lexer_fuel=50_000, initial_lexer_fuel=200_000)


class GrammarError(ValueError):
    """A JSON schema, grammar or regex that llguidance cannot compile; the message says why."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError(_INSTALL) from None
    return llguidance


# ---- the vocabulary, as llguidance sees it ------------------------------------------------------

# One LLTokenizer per pyklei Tokenizer: building it (llguidance's token trie, its slices) takes
# a noticeable time for a 128k vocabulary, and every request of a server needs it. Keyed by id()
# because Tokenizer is an unhashable dataclass; the finalizer drops the entry with the tokenizer.
_LLT_CACHE: dict[int, Any] = {}
_LLT_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS/BOS, and a tokenize function
    (llguidance tokenizes grammar literals and forced text with it)."""

    def __init__(self, tokenizer):
        special = tokenizer.special_ids
        self.tokens = [b"\xff" + tokenizer.tokens[i].encode("utf-8") if i in special
                       else tokenizer.token_to_piece(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        # weak: the cache entry holding this must not keep the tokenizer alive
        self._tokenizer = weakref.ref(tokenizer)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer().encode(text, add_bos=False, parse_special=False)


def llg_tokenizer(tokenizer):
    """The llguidance.LLTokenizer of a pyklei Tokenizer (built once per tokenizer, then cached)."""
    llg = _llguidance()
    key = id(tokenizer)
    with _LLT_LOCK:
        llt = _LLT_CACHE.get(key)
        if llt is None:
            if not tokenizer.eos_ids:
                raise GrammarError("the tokenizer has no end-of-sequence token: a constrained "
                                   "generation could not end")
            llt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)),
                                  n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_ids))
            _LLT_CACHE[key] = llt
            weakref.finalize(tokenizer, _LLT_CACHE.pop, key, None)
    return llt


# ---- closing within the budget ------------------------------------------------------------------
#
# A small model that loops inside an unbounded string or array would be cut by max_tokens
# mid-value, and an invalid reply is worse than a short one. So each sampled token is checked
# (Constraint.fit_budget): the grammar must still be completable within the tokens max_tokens
# leaves after it. If it is not, the first token of a completion found from the state before
# it is emitted instead, and the model goes on from there. So a reply that starts with a
# completion within its budget always has one, and max_tokens never cuts it mid-value.
# completion_within finds the completions: a search over one-character steps (short and
# universal: every vocabulary has the printable ASCII characters as tokens), respelled in the
# tokenizer's own tokens.

#: Every token is checked while fewer than this many would be left over after the completion
#: (a search each, ~0.5 ms typically); elsewhere every CLOSE_EVERY tokens, which keeps the
#: completion's length known as a reply nests deeper.
CLOSE_WINDOW, CLOSE_EVERY = 96, 16
#: At most this many grammar states are visited per search; past it the search gives up and the
#: generation stops checking (a grammar whose completions this search cannot find cheaply).
CLOSE_SEARCH_NODES = 300      # every search on benchmarks/structured.py's replies that can succeed does

# The characters a completion is spelled from, in the order they are tried among equal
# candidates: what strings are usually made of first (a completion should read like a plain
# value: "a@a.aa", not "}}@0"), then separators, literals' first letters, whitespace, and
# the brackets last (outside strings, closing ones are tried first anyway: they close), then
# the rest of printable ASCII but the backslash (an escape is never needed to close).
_ALPHABET = "".join(dict.fromkeys('"a01@.-:,A_+/TZeEtrufnls \n}]{['
                                  + "".join(chr(c) for c in range(0x20, 0x7f)))).replace("\\", "")
# Where two characters in a row changed nothing (more letters of a free string, more digits of
# a long number), the search tries only these next: the marks that move a format on (an e-mail's
# '@', a date's '-' and 'T', a time's ':') and the closers.
_MARKS = frozenset(c.encode() for c in '"@.-:+/_TZ,}]')
_CHAR_CACHE: dict[int, tuple[np.ndarray, tuple[bytes, ...]]] = {}


def _char_tokens(tokenizer) -> tuple[np.ndarray, tuple[bytes, ...]]:
    """The ids of the vocabulary's one-character tokens for _ALPHABET (in its order, characters
    without such a token left out), and their bytes; cached per tokenizer."""
    key = id(tokenizer)
    with _LLT_LOCK:
        hit = _CHAR_CACHE.get(key)
        if hit is None:
            want = {ch.encode(): None for ch in _ALPHABET}
            special = tokenizer.special_ids
            for i in range(tokenizer.vocab_size):
                if i not in special:
                    piece = tokenizer.token_to_piece(i)
                    if piece in want and want[piece] is None:
                        want[piece] = i
            found = [(t, b) for b, t in want.items() if t is not None]
            hit = (np.array([t for t, _ in found], np.int64), tuple(b for _, b in found))
            _CHAR_CACHE[key] = hit
            weakref.finalize(tokenizer, _CHAR_CACHE.pop, key, None)
    return hit


# The JSON state of a text, as the closing search needs it: (inside a string, after a backslash
# in it, open arrays and objects, the bytes of the open string -- or, outside, of the string just
# closed while only whitespace followed it, a key if ':' comes -- else None, per open array or
# object its (last key, commas so far), the last byte outside strings that is not whitespace,
# the values closed at the top level). The keys, counts and last byte tell apart places that look
# alike to the grammar's mask: after "name": "x" and after "age": 3 the same tokens may come
# next, but what must follow differs; likewise the first and the third item of an array of
# three, a '"' after ':' (a value) and after ',' (a key), and the same markup before and after
# a tool call's JSON ("<tool" of "<tool_call>" and of "</tool_call>").
JSON_START = (False, False, 0, None, (), 0, 0)
_KEY_CAP = 64     # bytes of a string kept: keys are short; longer strings are never keys


def _json_lex(state: tuple, data: bytes) -> tuple:
    """The JSON state (see JSON_START) after `data`."""
    in_str, esc, depth, cur, nest, last, closed = state
    for b in data:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:                      # backslash
                esc = True
            elif b == 0x22:                      # '"' closes it
                in_str, last = False, b
                continue
            if cur is not None and len(cur) < _KEY_CAP:
                cur += bytes((b,))
            continue
        if b in (0x20, 0x0A, 0x0D, 0x09):
            continue
        last = b
        if b == 0x22:
            in_str, cur = True, b""
            continue
        if b == 0x3A and cur is not None and nest:   # ':' after a string: it was a key
            nest = nest[:-1] + ((cur, nest[-1][1]),)
        elif b == 0x2C and nest:                     # ','
            nest = nest[:-1] + ((nest[-1][0], nest[-1][1] + 1),)
        elif b in (0x7B, 0x5B):                      # '{' '['
            depth += 1
            nest = nest + ((b"", 0),)
        elif b in (0x7D, 0x5D):                      # '}' ']'
            depth = max(0, depth - 1)
            nest = nest[:-1]
            closed += depth == 0
        cur = None
    return in_str, esc, depth, cur, nest, last, closed


def completion_within(matcher, tokenizer, lex: tuple | None, limit: int,
                      max_nodes: int = CLOSE_SEARCH_NODES) -> list[int] | None:
    """Tokens that take `matcher` to a state where the grammar accepts, at most `limit` of
    them; [] when it accepts already; None when the search finds none (within about 3 * limit
    characters and `max_nodes` visited states). `matcher` is not changed.

    `lex` is the JSON state of the text so far (_json_lex; None for grammars that are not
    JSON): each open string, array and object needs one more character at least, a lower
    bound that prunes the search and orders it.

    Depth first over one-character steps. At each state the next characters are tried
    fewest-open-structures first, then in _ALPHABET's order; a character that changes neither
    the grammar's mask (the tokens allowed next, over the whole vocabulary) nor the JSON
    structure -- one more letter of a free string -- is tried after those that do (the '@'
    of an e-mail before its local part's second letter). States with the same mask, JSON
    structure, key path and string length count as one (reached again with no more steps
    left, they are skipped): that keeps the search small, a few hundred states at most on
    benchmarks/structured.py's schemas. Not always the shortest completion, short in practice:
    a plain value of each required kind ("a@a", "00000", 0). The characters found are then
    respelled in the tokenizer's tokens where the grammar takes those."""
    if matcher.is_accepting() or matcher.is_stopped():
        return []
    ids, chars = _char_tokens(tokenizer)
    if lex is not None:   # JSON never needs whitespace between tokens
        keep = np.array([not c.isspace() for c in chars], bool)
        ids, chars = ids[keep], tuple(c for c, k in zip(chars, keep) if k)
    if not len(ids):
        return None
    path = _CompletionSearch(tokenizer, ids, chars, max_nodes).run(matcher, lex, 3 * limit + 8)
    if path is None:
        return None
    text = b"".join(tokenizer.token_to_piece(t) for t in path)
    try:
        short = tokenizer.encode(text.decode("utf-8"), add_bos=False, parse_special=False)
    except UnicodeDecodeError:
        short = path
    if len(short) < len(path):
        m = matcher.deep_copy()
        if all(m.consume_token(t) for t in short) and (m.is_accepting() or m.is_stopped()):
            path = list(short)
    return path if len(path) <= limit else None


def _completes(matcher, tokens) -> bool:
    """`tokens` take `matcher` (changed: give a copy) to where the grammar accepts."""
    return (all(matcher.consume_token(t) for t in tokens)
            and (matcher.is_accepting() or matcher.is_stopped()))


class _CompletionSearch:
    """The depth-first search of completion_within; `nodes` counts the states it visited."""

    def __init__(self, tokenizer, ids, chars, max_nodes):
        self.tokenizer, self.ids, self.chars, self.max_nodes = tokenizer, ids, chars, max_nodes
        self.n_words = (tokenizer.vocab_size + 31) // 32
        self.word, self.shift = ids >> 5, (ids & 31).astype(np.int32)
        self.nodes = 0
        # how each character changes the open count, inside a string and outside one
        self.delta_str = np.array([-1 if c == b'"' else 0 for c in chars])
        self.delta_out = np.array([1 if c in (b'"', b"{", b"[") else -1 if c in (b"}", b"]")
                                   else 0 for c in chars])

    @staticmethod
    def _open(lx) -> int:
        return 0 if lx is None else int(lx[0]) + lx[2]

    @staticmethod
    def _shape(lx):
        """The JSON state without the string's text: its structure and key path."""
        return None if lx is None else (lx[0], lx[1], lx[2], lx[4], lx[5], lx[6])

    def _mask(self, m) -> np.ndarray:
        bits = np.empty(self.n_words, np.int32)
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return bits

    def _children(self, bits, lx, g, limit):
        """(token, piece) of the allowed next steps within the limit, best first."""
        js = np.nonzero((bits[self.word] >> self.shift) & 1)[0]
        if not len(js):
            # where the next text is forced (a key's name), llguidance allows only the tokens
            # that spell it as the tokenizer would: take those. A special token is among them
            # only where the grammar names it (a tool call's marker, Mistral's [TOOL_CALLS]);
            # it is no JSON text
            special = self.tokenizer.special_ids
            allowed = np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))[0]
            out = []
            for t in allowed[:16].tolist():
                piece = b"" if t in special else self.tokenizer.token_to_piece(t)
                nlx = None if lx is None else _json_lex(lx, piece)
                if g + 1 + self._open(nlx) <= limit:
                    out.append((self._open(nlx), t, piece))
            return [(t, piece) for _, t, piece in sorted(out, key=lambda x: x[0])]
        # one character each: how it moves the count of open structures, from a table
        h = self._open(lx) + (self.delta_str[js] if lx is not None and lx[0] and not lx[1]
                              else self.delta_out[js] if lx is not None and not lx[0]
                              else 0)
        h = np.broadcast_to(h, js.shape)
        order = np.argsort(h, kind="stable")          # fewest open first, then the alphabet
        keep = order[g + 1 + h[order] <= limit]
        return [(int(self.ids[j]), self.chars[j]) for j in js[keep]]

    def run(self, matcher, lex, limit):
        best: dict = {}             # merged state -> most tokens left when it was reached
        root = self._mask(matcher)
        # a frame: [matcher, its mask, lex, path, children, next child, deferred children]
        stack = [[matcher, root, lex, (), self._children(root, lex, 0, limit), 0, []]]
        while stack:
            if self.nodes >= self.max_nodes:
                return None
            frame = stack[-1]
            m, bits, lx, path, kids, i, deferred = frame
            if i < len(kids):
                frame[5] = i + 1
                tok, piece = kids[i]
                if len(deferred) >= 2 and piece not in _MARKS:
                    continue   # two characters here changed nothing: only a format's marks might
                nlx = None if lx is None else _json_lex(lx, piece)
                child = m.deep_copy()
                self.nodes += 1
                if not child.consume_token(tok):
                    continue
                cpath = path + (tok,)
                if child.is_accepting() or child.is_stopped():
                    return list(cpath)
                cbits = self._mask(child)
                key = (cbits.tobytes(), self._shape(nlx),
                       len(nlx[3]) if nlx is not None and nlx[0] and nlx[3] is not None else -1)
                left = limit - len(cpath)
                if best.get(key, -1) >= left:
                    continue
                best[key] = left
                entry = [child, cbits, nlx, cpath, None, 0, []]
                if (np.array_equal(cbits, bits) and self._shape(nlx) == self._shape(lx)):
                    deferred.append(entry)       # no progress to see: after the siblings
                    continue
                entry[4] = self._children(cbits, nlx, len(cpath), limit)
                stack.append(entry)
            elif deferred:
                entry = deferred.pop(0)
                entry[4] = self._children(entry[1], entry[2], len(entry[3]), limit)
                stack.append(entry)
            else:
                stack.pop()
        return None


# ---- one request's constraint -------------------------------------------------------------------

class Constraint:
    """One generation's grammar state (an llguidance LLMatcher over the model's vocabulary).

    Stateful: it follows one sequence of tokens. ``fresh()`` gives another at the start state
    (for another request, or each of n choices) by copying the compiled start state: compiling
    happens once (_compile). Not thread-safe: the generation that owns it calls it."""

    def __init__(self, tokenizer, start, what: str, stop_when=None):
        """start: a compiled llguidance LLMatcher at its start state (kept unchanged: fresh()
        copies it). stop_when: called with the text so far after each token; True ends the
        generation there (tool calls: a call that repeats an earlier one)."""
        self.tokenizer = tokenizer
        self.what = what                      # "JSON schema", "tool calls", "grammar", "regex"
        self._stop_when = stop_when
        self._text = b""                      # the text so far, kept for stop_when only
        self._stopped = False                 # stop_when said so
        self._start = start
        self._matcher = start.deep_copy()
        self.n_vocab = tokenizer.vocab_size
        # the mask, one bit per token, as llguidance writes it (int32 words, token i at bit i%32
        # of word i//32); the bytes view unpacks it little-endian
        self._bits = np.zeros((self.n_vocab + 31) // 32, np.int32)
        self.n_tokens = 0                     # tokens advanced over
        self._claimed = False
        # closing within the budget (fit_budget): the JSON state of the text so far (None for
        # grammars that are not JSON: tool calls are, their markup having no JSON brackets or
        # quotes left open), a completion from the current state when known, and whether the
        # search gave up on this grammar
        self._lex = JSON_START if what in ("JSON schema", "tool calls") else None
        self._completion: list[int] | None = None   # from the state it was found at or a later one
        self._close_len = 0                   # its length
        self._gave_up = False
        self.n_substituted = 0                # tokens fit_budget replaced
        self.close_seconds = 0.0              # spent in its searches (benchmarks read it)

    def claim(self) -> "Constraint":
        """Marks it as one generation's (stream_generate and Engine.submit call this): a
        constraint follows one sequence, so a second generation with it is a ValueError."""
        if self._claimed:
            raise ValueError("this constraint already belongs to a generation; give each "
                             "generation its own (constraint.fresh())")
        self._claimed = True
        return self

    def fresh(self) -> "Constraint":
        """A new constraint with the same grammar at its start (a copy of the compiled start
        state: microseconds, where compiling a large schema again took seconds)."""
        return Constraint(self.tokenizer, self._start, self.what, self._stop_when)

    # ---- per step --------------------------------------------------------------------------
    def fill_bitmask(self, out: np.ndarray | None = None) -> np.ndarray:
        """Computes the allowed tokens of the next step into `out` (int32 [(n_vocab+31)//32],
        C-contiguous; default: this constraint's own buffer) and returns it. Releases the GIL
        while llguidance works."""
        out = self._bits if out is None else out
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def allowed(self, bits: np.ndarray | None = None) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows next (computed now unless `bits`, a
        mask from fill_bitmask, is given)."""
        bits = self.fill_bitmask() if bits is None else bits
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def apply(self, logits: np.ndarray, eos_ids: Sequence[int] = (),
              bits: np.ndarray | None = None) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf. `eos_ids` (the
        generation's own end tokens, which may be more than the tokenizer's) are allowed
        exactly where the grammar accepts."""
        ok = self.allowed(bits)
        eos = [t for t in eos_ids if 0 <= t < self.n_vocab]
        if eos:
            ok[eos] = self._matcher.is_accepting()
        if not ok.any():
            raise GrammarError(f"the {self.what} allows no token here: "
                               f"{_first_line(self._matcher.get_error()) or 'dead end'}")
        return np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def fit_budget(self, token: int, budget: int) -> int:
        """`token` (sampled, not yet advanced over) if the grammar can still be completed within
        `budget` tokens after it; otherwise the first token of a completion from here, which
        then leaves one of at most `budget` tokens. Generation calls it for every sampled
        token, so that max_tokens never cuts a reply the grammar has not closed (see
        completion_within).

        The search runs where the budget left over a completion is under CLOSE_WINDOW tokens,
        and every CLOSE_EVERY tokens elsewhere to see the completion's length grow (a reply
        that nests deeper and deeper needs more to close). Where the search gives up, `token`
        is kept and this constraint stops checking."""
        if self._gave_up:
            return token
        if budget - self._close_len >= CLOSE_WINDOW and (self.n_tokens % CLOSE_EVERY
                                                         or self.n_tokens == 0):
            return token
        t0 = time.perf_counter()
        try:
            return self._fit_budget(token, budget)
        finally:
            self.close_seconds += time.perf_counter() - t0

    def _fit_budget(self, token: int, budget: int) -> int:
        after = self._matcher.deep_copy()
        if after.consume_token(int(token)):
            # the last completion found often still closes the reply after this token (one
            # more letter of a string): checking that costs a few microseconds, a search ~1 ms
            # (or, when this token wrote its first characters, the rest of it)
            last = self._completion or []
            for k in range(min(4, len(last) + 1)):
                if len(last) - k <= budget and _completes(after.deep_copy(), last[k:]):
                    self._completion, self._close_len = last[k:], len(last) - k
                    return token
            lex = None if self._lex is None else _json_lex(self._lex, self._piece(token))
            path = completion_within(after, self.tokenizer, lex, budget)
            if path is not None:
                self._completion, self._close_len = path, len(path)
                return token
        path = self._completion
        if path is None or len(path) > budget + 1 or not _completes(self._matcher.deep_copy(),
                                                                    path):
            path = completion_within(self._matcher, self.tokenizer, self._lex, budget + 1)
        if not path:          # none found (or the grammar accepts already: keep the token)
            self._gave_up = path is None
            return token
        self._completion, self._close_len = path[1:], len(path) - 1
        self.n_substituted += 1
        return path[0]

    def _piece(self, token: int) -> bytes:
        return b"" if token in self.tokenizer.special_ids else self.tokenizer.token_to_piece(token)

    def advance(self, token: int) -> None:
        """Moves the grammar past `token` (sampled from apply()'s logits). An end-of-sequence
        token ends the generation and is not passed here."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not fit the {self.what}: "
                               f"{_first_line(self._matcher.get_error())}")
        self.n_tokens += 1
        if self._lex is not None:
            self._lex = _json_lex(self._lex, self._piece(int(token)))
        if self._stop_when is not None:
            self._text += self.tokenizer.token_to_piece(int(token))
            self._stopped = self._stop_when(self._text.decode("utf-8", "replace"))

    def is_done(self) -> bool:
        """The grammar can take no more text, or stop_when said so: the generation ends here."""
        return self._stopped or self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is a whole sentence of the grammar (EOS may come)."""
        return self._matcher.is_accepting()

    def __repr__(self) -> str:
        return f"<pyklei.runtime.grammar.Constraint {self.what}, {self.n_tokens} tokens>"


def _first_line(msg: str) -> str:
    """The message of an llguidance error, without the parser state and grammar it appends."""
    return msg.strip().split("\n<state>")[0].strip()


def _compile(tokenizer, grammar: str, what: str, stop_when=None) -> Constraint:
    """The constraint of llguidance's `grammar`, compiled once within the limits above; its
    first steps are tried here, so that a grammar whose lexer blows up on its first token (a
    regex such as `^a{300000}$`) is refused now rather than failing the generation later."""
    llg = _llguidance()
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what} too large: its grammar is {len(grammar)} bytes, at most "
                           f"{MAX_GRAMMAR_BYTES}")
    limits = llg.LLParserLimits(**_LIMITS)
    llt = llg_tokenizer(tokenizer)
    is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, llt, limits=limits)
    if is_error:
        raise GrammarError(f"invalid {what}: {_first_line(msgs[0])}")
    start = llg.LLMatcher(llt, grammar, log_level=0, limits=limits)
    _probe(start, tokenizer, what)
    return Constraint(tokenizer, start, what, stop_when)


def _probe(start, tokenizer, what: str) -> None:
    """GrammarError unless the first mask, and the mask after the first token it allows, can
    be computed within the limits (on copies: `start` stays at its start state)."""
    m = start.deep_copy()
    bits = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)
    m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if not m.is_error():
        ok = np.unpackbits(bits.view(np.uint8), bitorder="little")[:tokenizer.vocab_size]
        ok[list(tokenizer.eos_ids)] = 0
        first = np.flatnonzero(ok)
        if first.size and m.consume_token(int(first[0])):
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if m.is_error():
        raise GrammarError(f"{what} too costly to follow: {_first_line(m.get_error())}")


def _schema_text(schema) -> str:
    if isinstance(schema, (bytes, bytearray)):
        schema = schema.decode("utf-8")
    if isinstance(schema, str):
        if len(schema) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"JSON schema too large: {len(schema)} characters, at most "
                               f"{MAX_GRAMMAR_BYTES}")
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise GrammarError(f"invalid JSON schema: it nests deeper than {MAX_SCHEMA_DEPTH} "
                               f"levels") from None
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
    try:
        check_depth(schema, MAX_SCHEMA_DEPTH)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"invalid JSON schema: it must be a JSON object, got "
                           f"{type(schema).__name__}")
    return json.dumps(schema)


def constraint(tokenizer, *, json_schema=None, grammar: str | None = None,
               regex: str | None = None, response_format: dict | None = None,
               tool_calls=None) -> Constraint | None:
    """The constraint of one request, from at most one of:

    json_schema      a JSON schema (dict, or its JSON text); objects that list their
                     properties are closed (close_objects)
    grammar          a Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's)
    regex            a regular expression the whole reply matches (Rust regex syntax)
    response_format  OpenAI's: {"type": "text"} (None: no constraint), {"type": "json_object"},
                     {"type": "json_schema", "json_schema": {"schema": {...}, "name": ..,
                     "strict": ..}}
    tool_calls       pyklei.text.tool_calls.ForcedCalls: the calls tool_choice "required" or a
                     named function demands, in the model's own format; closed within
                     max_tokens as a JSON schema is, and ended at a call that repeats one

    None when none is given. GrammarError (a ValueError) names what does not compile; TypeError
    for an argument of the wrong kind; ImportError when llguidance is not installed."""
    given = {k: v for k, v in (("json_schema", json_schema), ("grammar", grammar),
                                ("regex", regex), ("response_format", response_format),
                                ("tool_calls", tool_calls)) if v is not None}
    if len(given) > 1:
        raise ValueError(f"give one of json_schema, grammar, regex, response_format and "
                         f"tool_calls, got {', '.join(given)}")
    if not given:
        return None
    if response_format is not None:
        json_schema = _from_response_format(response_format)
        if json_schema is None:
            return None
    llg = _llguidance()
    if tool_calls is not None:
        return _compile(tokenizer, tool_calls.lark(tokenizer, _JSON_LAYOUT), "tool calls",
                        tool_calls.repeats_a_call)
    if json_schema is not None:
        text = _schema_text(json_schema)   # checked as JSON here, then closed (close_objects)
        if len(text) > MAX_GRAMMAR_BYTES:  # before close_objects, which walks it in Python
            raise GrammarError(f"JSON schema too large: {len(text)} bytes, at most "
                               f"{MAX_GRAMMAR_BYTES}")
        text = json.dumps(close_objects(json.loads(text)))
        try:
            g = llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_LAYOUT)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return _compile(tokenizer, g, "JSON schema")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise TypeError(f"grammar must be the text of a Lark or GBNF grammar, got "
                            f"{type(grammar).__name__}")
        if not grammar.strip():
            raise GrammarError("invalid grammar: it is empty")
        try:
            g = llg.grammar_from("grammar", grammar)   # GBNF is translated to Lark; Lark kept
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {e}") from None
        return _compile(tokenizer, g, "grammar")
    if not isinstance(regex, str):
        raise TypeError(f"regex must be a string, got {type(regex).__name__}")
    return _compile(tokenizer, llg.LLMatcher.grammar_from_regex(regex), "regex")


def _from_response_format(rf) -> Any:
    """The JSON schema an OpenAI response_format asks for (None for plain text)."""
    if not isinstance(rf, dict):
        raise TypeError(f"response_format must be a dict such as {{'type': 'json_object'}}, "
                        f"got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise GrammarError("invalid response_format: type 'json_schema' needs "
                               "json_schema.schema, the JSON schema of the reply")
        return js["schema"]
    raise GrammarError(f"invalid response_format: type must be 'text', 'json_object' or "
                       f"'json_schema', got {kind!r}")
