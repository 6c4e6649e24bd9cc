"""Where a prefill's time goes, against what the core can do: each operation of the C forward
pass (benchmarks/profile_prefill_depth.py's operation timer) beside the work it does and the
rate of the unit that does it, measured on this core by benchmarks/core_peak.c (zmm vpdpbusd
for the int4 x int8 matmuls, f32 FMAs for attention's dot products).

    python benchmarks/prefill_breakdown.py MODEL.gguf --threads 1 --tokens 512 --rounds 5 \\
        --out profile-prefill-smollm2

Work counted: a matmul 2 x rows x N x K operations (rows: the pass's; the last layer's o_proj
and MLP run the rows whose logits are asked for only); attention 2 x 2 x n_head x head_dim
multiply-adds per (row, position it sees), causal, at depth 0 (QK and PV; the softmax
apart). "% of peak" is the operation's rate over the unit's peak at 1 thread; "floor" the
time at that peak. Medians over fresh processes, one per round. Writes
benchmarks/results/OUT.md and .json (--out), else prints.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from profile_prefill_depth import RESULTS, ROOT, measure

MATMULS = ("qkv", "o_proj", "gate_up", "down")


def core_peak() -> dict:
    """benchmarks/core_peak.c built and run here: instructions per second of each unit."""
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "core_peak"
        subprocess.run(["gcc", "-O2", str(ROOT / "benchmarks" / "core_peak.c"), "-o", str(exe)], check=True)
        return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)


def work(hp, tokens: int, out_rows: int = 1) -> dict:
    """Operations of each timed op over a prefill of `tokens` rows from depth 0."""
    d, f, L = hp.n_embd, hp.n_ff, hp.n_layer
    qd, kvd = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    tail = (L - 1) * tokens + out_rows   # rows past the last layer's K/V store (pk_llama.c)
    seen = tokens * (tokens + 1) // 2    # (row, position) pairs of causal attention
    return {"qkv": 2 * L * tokens * (qd + 2 * kvd) * d,
            "o_proj": 2 * tail * qd * d,
            "gate_up": 2 * tail * 2 * f * d,
            "down": 2 * tail * d * f,
            "attention": 2 * 2 * qd * ((L - 1) * seen + out_rows * tokens)}


def render(res: dict) -> str:
    peak, runs = res["peak"], res["runs"]
    med = {op: statistics.median(r["ops_s"][op] for r in runs) for op in runs[0]["ops_s"]}
    tok_s = statistics.median(r["tok_s"] for r in runs)
    total = sum(med.values())
    vnni = peak["vpdpbusd_per_s"] * 128          # int8 operations per second (64 multiply-adds)
    fma = peak["fma_per_s"] * 32                 # f32 flops
    lines = [f"# Prefill of {res['tokens']} tokens at depth 0, {res['threads']} thread(s): {res['model']}", "",
             f"`{res['command']}`; {res['date']}; {res['cpu']}; 1-min load average "
             f"{min(res['loadavg']):.1f}-{max(res['loadavg']):.1f} during the run. Medians of {res['rounds']} "
             f"fresh processes (each its fastest of {res['reps']} passes): **{tok_s:.0f} tok/s**.", "",
             f"Core peaks (benchmarks/core_peak.c, one core, best of 5): clock {peak['ghz']:.2f} GHz; zmm "
             f"vpdpbusd {peak['vpdpbusd_per_s'] / 1e9:.2f} G/s = **{vnni / 1e9:.0f} int8 GOP/s**; f32 FMA "
             f"{fma / 1e9:.0f} GFLOP/s; bf16 vdpbf16ps {peak['dpbf16_per_s'] * 64 / 1e9:.0f} GFLOP/s.", "",
             "| operation | ms | share | work (G) | rate (G/s) | unit | % of peak (1 thread) | floor (ms) |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    for op in sorted(med, key=lambda o: -med[o]):
        if med[op] < 1e-4:
            continue
        row = f"| {op} | {1e3 * med[op]:.1f} | {100 * med[op] / total:.1f}% |"
        w = res["work"].get(op)
        if w:
            unit, top = ("int8 VNNI", vnni) if op in MATMULS else ("f32 FMA", fma)
            rate = w / med[op]
            row += (f" {w / 1e9:.1f} | {rate / 1e9:.0f} | {unit} | {100 * rate / top / res['threads']:.0f}% |"
                    f" {1e3 * w / top / res['threads']:.1f} |")
        else:
            row += " | | | | |"
        lines.append(row)
    mm = sum(med[o] for o in MATMULS)
    lines += ["", f"Matmuls {1e3 * mm:.0f} ms ({100 * mm / total:.0f}%), attention {1e3 * med['attention']:.0f} ms "
              f"({100 * med['attention'] / total:.0f}%), the rest {1e3 * (total - mm - med['attention']):.0f} ms."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="passes per process, the fastest kept")
    ap.add_argument("--out", default=None, help="results file name in benchmarks/results, no suffix")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pyklei.formats.model_file import read_model
    hp = read_model(args.model).hparams
    peak = core_peak()
    runs, loads = [], []
    for rnd in range(args.rounds):
        runs.append(measure(None, args.model, args.threads, 0, args.tokens, args.reps))
        loads.append(os.getloadavg()[0])
        print(f"round {rnd + 1}: {runs[-1]['tok_s']:.1f} tok/s (load {loads[-1]:.1f})", file=sys.stderr)
    cmd = (f"python benchmarks/prefill_breakdown.py {args.model.name} --threads {args.threads} --tokens "
           f"{args.tokens} --rounds {args.rounds} --reps {args.reps}" + (f" --out {args.out}" if args.out else ""))
    res = {"model": args.model.name, "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "reps": args.reps,
           "peak": peak, "work": work(hp, args.tokens), "runs": runs, "loadavg": loads, "command": cmd,
           "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                if ln.startswith("model name")), "?"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    text = render(res)
    if args.out:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=1) + "\n")
        (RESULTS / f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
