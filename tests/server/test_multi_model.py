"""`pyklei serve` with several models (pyklei.server.model_registry), answered by the official
`openai` client: two real SmolLM2 files (the shared q4 conversion, "a", and a second conversion
with group 64 and 4-bit embeddings, "b"), a request for b while a streams (a's greedy text is
its solo run's), --models-max 1 (an idle model is unloaded, a busy one never: the request is
refused with 503 models_busy; the unloaded one reloads on demand), one load for two requests,
an unknown model (404 model_not_found), /v1/models and /health with each model's status, and
the memory a server holds (VmRSS) bounded by --models-max."""
import json
import shutil
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from live_server import LiveServer  # noqa: E402  (tests/fixtures/, on sys.path via conftest)

PROMPT = "Once upon a time"
LONG = 120          # tokens of the stream that another request must not disturb


@pytest.fixture(scope="module")
def model_files(smollm2_q4, smollm2_hf_path, tmp_path_factory):
    """A folder of two pyklei files of SmolLM2, converted differently: a.gguf and b.gguf."""
    from pyklei.converters import convert

    d = tmp_path_factory.mktemp("models")
    shutil.copy(smollm2_q4, d / "a.gguf")
    convert(smollm2_hf_path, d / "b.gguf", group_size=64, embedding_bits=4)
    (d / "notes.txt").write_text("not a model")
    return d


@pytest.fixture(scope="module")
def pair(model_files):
    """Both models resident at once (--models-max 2), a the default."""
    with LiveServer([model_files / "a.gguf", model_files / "b.gguf"], "--parallel", "2",
                    "--models-max", "2") as srv:
        yield srv


def complete(srv, model, max_tokens=16, **kw):
    r = srv.openai_client().completions.create(model=model, prompt=PROMPT, temperature=0,
                                               max_tokens=max_tokens, **kw)
    return r


def statuses(srv) -> dict:
    return {m["id"]: m["status"] for m in srv.health()["models"]}


def vm_rss(srv) -> int:
    """The server process's resident memory in bytes (/proc/PID/status VmRSS)."""
    for line in open(f"/proc/{srv.proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_b_loads_while_a_streams_and_a_is_undisturbed(pair):
    """b is loaded (in a worker thread) and answers while a streams; a's greedy text is the
    one it gets alone, and both are then resident."""
    assert statuses(pair) == {"a": "loaded", "b": "unloaded"}
    solo = complete(pair, "a", LONG).choices[0].text
    got, b_sent, b_done = [], [], []

    def ask_b():
        b_sent.append(time.monotonic())
        b_done.append(complete(pair, "b", 8))
        b_done.append(time.monotonic())

    stream = pair.openai_client().completions.create(model="a", prompt=PROMPT, temperature=0,
                                                     max_tokens=LONG, stream=True)
    asker = threading.Thread(target=ask_b)
    for chunk in stream:
        got.append(chunk.choices[0].text)
        assert chunk.model == "a"
        if len(got) == 2:
            asker.start()       # b's load and request run while a's tokens keep coming
    a_done = time.monotonic()
    asker.join(120)
    assert "".join(got) == solo
    assert b_sent[0] < a_done       # b was asked, and loaded, while a streamed
    reply_b = b_done[0]
    assert reply_b.model == "b" and reply_b.usage.completion_tokens == 8
    assert statuses(pair) == {"a": "loaded", "b": "loaded"}


def test_models_lists_every_model_with_its_status(pair):
    listed = pair.openai_client().models.list()
    assert [m.id for m in listed] == ["a", "b"]
    assert all(m.owned_by == "pyklei" and m.object == "model" for m in listed)
    assert {m.id: m.model_extra["status"] for m in listed} == statuses(pair)
    assert pair.openai_client().models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError):
        pair.openai_client().models.retrieve("c")


def test_an_unknown_model_is_404_model_not_found_listing_the_ids(pair):
    with pytest.raises(openai.NotFoundError) as e:
        pair.openai_client().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'gpt-4o'" in err["message"] and "'a'" in err["message"] and "'b'" in err["message"]
    r = httpx.post(pair.url + "/v1/completions", json={"model": 7, "prompt": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_request_naming_no_model_gets_the_default(pair):
    r = httpx.post(pair.url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "a"
    assert r.json()["choices"][0]["text"] == complete(pair, "a", 6).choices[0].text


def test_embeddings_go_to_the_model_they_name(pair):
    c = pair.openai_client()
    e = {m: c.embeddings.create(model=m, input="The capital of France") for m in ("a", "b")}
    assert e["a"].model == "a" and e["b"].model == "b"
    assert e["a"].data[0].embedding != e["b"].data[0].embedding      # two conversions
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="c", input="x")


def test_responses_and_messages_go_to_the_model_they_name(pair):
    r = pair.openai_client().responses.create(model="b", input="Hi", max_output_tokens=4)
    assert r.model == "b"
    m = httpx.post(pair.url + "/v1/messages", timeout=120, json={
        "model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert m.status_code == 200 and m.json()["model"] == "a"
    m = httpx.post(pair.url + "/v1/messages", timeout=60, json={
        "model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert m.status_code == 404 and m.json()["type"] == "error"      # Anthropic's error shape
    assert "'claude-x'" in m.json()["error"]["message"]


def test_metrics_sum_the_engines_and_show_each_model(pair):
    text = httpx.get(pair.url + "/metrics", timeout=30).text
    assert 'pyklei_model_loaded{model="a"} 1.0' in text
    assert 'pyklei_parallel_slots 4.0' in text       # two engines of --parallel 2, both loaded


def test_models_max_1_unloads_the_idle_model_never_the_busy_one(model_files, pair):
    """--models-max 1: b's request unloads idle a; a request for a while b streams is refused
    (503 models_busy, Retry-After) and b's stream goes on intact; then a reloads on demand and
    gives the same text. The resident memory stays that of one model."""
    complete(pair, "b", 1)
    assert statuses(pair) == {"a": "loaded", "b": "loaded"}
    both_rss = vm_rss(pair)
    with LiveServer([model_files / "a.gguf", model_files / "b.gguf"], "--models-max", "1",
                    "--parallel", "2") as srv:
        text_a = complete(srv, "a").choices[0].text
        one_rss = vm_rss(srv)
        assert statuses(srv) == {"a": "loaded", "b": "unloaded"}
        complete(srv, "b")
        assert statuses(srv) == {"a": "unloaded", "b": "loaded"}
        swapped_rss = vm_rss(srv)
        model_bytes = min(p.stat().st_size for p in model_files.glob("*.gguf"))
        # a's memory went back: the server holds one model, not two
        print(f"VmRSS: a alone {one_rss >> 20} MiB, b in a's place {swapped_rss >> 20} MiB, "
              f"a and b (--models-max 2) {both_rss >> 20} MiB; b.gguf {model_bytes >> 20} MiB")
        assert swapped_rss < one_rss + model_bytes / 2, (one_rss, swapped_rss, model_bytes)
        assert swapped_rss < both_rss - model_bytes / 2, (both_rss, swapped_rss, model_bytes)

        got, refused = [], None
        stream = srv.openai_client().completions.create(model="b", prompt=PROMPT, temperature=0,
                                                        max_tokens=LONG, stream=True)
        for chunk in stream:
            got.append(chunk.choices[0].text)
            if len(got) == 2:      # b is busy: a cannot be loaded in its place
                refused = httpx.post(srv.url + "/v1/completions", timeout=60,
                                     json={"model": "a", "prompt": PROMPT, "max_tokens": 4})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "models_busy"
        assert "'b'" in refused.json()["error"]["message"]
        assert "".join(got) == complete(srv, "b", LONG).choices[0].text   # b undisturbed
        assert statuses(srv) == {"a": "unloaded", "b": "loaded"}

        assert complete(srv, "a").choices[0].text == text_a    # reloaded on demand
        assert statuses(srv) == {"a": "loaded", "b": "unloaded"}
        # loads on demand: b once, a once again (its load at startup is not one)
        assert {m["id"]: m["loads"] for m in srv.health()["models"]} == {"a": 1, "b": 1}


def test_two_files_of_one_name_are_refused(model_files):
    with pytest.raises(RuntimeError, match="two model files are named 'a'"):
        LiveServer(model_files / "a.gguf", "--models-dir", model_files).start()


def test_two_requests_for_an_unloaded_model_load_it_once(model_files):
    with LiveServer([], "--models-dir", model_files, "--models-max", "1", "--parallel", "2") as srv:
        # the folder's models in name order, the first the default; notes.txt is not a model
        assert statuses(srv) == {"a": "loaded", "b": "unloaded"}
        replies = [None, None]

        def ask(i):
            replies[i] = complete(srv, "b", 4)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.model for r in replies] == ["b", "b"]
        assert replies[0].choices[0].text == replies[1].choices[0].text
        assert {m["id"]: m["loads"] for m in srv.health()["models"]} == {"a": 0, "b": 1}
        h = srv.health()
        assert h["completed"] == 2 and h["model"] == "a"


def test_one_model_server_takes_any_name_as_before(smollm2_q4):
    """The one-file command is unchanged: any model name is that model."""
    with LiveServer(smollm2_q4, "--model-id", "smol") as srv:
        r = complete(srv, "whatever", 4)
        assert r.model == "smol"
        assert [m.id for m in srv.openai_client().models.list()] == ["smol"]
        assert json.loads(httpx.get(srv.url + "/v1/models", timeout=30).text)["data"][0][
            "status"] == "loaded"
