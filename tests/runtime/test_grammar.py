"""Constrained decoding (pyklei.grammar, issue 23): llguidance over pyklei's own vocabularies,
the mask in Generation, the API, the engine and the CLI.

The vocabulary tests run on SmolLM2's converted file and on the Llama 3 (byte-level BPE) and
Llama 2 (SentencePiece) vocabularies of ../shared/vocab; the generation tests on the converted
SmolLM2 with schemas whose language is finite (every string bounded, no extra properties), so
that a reply that does not end, parse and validate is a failure of the constraint, not of the
model. Skipped where llguidance (pip install -e '.[grammar]') is absent.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from paths import VOCAB_DIR

try:
    import llguidance  # noqa: F401
    HAVE_LLG = True
except ImportError:
    HAVE_LLG = False

needs_llg = pytest.mark.skipif(not HAVE_LLG, reason="llguidance not installed "
                                                    "(pip install -e '.[grammar]')")



def _shared_vocab(name):
    path = VOCAB_DIR / name
    if not path.exists():
        pytest.skip(f"{name} not found in {VOCAB_DIR}")
    return path


@pytest.fixture(scope="module")
def smol_llm(smollm2_q4):
    import pyklei
    llm = pyklei.load(smollm2_q4, n_threads=2, n_ctx=1024, n_seq=5)
    yield llm
    llm.close()


# ---- the vocabulary llguidance sees ------------------------------------------------------------

@needs_llg
@pytest.mark.parametrize("vocab", ["smollm2", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf"])
def test_llguidance_vocabulary_agrees_with_pyklei(vocab, request):
    """Every token's bytes as llguidance sees them are token_to_piece's, the special tokens are
    llguidance's special ones, and the EOS set is pyklei's. One exception, by llguidance's
    convention: a token standing for the lone byte 0xFF reads as a special marker (empty);
    grammars never allow it (no UTF-8 text holds 0xFF)."""
    from pyklei.runtime.grammar import llg_tokenizer
    from pyklei.text.tokenizer import Tokenizer

    path = (request.getfixturevalue("smollm2_q4") if vocab == "smollm2" else _shared_vocab(vocab))
    tok = Tokenizer.from_gguf(path)
    llt = llg_tokenizer(tok)
    assert llg_tokenizer(tok) is llt                      # cached per tokenizer
    assert llt.vocab_size == tok.vocab_size
    assert sorted(llt.eos_tokens) == sorted(tok.eos_ids)
    special = tok.special_ids
    ff = []
    for i in range(tok.vocab_size):
        piece = tok.token_to_piece(i)
        if piece == b"\xff" and i not in special:
            ff.append(i)
            assert llt.is_special_token(i)
            continue
        assert llt.decode_bytes([i]) == piece, i
        assert llt.is_special_token(i) == (i in special), i
    assert len(ff) <= 1
    # llguidance tokenizes grammar literals with pyklei's own encoder
    for text in ["Hello world", '{"a": [1, 2.5e-3], "b": "ü€😀"}', "  two  spaces\nnew line"]:
        assert llt.tokenize_str(text) == tok.encode(text, add_bos=False, parse_special=False)
    # no grammar lets a special token or the 0xFF token through
    from pyklei.runtime.grammar import constraint
    ok = constraint(tok, regex=r"(.|\n)*").allowed()
    assert not ok[sorted(special - set(tok.eos_ids))].any() and not ok[ff].any()
    assert ok.sum() > tok.vocab_size // 2


# ---- compiling: errors ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_tok(smollm2_q4):
    from pyklei.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_q4)


@needs_llg
@pytest.mark.parametrize("kw, words", [
    (dict(json_schema={"type": "objec"}), ["JSON schema", "objec"]),
    (dict(json_schema='{"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}'),
     ["JSON schema", "/defs/x"]),
    (dict(json_schema={"type": "string", "pattern": "(ab"}), ["JSON schema", "unclosed group"]),
    (dict(json_schema='{"type": '), ["JSON schema", "not JSON"]),
    (dict(json_schema=[1, 2]), ["JSON schema", "JSON object"]),
    (dict(grammar="start: foo("), ["grammar", "Expected"]),
    (dict(grammar="   "), ["grammar", "empty"]),
    (dict(grammar="root ::= \"a\" missing"), ["grammar", "missing"]),
    (dict(regex="[a-"), ["regex", "unclosed character class"]),
    (dict(response_format={"type": "xml"}), ["response_format", "'xml'"]),
    (dict(response_format={"type": "json_schema"}), ["response_format", "json_schema.schema"]),
    (dict(json_schema={}, regex="a"), ["one of", "json_schema", "regex"]),
])
def test_what_does_not_compile_is_a_value_error_naming_why(smol_tok, kw, words):
    from pyklei.runtime.grammar import GrammarError, constraint
    with pytest.raises(ValueError) as e:
        constraint(smol_tok, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)
    if len(kw) == 1:
        assert isinstance(e.value, GrammarError)


@needs_llg
def test_constraint_kinds_and_no_constraint(smol_tok):
    from pyklei.runtime.grammar import constraint
    assert constraint(smol_tok) is None
    assert constraint(smol_tok, response_format={"type": "text"}) is None
    for kw in [dict(response_format={"type": "json_object"}), dict(json_schema=True),
               dict(response_format={"type": "json_schema", "json_schema": {
                   "name": "x", "strict": True, "schema": {"type": "integer"}}}),
               dict(grammar='root ::= "a"+'), dict(grammar='start: "a"+'), dict(regex="a+")]:
        c = constraint(smol_tok, **kw)
        assert not c.is_accepting() or kw.get("json_schema") is True
    with pytest.raises(TypeError):
        constraint(smol_tok, response_format="json_object")
    with pytest.raises(TypeError):
        constraint(smol_tok, grammar=b'root ::= "a"')


def test_without_llguidance_the_error_says_what_to_install(smol_tok, monkeypatch):
    import pyklei.runtime.grammar as G
    monkeypatch.setitem(sys.modules, "llguidance", None)   # import llguidance -> ImportError
    with pytest.raises(ImportError, match=r"pip install llguidance"):
        G.constraint(smol_tok, json_schema={"type": "object"})
    assert G.constraint(smol_tok) is None                  # no constraint needs no llguidance


# ---- Generation: the mask, EOS, the end --------------------------------------------------------

def _drive(tok, c, logits_of, max_tokens=64, eos=None):
    """Runs a Generation with `c` over logits_of(step) (no model); -> (text, last response)."""
    from pyklei.runtime.generate import Generation
    from pyklei.runtime.request import make_request
    from pyklei.runtime.sampler import SamplingParams
    gen = Generation(tok, make_request(1 << 20, tok, [1], max_tokens,
                                       SamplingParams(temperature=0.0), eos_ids=eos,
                                       constraint=c))
    parts, step = [], 0
    while not gen.done:
        r = gen.feed(logits_of(step))
        step += 1
        if r is not None:
            parts.append(r.text)
    return "".join(parts), r


@needs_llg
def test_eos_only_where_the_grammar_accepts(smol_tok):
    """Logits that always prefer EOS, then 'z', then 'a': the grammar [a-z]{3,5} keeps EOS out
    until three letters are written, then EOS wins."""
    from pyklei.runtime.grammar import constraint
    tok = smol_tok
    eos = tok.eos_ids[0]
    a, z = tok.encode("a", add_bos=False)[0], tok.encode("z", add_bos=False)[0]
    base = np.full(tok.vocab_size, -5.0, np.float32)
    base[[eos, z, a]] = [9.0, 8.0, 7.0]
    text, r = _drive(tok, constraint(tok, regex="[a-z]{3,5}"), lambda i: base)
    assert text == "zzz" and r.finish_reason == "stop" and r.token == eos
    # the generation's own EOS ids (beyond the tokenizer's) are held back alike
    extra = tok.encode("!", add_bos=False)[0]
    base2 = base.copy()
    base2[extra] = 10.0
    text, r = _drive(tok, constraint(tok, regex="[a-z]{3,5}"), lambda i: base2,
                     eos=[eos, extra])
    assert text == "zzz" and r.token == extra


@needs_llg
def test_a_grammar_that_ends_stops_the_generation(smol_tok):
    """'(yes|no)!' with logits that never pick EOS: the reply ends at '!' with "stop", where
    unconstrained it would run to max_tokens."""
    from pyklei.runtime.grammar import constraint
    tok = smol_tok
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((64, tok.vocab_size)).astype(np.float32)
    noise[:, list(tok.eos_ids)] = -30
    c = constraint(tok, grammar='root ::= ("yes" | "no") "!"')
    text, r = _drive(tok, c, lambda i: noise[i])
    assert text in ("yes!", "no!") and r.finish_reason == "stop" and c.is_done()
    assert r.token not in tok.eos_ids
    text, r = _drive(tok, None, lambda i: noise[i], max_tokens=20)
    assert r.finish_reason == "length"


@needs_llg
def test_a_constraint_belongs_to_one_generation(smol_llm):
    from pyklei.runtime.grammar import constraint
    c = constraint(smol_llm.tokenizer, regex="(yes|no)")
    ids = smol_llm.encode("Yes or no?")
    from pyklei.runtime.generate import stream_generate
    list(stream_generate(smol_llm.model, smol_llm.tokenizer, ids, 8, constraint=c))
    with pytest.raises(ValueError, match="fresh"):
        stream_generate(smol_llm.model, smol_llm.tokenizer, ids, 8, constraint=c)
    r = "".join(x.text for x in stream_generate(smol_llm.model, smol_llm.tokenizer, ids, 8,
                                                constraint=c.fresh()))
    assert r in ("yes", "no")


# ---- the real model under JSON schemas ---------------------------------------------------------

# Finite languages: each reply must end, parse and validate within the token budget.
SCHEMAS = [
    ("A person as JSON with name, age and a list of hobbies.",
     {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
      "properties": {"name": {"type": "string", "maxLength": 24},
                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                     "hobbies": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "string", "maxLength": 16}}}}),
    ("The weather in Paris as JSON.",
     {"type": "object", "additionalProperties": False, "required": ["city", "sky", "celsius"],
      "properties": {"city": {"enum": ["Paris", "London", "Rome"]},
                     "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                     "celsius": {"type": "number", "minimum": -30, "maximum": 45}}}),
    ("A point on a map as JSON, and whether it is a capital.",
     {"type": "object", "additionalProperties": False, "required": ["lat", "lon", "capital"],
      "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                     "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                     "capital": {"type": "boolean"},
                     "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
    ("A list of two fruits and their colours, as JSON.",
     {"type": "array", "minItems": 2, "maxItems": 2,
      "items": {"type": "object", "additionalProperties": False, "required": ["fruit", "colour"],
                "properties": {"fruit": {"type": "string", "maxLength": 12},
                               "colour": {"anyOf": [{"enum": ["red", "yellow", "green"]},
                                                    {"type": "null"}]}}}}),
]


def _check_reply(text, schema):
    import jsonschema
    jsonschema.validate(json.loads(text), schema)


@needs_llg
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=1),
                                      dict(temperature=1.2, seed=7, top_k=0, min_p=0.0)],
                         ids=["greedy", "seed1", "seed7-wide"])
def test_replies_under_a_schema_parse_and_validate(smol_llm, sampling):
    pytest.importorskip("jsonschema")
    for prompt, schema in SCHEMAS:
        r = smol_llm.chat([{"role": "user", "content": prompt}], max_tokens=200,
                          json_schema=schema, **sampling)
        assert r.finish_reason == "stop", (prompt, r.text)
        _check_reply(r.text, schema)


@needs_llg
def test_response_format_json_object_streams_json(smol_llm):
    parts = []
    for r in smol_llm.chat([{"role": "user", "content": "Reply with a JSON object {\"ok\": true}."}],
                           max_tokens=64, stream=True, temperature=0.0,
                           response_format={"type": "json_object"}):
        parts.append(r.text)
    text = "".join(parts)
    assert text.lstrip().startswith("{")
    if r.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@needs_llg
def test_engine_batches_constrained_and_free_requests_as_alone(smol_llm):
    """4 constrained requests (two schemas, a regex, a grammar) and an unconstrained one, in one
    Engine: each gives the text it gives alone through LLM.generate."""
    from pyklei.runtime.engine import Engine
    from pyklei.runtime.grammar import constraint
    from pyklei.runtime.sampler import SamplingParams

    tok = smol_llm.tokenizer
    kinds = [dict(json_schema=SCHEMAS[0][1]), dict(json_schema=SCHEMAS[1][1]),
             dict(regex=r"[A-Z][a-z]{2,8}( [a-z]{1,8}){0,3}\."),
             dict(grammar='root ::= "The answer is " ("yes" | "no") "."'), {}]
    prompts = [SCHEMAS[0][0], SCHEMAS[1][0], "Describe the sea.", "Is water wet?", "Say hi."]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
           for p in prompts]
    sampling = [dict(temperature=0.0), dict(temperature=0.8, seed=3), dict(temperature=0.0),
                dict(temperature=0.7, seed=5), dict(temperature=0.0)]
    alone = [smol_llm.generate(i, max_tokens=48, **k, **s).text
             for i, k, s in zip(ids, kinds, sampling)]
    with Engine(smol_llm.model, tok, n_parallel=5) as engine:
        streams = [engine.submit(i, max_tokens=48, params=SamplingParams(**s),
                                 eos_ids=smol_llm.eos_ids, constraint=constraint(tok, **k))
                   for i, k, s in zip(ids, kinds, sampling)]
        batched = ["".join(r.text for r in s) for s in streams]
    assert batched == alone
    assert alone[3] in ("The answer is yes.", "The answer is no.")


@needs_llg
def test_generate_batch_gives_each_prompt_its_own_constraint(smol_llm):
    schema = SCHEMAS[1][1]
    prompts = ["The weather in Rome as JSON.", "The weather in London as JSON."]
    rs = smol_llm.generate_batch(prompts, max_tokens=64, json_schema=schema, temperature=0.0)
    for p, r in zip(prompts, rs):
        assert r.text == smol_llm.generate(p, max_tokens=64, json_schema=schema,
                                           temperature=0.0).text
        if r.finish_reason == "stop":
            _check_reply(r.text, schema)


# ---- the CLI -----------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pyklei", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@needs_llg
def test_cli_json_schema_and_grammar(smollm2_q4, tmp_path):
    schema = tmp_path / "weather.json"
    schema.write_text(json.dumps(SCHEMAS[1][1]))
    r = _cli("generate", smollm2_q4, "--chat", "-p", SCHEMAS[1][0], "--json-schema", schema,
             "--temperature", "0", "-n", "80")
    assert r.returncode == 0, r.stderr
    _check_reply(r.stdout, SCHEMAS[1][1])
    r = _cli("generate", smollm2_q4, "--chat", "-p", "Is the sky blue?", "--json-schema",
             '{"enum": ["yes", "no"]}', "--temperature", "0")
    assert r.returncode == 0 and r.stdout.strip() in ('"yes"', '"no"'), r.stderr
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= ("yes" | "no") "!"\n')
    r = _cli("generate", smollm2_q4, "--chat", "-p", "Is the sky blue?", "--grammar", g,
             "--temperature", "0")
    assert r.returncode == 0 and r.stdout.strip() in ("yes!", "no!"), r.stderr
    for bad, words in [(["--json-schema", '{"type": "objec"}'], "invalid JSON schema"),
                       (["--json-schema", tmp_path / "missing.json"], "no such JSON schema file"),
                       (["--grammar", g, "--regex", "a"], "not allowed with"),
                       (["--regex", "[a-"], "invalid regex")]:
        r = _cli("generate", smollm2_q4, "-p", "x", *bad)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


@needs_llg
def test_objects_that_list_their_properties_are_closed(smol_tok):
    """close_objects adds additionalProperties: false where a schema lists properties and says
    nothing of others (a small model otherwise adds keys until max_tokens); what the schema says
    itself, allOf branches and data (enum/const) are kept."""
    from pyklei.runtime.grammar import close_objects, constraint
    person = {"type": "object", "properties": {"a": {"type": "integer"}}}
    s = {"type": "object", "properties": {"p": person, "q": {"type": "array", "items": person}},
         "$defs": {"d": person},
         "allOf": [person], "enum": [{"properties": {}}],
         "anyOf": [person, {"properties": {"b": {}}, "additionalProperties": True},
                   {"properties": {"b": {}}, "patternProperties": {"^x": {}}}]}
    c = close_objects(s)
    assert c["additionalProperties"] is False
    assert c["properties"]["p"]["additionalProperties"] is False
    assert c["properties"]["q"]["items"]["additionalProperties"] is False
    assert c["$defs"]["d"]["additionalProperties"] is False
    assert c["allOf"] == [person] and c["enum"] == s["enum"]
    assert c["anyOf"][0]["additionalProperties"] is False
    assert c["anyOf"][1]["additionalProperties"] is True
    assert "additionalProperties" not in c["anyOf"][2]
    assert "additionalProperties" not in person and close_objects({"type": "object"}) == {"type": "object"}
    # in the constraint: after {"a": 1 only the end of the object may come
    comma, brace = (smol_tok.encode(x, add_bos=False)[0] for x in (",", "}"))
    for schema, open_ in [(person, False), ({**person, "additionalProperties": True}, True)]:
        k = constraint(smol_tok, json_schema=schema)
        for t in smol_tok.encode('{"a": 1', add_bos=False):
            k.advance(t)
        ok = k.allowed()
        assert ok[brace] and ok[comma] == open_


@needs_llg
def test_engine_computes_the_masks_during_the_forward_pass(smol_llm, monkeypatch):
    """In the engine every mask is filled on the helper thread (overlapping model.batch), none
    again in Generation.feed; the replies still follow their grammars."""
    import threading
    import pyklei.runtime.grammar as G
    from pyklei.runtime.engine import Engine
    from pyklei.runtime.sampler import SamplingParams

    threads = []
    fill = G.Constraint.fill_bitmask

    def spy(self, out=None):
        threads.append(threading.current_thread().name)
        return fill(self, out)

    monkeypatch.setattr(G.Constraint, "fill_bitmask", spy)
    tok = smol_llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Is water wet?"}], tokenize=True)
    with Engine(smol_llm.model, tok, n_parallel=3) as engine:
        streams = [engine.submit(ids, max_tokens=16, params=SamplingParams(temperature=0.0),
                                 eos_ids=smol_llm.eos_ids,
                                 constraint=G.constraint(tok, regex=rx))
                   for rx in ("(yes|no)", "[0-9]{3}", "[a-z]+ [a-z]+")]
        texts = ["".join(r.text for r in s) for s in streams]
    assert texts[0] in ("yes", "no") and texts[1].isdigit() and len(texts[1]) == 3
    assert len(threads) >= 3 + 3 and all(t.startswith("pyklei-mask") for t in threads), threads


@needs_llg
def test_cli_chat_constrains_every_reply(smollm2_q4):
    r = subprocess.run([sys.executable, "-m", "pyklei", "chat", str(smollm2_q4), "--regex",
                        "(yes|no)", "--temperature", "0"], input="Is the sky blue?\nIs fire cold?\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    replies = [line.removeprefix("> ") for line in r.stdout.splitlines()[1:] if line != "> "]
    assert len(replies) == 2 and all(x in ("yes", "no") for x in replies), r.stdout


def test_a_reply_looping_in_a_string_closes_at_the_budget(smollm2_q4):
    """SmolLM2 loops inside an unbounded comment string: the closing check ends the reply
    valid ("stop") in its last tokens, where without it the same request is cut ("length")
    into text that does not parse."""
    pytest.importorskip("llguidance")
    import jsonschema

    import pyklei
    from pyklei.runtime import grammar
    llm = pyklei.load(smollm2_q4, n_threads=2, n_ctx=1024)
    schema = {"type": "object", "required": ["stars"], "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": {"type": "string"}}}
    ask = [{"role": "user", "content": "Rate a restaurant from 1 to 5 stars with an optional "
                                       "comment."}]
    r = llm.chat(ask, json_schema=schema, temperature=0, max_tokens=96)
    assert r.finish_reason == "stop" and r.generation_tokens > 90, r
    jsonschema.validate(json.loads(r.text), schema)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grammar.Constraint, "fit_budget", lambda self, token, budget: token)
        cut = llm.chat(ask, json_schema=schema, temperature=0, max_tokens=96)
    assert cut.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


# A schema whose shortest reply is long (an e-mail format, two required array items, a nested
# required integer with a minimum): the budget is what decides whether the reply closes.
_TIGHT = {"type": "object", "required": ["name", "emails", "address"], "properties": {
    "name": {"type": "string"},
    "emails": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 2},
    "address": {"type": "object", "required": ["zip"], "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "number": {"type": "integer",
                                                                      "minimum": 5}}}}}


def test_the_json_state_the_closing_search_reads():
    from pyklei.runtime import grammar
    lex = grammar._json_lex(grammar.JSON_START, b'{"a": [1, {"b": "x\\"y}')
    in_str, esc, depth, cur, nest, last, n_closed = lex
    assert (in_str, esc, depth) == (True, False, 3) and cur == b'x\\"y}'
    assert nest == ((b"a", 0), (b"", 1), (b"b", 0)) and last == ord('"') and n_closed == 0
    closed = grammar._json_lex(lex, b'"}]}')
    assert closed[:3] == (False, False, 0) and closed[4] == () and closed[6] == 1


@needs_llg
@pytest.mark.parametrize("prefix", ['', '{"name": "Ann', '{"name": "Ann", "emails": ["ann.b',
                                    '{"name": "Ann", "emails": ["a@b.co", "x}y@',
                                    '{"name": "A", "emails": ["a@b.co", "c@d.de"], "address": '
                                    '{"zip": "12'])
def test_completion_within_closes_the_reply_valid(smol_llm, prefix):
    """From any point of a reply, the completion found takes it to a text that parses and
    validates; it needs at most the limit it was given, and None below the open structures'
    count (each needs a character)."""
    import jsonschema

    from pyklei.runtime import grammar
    tok = smol_llm.tokenizer
    c = grammar.constraint(tok, json_schema=_TIGHT)
    for t in tok.encode(prefix, add_bos=False):
        c.advance(t)
    path = grammar.completion_within(c._matcher, tok, c._lex, 64)
    assert path is not None and len(path) <= 64
    text = prefix + tok.decode(path)
    jsonschema.validate(json.loads(text), _TIGHT, format_checker=jsonschema.FormatChecker())
    assert grammar.completion_within(c._matcher, tok, c._lex, len(path)) is not None
    opened = int(c._lex[0]) + c._lex[2]
    assert grammar.completion_within(c._matcher, tok, c._lex, opened - 1) is None


@needs_llg
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_max_tokens_never_cuts_a_constrained_reply(smol_llm, temperature):
    """Every budget from a little over the schema's shortest reply (29 tokens as the search
    spells it) up: the reply ends valid inside max_tokens (finish_reason "stop"), greedy and
    sampled, where without the closing check it is cut (SmolLM2 writes long e-mail
    addresses)."""
    import jsonschema

    from pyklei.runtime import grammar
    ask = "Write a JSON record of a person with two e-mail addresses and an address."
    cut = 0
    for max_tokens in (32, 36, 40, 48, 64):
        r = smol_llm.generate(ask, json_schema=_TIGHT, max_tokens=max_tokens,
                              temperature=temperature, seed=max_tokens)
        assert r.generation_tokens <= max_tokens and r.finish_reason == "stop", (max_tokens, r.text)
        jsonschema.validate(json.loads(r.text), _TIGHT,
                            format_checker=jsonschema.FormatChecker())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grammar.Constraint, "fit_budget", lambda self, token, budget: token)
            free = smol_llm.generate(ask, json_schema=_TIGHT, max_tokens=max_tokens,
                                     temperature=temperature, seed=max_tokens)
        cut += free.finish_reason == "length"
    assert cut >= 3       # the check is what closes these replies


# ---- what one grammar may cost (issue 40) -------------------------------------------------------

@needs_llg
@pytest.mark.parametrize("kw, words", [
    # a schema given as text goes through the same depth check as a body's JSON
    (dict(json_schema='{"type": "array", "items": ' * 400 + "{}" + "}" * 400),
     ["JSON schema", "nests deeper than 64"]),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "schema": '{"items": ' * 100 + "{}" + "}" * 100}}), ["JSON schema", "nests deeper"]),
    (dict(json_schema={"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(10_000)}}), ["too large"]),
    # lexers that blow up on the first token: refused when compiled, not when generating
    (dict(regex="^a{300000}$"), ["regex", "too costly"]),
    (dict(regex="^a{100000}$"), ["regex", "too costly"]),
])
def test_a_grammar_beyond_its_budget_is_refused_when_compiled(smol_tok, kw, words):
    from pyklei.runtime.grammar import GrammarError, constraint
    with pytest.raises(GrammarError) as e:
        constraint(smol_tok, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


@needs_llg
def test_fresh_copies_the_compiled_start_state(smol_tok):
    """n choices of one request share one compilation: fresh() copies the start state (even
    from a constraint that has advanced), and each copy follows its own tokens."""
    import time
    from pyklei.runtime.grammar import constraint
    props = {f"p{i}": {"type": "integer"} for i in range(2000)}
    t = time.perf_counter()
    c = constraint(smol_tok, json_schema={"type": "object", "properties": props,
                                          "required": list(props)})
    compile_s = time.perf_counter() - t
    c.advance(smol_tok.encode("{", add_bos=False)[0])
    t = time.perf_counter()
    copies = [c.fresh() for _ in range(15)]
    assert time.perf_counter() - t < compile_s        # 15 copies cost less than one compile
    assert all(x._start is c._start and x.n_tokens == 0 for x in copies)
    first = copies[0].allowed()
    assert first[smol_tok.encode("{", add_bos=False)[0]] and not c.allowed().all()
    assert (copies[1].allowed() == first).all()
