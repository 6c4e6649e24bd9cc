#!/usr/bin/env python
"""What a forward pass of m rows of one sequence costs beside one row (a decode step): the cost
behind speculative decoding's drafts and small batches (issue 25).

    python benchmarks/pass_rows.py MODEL.gguf [--threads 1] [--context 100] [--reps 7]

For m = 1..8: the CPU time (this process) of one model.batch of m consecutive rows after a
cached context, logits for the last row only (what a decode step computes), median of reps;
printed as ms and as a ratio to m = 1. CPU time, not wall: robust on a shared machine at one
thread (at more threads it counts spinning too).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import pyklei


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    args = ap.parse_args(argv)
    llm = pyklei.load(args.model, n_threads=args.threads, n_ctx=args.context + 16, n_seq=1)
    m = llm.model
    ctx = [int(t) for t in np.random.default_rng(0).integers(100, 1000, args.context)]
    print(f"{args.model}: {args.threads} thread(s), context {args.context}, load average "
          f"{os.getloadavg()[0]:.2f}")
    base = None
    for rows in [int(x) for x in args.rows.split(",")]:
        ts = []
        for _ in range(args.reps):
            m.reset()
            m.eval(ctx)
            toks = np.arange(5, 5 + rows, dtype=np.int32)
            t0 = time.process_time()
            m.batch(toks, np.zeros(rows, np.int32),
                    np.arange(args.context, args.context + rows, dtype=np.int32),
                    np.array([rows - 1], np.int32))
            ts.append(time.process_time() - t0)
        ms = 1000 * float(np.median(ts))
        base = base or ms
        print(f"  {rows} row(s): {ms:7.2f} ms  x{ms / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
