"""Two replicas of `pyklei serve`, four ways of spreading a multi-turn chat workload over them
(issue 44): `pyklei serve --ray` (Ray Serve, the prefix-aware router), and in front of two
plain `pyklei serve`s: `pyklei route` (the same rule, one hop), nginx round-robin and nginx
least_conn (examples/nginx-replicas.conf).

    python benchmarks/scale_out.py                       # SmolLM2, 2 replicas x 1 thread
    python benchmarks/scale_out.py --users 12 --rounds 3 --parallel 4

The workload: --users users at once, each a conversation of 4-8 turns (seeded) under one shared
system prompt; each turn sends the whole conversation so far (the previous replies included)
and waits for its reply (greedy, --max-tokens, streamed with usage) before the next. Each round
runs every setup once, in alternating order, with fresh conversations (another seed; the same
questions in every setup, each setup's users named apart, so that no setup finds another's
conversations in the replicas they share), so the figures of a round are taken under the same
load; the report gives each figure's median over
the rounds and the ratios to round-robin, per round then median.

    TTFT p50 / p95         request sent -> first text chunk, client side
    prompt tokens computed prompt_tokens - prompt_tokens_details.cached_tokens of each reply
                           (the replica's own count of what it prefilled), summed, and per turn
    prefix hit rate        cached / prompt tokens
    aggregate tok/s        completion tokens / the round's wall time for that setup

All setups run at once (idle between their turns) on this machine; the 1-minute load average is
recorded per round. Results: benchmarks/results/scale_out.md and .json (--out changes the stem).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))                       # pyklei_dev/ (not installed)
sys.path.append(str(ROOT / "tests" / "fixtures"))  # live_server.LiveServer
RESULTS = ROOT / "benchmarks" / "results"

SYSTEM = ("You are the help desk assistant of the Riverside Public Library. The library opens "
          "from nine to six on weekdays and from ten to four on Saturdays; it is closed on "
          "Sundays and public holidays. Members may borrow up to twelve items at once for three "
          "weeks, renew them twice online unless someone else reserved them, and return them "
          "at any branch or in the drop box by the main door. Fines are ten cents a day for "
          "books and a dollar a day for equipment. The library lends laptops, e-readers, board "
          "games, museum passes and a telescope. Study rooms are booked online for up to two "
          "hours a day. Printing costs ten cents a page in black and white and fifty cents in "
          "colour. The makerspace has two 3D printers, a laser cutter and sewing machines; a "
          "short safety class is needed before using them. Children's story time is on "
          "Tuesday and Thursday mornings. Answer briefly and politely, and say when you do "
          "not know.")
QUESTIONS = [
    "Can I renew a book that is already late?", "How many laptops can I borrow?",
    "Is the telescope available this weekend?", "What does the safety class cover?",
    "Can my child come to story time without me?", "How do I book a study room for tomorrow?",
    "Are museum passes free for members?", "What happens if I lose an e-reader?",
    "Can I print from my phone?", "Do you have board games for adults?",
    "Is there parking near the main branch?", "Can I return books at another branch?",
    "How long can I keep a museum pass?", "Can I use the laser cutter on Sunday?",
    "What is the fine for a late laptop?", "Can I reserve a book that is checked out?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conversations(users: int, seed: int, tag: str = "") -> list[list[str]]:
    """Each user's questions (4-8 of them), seeded; `tag` only renames the users. The setups of
    a round ask the same questions with their own tag: the nginx setups share their two
    replicas, and without it the second of them would find the first one's whole
    conversations (greedy: the same replies) in the replicas' caches."""
    rng = random.Random(seed)
    return [[f"(User {tag}{seed}-{u}, question {t + 1}.) {q}"
             for t, q in enumerate(rng.sample(QUESTIONS, rng.randint(4, 8)))]
            for u in range(users)]


def stream_turn(url: str, messages: list, max_tokens: int) -> dict:
    body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0, ttft, text, usage = time.perf_counter(), None, [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        replica = r.headers.get("x-pyklei-replica")      # pyklei serve --ray names it
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text.append(c["delta"]["content"])
            usage = chunk.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "text": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "completion": usage["completion_tokens"], "replica": replica}


def run_workload(url: str, convs: list[list[str]], max_tokens: int) -> dict:
    turns, errors = [], []
    lock = threading.Lock()

    def user(questions):
        messages = [{"role": "system", "content": SYSTEM}]
        last, seen = None, None
        try:
            for q in questions:
                messages.append({"role": "user", "content": q})
                t = stream_turn(url, messages, max_tokens)
                messages.append({"role": "assistant", "content": t["text"]})
                t["moved"] = last is not None and t["replica"] != last
                t["first"] = seen is None
                # at the floor: it computed no more than what is new since the previous turn
                # (the new message and the template's tokens around it; 2 for a reply that
                # tokenizes otherwise in the next prompt)
                t["floor"] = None if seen is None else \
                    t["prompt"] - t["cached"] <= t["prompt"] - seen + 2
                last, seen = t["replica"], t["prompt"] + t["completion"]
                with lock:
                    turns.append(t)
        except Exception as e:          # counted, not hidden
            with lock:
                errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(c,)) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(t["ttft"] for t in turns)
    prompt = sum(t["prompt"] for t in turns)
    cached = sum(t["cached"] for t in turns)
    later = [t for t in turns if not t["first"]]
    floor = [t["ttft"] for t in later if t["floor"]]
    above = [t["ttft"] for t in later if not t["floor"]]
    return {"turns": len(turns), "errors": errors, "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
            "computed_per_turn": (prompt - cached) / len(turns),
            "hit_rate": cached / prompt if prompt else 0.0,
            "tok_s": sum(t["completion"] for t in turns) / wall,
            # why a TTFT median moves little: the share of later turns at the floor, and the
            # TTFT p50 of those and of the others
            "floor_share": len(floor) / len(later) if later else None,
            "ttft_p50_floor_ms": 1000 * statistics.median(floor) if floor else None,
            "ttft_p50_above_ms": 1000 * statistics.median(above) if above else None,
            # turns served by another replica than their conversation's previous turn (known
            # where the replica names itself: pyklei serve --ray)
            "moved_turns": sum(t["moved"] for t in turns) if turns[0]["replica"] else None,
            "conversations_per_replica": sorted(collections.Counter(
                t["replica"] for t in turns if t["first"]).values()) if turns[0]["replica"] else None}


def nginx_conf(replica_ports, port: int, balance: str) -> str:
    """examples/nginx-replicas.conf with these ports, least_conn or round-robin (nginx's
    default, the least_conn line taken out)."""
    text = (ROOT / "examples" / "nginx-replicas.conf").read_text()
    for old, new in zip(("8001", "8002"), replica_ports):
        text = text.replace(f"server 127.0.0.1:{old} ", f"server 127.0.0.1:{new} ")
    text = text.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{port};")
    if balance == "round_robin":
        text = re.sub(r"^\s*least_conn;.*$", "", text, flags=re.M)
    return text


class Nginx:
    def __init__(self, binary, replica_ports, balance):
        self.dir = Path(tempfile.mkdtemp(prefix=f"scale-out-{balance}-"))
        (self.dir / "tmp").mkdir()
        self.port = free_port()
        (self.dir / "nginx.conf").write_text(nginx_conf(replica_ports, self.port, balance))
        self.proc = subprocess.Popen([binary, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(f"http://127.0.0.1:{self.port}/health", 30)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Route:
    """`pyklei route` over the plain replicas (the same rule as the Ray router, one hop)."""

    def __init__(self, replica_urls):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyklei", "route", *replica_urls, "--port", str(self.port),
             "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/health", 30)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


class RayServe:
    """`pyklei serve MODEL --ray` as a user starts it (its own local Ray cluster)."""

    def __init__(self, model, args):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyklei", "serve", str(model), "--ray", "--replicas",
             str(args.replicas), "-t", str(args.threads), "--parallel", str(args.parallel),
             "-c", str(args.ctx), "--port", str(self.port), "--model-id", "smollm2", "--quiet"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline()
        if "serving" not in line:
            raise RuntimeError(f"pyklei serve --ray did not start: {line!r}")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(120)


def wait_http(url: str, seconds: float):
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def default_model() -> Path:
    from pyklei.converters import convert
    from pyklei_dev.assets import cache_dir
    from pyklei_dev.gguf_to_hf import smollm2_hf

    out = cache_dir() / "smollm2-serve-q4.gguf"      # benchmarks/serve.py's too
    if not out.exists():
        convert(smollm2_hf(), out)
    return out


def report(res: dict) -> str:
    a = res["args"]
    lines = [f"# Scale-out: {a['replicas']} replicas x {a['threads']} thread, multi-turn chat",
             "", f"{a['users']} users at once, 4-8 turns each under one shared system prompt "
             f"(~{res['system_prompt_tokens']} tokens), greedy, max_tokens {a['max_tokens']}, "
             f"--parallel {a['parallel']} per replica; {a['rounds']} rounds, setups alternated, "
             f"medians. 1-min load average per round: "
             f"{', '.join(f'{x:.1f}' for x in res['load_avg'])} on {os.cpu_count()} cores. "
             f"Run by benchmarks/scale_out.py.", "",
             "| setup | TTFT p50 ms | TTFT p95 ms | prompt tokens computed | per turn | "
             "prefix hit rate | aggregate tok/s | errors |", "|---|---|---|---|---|---|---|---|"]
    for name, s in res["summary"].items():
        lines.append(f"| {name} | {s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | "
                     f"{s['computed_tokens']:.0f} | {s['computed_per_turn']:.1f} | "
                     f"{s['hit_rate']:.0%} | {s['tok_s']:.1f} | {s['errors']} |")
    if res["ratios"]:
        lines += ["", "Against round-robin (per round, then median):", ""]
        for name, r in res["ratios"].items():
            lines.append(f"- {name}: prompt tokens computed x{r['computed_tokens']:.2f}, "
                         f"TTFT p50 {r['ttft_p50_speedup']:.2f}x lower, aggregate tok/s "
                         f"x{r['tok_s']:.2f}")
    if any(r.get("floor_share") is not None for rs in res["runs"].values() for r in rs):
        lines += ["", "Later turns (each conversation's second on) at the floor, i.e. computing no "
                  "more than what is new since their previous turn, and the TTFT p50 of those and "
                  "of the rest (medians over the rounds):", ""]
    for name, rs in res["runs"].items():
        def med(k):
            xs = [r[k] for r in rs if r.get(k) is not None]
            return statistics.median(xs) if xs else None
        if med("floor_share") is not None:
            f, a = med("ttft_p50_floor_ms"), med("ttft_p50_above_ms")
            lines.append(f"- {name}: {med('floor_share'):.0%} at the floor, TTFT p50 "
                         f"{f:.0f} ms there" if f is not None else f"- {name}: none at the floor")
            lines[-1] += f", {a:.0f} ms above it" if a is not None else ", none above it"
    for name, rs in res["runs"].items():
        if rs and rs[0].get("moved_turns") is not None:
            lines += ["", f"{name}: turns served by another replica than their conversation's "
                      f"previous turn, per round: {[r['moved_turns'] for r in rs]}; "
                      f"conversations per replica: {[r['conversations_per_replica'] for r in rs]}."]
    if res.get("notes"):
        lines += [""] + [f"Note: {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="pyklei .gguf (default: SmolLM2-135M-Instruct converted)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="scale_out")
    args = ap.parse_args(argv)
    if args.replicas != 2:
        ap.error("the nginx setups are two replicas (examples/nginx-replicas.conf)")
    model = Path(args.model) if args.model else default_model()

    from live_server import LiveServer

    notes = []
    setups = {}
    replicas = [LiveServer(model, "--parallel", str(args.parallel), "--model-id", "smollm2",
                           threads=args.threads, ctx=args.ctx).start() for _ in range(2)]
    nginx_bin = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    ray = None
    try:
        ray = RayServe(model, args)
        setups["ray prefix-aware"] = ray.url
        setups["pyklei route"] = Route([r.url for r in replicas])
        if nginx_bin:
            for balance in ("round_robin", "least_conn"):
                setups[f"nginx {balance}"] = Nginx(nginx_bin, [r.port for r in replicas], balance)
        else:
            notes.append("nginx is not installed: no nginx setups (apt-get install nginx-light)")
            setups["round_robin"] = None
        runs = {name: [] for name in setups}
        loads = []
        warm = conversations(2, 999)            # the system prompt once everywhere, untimed
        for name, s in setups.items():
            run_workload(s if isinstance(s, str) else s.url, warm, 4)
        for rnd in range(args.rounds):
            order = list(setups) if rnd % 2 == 0 else list(reversed(setups))
            loads.append(os.getloadavg()[0])
            for name in order:
                s = setups[name]
                convs = conversations(args.users, seed=rnd, tag="abcd"[list(setups).index(name)])
                r = run_workload(s if isinstance(s, str) else s.url, convs, args.max_tokens)
                runs[name].append(r)
                print(f"round {rnd + 1} {name}: TTFT p50 {r['ttft_p50_ms']:.0f} ms, computed "
                      f"{r['computed_tokens']}, hit {r['hit_rate']:.0%}, {r['tok_s']:.1f} tok/s, "
                      f"errors {len(r['errors'])}", flush=True)
    finally:
        for s in setups.values():
            if isinstance(s, (Nginx, Route)):
                s.stop()
        if ray:
            ray.stop()
        for r in replicas:
            r.stop()

    keys = ("ttft_p50_ms", "ttft_p95_ms", "computed_tokens", "computed_per_turn", "hit_rate", "tok_s")
    summary = {name: {**{k: statistics.median(r[k] for r in rs) for k in keys},
                      "errors": sum(len(r["errors"]) for r in rs)} for name, rs in runs.items()}
    ratios = {}
    base = "nginx round_robin"
    if base in runs:
        for name in runs:
            if name == base:
                continue
            pairs = list(zip(runs[name], runs[base]))
            ratios[name] = {
                "computed_tokens": statistics.median(a["computed_tokens"] / b["computed_tokens"]
                                                     for a, b in pairs),
                "ttft_p50_speedup": statistics.median(b["ttft_p50_ms"] / a["ttft_p50_ms"]
                                                      for a, b in pairs),
                "tok_s": statistics.median(a["tok_s"] / b["tok_s"] for a, b in pairs)}
    from pyklei.llm import load
    llm = load(str(model), n_threads=1, n_ctx=512)
    sys_tokens = len(llm.tokenizer.encode(SYSTEM))
    llm.close()
    res = {"args": vars(args), "model": str(model), "load_avg": loads,
           "system_prompt_tokens": sys_tokens, "runs": runs, "summary": summary,
           "ratios": ratios, "notes": notes}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=1))
    (RESULTS / f"{args.out}.md").write_text(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
