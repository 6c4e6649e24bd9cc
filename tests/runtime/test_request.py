"""One request, checked once (pyklei.request, issue 23 part 4), and one end-of-generation rule
(Tokenizer.eos_ids, issue 27): on SmolLM2's converted file."""
from __future__ import annotations

import pytest

from pyklei.runtime.request import MAX_STOPS, GenerationRequest, check_stops, make_request, token_budget
from pyklei.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_q4):
    import pyklei
    with pyklei.load(smollm2_q4, n_threads=1, n_ctx=256, n_seq=2) as llm:
        yield llm


def test_a_request_is_checked_where_it_is_made(llm):
    tok = llm.tokenizer
    r = make_request(256, tok, [1, 2, 3], 8, stop="\n")
    assert isinstance(r, GenerationRequest)
    assert (r.prompt, r.max_tokens, r.stop, r.params) == ((1, 2, 3), 8, ("\n",), SamplingParams())
    assert r.eos_ids == tuple(tok.eos_ids)
    assert make_request(256, tok, [1], None).max_tokens == 255          # the rest of the context
    assert make_request(256, tok, [1], 999, trim=True).max_tokens == 255
    bad = [
        (dict(prompt=[]), ValueError, "empty"),
        (dict(prompt=[tok.vocab_size]), ValueError, "outside the vocabulary"),
        (dict(prompt=["a"]), ValueError, "integers"),
        (dict(max_tokens=999), ValueError, "exceeds the context"),
        (dict(max_tokens=-2), ValueError, "max_tokens"),
        (dict(stop=[1]), TypeError, "stop"),
        (dict(params={"temperature": 0}), TypeError, "SamplingParams"),
        (dict(params=SamplingParams(logit_bias={tok.vocab_size: 1})), ValueError, "logit_bias"),
        (dict(logprobs=21), ValueError, "logprobs"),
        (dict(logprobs=True), ValueError, "logprobs"),
        (dict(eos_ids=[-1]), ValueError, "vocabulary"),
    ]
    for kw, err, words in bad:
        args = dict(prompt=[1, 2], max_tokens=8) | kw
        with pytest.raises(err, match=words):
            make_request(256, tok, args.pop("prompt"), **args)


def test_stops_and_budget_rules():
    assert check_stops("x") == ("x",) and check_stops(["a", "b"]) == ("a", "b")
    assert len(check_stops(["s"] * 100)) == 100                        # the Python API: any
    with pytest.raises(ValueError, match=f"at most {MAX_STOPS}"):
        check_stops(["s"] * (MAX_STOPS + 1), MAX_STOPS)                 # the server's bound
    assert token_budget(10, 4, 0) == 0 and token_budget(10, 10, 0) == 0
    with pytest.raises(ValueError, match="no room"):
        token_budget(10, 10, 1)


def test_the_engine_trusts_a_request_but_not_one_made_for_a_larger_context(llm):
    from pyklei.runtime.engine import Engine
    tok = llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                  add_generation_prompt=True, tokenize=True)
    greedy = SamplingParams(temperature=0)
    with Engine(llm.model, tok, n_parallel=1) as eng:
        made = make_request(llm.n_ctx, tok, ids, 16, greedy)
        text = "".join(r.text for r in eng.submit_requests([made])[0])
        assert text == llm.generate(ids, max_tokens=16, temperature=0).text
        with pytest.raises(ValueError, match="does not fit this engine's context"):
            eng.submit_requests([make_request(4096, tok, ids, 1000, greedy)])
        with pytest.raises(ValueError, match="share one prompt"):
            eng.submit_requests([made, make_request(llm.n_ctx, tok, [1, 2], 4)])


def test_one_end_of_generation_rule(llm, smollm2_q4):
    """Tokenizer.eos_ids holds the metadata's EOS/EOT/EOM ids, the ids a pyklei file lists
    (pyklei.eos_token_ids) and end-of-turn tokens by name; LLM, Engine, stream_generate and
    the server all stop on exactly these."""
    from pyklei.formats import gguf_keys as K
    from pyklei.text.tokenizer import Tokenizer, read_gguf_metadata

    tok = llm.tokenizer
    assert set(llm.model.file.eos_token_ids) <= set(tok.eos_ids)
    assert list(tok.eos_ids) == llm.eos_ids
    assert {tok.tokens[i] for i in tok.eos_ids} == {"<|im_end|>", "<|endoftext|>"}
    meta = read_gguf_metadata(smollm2_q4, prefixes=("tokenizer.", "general.architecture",
                                                    K.KEY_EOS_IDS))
    listed = 17                                    # a plain token a file says ends generation
    assert listed not in tok.eos_ids
    meta[K.KEY_EOS_IDS] = [2, listed]
    assert listed in Tokenizer.from_metadata(meta).eos_ids
    # the defaults below LLM: the same set
    assert make_request(llm.n_ctx, tok, [1], 4).eos_ids == tuple(llm.eos_ids)


def _stop_reference(stops, pieces):
    """What StopMatcher must do, written the obvious way: emit all but the longest end of the
    text that begins a stop; cut at the earliest start of any stop found."""
    stops = [s for s in stops if s]
    pending, out = "", []
    for piece in pieces:
        pending += piece
        starts = [i for i in (pending.find(s) for s in stops) if i >= 0]
        if starts:
            out.append(pending[:min(starts)])
            return "".join(out), True
        hold = max((n for s in stops for n in range(1, len(s)) if pending.endswith(s[:n])),
                   default=0)
        out.append(pending[:len(pending) - hold])
        pending = pending[len(pending) - hold:]
    return "".join(out), False


def test_stop_matcher_agrees_with_the_obvious_rule():
    import random
    from pyklei.runtime.generate import StopMatcher
    rng = random.Random(40)
    for _ in range(5000):
        alpha = rng.choice(["ab", "abc"])
        stops = ["".join(rng.choice(alpha) for _ in range(rng.randint(0, 5)))
                 for _ in range(rng.randint(0, 4))]
        pieces = ["".join(rng.choice(alpha) for _ in range(rng.randint(0, 4)))
                  for _ in range(rng.randint(1, 8))]
        m, got, stopped = StopMatcher(stops), [], False
        for piece in pieces:
            text, stopped = m.feed(piece)
            got.append(text)
            if stopped:
                break
        assert ("".join(got), stopped) == _stop_reference(stops, pieces), (stops, pieces)


def test_stop_matcher_is_linear_in_the_text_whatever_the_stops():
    """16 stops of 480,000 characters (issue 40): each piece costs what its own characters do,
    not what the held text and the stops do."""
    import time
    from pyklei.runtime.generate import StopMatcher
    m = StopMatcher(["=" * 480_000 + str(i) for i in range(16)])
    t = time.perf_counter()
    for _ in range(7500):                      # 480,000 characters, all held back
        assert m.feed("=" * 64) == ("", False)
    assert time.perf_counter() - t < 5.0       # the old rule: ~0.2 s a piece at the end
    assert m.feed("7") == ("", True)


def test_server_stop_bounds():
    from pyklei.runtime.request import MAX_STOP_CHARS, stop_chars_bound
    assert stop_chars_bound(8192, 64) == MAX_STOP_CHARS
    assert stop_chars_bound(16, 8) == 128
    with pytest.raises(ValueError, match="at most 10"):
        check_stops(["x" * 11], MAX_STOPS, 10)
