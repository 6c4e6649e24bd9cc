"""What one client's traffic costs the others on `pyklei serve` (issue 22), for a checkout and
optionally another one beside it (before/after a change), alternating rounds:

    python benchmarks/serve_latency.py                         # this checkout
    python benchmarks/serve_latency.py --other /tmp/base       # and another checkout's server

Per server (SmolLM2, --parallel 4, --threads 2), medians over --rounds:

  health ms        GET /health on a kept-alive connection (what the OpenAI SDKs use)
  chat ms          a 4-token greedy chat on a kept-alive connection
  gap ms           a greedy stream's median gap between tokens
  gap, big ms      its longest gap while a 7.9 MB prompt is posted beside it
  big reply s      how long that 7.9 MB request took to be answered (a 400)

Each server is its own process; `--other DIR` runs `python -m pyklei serve` with DIR as the
working directory, so DIR's pyklei package is imported (copy the built extension into it).
Results: benchmarks/results/serve-latency.md (and .json). Not a test: timings on a shared
machine vary; the load average is written beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
from live_server import LiveServer  # noqa: E402

BIG = 7_900_000


def _stream_gaps(url: str, during=None) -> list[float]:
    """Gaps between the chunks of a 96-token greedy stream; `during()` runs once it has begun."""
    import httpx

    stamps = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": "Once upon a time", "max_tokens": 96, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                if len(stamps) == 8 and during is not None:
                    threading.Thread(target=during).start()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def measure(srv) -> dict:
    import httpx

    out = {}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.get("/health")
        health, chat = [], []
        for _ in range(20):
            t = time.perf_counter()
            c.get("/health")
            health.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 4, "temperature": 0})
            chat.append(time.perf_counter() - t)
    out["health ms"] = 1e3 * statistics.median(health)
    out["chat ms"] = 1e3 * statistics.median(chat)
    out["gap ms"] = 1e3 * statistics.median(_stream_gaps(srv.url))
    big = json.dumps({"prompt": "x" * BIG}).encode()
    took = []

    def post_big():
        t = time.perf_counter()
        httpx.post(srv.url + "/v1/completions", content=big, timeout=120,
                   headers={"Content-Type": "application/json"})
        took.append(time.perf_counter() - t)

    gaps = _stream_gaps(srv.url, during=post_big)
    while not took:
        time.sleep(0.05)
    out["gap, big ms"] = 1e3 * max(gaps)
    out["big reply s"] = took[0]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="pyklei .gguf (default: SmolLM2 converted by the example)")
    ap.add_argument("--other", type=Path, help="another checkout whose server runs beside")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve-latency"))
    args = ap.parse_args(argv)
    model = args.model or str(Path(os.environ.get("PYKLEI_CACHE", Path.home() / ".cache/pyklei"))
                              / "smollm2-135m-instruct-q4.gguf")
    servers = {"this checkout": ROOT}
    if args.other:
        servers = {"other": args.other.resolve(), **servers}
    runs = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, where in servers.items():
            with LiveServer(model, "--parallel", "4", threads=args.threads, ctx=1024,
                            cwd=where) as srv:
                runs[name].append(measure(srv))
                print(name, {k: round(v, 2) for k, v in runs[name][-1].items()}, flush=True)
    keys = list(next(iter(runs.values()))[0])
    lines = [f"`python benchmarks/serve_latency.py{' --other ' + str(args.other) if args.other else ''}`"
             f", {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, SmolLM2, --parallel 4, "
             f"{args.threads} threads, medians of {args.rounds} rounds, load average "
             f"{os.getloadavg()[0]:.2f}", "", "| server | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    for name, m in med.items():
        where = servers[name]
        lines.append(f"| {name} ({where.name}) | " + " | ".join(f"{m[k]:.1f}" if k != "big reply s"
                                                                  else f"{m[k]:.2f}" for k in keys) + " |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps({"runs": runs, "medians": med,
                                                    "servers": {k: str(v) for k, v in servers.items()}},
                                                   indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
