"""Prefill and decode speed of pyklei's default file beside llama.cpp's Q4_K_M and Q4_0 of the
same weights, on this machine, in one run (issue 15's speed goal: decode >= 1.3x and prefill
>= 2x llama.cpp Q4_K_M).

    python benchmarks/speed_vs_llamacpp.py                 # SmolLM2, 2 threads, 5 rounds
    python benchmarks/speed_vs_llamacpp.py --threads 1,2 --rounds 3

pyklei's file is what `pyklei convert` makes by default (rotation + GPTQ; the quality
harness's cached "default" file, benchmarks/quality.py), measured by `pyklei bench` with two
activation planes (the default) and with one; llama.cpp's files come from its own
llama-quantize (benchmarks/llamacpp_quality.py's cache) and are measured by llama-bench. The
engines alternate, round after round, each in its own process, so that a busy neighbour on a
shared VM slows all of them alike; in each round an engine reports the median (pyklei bench) or
the mean (llama-bench) of 3 runs, and each figure here is the median over the rounds. Quality of the
same files: benchmarks/results/quality.md.

Results: benchmarks/results/speed-vs-llamacpp.md and .json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)


def pyklei_run(path: Path, threads: int, pl: list[int], n_gen: int, act: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "pyklei", "bench", str(path), "-t", str(threads),
                          "-p", ",".join(map(str, pl)), "-n", str(n_gen), "-r", "3", "--json",
                          "--no-progress", "--activations", act],
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)["results"][0]
    got = {f"pp{r['tokens']}": r["tok_s"] for r in res["prefill"]}
    got[f"tg{n_gen}"] = res["decode"]["tok_s"]
    return got


def llamacpp_run(bench: Path, path: Path, threads: int, pl: list[int], n_gen: int) -> dict:
    out = subprocess.run([str(bench), "-m", str(path), "-t", str(threads), "-p", ",".join(map(str, pl)),
                          "-n", str(n_gen), "-r", "3", "-o", "json"], capture_output=True, text=True,
                         check=True)
    got = {}
    for r in json.loads(out.stdout):
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        got[key] = r["avg_ts"]
    return got


def main(argv=None) -> int:
    import llamacpp_quality as lcpp
    from quality import VARIANTS, convert_variant

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="2", help="comma list (default 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-lengths", default="128,512")
    ap.add_argument("--n-gen", type=int, default=128)
    args = ap.parse_args(argv)
    pl = [int(x) for x in args.prompt_lengths.split(",")]
    bench = lcpp.LLAMACPP_BIN / "llama-bench"
    if lcpp.tools_missing() or not bench.is_file():
        print(f"llama.cpp's tools are missing ({', '.join(lcpp.tools_missing()) or bench}); "
              f"set LLAMACPP_SRC / LLAMACPP_BIN", file=sys.stderr)
        return 2

    from models import smollm2_hf_dir

    from pyklei_dev.assets import cache_dir
    hf = smollm2_hf_dir()
    ours = cache_dir() / "quality" / "smollm2-default.gguf"
    convert_variant(hf, ours, VARIANTS["default"])
    theirs = lcpp.make_files(hf, cache_dir() / "llamacpp" / "smollm2", ["Q4_K_M", "Q4_0"],
                             log=lambda m: print(m, file=sys.stderr))
    engines = {"pyklei default (2 planes)": ("pyklei", ours, "auto"),
               "pyklei default, 1 plane": ("pyklei", ours, "qai8dx"),
               "llama.cpp Q4_K_M": ("llamacpp", theirs["Q4_K_M"], None),
               "llama.cpp Q4_0": ("llamacpp", theirs["Q4_0"], None)}
    runs = {(e, t): [] for e in engines for t in args.threads.split(",")}
    for rnd in range(args.rounds):
        for (e, t) in runs:
            kind, path, act = engines[e]
            got = (pyklei_run(path, int(t), pl, args.n_gen, act) if kind == "pyklei"
                   else llamacpp_run(bench, path, int(t), pl, args.n_gen))
            runs[(e, t)].append(got)
            print(f"round {rnd + 1}: {e}, {t} threads: {got}", file=sys.stderr)

    tests = [f"pp{p}" for p in pl] + [f"tg{args.n_gen}"]
    med = {k: {x: statistics.median(r[x] for r in v) for x in tests} for k, v in runs.items()}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    lines = [f"# pyklei's default file beside llama.cpp Q4_K_M / Q4_0: SmolLM2-135M-Instruct", "",
             f"`python benchmarks/speed_vs_llamacpp.py --threads {args.threads} --rounds {args.rounds}`; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu}. Tokens per second, "
             f"median of {args.rounds} alternating rounds (pp = prefill of N tokens, tg = decode).", "",
             "| engine | file | threads | " + " | ".join(tests) + " |",
             "|---|---|---|" + "---|" * len(tests)]
    for (e, t), m in med.items():
        size = engines[e][1].stat().st_size / 1e6
        lines.append(f"| {e} | {size:.1f} MB | {t} | " + " | ".join(f"{m[x]:.1f}" for x in tests) + " |")
    lines += [""]
    for t in args.threads.split(","):
        for e in ("pyklei default (2 planes)", "pyklei default, 1 plane"):
            for peer in ("llama.cpp Q4_K_M", "llama.cpp Q4_0"):
                r = [f"{x} **{med[(e, t)][x] / med[(peer, t)][x]:.2f}**" for x in tests]
                lines.append(f"- {e} / {peer}, {t} thread{'s' if t != '1' else ''}: " + ", ".join(r))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "speed-vs-llamacpp.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "speed-vs-llamacpp.json").write_text(json.dumps(
        {"rounds": {f"{e} | {t}": v for (e, t), v in runs.items()}, "cpu": cpu}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
