"""Scale-out (docs/SERVE.md): two `pyklei serve` replicas behind nginx on loopback, with the
configuration of examples/nginx-replicas.conf (only its ports changed). Requests through nginx
reach both replicas, a streamed reply comes through unbuffered, and when one replica stops
the other takes every request."""
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
from live_server import free_port, tiny_replicas  # noqa: E402
from paths import ROOT  # noqa: E402

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="needs nginx (Debian: apt-get install "
                                                      "nginx-light; scripts/test.sh installs it)")


def nginx_conf(replica_ports, listen_port) -> str:
    """examples/nginx-replicas.conf with these ports (the documented file, not a copy)."""
    text = (ROOT / "examples" / "nginx-replicas.conf").read_text()
    servers = re.findall(r"^\s*server 127\.0\.0\.1:(\d+)", text, re.M)
    assert servers == ["8001", "8002"], servers
    for old, new in zip(servers, replica_ports):
        text = text.replace(f"server 127.0.0.1:{old} ", f"server 127.0.0.1:{new} ")
    assert "listen 127.0.0.1:8080;" in text
    return text.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{listen_port};")


@pytest.fixture
def replicas(tiny64):
    with tiny_replicas(tiny64[1]) as servers:
        yield servers


@pytest.fixture
def balancer(replicas, tmp_path):
    port = free_port()
    (tmp_path / "tmp").mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_conf([r.port for r in replicas], port))
    proc = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(conf)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {proc.communicate()[1]}")
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def complete(url, i, **kw):
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": f"request {i}", "max_tokens": 8, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_behind_nginx(replicas, balancer):
    a, b = replicas
    for i in range(8):
        complete(balancer, i)
    done = [r.health()["completed"] for r in replicas]
    assert sum(done) == 8 and min(done) >= 2, done      # both replicas served requests

    # a streamed reply passes through nginx as events (proxy_buffering off)
    with httpx.stream("POST", balancer + "/v1/completions", timeout=60, json={
            "prompt": "stream", "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln]
    assert events[-1] == "data: [DONE]" and len(events) > 3
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"

    # one replica stops (SIGTERM, exit 0): the other takes every request
    assert a.terminate() == 0
    before = b.health()["completed"]
    for i in range(4):
        complete(balancer, 100 + i)
    assert b.health()["completed"] == before + 4
