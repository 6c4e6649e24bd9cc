"""Aggregate decode throughput of pyklei.engine with N concurrent greedy requests (issue 16).

    python benchmarks/batch_decode.py [MODEL.gguf] [--threads 2] [--tokens 128] [--n 1,2,4,8,16]

Each request: a different short prompt, max_tokens greedy tokens, EOS ignored (every request
runs its whole budget). Aggregate tok/s = all generated tokens / wall time from the first
submit to the last token; per-request decode tok/s and time to first token as the responses
report them. Converts SmolLM2-135M-Instruct (pyklei_dev.assets) when no model is given.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[1]))  # pyklei_dev/ (not installed: its __init__.py)

from pyklei.runtime.engine import Engine
from pyklei.runtime.model import Model
from pyklei.runtime.sampler import SamplingParams
from pyklei.text.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "Once upon a time", "Write a poem about the sea.",
           "def quicksort(xs):", "The three primary colours are", "Explain gravity simply:",
           "List five fruits:", "In 1969, the first", "My favourite recipe is",
           "The best way to learn Python", "Dear diary, today", "A haiku about winter:",
           "The mitochondria is", "How do airplanes fly?", "Translate 'hello' to French:",
           "Ten facts about owls:"]


def run(model: Model, tok: Tokenizer, n: int, max_tokens: int) -> dict:
    greedy = SamplingParams(temperature=0.0)
    with Engine(model, tok, n_parallel=n, prefill_chunk=256) as eng:
        t0 = time.perf_counter()
        streams = [eng.submit(tok.encode(PROMPTS[i % len(PROMPTS)]), max_tokens=max_tokens,
                              params=greedy, eos_ids=[]) for i in range(n)]
        last = [None] * n

        def consume(i):
            for r in streams[i]:
                last[i] = r

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    gen = sum(r.generation_tokens for r in last)
    return dict(n=n, aggregate=gen / wall, wall=wall,
                per_request=statistics.median(r.generation_tps for r in last),
                ttft_max=max(r.time_to_first_token for r in last))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--n", default="1,2,4,8,16")
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.n.split(",")]
    path = a.model
    if path is None:
        from pyklei.converters import convert
        from pyklei_dev.gguf_to_hf import smollm2_hf
        path = Path(tempfile.mkdtemp()) / "smollm2-q4.gguf"
        convert(smollm2_hf(), path, progress=False)
    model = Model(path, n_threads=a.threads, n_ctx=512, n_seq=max(ns))
    tok = Tokenizer.from_gguf(path)
    run(model, tok, 1, 8)   # warm-up: page in the weights
    print(f"{Path(path).name}, {a.threads} threads, {a.tokens} greedy tokens per request")
    print("| concurrent | aggregate tok/s | per-request decode tok/s (median) | slowest TTFT | wall |")
    print("|---|---|---|---|---|")
    for n in ns:
        r = run(model, tok, n, a.tokens)
        print(f"| {n} | {r['aggregate']:.1f} | {r['per_request']:.1f} | {r['ttft_max']:.2f} s | "
              f"{r['wall']:.2f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
