"""The prefix cache that outlives a slot (pyklei.runtime.prefix_cache) on a multi-turn chat
workload, with and without it, in one process.

    python benchmarks/prefix_cache.py                       # SmolLM2, 6 users x 4 turns, 2 slots
    python benchmarks/prefix_cache.py --users 8 --turns 6 --rounds 3

Workload: --users conversations share a system prompt (--system tokens); each turn adds a user
message (--message tokens), and the turn's prompt is the whole conversation so far (system,
every earlier message and reply); replies are --max-tokens greedy tokens (end-of-text ignored).
Turns go round-robin over the users (user 1 turn 1, user 2 turn 1, ..., user 1 turn 2, ...),
one request at a time, on an engine of --parallel slots: with more users than slots a user's
slot is gone by its next turn, so only the prefix cache can hold its conversation. Token ids
are random (the cost of a turn depends on its length, not its words).

Per variant (cache off: --cache-ram 0; on: --cache-ram MB) and round, alternated so that the
machine's load falls on both alike:

  prompt tokens run        prompt tokens the engine computed, all turns (prompt_eval_tokens)
  TTFT p50 / p95           submission -> first token, per turn after each user's first
  restore ms per 1k tokens the cache's copy into a slot, measured apart (Model.import_kv)

Results: benchmarks/results/prefix-cache.md and .json (medians over rounds; the 1-minute load
average at the start). Not a test: a ratio between variants is the figure to read.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from pyklei.runtime.engine import Engine  # noqa: E402
from pyklei.runtime.model import Model  # noqa: E402
from pyklei.runtime.sampler import SamplingParams  # noqa: E402
from pyklei.text.tokenizer import Tokenizer  # noqa: E402


def run_workload(engine, args, rng_seed: int) -> dict:
    rng = np.random.default_rng(rng_seed)
    vocab = engine.tokenizer.vocab_size
    system = rng.integers(100, vocab, args.system).tolist()
    convs = [list(system) for _ in range(args.users)]
    run = 0
    ttfts = []
    for turn in range(args.turns):
        for u in range(args.users):
            convs[u] += rng.integers(100, vocab, args.message).tolist()
            *resps, last = engine.submit(convs[u], max_tokens=args.max_tokens, eos_ids=[],
                                         logprobs=0, params=SamplingParams(temperature=0.0))
            convs[u] += [lp.token for r in resps + [last] for lp in r.logprobs or ()]
            run += last.prompt_eval_tokens
            if turn:
                ttfts.append(last.time_to_first_token)
    return dict(prompt_tokens_run=run, ttft_p50=statistics.median(ttfts),
                ttft_p95=float(np.percentile(ttfts, 95)))


def restore_ms_per_1k(model) -> float:
    """The time to copy 1,024 positions' K/V into a slot (import_kv), as a restore does."""
    toks = list(range(100, 100 + 1024))
    model.reset()
    model.logits(toks)
    data = model.export_kv(0, 0, 1024)
    t = time.perf_counter()
    for _ in range(5):
        model.import_kv(1, 0, toks, data)
    return (time.perf_counter() - t) / 5 * 1e3


def main(argv=None) -> int:
    from paths import SMOLLM2_CACHED
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SMOLLM2_CACHED)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=300)
    ap.add_argument("--message", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-ram", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix-cache")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    model = Model(args.model, n_threads=args.threads, n_ctx=2048, n_seq=args.parallel)
    tok = Tokenizer.from_gguf(args.model)
    results = {"off": [], "on": []}
    for r in range(args.rounds):
        for name, ram in (("off", 0), ("on", args.cache_ram)) if r % 2 == 0 else \
                         (("on", args.cache_ram), ("off", 0)):
            model.reset()
            with Engine(model, tok, n_parallel=args.parallel, cache_ram=ram) as engine:
                results[name].append(run_workload(engine, args, rng_seed=r))
            print(name, r, results[name][-1], flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for name, rs in results.items()}
    restore = restore_ms_per_1k(model)
    summary = dict(model=str(args.model.name), load_1min=load, workload=vars(args) | {
        "model": str(args.model), "out": str(args.out)}, median=med, rounds=results,
        restore_ms_per_1k_tokens=restore, kv_bytes_per_token=model.kv_bytes_per_token)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    off, on = med["off"], med["on"]
    md = [f"# Prefix cache: {args.users} users x {args.turns} turns on {args.parallel} slots "
          f"({args.model.name}, {args.threads} thread)", "",
          f"System prompt {args.system} tokens, messages {args.message}, replies "
          f"{args.max_tokens} (greedy); medians of {args.rounds} rounds, variants alternated; "
          f"1-min load average at start {load:.2f}. benchmarks/prefix_cache.py.", "",
          "| | cache off | cache on | ratio |", "|---|---|---|---|",
          f"| prompt tokens run | {off['prompt_tokens_run']:.0f} | {on['prompt_tokens_run']:.0f} | "
          f"{on['prompt_tokens_run'] / off['prompt_tokens_run']:.2f} |",
          f"| TTFT p50 (turns 2+) | {off['ttft_p50'] * 1e3:.0f} ms | {on['ttft_p50'] * 1e3:.0f} ms | "
          f"{off['ttft_p50'] / on['ttft_p50']:.2f}x faster |",
          f"| TTFT p95 (turns 2+) | {off['ttft_p95'] * 1e3:.0f} ms | {on['ttft_p95'] * 1e3:.0f} ms | "
          f"{off['ttft_p95'] / on['ttft_p95']:.2f}x faster |", "",
          f"Restoring 1,024 tokens' K/V into a slot: {restore:.1f} ms "
          f"({model.kv_bytes_per_token} bytes per token, f16)."]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
