"""Speculative decoding with prompt lookup (issue 25; a draft model: test_speculative_draft_model.py): Model.verify gives every row the logits of
a decode step bit for bit, truncate_seq rolls a slot back, and stream_generate with
speculative="lookup" gives plain decoding's tokens (greedy, and sampling under one seed) with
stop strings, max_tokens, EOS and logprobs unchanged. On the committed tiny model (random token
streams: a stand-in model whose logits are a random function of the last two tokens) and on
SmolLM2-135M-Instruct (stop strings, logprobs, chat turns and a 300-token quoting reply), when
its file is cached."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

from paths import ROOT, SEED, SMOLLM2_CACHED
from speculative_cases import markov_run, repetitive_prompt, tokens_text_finish
from pyklei.runtime.generate import stream_generate
from pyklei.llm import LLM
from pyklei.runtime.model import Model, SequenceLostError
from pyklei.runtime.sampler import SamplingParams
from pyklei.runtime.speculative import DraftLength, PromptLookup, check_speculative

GREEDY = SamplingParams(temperature=0.0)


def _run(llm, prompt, spec, **kw):
    llm.reset()
    rs = list(stream_generate(llm.model, llm.tokenizer, prompt, speculative=spec,
                              eos_ids=kw.pop("eos_ids", llm.eos_ids), **kw))
    return rs, llm.model.cached_tokens


# ---- Model.verify / truncate_seq --------------------------------------------------------------

@pytest.mark.parametrize("n_threads", [1, 2])
def test_verify_rows_are_decode_steps_bit_for_bit(n_threads):
    m = Model(SEED, n_threads=n_threads, n_ctx=256, n_seq=2)
    prompt = repetitive_prompt(1)
    tail = [5, 17, 200, 3, 3, 99, 1]
    m.eval(prompt)
    steps = [m.step(t) for t in tail]
    m.reset()
    m.eval(prompt)
    rows = m.verify(tail)
    assert rows.shape == (len(tail), m.vocab_size)
    for a, b in zip(steps, rows):
        assert np.array_equal(a, b)
    assert m.cached_tokens == prompt + tail
    # roll back past a "rejected" position and continue: the stale K/V are never read
    m.truncate_seq(0, len(prompt) + 3)
    assert m.cached_tokens == prompt + tail[:3]
    assert np.array_equal(m.step(tail[3]), steps[3])
    again = m.verify([77, 78, 79])
    m.reset()
    m.eval(prompt + tail[:4])
    assert np.array_equal(again[0], m.step(77))
    # another slot, from a copied prefix
    m.copy_seq(0, 1, len(prompt))
    rows1 = m.verify(tail, seq=1)
    assert all(np.array_equal(a, b) for a, b in zip(steps, rows1))
    assert m.seq_tokens(1) == prompt + tail


def test_verify_and_truncate_check_their_arguments(tiny):
    m = tiny.model
    m.reset()
    m.eval([1, 2, 3])
    with pytest.raises(ValueError, match="cannot keep 5 positions: slot 0 holds 3 tokens"):
        m.truncate_seq(0, 5)
    with pytest.raises(ValueError, match="outside the model's 2 slots"):
        m.verify([1], seq=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.verify([1, 384])
    with pytest.raises(ValueError, match="would pass the context of 512 tokens"):
        m.verify([1] * 510)
    assert m.cached_tokens == [1, 2, 3]          # refused calls change nothing
    owner = object()
    m.eval([1, 2, 3], owner=owner)
    m.logits([4, 5])                             # somebody else used the cache
    with pytest.raises(SequenceLostError):
        m.verify([6], owner=owner)
    with pytest.raises(SequenceLostError):
        m.truncate_seq(0, 1, owner=owner)


# ---- the drafter and the draft length --------------------------------------------------------

def test_prompt_lookup_drafts_the_latest_longest_match():
    pl = PromptLookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], max_ngram=3)
    assert pl.draft(4) == [5, 6, 7, 2]            # "2 3": its latest earlier occurrence
    pl = PromptLookup([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], max_ngram=3)
    assert pl.draft(2) == [4, 9]                  # "1 2 3" beats the later "2 3"
    assert PromptLookup([1, 2, 3]).draft(4) == []
    pl = PromptLookup([10, 11, 12, 13, 14, 15, 16, 0, 10, 11], max_ngram=2)
    assert pl.draft(2) == [12, 13]
    pl.extend([12, 13, 14])                       # accepted, and the pass's own token agreed
    assert pl.draft(3) == [15, 16, 0]             # the copy continues from its source
    # "7 8" occurs twice; the first occurrence matches the text's end further back (5 6 7 8)
    pl = PromptLookup([5, 6, 7, 8, 1, 2, 0, 7, 8, 3, 4, 9, 5, 6, 7, 8], max_ngram=2)
    assert pl.draft(2) == [1, 2]
    with pytest.raises(ValueError):
        PromptLookup([1], max_ngram=1, min_ngram=2)


def test_prompt_lookup_tells_a_copy_in_progress_from_a_fresh_match():
    pl = PromptLookup([10, 11, 12, 13, 14, 15, 16, 0, 10, 11], max_ngram=2)
    assert pl.kind() == "match"                   # the first draft looks "10 11" up
    assert pl.draft(2) == [12, 13]
    pl.extend([12, 13, 14])                       # accepted, and the pass's own token agreed
    assert pl.kind() == "copy"
    assert pl.draft(1) == [15]
    pl.extend([99])                               # rejected: the reply left its source
    pl.rejected()
    assert pl.kind() == "match"
    pl = PromptLookup([100, 101], prediction=[1, 2, 3])
    assert pl.kind() == "copy"                    # the reply is expected to be the prediction
    pl.extend([7])
    assert pl.kind() == "match"


def test_draft_length_learns_each_kind_of_draft_apart():
    d = DraftLength(row_cost=0.25)
    assert d.length(100, "copy") > d.length(100, "match") >= 1   # the priors: 0.9 and 0.5
    for _ in range(30):
        d.accepted(4, 0, "match")                 # fresh matches keep failing ...
    for _ in range(5):
        d.accepted(8, 8, "copy")                  # ... while copies hold: they draft long
    assert d.length(100, "copy") >= 8
    assert d.gain(1, "match") < 1                 # where a fresh match would not pay
    assert d.accept("copy") > 0.95 and d.accept("match") < 0.05
    assert d.accept(None) == d.accept("model") == 0.5   # other kinds start from the prior


def test_prompt_lookup_goes_on_from_where_the_copy_left_its_source():
    # "20" occurs twice in the source; the reply copied "10 11", then left the source ("20"
    # where the source has "12"): it goes on from the first "20" ahead of that place, not the
    # latest one
    pl = PromptLookup([10, 11, 12, 13, 20, 14, 15, 0, 16, 17, 20, 18, 19, 0, 10], max_ngram=2)
    assert pl.draft(2) == [11, 12]
    pl.extend([11, 20])                           # one drafted token accepted, then "20"
    pl.rejected()
    assert pl.draft(2) == [14, 15]                # not [18, 19] after the latest "20"
    # none ahead of the cursor: the latest occurrence
    pl = PromptLookup([20, 14, 15, 20, 18, 19, 7, 8, 9, 7], max_ngram=2)
    assert pl.draft(2) == [8, 9]
    pl.extend([8, 20])
    pl.rejected()
    assert pl.draft(1) == [18]


def test_prompt_lookup_drafts_a_prediction_from_its_start_and_finds_it_again():
    pl = PromptLookup([100, 101, 102], prediction=[1, 2, 3, 4, 5, 6, 7, 8])
    assert pl.draft(3) == [1, 2, 3]               # the reply is expected to be the prediction
    pl.extend([1])
    assert pl.draft(3) == [2, 3, 4]
    pl.extend([2, 3, 4, 5])
    assert pl.draft(10) == [6, 7, 8]              # never past its end into the prompt
    pl.extend([9])                                # the reply leaves it (an edit) ...
    assert pl.draft(3) == []
    pl.extend([4, 5])                             # ... and comes back: its n-grams find it
    assert pl.draft(3) == [6, 7, 8]
    assert PromptLookup([1, 2, 1], prediction=[]).draft(2) == [2, 1]   # none: plain lookup
    pl = PromptLookup([1, 50, 51, 52, 53], prediction=[10, 11, 12, 13, 14])
    pl.extend([10, 11, 12, 13, 14])               # the reply reached the prediction's end:
    assert pl.draft(8) == []                      # the prompt is not its continuation
    pl = PromptLookup([1, 5, 6, 7, 8], prediction=[5, 6])
    pl.extend([5, 6])
    assert pl.draft(2) == [7, 8]                  # the prompt's own occurrence, not the boundary


def test_which_requests_draft_and_how():
    from pyklei.runtime.speculative import drafting
    draft_model, constraint = object(), object()
    assert drafting(None, (), None) is None
    assert drafting("lookup", (), None) == "lookup"
    assert drafting(None, (5, 6), None) == "lookup"            # a prediction drafts by itself
    assert drafting(draft_model, (), None) == "model"
    assert drafting(draft_model, (5, 6), None) == "lookup"     # ... even beside a draft model
    assert drafting("lookup", (5, 6), constraint) is None      # a constrained reply never drafts


def test_draft_length_grows_with_acceptance_and_switches_off():
    d = DraftLength(row_cost=0.25)
    for _ in range(20):
        d.accepted(4, 4)
    assert d.length(100) >= 4
    assert d.length(2) == 2                       # never beyond the room left
    d = DraftLength(row_cost=0.25)
    drafted = 0
    for _ in range(400):                          # every draft rejected
        k = d.length(100)
        if k:
            drafted += 1
            d.accepted(k, 0)
    assert drafted < 400 * 0.06                   # off, with a rare one-token probe


def test_a_probe_that_pays_is_followed_without_a_pause():
    d = DraftLength(row_cost=0.25)
    for _ in range(30):
        d.accepted(4, 0)                                        # off
    ks = [d.length(100) for _ in range(12)]
    assert ks[0] == 1 and ks[1:5] == [0] * 4                    # a probe, then a pause
    d = DraftLength(row_cost=0.25)
    for _ in range(30):
        d.accepted(4, 0)
    assert d.length(100) == 1
    d.accepted(1, 1)                                            # the probe was right
    assert d.length(100) == 1                                   # probe again at once


def test_bad_speculative_value_is_a_clear_error(tiny):
    assert check_speculative(None) is None and check_speculative("lookup") == "lookup"
    for bad in ("nonsense", "Lookup", 1, True):
        with pytest.raises(ValueError, match="speculative must be None, one of 'lookup'"):
            tiny.generate([1, 2, 3], max_tokens=4, speculative=bad)
    with pytest.raises(ValueError, match="speculative must be"):
        tiny.chat([{"role": "user", "content": "hi"}], max_tokens=4, speculative="nonsense")


# ---- same tokens as plain decoding ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_lookup_gives_plain_tokens_on_random_streams(tiny, seed):
    """Greedy, and sampling under one seed: the same tokens, texts, logprobs and cache."""
    for params in (GREEDY, SamplingParams(temperature=0.8, top_k=0, top_p=0.95, seed=seed,
                                          repetition_penalty=1.05)):
        plain, mp = markov_run(tiny.tokenizer, seed, None, params, logprobs=2)
        spec, ms = markov_run(tiny.tokenizer, seed, "lookup", params, logprobs=2)
        assert tokens_text_finish(spec) == tokens_text_finish(plain)
        assert [r.logprobs for r in spec if r.logprobs] == [r.logprobs for r in plain if r.logprobs]
        assert ms.seq == mp.seq                    # the cache ends as plain decoding leaves it
        assert plain[-1].drafted_tokens == 0


def test_lookup_drafts_are_accepted_rejected_and_save_passes(tiny, steady_costs):
    drafted = accepted = passes = plain_passes = 0
    for seed in range(8):
        spec, ms = markov_run(tiny.tokenizer, seed, "lookup", GREEDY, max_tokens=300)
        plain, mp = markov_run(tiny.tokenizer, seed, None, GREEDY, max_tokens=300)
        drafted += spec[-1].drafted_tokens
        accepted += spec[-1].accepted_tokens
        passes, plain_passes = passes + ms.passes, plain_passes + mp.passes
    assert 0 < accepted < drafted                  # partial acceptance happened
    assert passes < plain_passes


@pytest.mark.parametrize("seed", range(4))
def test_a_prediction_gives_plain_tokens_and_drafts_from_it(tiny, seed, steady_costs):
    """Predicted outputs: greedy and sampled, the reply is plain decoding's whatever the
    prediction says; a right prediction is mostly accepted, an edited one partly, and with
    or without speculative="lookup" it drafts."""
    for params in (GREEDY, SamplingParams(temperature=0.8, seed=seed)):
        plain, mp = markov_run(tiny.tokenizer, seed, None, params, max_tokens=120)
        toks = mp.seq[70:]    # the reply's ids but its last (a response may carry several)
        assert len(toks) == 119
        edited = toks[:40] + [(t + 1) % tiny.tokenizer.vocab_size for t in toks[40:45]] + toks[45:]
        for spec, pred in ((None, toks), ("lookup", toks), (None, edited), (None, toks[::-1])):
            rs, m = markov_run(tiny.tokenizer, seed, spec, params, max_tokens=120,
                                prediction=pred)
            assert tokens_text_finish(rs) == tokens_text_finish(plain)
            assert m.seq == mp.seq
            if pred is toks and params is GREEDY:
                assert rs[-1].accepted_tokens >= 100 and m.passes < mp.passes / 4
            if pred is edited and params is GREEDY:
                assert rs[-1].accepted_tokens >= 80 and m.passes < mp.passes / 2


def test_a_prediction_as_text_and_bad_predictions(tiny):
    r = tiny.generate([1, 2, 3], max_tokens=20, temperature=0)
    again = tiny.generate([1, 2, 3], max_tokens=20, temperature=0, prediction=r.text)
    assert again.text == r.text and again.drafted_tokens > 0
    for bad in (3, 1.5, b"abc", [1, "2"], {"type": "content", "content": "x"}):
        with pytest.raises((TypeError, ValueError), match="prediction|token ids"):
            tiny.generate([1, 2, 3], max_tokens=4, prediction=bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.generate([1, 2, 3], max_tokens=4, prediction=[1, 10 ** 6])


@pytest.mark.parametrize("kw", [dict(max_tokens=1), dict(max_tokens=0), dict(max_tokens=37),
                                dict(eos="at30"), dict(stop="mid")])
def test_lookup_ends_where_plain_decoding_ends(tiny, kw):
    plain, _ = markov_run(tiny.tokenizer, 5, None, GREEDY, max_tokens=100)
    kw = dict(kw)
    if kw.pop("eos", None):
        kw["eos_ids"] = [plain[30].token]
    if kw.pop("stop", None):
        text = "".join(r.text for r in plain)
        kw["stop"] = [text[len(text) // 2:len(text) // 2 + 2]]
    kw.setdefault("max_tokens", 100)
    a, ma = markov_run(tiny.tokenizer, 5, None, GREEDY, **kw)
    b, mb = markov_run(tiny.tokenizer, 5, "lookup", GREEDY, **kw)
    assert tokens_text_finish(a) == tokens_text_finish(b)
    assert [r.text for r in a] == [r.text for r in b]
    assert ma.seq == mb.seq


def test_lookup_on_the_tiny_model_matches_plain(tiny, steady_costs):
    prompt = repetitive_prompt(2)
    plain, cache_plain = _run(tiny, prompt, None, max_tokens=120, params=GREEDY, eos_ids=[])
    spec, cache_spec = _run(tiny, prompt, "lookup", max_tokens=120, params=GREEDY, eos_ids=[])
    assert tokens_text_finish(spec) == tokens_text_finish(plain)
    assert cache_spec == cache_plain
    assert spec[-1].accepted_tokens > 0


def test_chat_turns_with_lookup_reuse_the_cache_like_plain(smollm2):
    msgs = [{"role": "user", "content": "Say 'one two three four five' three times."}]
    out = []
    for spec in (None, "lookup"):
        smollm2.reset()
        r1 = smollm2.chat(msgs, max_tokens=40, temperature=0, speculative=spec)
        r2 = smollm2.chat(msgs + [{"role": "assistant", "content": r1.text},
                                  {"role": "user", "content": "Again, twice."}], max_tokens=40,
                          temperature=0, speculative=spec)
        out.append((r1.text, r2.text, r2.prompt_eval_tokens))
    assert out[0] == out[1]


def test_smollm2_stop_strings_and_logprobs_with_lookup(smollm2):
    doc = ("Name: Ada Lovelace. Born: 10 December 1815, London. Known for: the first published "
           "computer program, for Babbage's Analytical Engine. ")
    msgs = [{"role": "user", "content": doc + "\nRepeat the text above word for word."}]
    base = smollm2.chat(msgs, max_tokens=60, temperature=0)
    for kw in (dict(stop=["1815"]), dict(stop=["Engine"], logprobs=2), dict(max_tokens=9),
               dict(temperature=0.9, seed=3, top_p=0.9)):
        kw = {"max_tokens": 60, "temperature": 0, **kw}
        smollm2.reset()
        a = smollm2.chat(msgs, **kw)
        smollm2.reset()
        b = smollm2.chat(msgs, speculative="lookup", **kw)
        assert (a.text, a.finish_reason, a.generation_tokens, a.logprobs) == \
            (b.text, b.finish_reason, b.generation_tokens, b.logprobs), kw
    assert "1815" in base.text


def test_smollm2_quoting_300_tokens_identical_and_accepted(smollm2, steady_costs):
    code = (ROOT / "pyklei" / "chat.py").read_text()[:3000]
    msgs = [{"role": "user", "content": "Copy this Python code exactly, renaming `history` to "
                                        "`turns`:\n\n" + code}]
    smollm2.reset()
    plain = smollm2.chat(msgs, max_tokens=300, temperature=0)
    smollm2.reset()
    spec = smollm2.chat(msgs, max_tokens=300, temperature=0, speculative="lookup")
    assert spec.text == plain.text
    assert spec.generation_tokens == plain.generation_tokens == 300
    assert spec.accepted_tokens > 100                # the reply quotes: most tokens come drafted


def test_cli_generate_and_chat_lookup_print_the_plain_text():
    import subprocess
    import sys

    def cli(*args, stdin=None):
        r = subprocess.run([sys.executable, "-m", "pyklei", *map(str, args)], input=stdin,
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        return r
    gen = ["generate", SEED, "-p", "abc abc abc abc abc", "-n", "40", "--temperature", "0",
           "-t", "1", "--stats"]
    plain, spec = cli(*gen), cli(*gen, "--lookup")
    assert spec.stdout == plain.stdout
    assert "drafted" in spec.stderr and "drafted" not in plain.stderr
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:   # the reply as the prediction
        f.write(plain.stdout.rstrip("\n"))
        f.flush()
        pred = cli(*gen, "--prediction", f.name)
    assert pred.stdout == plain.stdout and "drafted" in pred.stderr
    draft = cli(*gen, "--draft-model", SEED)
    assert draft.stdout == plain.stdout and "drafted" in draft.stderr
    chat = ["chat", SEED, "-n", "30", "--temperature", "0", "-t", "1"]
    msg = "abc abc abc abc\n/stats\n"
    a, b = cli(*chat, stdin=msg), cli(*chat, "--lookup", stdin=msg)
    assert a.stdout.split("last reply:")[0] == b.stdout.split("last reply:")[0]


# ---- the engine: drafts inside the batched steps ----------------------------------------------

def _engine_texts(llm, prompts, spec, **kw):
    from pyklei.runtime.engine import Engine
    eng = Engine(llm.model, llm.tokenizer, n_parallel=llm.model.n_seq, max_queue=len(prompts))
    try:
        with eng._cond:   # the first step sees them all (see _engine_draft_texts)
            streams = [eng.submit(p, speculative=spec, **kw) for p in prompts]
        out = []
        for s in streams:
            rs = list(s)
            out.append(([r.token for r in rs], "".join(r.text for r in rs), rs[-1].finish_reason,
                        rs[-1].drafted_tokens, rs[-1].accepted_tokens))
        return out
    finally:
        eng.shutdown(cancel=True)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=4)])
def test_engine_lookup_gives_each_request_its_plain_tokens(params, steady_costs):
    llm = LLM(SEED, n_threads=1, n_ctx=512, n_seq=3)
    prompts = [repetitive_prompt(s, n=20 + 7 * s) for s in range(5)]
    kw = dict(max_tokens=60, params=params, eos_ids=[])
    plain = _engine_texts(llm, prompts, None, **kw)
    spec = _engine_texts(llm, prompts, "lookup", **kw)
    assert [x[:3] for x in spec] == [x[:3] for x in plain]
    alone = []
    for p in prompts:
        llm.reset()
        rs = list(stream_generate(llm.model, llm.tokenizer, p, **kw))
        alone.append([r.token for r in rs])
    assert [x[0] for x in spec] == alone
    if params is GREEDY:
        assert sum(x[4] for x in spec) > 0


def test_engine_prediction_gives_each_request_its_plain_tokens(steady_costs):
    llm = LLM(SEED, n_threads=1, n_ctx=512, n_seq=3)
    prompts = [repetitive_prompt(s, n=20 + 7 * s) for s in range(3)]
    kw = dict(max_tokens=60, params=GREEDY, eos_ids=[])
    plain = _engine_texts(llm, prompts, None, **kw)
    from pyklei.runtime.engine import Engine
    eng = Engine(llm.model, llm.tokenizer, n_parallel=3, max_queue=3)
    try:
        with eng._cond:
            streams = [eng.submit(p, prediction=llm.encode(x[1], add_bos=False), **kw)
                       for p, x in zip(prompts, plain)]
        for s, x in zip(streams, plain):
            rs = list(s)
            assert [r.token for r in rs] == x[0]
            assert rs[-1].accepted_tokens >= 40   # of at most 60 - its passes
    finally:
        eng.shutdown(cancel=True)


def test_engine_lookup_on_smollm2_quotes_like_plain(steady_costs, f32_attention):
    # attention in f32: which of the 135M model's replies quote their document verbatim moves
    # with the last bits of its logits (bf16 attention quotes none of these three)
    if not SMOLLM2_CACHED.exists():
        pytest.skip(f"{SMOLLM2_CACHED} is not cached")
    llm = LLM(SMOLLM2_CACHED, n_threads=1, n_ctx=2048, n_seq=3)
    docs = ["The meeting is on Tuesday at 10:00 in room 4B. Bring the quarterly report and the "
            "budget sheet.", "Alice Smith, 42 Elm Street, Springfield, phone 555-0134, "
            "account number 88172.", "To reset the router, hold the power button for ten "
            "seconds, wait for the light to blink twice, then release it."]
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": d + "\nRepeat the text above exactly."}],
        add_generation_prompt=True, tokenize=True) for d in docs]
    kw = dict(max_tokens=50, params=GREEDY, eos_ids=llm.eos_ids)
    plain = _engine_texts(llm, prompts, None, **kw)
    spec = _engine_texts(llm, prompts, "lookup", **kw)
    assert [x[:3] for x in spec] == [x[:3] for x in plain]
    # a reply that repeats its document verbatim comes mostly from drafts (the others are the
    # 135M model's refusals, whose length moves with the last bits of the logits)
    quoted = [x for d, x in zip(docs, spec) if d in x[1]]
    assert quoted and all(x[4] >= len(x[0]) // 2 for x in quoted), [x[3:] for x in spec]
