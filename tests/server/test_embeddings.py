"""POST /v1/embeddings (issue 43) through `pyklei serve` on SmolLM2, as applications call it:
the official openai client (base64, its default, and float), langchain-openai's
OpenAIEmbeddings, the input forms and `dimensions`; a generation streaming beside embedding
requests keeps its tokens; bad bodies get 400s naming the field."""
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

import pyklei

openai = pytest.importorskip("openai")
from live_server import LiveServer  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

TEXTS = ["The cat sat on the mat.", "A dog slept by the door.", "Stock markets fell sharply."]
CTX = 1024


@pytest.fixture(scope="module")
def server(smollm2_q4):
    with LiveServer(smollm2_q4, "--parallel", "2", ctx=CTX, threads=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def local(smollm2_q4):
    """The same file in this process: the vectors the server should send."""
    return pyklei.load(smollm2_q4, n_threads=2, n_ctx=CTX)


def _post(srv, body) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_openai_client_gets_the_models_vectors(server, local):
    c = server.openai_client()
    want = np.array(local.embed(TEXTS))
    b64 = c.embeddings.create(model="m", input=TEXTS)            # the client asks for base64
    flt = c.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    for res in (b64, flt):
        got = np.array([d.embedding for d in sorted(res.data, key=lambda d: d.index)])
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert res.usage.prompt_tokens == res.usage.total_tokens == sum(
            len(local.encode(t)) for t in TEXTS)
    one = c.embeddings.create(model="m", input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, want[0], atol=1e-6)
    # a retrieval ranks the related sentence above the unrelated one
    q = np.array(c.embeddings.create(model="m", input="A cat on a rug.").data[0].embedding)
    assert q @ want[0] > q @ want[2]


def test_token_id_inputs_and_dimensions(server, local):
    c = server.openai_client()
    ids = [local.encode(t) for t in TEXTS]
    by_ids = c.embeddings.create(model="m", input=ids, encoding_format="float")
    assert np.allclose([d.embedding for d in by_ids.data], local.embed(TEXTS), atol=1e-6)
    one = c.embeddings.create(model="m", input=ids[1], encoding_format="float")
    assert np.allclose(one.data[0].embedding, local.embed(TEXTS[1])[0], atol=1e-6)
    cut = c.embeddings.create(model="m", input=TEXTS, dimensions=64)
    got = np.array([d.embedding for d in cut.data])
    assert got.shape == (3, 64)
    np.testing.assert_allclose(got, local.embed(TEXTS, dimensions=64), atol=1e-6)


def test_langchain_openai_embeddings(server, local):
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: send text, not tiktoken's ids (another vocabulary),
    # as langchain documents for servers other than OpenAI's
    emb = lc.OpenAIEmbeddings(model="m", base_url=server.url + "/v1", api_key="none",
                              check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(TEXTS)
    np.testing.assert_allclose(docs, local.embed(TEXTS), atol=1e-6)
    np.testing.assert_allclose(emb.embed_query(TEXTS[2]), local.embed(TEXTS[2])[0], atol=1e-6)


def test_a_generation_beside_embeddings_keeps_its_tokens(server):
    """The embeddings run on their own KV cache slots between the generation's steps: the
    streamed reply is token for token its solo run."""
    c = server.openai_client()
    ask = dict(model="m", messages=[{"role": "user", "content": "Write a short poem about the sea."}],
               temperature=0, max_tokens=120, stream=True)

    def streamed():
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**ask)
                       if ch.choices)

    solo = streamed()
    long_text = " ".join(TEXTS * 40)
    errors, stop, done = [], threading.Event(), []

    def embed_loop():
        try:
            while not stop.is_set():
                c.embeddings.create(model="m", input=[long_text, *TEXTS])
                done.append(1)
        except Exception as e:   # handed to the test
            errors.append(e)

    workers = [threading.Thread(target=embed_loop) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        beside = streamed()
        overlapped = len(done)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors and overlapped >= 1     # embeddings ran while it streamed
    assert beside == solo


def test_a_client_that_hangs_up_cancels_its_embeddings(server):
    """A request of minutes of work whose client leaves after a second: what is left of it is
    dropped, so the next request is answered at once rather than after it."""
    import time
    big = {"model": "m", "input": [" ".join(TEXTS * 40)] * 300, "encoding_format": "float"}
    req = urllib.request.Request(server.url + "/v1/embeddings", data=json.dumps(big).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(OSError):          # a timeout: the client gives up and closes
        urllib.request.urlopen(req, timeout=1.5)
    t = time.perf_counter()
    status, got = _post(server, {"model": "m", "input": "after"})
    assert status == 200 and len(got["data"]) == 1
    assert time.perf_counter() - t < 30     # the whole request would take minutes


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": None}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": [1, 2, 49152]}, "input"),
    ({"input": [[1, -1]]}, "input"),
    ({"input": [1.5, 2]}, "input"),
    ({"input": [[1] * (CTX + 1)]}, "input"),
    ({"input": "word " * (2 * CTX)}, "input"),
    ({"input": "a", "dimensions": 577}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": "64"}, "dimensions"),
    ({"input": "a", "dimensions": True}, "dimensions"),
    ({"input": "a", "encoding_format": "xml"}, "encoding_format"),
])
def test_bad_bodies_get_a_400_naming_the_field(server, body, param):
    status, got = _post(server, {"model": "m", **body})
    assert status == 400, got
    assert got["error"]["param"] == param and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"]


def test_not_an_object_is_a_400(server):
    status, got = _post(server, ["input", "a"])
    assert status == 400 and "JSON object" in got["error"]["message"]


GARBAGE = [None, True, False, 0, -1, 1, 2 ** 63, -2 ** 63, 0.5, -0.0, 1e308, "", "x", "\u0000",
           "\ud7ff\uffff", [], {}, [[]], [{}], [1, "a", None], [[1, 2], "a"], [[1.5]],
           [[2 ** 40]], ["a", ["b"]], "A" * 5000]


def test_fuzzed_embedding_bodies_never_500(server):
    """300 mutations of valid bodies (a field's value replaced, removed or added, the JSON text
    damaged): a 200 or a 400 in OpenAI's shape, never a 500, and the server healthy after."""
    import random
    rng = random.Random(43)
    seen = {}
    for i in range(300):
        body = {"model": "m", "input": rng.choice(["Hello", ["a b", "c"], [1, 2, 3], [[4, 5]]]),
                "encoding_format": rng.choice(["float", "base64"]), "dimensions": 32}
        op = rng.randrange(5)
        if op == 0:
            body[rng.choice(list(body))] = rng.choice(GARBAGE)
        elif op == 1:
            del body[rng.choice(list(body))]
        elif op == 2:
            body[rng.choice(["user", "x" * 50, "pooling", "truncate"])] = rng.choice(GARBAGE)
        elif op == 3:
            body["input"] = [rng.choice(GARBAGE + ["ok", [7, 8]]) for _ in range(rng.randrange(1, 4))]
        raw = json.dumps(body).encode()
        if op == 4:
            raw = bytearray(raw)
            pos = rng.randrange(len(raw))
            raw[pos:pos + 2] = bytes(rng.randrange(256) for _ in range(2))
        req = urllib.request.Request(server.url + "/v1/embeddings", data=bytes(raw),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, got = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            status, got = e.code, json.loads(e.read())
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400), (raw[:200], status, got)
        if status == 400:
            assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
        else:
            assert got["data"] and all(d["object"] == "embedding" for d in got["data"])
    assert seen.get(200, 0) > 30 and seen.get(400, 0) > 30, seen
    assert server.health()["status"] == "ok"
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'pyklei_requests_total{endpoint="/v1/embeddings",status="400"}' in metrics
    assert 'endpoint="/v1/embeddings",status="500"' not in metrics
