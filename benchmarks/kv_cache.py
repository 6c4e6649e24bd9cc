#!/usr/bin/env python
"""The KV cache's precision (issue 24): quality and speed of each `kv_cache` on one file.

    python benchmarks/kv_cache.py [--model M.gguf] [--hf DIR] [--tokens 2048] [--threads 2]

Quality: the logits of every position of a long text (the GPL-3 text where Debian has it, else
pyklei's evaluation text), with each cache type, against transformers fp32 on the checkpoint the
file came from (KL divergence, top-1 agreement, perplexity, as benchmarks/quality.py) and
against the f32 cache (what the cache's rounding alone changes).
Speed: prefill of `depth` tokens, then decoding at that depth, cache types alternated in one
run (reps rounds each), CPU load written beside them.

Results: benchmarks/results/kv-cache.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT.parent))  # pyklei_dev/ (not installed: its __init__.py)

from quality import kld_positions, paired_change, reference, score, texts  # noqa: E402

RESULTS = ROOT / "results"
KINDS = ("f32", "f16", "q8")


def vs_f32(base: np.ndarray, logits: np.ndarray) -> dict:
    """KL(f32 cache || this cache) per position, mean and p99, and top-1 agreement."""
    kld = kld_positions(base, logits)
    top1 = base[:-1].argmax(-1) == logits[:-1].argmax(-1)
    return {"kld_vs_f32": float(kld.mean()), "kld_vs_f32_p99": float(np.percentile(kld, 99)),
            "top1_vs_f32": float(top1.mean())}


def speed(model: str, threads: int, depth: int, n_gen: int, reps: int) -> list[dict]:
    """Prefill of `depth` random ordinary tokens, then n_gen decode steps at that depth, per
    cache type; the types alternated in each of `reps` rounds."""
    from pyklei.llm import LLM
    rows = []
    for rep in range(reps):
        for kind in KINDS:                        # alternated: a busy machine hits both alike
            with LLM(model, n_threads=threads, n_ctx=depth + n_gen + 8, kv_cache=kind) as llm:
                rng = np.random.default_rng(rep)
                normal = np.nonzero(np.asarray(llm.tokenizer.token_types) == 1)[0]
                ids = [int(t) for t in rng.choice(normal, depth)]
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                logits = llm.model.eval(ids)
                t1 = time.perf_counter()
                kv_bytes = llm.model.kv_bytes_per_token
                for _ in range(n_gen):
                    logits = llm.model.step(int(np.argmax(logits)))
                t2 = time.perf_counter()
            rows.append({"kv_cache": kind, "rep": rep, "load": load, "kv_bytes": kv_bytes,
                         f"pp{depth}": depth / (t1 - t0), f"tg{n_gen} @ {depth}": n_gen / (t2 - t1)})
            print(rows[-1], file=sys.stderr)
    return rows


def main(argv=None) -> int:
    from pyklei_dev.assets import cache_dir
    from pyklei_dev.gguf_to_hf import smollm2_hf
    from pyklei.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="pyklei .gguf (default: SmolLM2 converted)")
    ap.add_argument("--hf", type=Path, default=None,
                    help="the checkpoint it came from (default: SmolLM2's)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2048, help="speed: prompt tokens before decoding")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="speed rounds (0: quality only)")
    ap.add_argument("--out", default="kv-cache",
                    help="results name in benchmarks/results (.md and .json)")
    ap.add_argument("--keep-quality", action="store_true",
                    help="speed only: keep the quality rows of the last results file (same model)")
    args = ap.parse_args(argv)
    model = args.model or str(cache_dir() / "smollm2-135m-instruct-q4.gguf")
    hf = args.hf or smollm2_hf()
    t0 = time.time()
    load0 = os.getloadavg()

    quality = []
    last = RESULTS / f"{args.out}.json"
    if args.keep_quality:
        old = json.loads(last.read_text())
        if old["model"] != Path(model).name:
            ap.error(f"--keep-quality: {last} measured {old['model']}, not {Path(model).name}")
        quality = old["quality"]
        args.tokens = quality[0]["tokens"]
    for tname, text in ([] if args.keep_quality else texts().items()):
        with LLM(model, n_threads=args.threads, n_ctx=args.tokens, kv_cache="f32") as llm:
            ids = llm.tokenizer.encode(text, parse_special=False)[:args.tokens]
            base = llm.logits(ids)
        ref = reference(hf, ids)
        kld_f32 = kld_positions(ref, base)
        for kind in KINDS:
            if kind == "f32":
                logits = base
            else:
                with LLM(model, n_threads=args.threads, n_ctx=args.tokens, kv_cache=kind) as llm:
                    logits = llm.logits(ids)
            quality.append({"text": tname, "tokens": len(ids), "kv_cache": kind,
                            **score(ref, logits, ids), **vs_f32(base, logits),
                            **paired_change(kld_positions(ref, logits), kld_f32)})
            print(quality[-1], file=sys.stderr)
    rates = speed(model, args.threads, args.depth, args.n_gen, args.reps)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": Path(model).name,
           "threads": args.threads, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "wall_s": time.time() - t0, "quality": quality, "speed": rates, "tokens": args.tokens,
           "depth": args.depth, "n_gen": args.n_gen,
           "command": "python benchmarks/kv_cache.py " + " ".join(argv or sys.argv[1:])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=1))
    (RESULTS / f"{args.out}.md").write_text(report(res))
    print(report(res))
    return 0


def report(res: dict) -> str:
    lines = ["# KV cache precision: quality and speed", "",
             f"Command: `{res.get('command') or ('python benchmarks/kv_cache.py --threads ' + str(res['threads']) + ' --depth ' + str(res['depth']) + ' --tokens ' + str(res['tokens']))}`; "
             f"{res['date']}; model {res['model']}; "
             f"load average {res['loadavg_start'][0]:.2f} at the start, "
             f"{res['loadavg_end'][0]:.2f} at the end (2 shared CPUs); {res['wall_s']:.0f} s.", "",
             "Quality: every position's logits against transformers fp32 (KLD = KL(fp32 || "
             "pyklei)) and against the f32 cache on the same file.", "",
             "| text | tokens | kv_cache | KLD vs fp32 | its change from the f32 cache's (95% "
             "interval) | top-1 vs fp32 | PPL | KLD vs f32 cache (mean / p99) | top-1 vs f32 "
             "cache |",
             "|---|---|---|---|---|---|---|---|---|"]
    for q in res["quality"]:
        change = ""
        if "kld_change" in q and q["kv_cache"] != "f32":   # runs from before it have none
            change = (f"{100 * q['kld_change']:+.2f}% ({100 * q['kld_change_lo']:+.2f}% to "
                      f"{100 * q['kld_change_hi']:+.2f}%)")
        lines.append(f"| {q['text']} | {q['tokens']} | {q['kv_cache']} | {q['kld']:.5f} | "
                     f"{change} | {q['top1']:.4f} | {q['ppl']:.3f} | {q['kld_vs_f32']:.2e} / "
                     f"{q['kld_vs_f32_p99']:.2e} | {q['top1_vs_f32']:.4f} |")
    lines += ["", "The change's interval comes from resampling blocks of 128 positions' paired "
              "differences (quality.paired_change): a small change to the cache moves each "
              "position's KLD a little either way."]
    if not res["speed"]:
        return "\n".join(lines) + "\n"
    tests = sorted({k for r in res["speed"] for k in r if k not in ("kv_cache", "rep", "load", "kv_bytes")})
    lines += ["", f"Speed (tokens/s, {res['threads']} threads; rounds alternated; median of "
              f"{max(r['rep'] for r in res['speed']) + 1}):", "",
              "| kv_cache | KV bytes/token | " + " | ".join(tests) + " | load during |",
              "|---|---|" + "---|" * len(tests) + "---|"]
    med = {}
    for kind in KINDS:
        rs = [r for r in res["speed"] if r["kv_cache"] == kind]
        med[kind] = {t: float(np.median([r[t] for r in rs if r.get(t)])) for t in tests}
        lines.append(f"| {kind} | {rs[0]['kv_bytes']} | " + " | ".join(f"{med[kind][t]:.1f}" for t in tests)
                     + f" | {min(r['load'] for r in rs):.1f}-{max(r['load'] for r in rs):.1f} |")
    for kind in KINDS[1:]:
        rs = [r for r in res["speed"] if r["kv_cache"] == kind]
        base = [r for r in res["speed"] if r["kv_cache"] == "f32"][0]["kv_bytes"]
        lines.append(f"| {kind} / f32 | {rs[0]['kv_bytes'] / base:.2f}x | "
                     + " | ".join(f"{med[kind][t] / med['f32'][t]:.2f}x" for t in tests) + " | |")
    if "q8" in med and "f16" in med:   # the default's question: the smaller cache against f16
        rs = {k: [r for r in res["speed"] if r["kv_cache"] == k][0]["kv_bytes"] for k in ("q8", "f16")}
        lines.append(f"| q8 / f16 | {rs['q8'] / rs['f16']:.2f}x | "
                     + " | ".join(f"{med['q8'][t] / med['f16'][t]:.2f}x" for t in tests) + " | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
