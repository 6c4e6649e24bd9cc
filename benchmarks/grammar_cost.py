#!/usr/bin/env python
"""What a JSON-schema constraint costs a decode step on one model (issue 23's cost goal; the
1B-shaped model has Llama 3's 128k vocabulary, where the mask is largest).

    python benchmarks/grammar_cost.py MODEL.gguf [--threads 2] [--reps 4]

Decode time per token of the same prompt with and without a JSON schema (sampled at 0.7 under
a seed, so a random-weight model writes a long reply either way), arms alternated, medians;
then the mask alone (Constraint.apply + advance) per token along a fixed reply.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import pyklei
from pyklei.runtime import grammar
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}
REPLY = '{"items": ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape"]}'


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    llm = pyklei.load(args.model, n_threads=args.threads, n_ctx=512, n_seq=1)
    tok = llm.tokenizer
    ids = tok.encode("Write a JSON list of fruits:", add_bos=True)
    ms = {"free": [], "json": []}
    load0 = os.getloadavg()[0]
    for rep in range(args.reps):
        for arm in ms:
            kw = {"json_schema": SCHEMA} if arm == "json" else {}
            llm.reset()
            r = llm.generate(ids, max_tokens=args.max_tokens, temperature=0.7, seed=rep, **kw)
            ms[arm].append(1000 / r.generation_tps if r.generation_tps else float("nan"))
    print(f"{args.model}: vocabulary {tok.vocab_size}, {args.threads} thread(s), load average "
          f"{load0:.2f} -> {os.getloadavg()[0]:.2f}")
    for arm, v in ms.items():
        print(f"  {arm:5s} ms/token: " + " ".join(f"{x:.2f}" for x in v)
              + f"  median {np.median(v):.2f}")
    print(f"  constrained / free: x{np.median(ms['json']) / np.median(ms['free']):.3f}")
    c = grammar.constraint(tok, json_schema=SCHEMA)
    toks = tok.encode(REPLY, add_bos=False)
    logits = np.zeros(tok.vocab_size, np.float32)
    t0 = time.perf_counter()
    for t in toks:
        c.apply(logits, tok.eos_ids)
        c.advance(t)
    print(f"  mask (apply + advance): {(time.perf_counter() - t0) * 1000 / len(toks):.3f} ms/token "
          f"over {len(toks)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
