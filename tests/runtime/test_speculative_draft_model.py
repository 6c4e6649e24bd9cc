"""Speculative decoding with a draft model (issue 25): greedy gives plain decoding's tokens,
sampling follows the target's distribution (a chi-square test of speculative sampling's rule
and of whole runs), the same under a seed; in the engine, a KV cache slot of the draft per
request, drafted in batched passes; and `pyklei serve` with --lookup or --draft-model gives
the plain text and counts its drafts. Fixtures: tests/runtime/conftest.py; the stand-in model:
tests/fixtures/speculative_cases.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paths import SEED, SEED_TIED_Q6, SEED_UNTIED_Q8, SMOLLM2_CACHED as SMOLLM2
from pyklei.llm import LLM
from pyklei.runtime.generate import stream_generate
from pyklei.runtime.sampler import SamplingParams
from speculative_cases import MarkovModel, markov_run, repetitive_prompt, tokens_text_finish

GREEDY = SamplingParams(temperature=0.0)


# ---- a draft model -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_draft_model_greedy_gives_plain_tokens(tiny, seed, steady_costs):
    plain, mp = markov_run(tiny.tokenizer, seed, None, GREEDY)
    spec, ms = markov_run(tiny.tokenizer, seed, "draft", GREEDY)
    assert tokens_text_finish(spec) == tokens_text_finish(plain)
    assert ms.seq == mp.seq
    assert 0 < spec[-1].accepted_tokens < spec[-1].drafted_tokens
    assert ms.passes < mp.passes


# ---- speculative sampling: the output follows the target's distribution ------------------------

def _chi2_pvalue(samples, probs):
    """Pearson's chi-square test of `samples` (ints) against the distribution `probs`, with the
    cells expected fewer than 5 times pooled into one; 0 when a sample is one the distribution
    cannot give (an index with probability 0, or beyond `probs`)."""
    from scipy.stats import chisquare
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    if len(counts) > len(probs) or counts[probs == 0].sum():
        return 0.0
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    return chisquare(obs[keep], exp[keep]).pvalue


def _accept_always(p, q, token, rng):
    return int(token)


def _resample_from_p(p, q, token, rng):
    """A plausible mistake: the right acceptance test, but a rejection draws from p."""
    if rng.random() * q[token] < p[token]:
        return int(token)
    return int(rng.choice(len(p), p=p))


def test_speculative_choice_gives_p_not_q():
    """On a 6-token vocabulary, q far from p (and each with a token the other cannot give):
    the tokens chosen follow p; two wrong rules, run the same way, are caught."""
    from pyklei.runtime.sampler import speculative_choice
    p = np.array([0.40, 0.25, 0.15, 0.10, 0.10, 0.00])
    q = np.array([0.05, 0.10, 0.30, 0.05, 0.00, 0.50])

    def run(rule, n=30000):
        rng = np.random.default_rng(1234)
        drafts = rng.choice(6, size=n, p=q)
        return np.array([rule(p, q, int(x), rng) for x in drafts])

    assert _chi2_pvalue(run(speculative_choice), p) > 1e-3
    for wrong in (_accept_always, _resample_from_p):
        assert _chi2_pvalue(run(wrong), p) < 1e-6, wrong.__name__


def _markov_pair(vocab, seed, scale):
    m = MarkovModel(vocab, seed)
    m.t1 *= scale
    m.t2 *= scale
    return m


def _sampled_triples(tok, rule=None, runs=3000):
    """Each run: a fresh 3-token reply of a MarkovModel target (sampling with top-k 3 and a
    presence penalty) with a MarkovModel of other tables as its draft model: the first token by
    plain sampling, the second drafted (accepted or resampled), the third the bonus row's (or
    a plain step's, after a rejection).
    Returns the replies as indices of (t1, t2, t3) (len(cells): one the target cannot give) and
    the target's exact distribution of them, and the drafted / accepted counts."""
    import pyklei.runtime.generate as generate
    from pyklei.runtime.sampler import Sampler, apply_presence_frequency
    vocab = tok.vocab_size
    prompt = [7, 19, 3]
    target = _markov_pair(vocab, 11, 0.3)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0,
                            presence_penalty=1.5)
    probs = Sampler(params).probs

    def dist(ctx, gen_toks):
        counts = {}
        for t in gen_toks:
            counts[t] = counts.get(t, 0) + 1
        return probs(apply_presence_frequency(target._logits(ctx), counts, 1.5, 0.0))

    exact = {}
    p1 = dist(prompt, [])
    for a in np.flatnonzero(p1):
        p2 = dist(prompt + [a], [a])
        for b in np.flatnonzero(p2):
            p3 = dist(prompt + [a, b], [a, b])
            for c in np.flatnonzero(p3):
                exact[(a, b, c)] = p1[a] * p2[b] * p3[c]
    cells = sorted(exact)
    redo = np.random.default_rng(5).random(vocab) < 0.3
    redrawn = np.random.default_rng(6).normal(0, 1, (redo.sum(), vocab)).astype(np.float32)
    index = {c: i for i, c in enumerate(cells)}
    out, drafted, accepted = [], 0, 0
    orig = generate.speculative_choice
    if rule is not None:
        generate.speculative_choice = rule
    try:
        for run in range(runs):
            draft = _markov_pair(vocab, 11, 0.6)   # sharper than the target: q != p
            draft.t1[redo] = redrawn                  # and elsewhere other tokens altogether
            rs = list(stream_generate(target, tok, prompt, 3,
                                      dataclasses.replace(params, seed=run), eos_ids=[],
                                      logprobs=0, speculative=draft))
            out.append(index.get(tuple(lp.token for r in rs for lp in r.logprobs), len(cells)))
            drafted += rs[-1].drafted_tokens
            accepted += rs[-1].accepted_tokens
    finally:
        generate.speculative_choice = orig
    return np.array(out), np.array([exact[c] for c in cells]), drafted, accepted


def test_draft_model_sampling_follows_the_target_distribution(tiny, steady_costs):
    """The whole loop (draft model's q, the target's rows, acceptance, residual, bonus row): the
    replies' distribution is the target's plain-sampling distribution, by a chi-square test
    under fixed seeds; accepting every draft, run the same way, fails it."""
    got, exact, drafted, accepted = _sampled_triples(tiny.tokenizer)
    assert drafted == 3000                          # every run drafted its second token
    assert 0.2 * drafted < accepted < 0.9 * drafted   # both acceptance and resampling happened
    assert _chi2_pvalue(got, exact) > 1e-3
    wrong, _, _, _ = _sampled_triples(tiny.tokenizer, rule=_accept_always, runs=1500)
    assert _chi2_pvalue(wrong, exact) < 1e-6


def test_draft_model_sampling_repeats_under_a_seed(tiny, steady_costs):
    """With the draft lengths fixed (steady costs), one seed gives one text."""
    a, _ = markov_run(tiny.tokenizer, 3, "draft", SamplingParams(temperature=0.8, seed=5))
    b, _ = markov_run(tiny.tokenizer, 3, "draft", SamplingParams(temperature=0.8, seed=5))
    assert tokens_text_finish(a) == tokens_text_finish(b)
    assert 0 < a[-1].accepted_tokens < a[-1].drafted_tokens


def test_smollm2_with_itself_as_draft_model(smollm2, steady_costs):
    draft = LLM(SMOLLM2, n_threads=1, n_ctx=1024, n_seq=1)
    msgs = [{"role": "user", "content": "Write a poem about rain."}]   # 60 tokens, not EOS
    smollm2.reset()
    plain = smollm2.chat(msgs, max_tokens=60, temperature=0)
    smollm2.reset()
    spec = smollm2.chat(msgs, max_tokens=60, temperature=0, speculative=draft)
    assert spec.text == plain.text
    assert spec.accepted_tokens == spec.drafted_tokens > 20     # its own drafts all hold
    with pytest.raises(ValueError, match="the draft model is the model itself"):
        smollm2.generate("Hi", max_tokens=2, speculative=smollm2)
    from pyklei.runtime.engine import Engine
    with pytest.raises(ValueError, match="this draft model is not it"):
        with Engine(smollm2.model, smollm2.tokenizer, n_parallel=1) as eng:
            eng.submit([1, 2, 3], speculative=draft)
    with pytest.raises(ValueError, match="needs as many KV cache slots; it has n_seq=1"):
        Engine(smollm2.model, smollm2.tokenizer, n_parallel=2, speculative=draft)


def test_draft_model_needs_the_same_vocabulary(smollm2, tiny):
    with pytest.raises(ValueError, match="the draft model's vocabulary has 384 tokens"):
        smollm2.generate("Hi", max_tokens=2, speculative=tiny)


def test_pass_cost_fit_prices_a_drafted_row_by_the_batch():
    from pyklei.runtime.speculative import PassCost
    c = PassCost()
    assert c.row_cost(1) == pytest.approx(0.25)          # the prior: fixed = 3 rows
    for rows in (8, 12, 16, 24, 8, 10) * 3:               # 14 ms fixed + 2.5 ms a row
        c.add(rows, 0.014 + 0.0025 * rows)
    assert c.row_cost(8) == pytest.approx(1 / (5.6 / 8 + 1), rel=1e-3)
    assert c.row_cost(1) == pytest.approx(1 / 6.6, rel=1e-3)


def _served_plain_and_drafting(*flags):
    """One greedy completion from `pyklei serve` without and with the drafting flags: the two
    texts, and the drafting server's /metrics (asserted: only that server drafted)."""
    import httpx
    from live_server import LiveServer     # tests/fixtures/, on sys.path via conftest

    body = {"model": "m", "prompt": "abc abc abc abc abc abc", "max_tokens": 40,
            "temperature": 0}
    texts = []
    for extra in ((), flags):
        with LiveServer(SEED, "--parallel", "2", "--model-id", "m", *extra) as srv:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        drafted = [line for line in metrics.splitlines()
                   if line.startswith("pyklei_drafted_tokens_total")]
        assert drafted and (float(drafted[0].split()[-1]) > 0) == bool(extra)
    return texts, metrics


def test_serve_lookup_gives_the_plain_text_and_counts_drafts():
    pytest.importorskip("uvicorn")
    texts, metrics = _served_plain_and_drafting("--lookup")
    assert "pyklei_accepted_tokens_total" in metrics
    assert texts[0] == texts[1]


def test_a_stream_closed_mid_draft_leaves_a_cache_the_next_call_can_trust(smollm2, steady_costs):
    msgs = [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red "
                                        "green blue, red green blue."}]
    smollm2.reset()
    want = smollm2.chat(msgs, max_tokens=40, temperature=0)
    it = smollm2.chat(msgs, max_tokens=40, temperature=0, speculative="lookup", stream=True)
    for i, r in enumerate(it):
        if r.drafted_tokens and i >= 3:
            break
    assert r.finish_reason is None            # stopped in the middle, after drafts ran
    it.close()
    cached = smollm2.model.cached_tokens
    again = smollm2.chat(msgs, max_tokens=40, temperature=0)   # reuses the cached prefix
    assert again.text == want.text
    assert again.prompt_eval_tokens < again.prompt_tokens and len(cached) > again.prompt_tokens


# ---- a draft model in the engine: a KV cache slot per request, drafted in batched passes -------

TIED_Q6 = SEED_TIED_Q6       # the same weights, 6-bit embeddings
UNTIED_Q8 = SEED_UNTIED_Q8   # another model, the same vocab size


def _engine_draft_texts(llm, prompts, draft, n_parallel=3, **kw):
    from pyklei.runtime.engine import Engine
    eng = Engine(llm.model, llm.tokenizer, n_parallel=n_parallel, max_queue=len(prompts),
                 speculative=draft, prefill_chunk=kw.pop("prefill_chunk", 256))
    try:
        # queued under the scheduler's lock, so that the first step sees them all: a sampled
        # draft's text follows the draft lengths, and they follow the batch (PassCost per batch),
        # which must not depend on how fast this thread submits on a loaded machine
        with eng._cond:
            streams = [eng.submit(p, **kw) for p in prompts]
        out = []
        for st in streams:
            rs = list(st)
            out.append(([r.token for r in rs], "".join(r.text for r in rs), rs[-1].finish_reason,
                        rs[-1].drafted_tokens, rs[-1].accepted_tokens))
        return out, eng.stats()
    finally:
        eng.shutdown(cancel=True)


@pytest.mark.parametrize("draft_file", [SEED, TIED_Q6, UNTIED_Q8])
def test_engine_draft_model_greedy_gives_each_request_its_plain_tokens(draft_file, steady_costs):
    """The model as its own draft (a second load: every draft holds), a near copy and another
    model (drafts rejected): each request gets the tokens it gets alone. Five
    requests on three slots: slots are reused, and a prompt longer than prefill_chunk makes
    the draft model catch up in chunks."""
    llm = LLM(SEED, n_threads=1, n_ctx=512, n_seq=3)
    draft = LLM(draft_file, n_threads=1, n_ctx=512, n_seq=3)
    prompts = [repetitive_prompt(s, n=20 + 7 * s) for s in range(4)] + [repetitive_prompt(9, 90)]
    kw = dict(max_tokens=60, params=GREEDY, eos_ids=[])
    spec, stats = _engine_draft_texts(llm, prompts, draft, prefill_chunk=64, **kw)
    alone = []
    for p in prompts:
        llm.reset()
        rs = list(stream_generate(llm.model, llm.tokenizer, p, **kw))
        alone.append([r.token for r in rs])
    assert [x[0] for x in spec] == alone
    assert stats["drafted_tokens"] == sum(x[3] for x in spec) > 0
    assert stats["accepted_tokens"] == sum(x[4] for x in spec)
    if draft_file == SEED:
        assert all(x[3] == x[4] for x in spec)            # its own drafts all hold
    if draft_file == UNTIED_Q8:
        assert sum(x[4] for x in spec) < sum(x[3] for x in spec)


def test_engine_draft_model_sampling_with_itself_accepts_every_draft(steady_costs):
    """Sampling with penalties, the model as its own draft: the draft's distribution at each
    drafted position is the model's (same logits, processed over the same history, drafted
    tokens included), so min(1, p/q) = 1 keeps every draft. The same seeds give the same
    texts again."""
    llm = LLM(SEED, n_threads=1, n_ctx=512, n_seq=2)
    draft = LLM(SEED, n_threads=1, n_ctx=512, n_seq=2)
    prompts = [repetitive_prompt(s) for s in range(3)]
    params = SamplingParams(temperature=0.9, top_k=20, seed=7, repetition_penalty=1.3,
                            presence_penalty=0.8, frequency_penalty=0.5)
    kw = dict(max_tokens=50, params=params, eos_ids=[])
    a, _ = _engine_draft_texts(llm, prompts, draft, n_parallel=2, **kw)
    assert all(x[3] == x[4] > 10 for x in a)
    b, _ = _engine_draft_texts(llm, prompts, draft, n_parallel=2, **kw)
    assert [x[:2] for x in a] == [x[:2] for x in b]


def test_generate_batch_and_serve_take_a_draft_model():
    llm = LLM(SEED, n_threads=1, n_ctx=512, n_seq=2)
    prompts = [repetitive_prompt(s) for s in range(3)]
    plain = llm.generate_batch(prompts, max_tokens=30, temperature=0)
    one_slot = LLM(TIED_Q6, n_threads=1, n_ctx=512, n_seq=1)
    with pytest.raises(ValueError, match="it has n_seq=1 \\(load it with n_seq=2\\)"):
        llm.generate_batch(prompts, max_tokens=30, temperature=0, speculative=one_slot)
    draft = LLM(TIED_Q6, n_threads=1, n_ctx=512, n_seq=2)
    spec = llm.generate_batch(prompts, max_tokens=30, temperature=0, speculative=draft)
    assert [r.text for r in spec] == [r.text for r in plain]
    assert sum(r.accepted_tokens for r in spec) > 0


def test_serve_draft_model_gives_the_plain_text_and_counts_drafts():
    pytest.importorskip("uvicorn")
    texts, _ = _served_plain_and_drafting("--draft-model", TIED_Q6)
    assert texts[0] == texts[1]


def test_engine_draft_model_sampling_follows_the_model_distribution(steady_costs, monkeypatch):
    """The engine's path (batched draft passes, the draft's slots, feed_drafted on the batch's
    rows): 3-token replies of 1200 requests (one prompt, a seed each) follow the model's own
    distribution of them, by a chi-square test. The draft (a near copy of the model) draws
    from a hotter, wider distribution than the request's, so that drafts are both kept and
    rejected (any q is right for the rule, as long as the draft is drawn from it)."""
    from pyklei.runtime.engine import Engine
    from pyklei.runtime.generate import Generation
    from pyklei.runtime.sampler import Sampler
    hot = Sampler(SamplingParams(temperature=2.0, top_k=6, top_p=1.0, min_p=0.0, seed=1))

    def draft_token(self, logits, drafted):
        q = hot.probs(self.process(logits, drafted))
        return int(hot.rng.choice(len(q), p=q)), q

    monkeypatch.setattr(Generation, "draft_token", draft_token)
    llm = LLM(SEED, n_threads=1, n_ctx=64, n_seq=4)
    draft = LLM(TIED_Q6, n_threads=1, n_ctx=64, n_seq=4)
    prompt = [7, 19, 3, 250, 11]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    probs = Sampler(params).probs
    exact = {}
    p1 = probs(llm.model.logits(prompt)[-1])
    for a in np.flatnonzero(p1):
        p2 = probs(llm.model.logits(prompt + [a])[-1])
        for b in np.flatnonzero(p2):
            p3 = probs(llm.model.logits(prompt + [a, b])[-1])
            for c in np.flatnonzero(p3):
                exact[(a, b, c)] = p1[a] * p2[b] * p3[c]
    cells = sorted(exact)
    index = {c: i for i, c in enumerate(cells)}
    n = 1200
    with Engine(llm.model, llm.tokenizer, n_parallel=4, max_queue=n, speculative=draft) as eng:
        streams = [eng.submit(prompt, max_tokens=3, eos_ids=[], logprobs=0,
                              params=dataclasses.replace(params, seed=i)) for i in range(n)]
        replies = [[lp.token for r in st for lp in r.logprobs] for st in streams]
        stats = eng.stats()
    got = np.array([index.get(tuple(t), len(cells)) for t in replies])
    assert stats["drafted_tokens"] == n
    assert 0.1 * n < stats["accepted_tokens"] < 0.9 * n
    assert _chi2_pvalue(got, np.array([exact[c] for c in cells])) > 1e-3
