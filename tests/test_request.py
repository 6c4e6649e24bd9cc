"""One request, checked once (pyklei.request, issue 23 part 4), and one end-of-generation rule
(Tokenizer.eos_ids, issue 27): on SmolLM2's converted file."""
from __future__ import annotations

import pytest

from pyklei.request import MAX_STOPS, GenerationRequest, check_stops, make_request, token_budget
from pyklei.sampler import SamplingParams


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
    from pyklei.engine import Engine
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
    from pyklei.tokenizer import Tokenizer, read_gguf_metadata

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
