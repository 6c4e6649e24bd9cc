"""Speed of the three activation schemes on one file, alternated in one run (issue 45, item 4).

    python benchmarks/activations_speed.py                       # SmolLM2's default file, 1 thread
    python benchmarks/activations_speed.py --model gemma3 --threads 2 --rounds 5

The same file is loaded once per scheme (qai8dx: one int8 plane per row; qai8dx2: two planes;
qsi8d32: one plane with a scale per block of 32, docs/FORMAT.md) and the three models are
measured in turn, round after round (a prefill of each --prompts length from an empty cache,
then --gen greedy decode steps after a one-token prompt; the same tokens for each, each
scheme first in turn), so that a busy neighbour on the shared machine slows all of them alike.
The decode figures are not a finding about the schemes: here qai8dx decoded 15-25% slower
than the others whatever the order, while three models loaded in another order, or one model
per process (benchmarks/profile_decode.py's loop), decode at the same speed with each scheme. Rates are tokens per second of the process's CPU time
(1 thread: the work itself; on this shared 2-core VM wall-clock rates moved 2x between rounds
under a load of 20) and, beside them, of wall-clock time. Each figure is the median over the
rounds; each ratio is the median over the rounds of that round's ratio to qai8dx; the load
average is printed beside the run.

Files: --model smollm2 is benchmarks/quality.py's cached "default" file of the smollm2 bed
(rotation + GPTQ, made by that script), gemma3 its default conversion of Gemma 3 270M.
Results: benchmarks/results/<--out>.md and .json.
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
sys.path.append(str(ROOT))
from compare import cpu_name  # noqa: E402  (benchmarks/, this script's folder)
RESULTS = ROOT / "benchmarks" / "results"
SCHEMES = ("qai8dx", "qai8dx2", "qsi8d32")


def model_path(name: str) -> Path:
    from pyklei_dev.assets import cache_dir
    return cache_dir() / "quality" / f"{name}-default.gguf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or gemma3 (quality.py's default file)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", default="128,512", help="prefill lengths (comma list)")
    ap.add_argument("--gen", type=int, default=64, help="decode steps")
    ap.add_argument("--out", default=None, help="results name (default activations-speed-<model>)")
    args = ap.parse_args(argv)

    from pyklei.llm import LLM

    path = model_path(args.model)
    if not path.is_file():
        ap.error(f"{path} is missing: run benchmarks/quality.py --beds {args.model} --variants default first")
    lengths = [int(x) for x in args.prompts.split(",")]
    n_ctx = max(lengths + [args.gen + 2]) + 16
    models = {s: LLM(str(path), n_threads=args.threads, n_ctx=n_ctx, activations=s) for s in SCHEMES}
    rng = np.random.default_rng(0)
    vocab = models["qai8dx"].model.vocab_size
    tokens = lambda n: [int(t) for t in rng.integers(100, vocab, n)]   # noqa: E731
    tests = [f"pp{p}" for p in lengths] + [f"tg{args.gen}"]
    clocks = {"cpu": time.process_time, "wall": time.perf_counter}
    rates = {c: {s: {t: [] for t in tests} for s in SCHEMES} for c in clocks}

    def timed(fn):
        t = {c: f() for c, f in clocks.items()}
        out = fn()
        return out, {c: f() - t[c] for c, f in clocks.items()}

    for s in SCHEMES:   # warm-up: touch every weight once
        models[s].model.reset()
        models[s].model.eval(tokens(8))
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        prompts = {p: tokens(p) for p in lengths}          # the same tokens for every scheme
        first = tokens(1)
        for s in SCHEMES[r % 3:] + SCHEMES[:r % 3]:        # each scheme first in turn
            model = models[s].model
            for p in lengths:
                model.reset()
                _, dt = timed(lambda: model.eval(prompts[p]))
                for c in clocks:
                    rates[c][s][f"pp{p}"].append(p / dt[c])
            model.reset()
            logits = model.eval(first)

            def decode(logits=logits, model=model):
                for _ in range(args.gen):
                    logits = model.step(int(np.argmax(logits)))

            _, dt = timed(decode)
            for c in clocks:
                rates[c][s][f"tg{args.gen}"].append(args.gen / dt[c])
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done (load {load[-1]:.1f})", file=sys.stderr)

    med = {c: {s: {t: statistics.median(v) for t, v in rates[c][s].items()} for s in SCHEMES} for c in clocks}
    ratio = {c: {s: {t: statistics.median([a / b for a, b in zip(rates[c][s][t], rates[c]["qai8dx"][t])])
                     for t in tests} for s in SCHEMES} for c in clocks}
    report = {"model": str(path), "threads": args.threads, "rounds": args.rounds, "cpu": cpu_name(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_1min": load,
              "tok_s": rates, "median_tok_s": med, "median_ratio_vs_qai8dx": ratio}
    name = args.out or f"activations-speed-{args.model}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"`python benchmarks/activations_speed.py --model {args.model} --threads {args.threads} "
             f"--rounds {args.rounds}` — {report['date']}, {report['cpu']}, {args.threads} thread(s), "
             f"1-min load average {min(load):.1f}-{max(load):.1f} during the run (shared machine).",
             "", "tok/s of CPU time and of wall-clock time, median over rounds (ratio to qai8dx: median "
             "of the per-round ratios)", "",
             "| scheme | " + " | ".join(f"{t} CPU | {t} wall" for t in tests) + " |",
             "|---|" + "---|---|" * len(tests)]
    for s in SCHEMES:
        lines.append(f"| {s} | " + " | ".join(f"{med[c][s][t]:.0f} ({ratio[c][s][t]:.2f}x)" for t in tests
                                               for c in clocks) + " |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
