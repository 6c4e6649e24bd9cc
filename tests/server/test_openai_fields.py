"""The OpenAI fields that steer or inspect the output (issue 23): logprobs and top_logprobs
(chat and completions shapes, streamed, echo with the prompt's), n choices from one prompt
evaluation, presence/frequency penalties, logit_bias, and max_tokens clamped to the context.
Checked against llm.logits() and solo runs on SmolLM2, through the Python API, the engine and
`pyklei serve` with the official openai client."""
import json

import numpy as np
import pytest

from pyklei.runtime.engine import Engine
from pyklei.runtime.sampler import (SamplingParams, apply_logit_bias, apply_presence_frequency,
                            check_logit_bias)

openai = pytest.importorskip("openai")
from live_server import LiveServer  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

CHAT = [{"role": "user", "content": "Name three colours."}]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


@pytest.fixture(scope="module")
def llm(smollm2_q4):
    import pyklei
    return pyklei.load(smollm2_q4, n_threads=2, n_ctx=512, n_seq=4)


@pytest.fixture(scope="module")
def server(smollm2_q4):
    with LiveServer(smollm2_q4, "--parallel", "4", ctx=512, threads=2) as srv:
        yield srv


def client(srv):
    return srv.openai_client()


# ---- the sampler's processors ------------------------------------------------------------

def test_presence_and_frequency_follow_openais_formula():
    logits = np.arange(8, dtype=np.float32)
    out = apply_presence_frequency(logits, {2: 3, 5: 1}, presence=0.5, frequency=0.25)
    want = logits.copy()
    want[2] -= 3 * 0.25 + 0.5
    want[5] -= 1 * 0.25 + 0.5
    assert np.array_equal(out, want) and np.array_equal(logits, np.arange(8))
    assert apply_presence_frequency(logits, {}, 1.0, 1.0) is logits


def test_logit_bias_adds_and_minus_100_bans():
    logits = np.zeros(6, np.float32)
    out = apply_logit_bias(logits, check_logit_bias({"1": 2.5, 4: -100}))
    assert out[1] == 2.5 and out[4] == -np.inf and out[0] == 0
    for bad, err in [({"x": 1}, TypeError), ({1: 100.5}, ValueError), ({-1: 1}, TypeError),
                     ({1: float("nan")}, ValueError), ([1, 2], TypeError)]:
        with pytest.raises(err, match="logit_bias"):
            SamplingParams(logit_bias=bad)


# ---- Python API -----------------------------------------------------------------------------

def test_logprobs_agree_with_logits(llm):
    prompt = llm.encode("The capital of France is")
    r = llm.generate(prompt, max_tokens=8, temperature=0, logprobs=5)
    toks = [lp.token for lp in r.logprobs]
    assert len(toks) == r.generation_tokens
    rows = llm.logits(prompt + toks)[len(prompt) - 1:]
    for lp, row in zip(r.logprobs, rows):
        ref = log_softmax(row)
        assert lp.logprob == pytest.approx(ref[lp.token], abs=1e-6)
        assert lp.token == int(np.argmax(row))                 # greedy: the top token
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:5])
        assert [v for _, v in lp.top] == pytest.approx(sorted(ref, reverse=True)[:5], abs=1e-6)


def test_streamed_logprobs_cover_every_generated_token(llm):
    rs = list(llm.generate("Once upon a time", max_tokens=12, temperature=0.7, seed=3,
                           stream=True, logprobs=0))
    lps = [lp for r in rs for lp in (r.logprobs or [])]
    assert len(lps) == rs[-1].generation_tokens and all(lp.top == () for lp in lps)
    assert llm.tokenizer.decode([lp.token for lp in lps]) == "".join(r.text for r in rs)


def test_logit_bias_bans_a_token(llm):
    first = llm.generate("The capital of France is", max_tokens=4, temperature=0, logprobs=0)
    banned = first.logprobs[0].token
    r = llm.generate("The capital of France is", max_tokens=16, temperature=0, logprobs=0,
                     logit_bias={banned: -100})
    assert banned not in [lp.token for lp in r.logprobs]
    r = llm.generate("The capital of France is", max_tokens=16, temperature=1.0, seed=1,
                     top_k=0, top_p=1.0, min_p=0.0, logprobs=0, logit_bias={banned: -100})
    assert banned not in [lp.token for lp in r.logprobs]


def test_presence_penalty_in_a_generation(llm):
    """A token already generated loses `presence` from its logit once, however often it came."""
    from pyklei.runtime.generate import Generation
    from pyklei.runtime.request import make_request

    logits = np.zeros(llm.tokenizer.vocab_size, np.float32)
    logits[[100, 101]] = [1.0, 0.5]
    params = SamplingParams(temperature=0, presence_penalty=0.75)
    gen = Generation(llm.tokenizer, make_request(llm.n_ctx, llm.tokenizer, [1], 8, params,
                                                 eos_ids=[]))
    picks = []
    for _ in range(4):
        gen.feed(logits)
        picks.append(gen.token)
    # 100 (1.0), then 101 (0.5 > 0.25), then both penalised: 100 (0.25 > -0.25) again
    assert picks == [100, 101, 100, 100]


def test_frequency_penalty_changes_a_repetitive_text(llm):
    plain = llm.generate("1, 2, 1, 2, 1, 2,", max_tokens=24, temperature=0)
    pen = llm.generate("1, 2, 1, 2, 1, 2,", max_tokens=24, temperature=0, frequency_penalty=2.0)
    assert pen.text != plain.text


def test_engine_choices_share_one_prompt_evaluation(llm):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}], tokenize=True)
    solo = llm.generate(prompt, max_tokens=16, temperature=0).text
    assert len(solo) > 20
    llm.model.reset()              # no cached prefix: the first choice evaluates the prompt
    with Engine(llm.model, llm.tokenizer, n_parallel=4) as eng:
        streams = eng.submit_choices(prompt, [SamplingParams(temperature=0)] * 4, max_tokens=16)
        outs = []
        for st in streams:
            rs = list(st)
            outs.append(("".join(r.text for r in rs), rs[-1]))
        assert [t for t, _ in outs] == [solo] * 4
        assert outs[0][1].prompt_eval_tokens == len(prompt)
        assert all(last.prompt_eval_tokens == 1 for _, last in outs[1:])   # copied prefix
        seeded = [SamplingParams(temperature=1.0, seed=10 + i) for i in range(3)]
        a = ["".join(r.text for r in st) for st in eng.submit_choices(prompt, seeded,
                                                                        max_tokens=16)]
        b = ["".join(r.text for r in st) for st in eng.submit_choices(prompt, seeded,
                                                                        max_tokens=16)]
        assert a == b and len(set(a)) > 1


# ---- the server -------------------------------------------------------------------------------

def test_chat_logprobs_agree_with_logits(server, llm):
    r = client(server).chat.completions.create(model="m", messages=CHAT, max_tokens=6,
                                               temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # greedy: each entry is the argmax of the logits after the ones before it
    ids = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    for e in content:
        row = llm.logits(ids)[-1]
        t = int(np.argmax(row))
        assert list(llm.tokenizer.token_to_piece(t)) == e.bytes
        ref = log_softmax(row)
        assert e.logprob == pytest.approx(ref[t], abs=1e-5)
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(
            sorted(ref, reverse=True)[:3], abs=1e-5)
        ids.append(t)


def test_completion_logprobs_echo_the_prompt(server, llm):
    text = "The capital of France is"
    r = client(server).completions.create(model="m", prompt=text, max_tokens=3, temperature=0,
                                          logprobs=2, echo=True)
    ch = r.choices[0]
    assert ch.text.startswith(text)
    lp = ch.logprobs
    ids = llm.tokenizer.encode(text, parse_special=True)
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 3
    ref = [log_softmax(row) for row in llm.logits(ids)]
    for k in range(1, len(ids)):
        assert lp.token_logprobs[k] == pytest.approx(ref[k - 1][ids[k]], abs=1e-5)
    assert "".join(lp.tokens) == ch.text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    streamed = list(client(server).completions.create(
        model="m", prompt=text, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True))
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs
                                            else [])]
    assert tokens == lp.tokens
    assert "".join(c.choices[0].text for c in streamed) == ch.text


def test_n_choices(server):
    c = client(server)
    greedy = c.chat.completions.create(model="m", messages=CHAT, max_tokens=12, temperature=0,
                                       n=4)
    texts = [ch.message.content for ch in greedy.choices]
    assert [ch.index for ch in greedy.choices] == [0, 1, 2, 3] and len(set(texts)) == 1
    one = c.chat.completions.create(model="m", messages=CHAT, max_tokens=12, temperature=0)
    assert texts[0] == one.choices[0].message.content
    assert greedy.usage.completion_tokens == 4 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    kw = dict(model="m", messages=CHAT, max_tokens=12, temperature=1.0, n=4, seed=7)
    a = [ch.message.content for ch in c.chat.completions.create(**kw).choices]
    b = [ch.message.content for ch in c.chat.completions.create(**kw).choices]
    assert a == b and len(set(a)) > 1
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    by_index = {}
    for ch in chunks[:-1]:
        by_index[ch.choices[0].index] = by_index.get(ch.choices[0].index, "") + (
            ch.choices[0].delta.content or "")
    assert [by_index[i] for i in range(4)] == a
    assert chunks[-1].usage.completion_tokens >= 4


def test_logit_bias_and_penalties_through_the_server(server):
    c = client(server)
    first = c.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0,
                                      logprobs=True)
    banned = first.choices[0].logprobs.content[0].bytes
    from pyklei.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(server.cmd[server.cmd.index("serve") + 1])
    tid = next(i for i in range(tok.vocab_size) if list(tok.token_to_piece(i)) == banned)
    r = c.chat.completions.create(model="m", messages=CHAT, max_tokens=16, temperature=0,
                                  logprobs=True, logit_bias={str(tid): -100})
    assert banned not in [e.bytes for e in r.choices[0].logprobs.content]
    kw = dict(model="m", prompt="1, 2, 1, 2, 1, 2,", max_tokens=24, temperature=0)
    plain = c.completions.create(**kw).choices[0].text
    assert c.completions.create(**kw, frequency_penalty=2.0).choices[0].text != plain


def test_max_tokens_beyond_the_context_is_clamped(server, llm):
    no_end = {str(t): -100 for t in llm.eos_ids}      # so that only the context ends it
    r = client(server).completions.create(model="m", prompt="Once upon a time", temperature=0,
                                          max_tokens=100_000, logit_bias=no_end)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 512
    body = json.dumps({"prompt": "x", "max_tokens": "lots"}).encode()
    import httpx
    e = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json"}).json()["error"]
    assert e["param"] == "max_tokens" and "--" not in e["message"]


def test_best_of_returns_the_n_most_likely_choices(server):
    """best_of 4, n 2, seeded: the two of the four seeded choices (those n=4 gives) with the
    highest log-probability per token, in their order; usage counts all four."""
    c = client(server)
    kw = dict(model="m", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3)
    four = c.completions.create(**kw, n=4, logprobs=0)
    mean = [sum(ch.logprobs.token_logprobs) / len(ch.logprobs.token_logprobs)
            for ch in four.choices]
    best = sorted(sorted(range(4), key=lambda i: mean[i], reverse=True)[:2])
    r = c.completions.create(**kw, n=2, best_of=4)
    assert [ch.text for ch in r.choices] == [four.choices[i].text for i in best]
    assert [ch.index for ch in r.choices] == [0, 1] and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == four.usage.completion_tokens
    for bad in (dict(n=3, best_of=2), dict(best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**kw, **bad)
        assert e.value.body["param"] == "best_of"
