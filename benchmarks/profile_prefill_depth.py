"""Where a prefill's time goes at a depth of context: wall time per operation of the C forward
pass over P new tokens after D tokens already in the cache, for the pyklei of this tree and,
with --before DIR, of another tree (a copy with its built extension, e.g. main's), alternated
round by round so that both see the same load.

    python benchmarks/profile_prefill_depth.py MODEL.gguf --depth 4096 --tokens 512
    python benchmarks/profile_prefill_depth.py MODEL.gguf --before /tmp/main-tree --rounds 3 \\
        --out profile-prefill-gemma3-d4096

Each measurement is a fresh process: load, prefill D random tokens (untimed), then P more with
the operation timer on (two clock reads per operation). Reports the medians over the rounds of
the prefill's tokens per second and of each operation's seconds, and the after / before ratio.
--decode N: then N decode steps with the timer on, at depth D + P, each operation's time per
step beside the other tree's. Writes benchmarks/results/OUT.md and .json (--out), else prints.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# run in the measured tree's process: prints one JSON line
CHILD = r"""
import json, sys, time
import numpy as np
import pyklei
path, threads, depth, tokens, reps, steps = (sys.argv[1], *map(int, sys.argv[2:7]))
llm = pyklei.load(path, n_threads=threads, n_ctx=depth + tokens + steps + 16, kv_cache=sys.argv[7])
m, rt = llm.model, llm.model.runtime
toks = np.random.default_rng(0).integers(10, llm.tokenizer.vocab_size - 10, depth + tokens + steps).tolist()
best = None
for _ in range(reps):   # the fastest pass: the one the rest of the machine disturbed least
    m.reset()
    if depth:
        m.eval(toks[:depth])
    rt.profile_ops(True)
    t0 = time.perf_counter()
    m.eval(toks[:depth + tokens])
    wall = time.perf_counter() - t0
    if best is None or wall < best[0]:
        best = (wall, rt.op_profile()[0])
wall, ops = best
out = {"pyklei": pyklei.__file__, "wall_s": wall, "tok_s": tokens / wall, "ops_s": ops}
if steps:   # decode after the last pass, at depth + tokens: each op's seconds per step
    rt.profile_ops(True)
    t0 = time.perf_counter()
    for t in toks[depth + tokens:]:
        m.step(t)
    wall = time.perf_counter() - t0
    out.update(decode_tok_s=steps / wall, decode_ops_s={k: v / steps for k, v in rt.op_profile()[0].items()})
print(json.dumps(out))
"""


def measure(tree: Path | None, model: Path, threads: int, depth: int, tokens: int, reps: int = 1,
            steps: int = 0, kv_cache: str = "f16") -> dict:
    """One fresh process of the pyklei in tree (None: this one), its cache of type kv_cache: its
    fastest of reps passes, then `steps` decode steps after it."""
    env = {**os.environ, "PYTHONPATH": str(tree or ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(threads), str(depth), str(tokens),
                          str(reps), str(steps), kv_cache],
                         env=env, cwd=tree or ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def render(res: dict) -> str:
    engines = list(res["runs"])
    med = {e: {"tok_s": statistics.median(r["tok_s"] for r in runs),
               "ops": {op: statistics.median(r["ops_s"][op] for r in runs) for op in runs[0]["ops_s"]}}
           for e, runs in res["runs"].items()}
    lines = [f"# Prefill of {res['tokens']} tokens at depth {res['depth']}: {res['model']}", "",
             f"`{res['command']}`; {res['date']}; {res['threads']} threads; 1-min load average "
             f"{min(res['loadavg']):.1f}-{max(res['loadavg']):.1f} during the run. Medians of "
             f"{res['rounds']} alternating rounds, each a fresh process"
             + (f" (its fastest of {res['reps']} passes)" if res.get("reps", 1) > 1 else "") + ".", "",
             "| operation | " + " | ".join(f"{e} (ms)" for e in engines) + " | share |", "|---|"
             + "---:|" * (len(engines) + 1)]
    last = engines[-1]
    total = sum(med[last]["ops"].values())
    for op in sorted(med[last]["ops"], key=lambda o: -med[last]["ops"][o]):
        if max(med[e]["ops"][op] for e in engines) < 1e-4:
            continue
        lines.append(f"| {op} | " + " | ".join(f"{1e3 * med[e]['ops'][op]:.1f}" for e in engines)
                     + f" | {100 * med[last]['ops'][op] / total:.1f}% |")
    lines += ["", "| | " + " | ".join(engines) + " |", "|---|" + "---:|" * len(engines),
              "| prefill tok/s | " + " | ".join(f"{med[e]['tok_s']:.1f}" for e in engines) + " |"]
    if len(engines) == 2:
        a, b = engines
        lines += ["", f"{b} / {a}: prefill **{med[b]['tok_s'] / med[a]['tok_s']:.2f}x**, attention "
                  f"**{med[a]['ops']['attention'] / med[b]['ops']['attention']:.2f}x** faster "
                  "(medians of each)."]
        per = sorted(y["tok_s"] / x["tok_s"] for x, y in zip(res["runs"][a], res["runs"][b]))
        lines += ["", f"Prefill ratio round by round: median {statistics.median(per):.3f}x, "
                  f"range {per[0]:.3f}-{per[-1]:.3f}x."]
    if res.get("steps"):
        dec = {e: {"tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                   "ops": {op: statistics.median(r["decode_ops_s"][op] for r in runs)
                           for op in runs[0]["decode_ops_s"]}}
               for e, runs in res["runs"].items()}
        lines += ["", f"Then {res['steps']} decode steps at depth {res['depth'] + res['tokens']} "
                  "(medians over the rounds of each op's time per step):", "",
                  "| operation | " + " | ".join(f"{e} (ms per step)" for e in engines) + " |",
                  "|---|" + "---:|" * len(engines)]
        for op in sorted(dec[last]["ops"], key=lambda o: -dec[last]["ops"][o]):
            if max(dec[e]["ops"][op] for e in engines) >= 1e-4:
                lines.append(f"| {op} | " + " | ".join(f"{1e3 * dec[e]['ops'][op]:.2f}" for e in engines) + " |")
        lines += ["| decode tok/s | " + " | ".join(f"{dec[e]['tok_s']:.1f}" for e in engines) + " |"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1,
                    help="passes per process, the fastest kept (a shared machine's spikes hit single passes)")
    ap.add_argument("--decode", type=int, default=0, metavar="N",
                    help="then N decode steps, their op times per step beside the prefill's")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="also the pyklei package in DIR (a tree with its built extension)")
    ap.add_argument("--kv-caches", default="f16", metavar="TYPE[,TYPE]",
                    help="the KV cache type of every run (default f16); two: each tree with each, alternated")
    ap.add_argument("--out", default=None, help="results file name in benchmarks/results, no suffix")
    args = ap.parse_args(argv)
    caches = args.kv_caches.split(",")
    if not 1 <= len(caches) <= 2 or any(c not in ("f32", "f16", "bf16", "q8") for c in caches):
        ap.error(f"--kv-caches {args.kv_caches}: one or two of f32, f16, bf16, q8")
    if args.decode < 0:
        ap.error(f"--decode {args.decode}: a number of decode steps, 0 or more")
    if args.before is not None and not (args.before / "pyklei" / "__init__.py").is_file():
        ap.error(f"--before {args.before}: no pyklei package there")
    trees = {**({"before": args.before.resolve()} if args.before else {}), "this tree": None}
    engines = {(f"{e}, {c} cache" if len(caches) > 1 else e): (tree, c) for e, tree in trees.items() for c in caches}
    runs = {e: [] for e in engines}
    loads = []
    for rnd in range(args.rounds):
        for e, (tree, kv) in engines.items():
            r = measure(tree, args.model, args.threads, args.depth, args.tokens, args.reps, args.decode, kv)
            runs[e].append(r)
            loads.append(os.getloadavg()[0])
            print(f"round {rnd + 1}: {e}: {r['tok_s']:.1f} tok/s, attention {r['ops_s']['attention']:.3f} s "
                  f"(load {loads[-1]:.1f})", file=sys.stderr)
    cmd = (f"python benchmarks/profile_prefill_depth.py {args.model.name} --threads {args.threads} "
           f"--depth {args.depth} --tokens {args.tokens} --rounds {args.rounds}"
           + (f" --reps {args.reps}" if args.reps > 1 else "") + (f" --decode {args.decode}" if args.decode else "")
           + (f" --before {args.before}" if args.before else "")
           + (f" --kv-caches {args.kv_caches}" if args.kv_caches != "f16" else "")
           + (f" --out {args.out}" if args.out else ""))
    res = {"model": args.model.name, "threads": args.threads, "depth": args.depth, "tokens": args.tokens,
           "rounds": args.rounds, "reps": args.reps, "steps": args.decode, "runs": runs, "loadavg": loads, "command": cmd,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    text = render(res)
    if args.out:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=1) + "\n")
        (RESULTS / f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
