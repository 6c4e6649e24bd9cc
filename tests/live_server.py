"""`pyklei serve` in a subprocess on 127.0.0.1, for the server tests and benchmarks/serve.py.

    with LiveServer(model_path, "--parallel", "4") as srv:
        srv.url          # http://127.0.0.1:PORT
        srv.health()     # GET /health as a dict (engine stats)
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class LiveServer:
    def __init__(self, model, *args, threads=1, ctx=1024, start_timeout=120, env=None, cwd=None):
        self.cmd = [sys.executable, "-m", "pyklei", "serve", str(model), "--port", "0",
                    "-t", str(threads), "-c", str(ctx), "--quiet", *map(str, args)]
        self.start_timeout, self.env = start_timeout, env
        self.cwd = cwd or ROOT       # another checkout's directory runs that checkout's pyklei
        self.proc = None
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LiveServer":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=self.cwd, env=self.env)
        ready, _, _ = select.select([self.proc.stdout], [], [], self.start_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if "http://127.0.0.1:" not in line:
            self.proc.kill()
            raise RuntimeError(f"pyklei serve did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.split("http://127.0.0.1:", 1)[1].split("/")[0])
        deadline = time.monotonic() + self.start_timeout
        while True:                       # the socket listens; wait until the app answers
            try:
                self.health()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def wait_health(self, pred, timeout=30.0) -> dict:
        """Polls /health until pred(stats) holds; the last stats (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if pred(h):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"/health never satisfied the condition: {h}")
            time.sleep(0.05)

    def terminate(self, timeout=60.0) -> int:
        """SIGTERM, then the exit code (kills it after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def env_with(**kw) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in kw.items()})
    return env
