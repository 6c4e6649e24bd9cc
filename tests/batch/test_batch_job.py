"""`pyklei batch` on this machine (pyklei.batch.job, engine_run) with the tiny committed model:
a mixed file of chat, completions and embeddings with bad lines among them gets one result per
line, in order, each what `pyklei serve` answers for the same body; a job killed mid-way and
run again loses and repeats nothing; the command's mistakes are one line."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from paths import ROOT, SEED
from pyklei.batch import lines as L
from pyklei.batch.engine_run import EngineRunner, load_engine
from pyklei.batch.job import run_job
from pyklei.cli import main

CHAT = [{"role": "user", "content": "the capital of france"}]
BODIES = {    # custom_id -> (url, body): every one a request the server answers with a 200
    "chat": ("/v1/chat/completions", {"model": "any", "messages": CHAT, "max_tokens": 8,
                                      "temperature": 0}),
    "chat-n": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "n": 2, "seed": 5,
                                        "temperature": 0.8, "logprobs": True, "top_logprobs": 2}),
    "text": ("/v1/completions", {"prompt": "the river of", "max_tokens": 8, "temperature": 0,
                                 "stop": ["\n"]}),
    "text-best": ("/v1/completions", {"prompt": "seven eleven", "max_tokens": 5, "best_of": 3,
                                      "seed": 1, "temperature": 1.0, "logprobs": 1, "echo": True}),
    "emb": ("/v1/embeddings", {"input": ["the model", "a river"], "encoding_format": "base64"}),
}
REFUSED = {   # custom_id -> (url, body, the field the 400 names)
    "hot": ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, "top_p"),
    "streamed": ("/v1/completions", {"prompt": "x", "stream": True}, "stream"),
    "no-input": ("/v1/embeddings", {"encoding_format": "float"}, "input"),
    "no-messages": ("/v1/chat/completions", {"messages": []}, "messages"),
}


def _request(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _mixed_input(path):
    rows = [_request(c, u, b) for c, (u, b) in BODIES.items()]
    rows += [_request(c, u, b) for c, (u, b, _) in REFUSED.items()]
    rows.insert(2, "this is not json")
    rows.insert(4, "")
    rows.append(json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions",
                            "body": {}}))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def engine():
    llm, eng = load_engine(str(SEED), 2, n_threads=1)
    yield llm, eng
    eng.shutdown(cancel=True)


def _run(engine, inp, out):
    llm, eng = engine
    runner = EngineRunner(eng, llm.tokenizer, "seed", L.created_of(inp))
    return run_job(inp, out, runner.run)


def test_a_mixed_file_gets_one_result_per_line_in_order(engine, tmp_path):
    inp = _mixed_input(tmp_path / "in.jsonl")
    summary = _run(engine, inp, tmp_path / "out.jsonl")
    outs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    want = [x.custom_id for x in L.read_input(inp)]
    assert [o["custom_id"] for o in outs] == want and len(want) == 11
    by = {o["custom_id"]: o for o in outs}
    for cid in BODIES:
        assert by[cid]["response"]["status_code"] == 200 and by[cid]["error"] is None
    for cid, (_, _, param) in REFUSED.items():
        r = by[cid]["response"]
        assert r["status_code"] == 400 and r["body"]["error"]["param"] == param, cid
    junk = outs[2]
    assert junk["custom_id"] is None and junk["error"]["line"] == 3
    assert by["get"]["error"]["param"] == "method" and by["get"]["response"] is None
    assert len(by["chat-n"]["response"]["body"]["choices"]) == 2
    assert len(by["text-best"]["response"]["body"]["choices"]) == 1
    assert summary.written == 11 and summary.failed == 6 and summary.statuses[400] == 4
    # run again from scratch: the same bytes (ids, created and the greedy texts are the input's)
    _run(engine, inp, tmp_path / "again.jsonl")
    greedy = ("chat", "text", "emb")
    first = {o["custom_id"]: o for o in outs if o["custom_id"] in greedy}
    again = [json.loads(x) for x in (tmp_path / "again.jsonl").read_text().splitlines()]
    assert {o["custom_id"]: o for o in again if o["custom_id"] in greedy} == first


def test_a_line_gets_what_the_server_answers(engine, tmp_path):
    """The same body to `pyklei serve`'s app and to the batch job: the same reply, but for what
    the batch leaves out or derives from its input (lines.reproducible)."""
    from starlette.testclient import TestClient

    from pyklei.server.app import create_app

    llm, eng = engine
    inp = _mixed_input(tmp_path / "in.jsonl")
    _run(engine, inp, tmp_path / "out.jsonl")
    by = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    with TestClient(create_app(eng, llm.tokenizer, "seed", n_ctx=eng.n_ctx)) as client:
        # all but "streamed": the server streams it; a batch result is written whole
        asked = {**BODIES, **{c: v[:2] for c, v in REFUSED.items() if c != "streamed"}}
        for cid, (url, body) in asked.items():
            http = client.post(url, json=body)
            got = by[cid]["response"]
            assert got["status_code"] == http.status_code, cid
            want = http.json()
            if http.status_code == 200 and "choices" in want:
                want = L.reproducible(want, got["body"]["created"])
                want["id"] = got["body"]["id"]
            assert got["body"] == want, cid


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pyklei", "batch", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, **kw)


def test_a_job_killed_midway_resumes_without_losing_or_repeating_a_line(tmp_path):
    n = 240
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(_request(f"r{i}", "/v1/completions",
                                    {"prompt": f"number {i} of the", "max_tokens": 12,
                                     "temperature": 0}) + "\n" for i in range(n)))
    out, whole = tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    args = (SEED, inp, "--parallel", "2", "--threads", "1", "--no-progress")
    proc = subprocess.Popen([sys.executable, "-m", "pyklei", "batch", *map(str, args), "-o",
                             str(out)], cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (not out.exists() or out.stat().st_size < 2000) and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cut = out.read_bytes()
    assert 0 < cut.count(b"\n") < n, "the job was not killed mid-way"
    with open(out, "ab") as f:     # a torn last line too, as a kill inside a write leaves
        f.write(b'{"id":"batch_req_')
    r = _cli(*args, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "already done" in r.stderr
    assert _cli(*args, "-o", whole).returncode == 0
    assert out.read_bytes() == whole.read_bytes()
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(n)]           # 0 lost, 0 repeated, in order
    r = _cli(*args, "-o", out)                           # a finished job: nothing to do
    assert r.returncode == 0 and out.read_bytes() == whole.read_bytes()


def test_mistakes_are_one_line(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(_request("a", "/v1/completions", {"prompt": "x"}) + "\n"
                   + _request("a", "/v1/completions", {"prompt": "y"}) + "\n")
    cases = [
        ((SEED, inp, "-o", tmp_path / "o.jsonl"), "lines 1 and 2 have the same custom_id 'a'"),
        ((SEED, inp, "-o", inp), "OUTPUT is the INPUT"),
        ((SEED, tmp_path / "none.jsonl", "-o", tmp_path / "o.jsonl"), "no such input file"),
        ((SEED, inp, "-o", tmp_path / "o.jsonl", "--replicas", "2"), "--replicas applies to --ray"),
    ]
    for args, words in cases:
        assert main(["batch", *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_without_the_ray_extra_is_one_line(tmp_path, capsys, monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_text(_request("a", "/v1/completions", {"prompt": "x"}) + "\n")
    monkeypatch.setitem(sys.modules, "ray", None)        # import ray fails, as without the extra
    assert main(["batch", str(SEED), str(inp), "-o", str(tmp_path / "o.jsonl"), "--ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs the 'ray' extra" in err and ".[ray]" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_silent_ray_address_fails_within_the_timeout():
    """An address that does not answer as Ray (here whatever takes 10.255.255.1:6379, or no
    route at all): one RayUnavailable within the timeout, never Ray's minute of retries. In a
    child process: the abandoned connection attempt goes on in its thread until the process
    ends."""
    pytest.importorskip("ray")
    code = ("import time\n"
            "from pyklei.distributed.ray_connect import RayUnavailable, connect, import_ray\n"
            "import_ray('the test', 'data')\n"  # Ray's import is not the connection's time
            "t0 = time.monotonic()\n"
            "try:\n"
            "    connect('10.255.255.1:6379', part='data', timeout=1.0)\n"
            "except RayUnavailable as e:\n"
            "    print(round(time.monotonic() - t0, 1), e, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    seconds, _, message = r.stdout.partition(" ")
    assert "10.255.255.1:6379" in message, r.stdout + r.stderr
    assert float(seconds) < 5
