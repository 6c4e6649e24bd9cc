"""Throughput of a `pyklei batch` job on this machine against the same job on Ray Data
(issue 44), alternated round by round in one process, medians.

    python benchmarks/batch_job.py [MODEL.gguf] [--requests 32] [--tokens 32] [--rounds 3]

The job: --requests chat requests, a shared system prompt and a different question each,
greedy, at most --tokens tokens each (generated tokens counted from the results' usage). Variants, each from a fresh output file and a fresh load of the
model (what a run of the command pays): local = one engine of --parallel sequences on
--threads threads (pyklei.batch.engine_run); ray = Ray Data's actor pool of --replicas engines
of --parallel sequences on --ray-threads threads each (pyklei.batch.ray_data), on one local Ray
cluster started once (its start-up is reported apart). Every run's output must be the local
run's bytes. Writes benchmarks/results/batch_job.{md,json}. Converts SmolLM2-135M-Instruct
(pyklei_dev) when no model is given.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # pyklei_dev/ (not installed)

from pyklei.batch import lines as L
from pyklei.batch.engine_run import EngineRunner, load_engine
from pyklei.batch.job import run_job
from pyklei.batch.ray_data import run_on_ray
from pyklei.distributed.ray_connect import connect

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
TOPICS = ["rivers", "owls", "bread", "volcanoes", "chess", "tides", "glass", "bees", "comets",
          "maps", "salt", "bridges", "clouds", "coffee", "deserts", "violins"]


def write_input(path: Path, n: int, tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            q = f"Tell me one fact about {TOPICS[i % len(TOPICS)]} (question {i})."
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": q}],
                    "max_tokens": tokens, "temperature": 0}
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def local(model, inp, out, a) -> tuple[float, int]:
    """(seconds, tokens generated)"""
    t0 = time.perf_counter()
    llm, engine = load_engine(model, a.parallel, n_threads=a.threads)
    try:
        s = run_job(inp, out, EngineRunner(engine, llm.tokenizer, "m", L.created_of(inp)).run)
    finally:
        engine.shutdown(cancel=True)
        llm.close()
    return time.perf_counter() - t0, s.completion_tokens


def on_ray(ray, model, inp, out, a) -> tuple[float, int]:
    t0 = time.perf_counter()
    s = run_job(inp, out, lambda todo: run_on_ray(
        ray, todo, model=model, replicas=a.replicas, threads=a.ray_threads,
        n_parallel=a.parallel, load_kwargs={}, model_id="m", created=L.created_of(inp)))
    return time.perf_counter() - t0, s.completion_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="the local engine's threads")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--ray-threads", type=int, default=1)
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--name", default="batch_job")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    model = a.model
    if model is None:
        from pyklei.converters import convert
        from pyklei_dev.gguf_to_hf import smollm2_hf
        model = str(tmp / "smollm2-q4.gguf")
        convert(smollm2_hf(), model, progress=False)
    inp = tmp / "in.jsonl"
    write_input(inp, a.requests, a.tokens)
    t0 = time.perf_counter()
    ray = connect(part="data", num_cpus=a.ray_cpus)
    ray_start = time.perf_counter() - t0
    times = {"local": [], "ray": []}
    reference = None
    loads = []
    for r in range(a.rounds):
        for name in ("local", "ray") if r % 2 == 0 else ("ray", "local"):
            out = tmp / f"{name}-{r}.jsonl"
            dt, tokens = (local(model, inp, out, a) if name == "local"
                          else on_ray(ray, model, inp, out, a))
            data = out.read_bytes()
            reference = reference or data
            assert data == reference, f"{name} round {r}: output differs from the first run"
            times[name].append(dt)
            loads.append(os.getloadavg()[0])
            print(f"round {r} {name}: {dt:.1f} s", flush=True)
    ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = {k: {"seconds": v, "median_s": med[k], "requests_per_s": a.requests / med[k],
                "tokens_per_s": tokens / med[k]} for k, v in times.items()}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info = {"date": now, "model": Path(model).name, "requests": a.requests,
            "tokens_each": a.tokens, "rounds": a.rounds, "parallel": a.parallel,
            "local_threads": a.threads, "replicas": a.replicas, "ray_threads": a.ray_threads,
            "ray_cpus": a.ray_cpus, "ray_start_s": ray_start, "cpus": os.cpu_count(),
            "load_average_1min": loads, "identical_bytes": True, "results": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(info, indent=1) + "\n")
    md = [f"`python benchmarks/batch_job.py`, {now}, {Path(model).name}, {a.requests} chat "
          f"requests x {a.tokens} greedy tokens, medians of {a.rounds} alternated rounds, "
          f"{os.cpu_count()} CPUs, 1-min load average {min(loads):.1f}-{max(loads):.1f}",
          "", "| variant | job s (load included) | requests/s | generated tok/s | ratio to local |",
          "|---|---|---|---|---|"]
    for k, label in (("local", f"local: 1 engine, --parallel {a.parallel}, {a.threads} threads"),
                     ("ray", f"Ray Data: {a.replicas} engines x {a.ray_threads} thread, "
                             f"--parallel {a.parallel} each")):
        md.append(f"| {label} | {med[k]:.1f} | {rows[k]['requests_per_s']:.2f} | "
                  f"{rows[k]['tokens_per_s']:.1f} | {med['local'] / med[k]:.2f} |")
    md += ["", f"Every run wrote the same bytes. The local Ray cluster's start ({a.ray_cpus} CPUs) "
           f"took {ray_start:.1f} s once, outside the rounds; each round loads the model afresh "
           f"(the Ray rounds in their actors)."]
    (RESULTS / f"{a.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
