#!/usr/bin/env python
"""Attention in bf16 against f32 (issue 45): quality at depth and speed, PYKLEI_ATTENTION=f32 or
bf16 on the same file (the bf16 kernels need AVX-512 BF16; elsewhere the script stops).

    python benchmarks/attention_bf16.py --bed smollm2=A.gguf:HF_DIR --bed offgrid=B.gguf:HF_DIR \
        [--at 0,4096] [--window 1024] [--caches f16,q8] [--threads 2] [--reps 3] [--depths 512,4096] \
        [--texts langref]

Quality at depth: one run over each of benchmarks/quality.py's texts, long enough for every
window (--window positions from each depth in --at: positions 0-1023 and 4096-5119 by default,
5121 tokens; causal attention makes the window at depth 0 a short run's own positions), with
each attention and KV cache, against transformers fp32 on the checkpoint the file came from
(its logits at the windows cached on disk): per window, KLD (mean, p99), top-1 agreement and
perplexity, and bf16's change of the KLD relative to f32's with a 95% interval
(benchmarks/quality.py's paired_change: positions resampled in blocks). A bed without its
checkpoint (NAME=MODEL.gguf): bf16's drift from f32 over --tokens positions.
The op alone (--kernel-reps): pk_attend_rows over 4096 positions, 8 rows and 1, medians.
Speed: a prefill of `depth` random ordinary tokens, then n_gen decode steps at that depth, f16
cache, the two attentions alternated in each of `reps` rounds (medians), the attention's share
of the prefill from the runtime's op profile, the 1-minute load average beside each.

Results: benchmarks/results/attention-bf16.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from quality import kld_positions, log_softmax, paired_change, texts  # noqa: E402

RESULTS = ROOT / "results"
MODES = ("f32", "bf16")
CACHES = ("f16", "q8")


def load(model: str, mode: str, **kw):
    """The model with attention in `mode` (PYKLEI_ATTENTION is read when a model is made)."""
    from pyklei.llm import LLM
    os.environ["PYKLEI_ATTENTION"] = mode
    return LLM(model, **kw)


def window_rows(at: list[int], window: int) -> np.ndarray:
    """The scored positions: `window` positions from each depth in `at` (ascending, no repeats).
    Causal attention makes the window at depth 0 of a long run the short run's own positions."""
    return np.unique(np.concatenate([np.arange(d, d + window) for d in at]))


def reference_rows(hf: Path, ids: list[int], rows: np.ndarray) -> np.ndarray:
    """transformers fp32's logits [len(rows), n_vocab] at `rows` of one pass over ids (the
    lm_head only where scored: a 262k vocabulary over 5k positions would be 5 GB), cached on
    disk by checkpoint, tokens and rows (a reference at depth takes minutes on a loaded VM)."""
    import hashlib

    import torch

    from pyklei_dev.assets import cache_dir
    from quality import reference_model
    key = hashlib.sha256(np.asarray(ids, np.int64).tobytes() + rows.astype(np.int64).tobytes()).hexdigest()[:16]
    path = cache_dir() / "quality" / "ref-logits" / f"{hf.stem}-{len(ids)}-{key}.npy"
    if path.is_file():
        return np.load(path)
    model = reference_model(hf)
    with torch.no_grad():
        out = model(torch.tensor([ids]), logits_to_keep=torch.from_numpy(rows)).logits[0].numpy()
    del model
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.npy")
    np.save(tmp, out)
    tmp.rename(path)
    return out


def pyklei_rows(llm, ids: list[int], rows: np.ndarray) -> np.ndarray:
    """pyklei's logits [len(rows), n_vocab] at `rows` of one prefill over ids (Model.batch with
    logit_rows: the same forward pass as logits(), the lm_head only where scored)."""
    n = len(ids)
    return llm.model.batch(ids, np.zeros(n, np.int32), np.arange(n, dtype=np.int32), rows)


def score_rows(ref: np.ndarray, logits: np.ndarray, ids: list[int], rows: np.ndarray) -> dict:
    """Per scored position: KL(ref || logits), top-1 agreement and the next token's negative
    log-likelihood (arrays), in slices so float64 copies of a large vocabulary stay small."""
    kld, top1, nll = [], [], []
    for a in range(0, len(rows), 128):
        lr, lp = log_softmax(ref[a:a + 128]), log_softmax(logits[a:a + 128])
        kld.append((np.exp(lr) * (lr - lp)).sum(-1))
        top1.append(lr.argmax(-1) == lp.argmax(-1))
        nll.append(-lp[np.arange(len(lp)), np.asarray(ids)[rows[a:a + 128] + 1]])
    return {"kld": np.concatenate(kld), "top1": np.concatenate(top1), "nll": np.concatenate(nll)}


def quality(bed: str, model: str, hf: Path, at: list[int], window: int, threads: int, names: list[str],
            caches: list[str]) -> list[dict]:
    """KLD against transformers fp32 in each window (`window` positions from each depth in
    `at`) of one long run per text, f32 and bf16 attention on the same file, per KV cache;
    bf16's change of the KLD relative to f32's with a 95% interval (blocks of positions)."""
    rows_out = []
    rows = window_rows(at, window)
    n_tok = int(rows[-1]) + 2             # the last scored position's next token is scored too
    block = max(8, min(128, window // 8))
    for tname, text in texts().items():
        if names and tname not in names:
            continue
        with load(model, "f32", n_threads=threads, n_ctx=n_tok) as llm:
            ids = llm.tokenizer.encode(text, parse_special=False)[:n_tok]
        if len(ids) < n_tok:
            print(f"{bed} {tname}: {len(ids)} tokens, fewer than the {n_tok} the windows need: "
                  f"left out", file=sys.stderr)
            continue
        t0 = time.time()
        ref = reference_rows(hf, ids, rows)
        print(f"{bed} {tname}: reference of {n_tok} tokens in {time.time() - t0:.0f} s", file=sys.stderr)
        per_cache = {}
        for kv in caches:
            per = per_cache[kv] = {}
            for mode in MODES:
                with load(model, mode, n_threads=threads, n_ctx=n_tok, kv_cache=kv) as llm:
                    per[mode] = score_rows(ref, pyklei_rows(llm, ids, rows), ids, rows)
            for d in at:
                sel = (rows >= d) & (rows < d + window)
                for mode in MODES:
                    k = per[mode]["kld"][sel]
                    rows_out.append({"bed": bed, "text": tname, "depth": d, "positions": int(sel.sum()),
                                     "kv_cache": kv, "attention": mode, "kld": float(k.mean()),
                                     "kld_p99": float(np.percentile(k, 99)), "top1": float(per[mode]["top1"][sel].mean()),
                                     "ppl": float(np.exp(per[mode]["nll"][sel].mean()))})
                    if mode == "bf16":
                        rows_out[-1].update(paired_change(k, per["f32"]["kld"][sel], block=block))
                    print(rows_out[-1], file=sys.stderr)
        # each later cache against the first with the same attention, on the same positions: a
        # paired interval, far narrower than the two caches' separate changes against f32
        for kv in caches[1:]:
            for d in at:
                sel = (rows >= d) & (rows < d + window)
                for mode in MODES:
                    row = next(r for r in rows_out if (r["bed"], r["text"], r["depth"], r["kv_cache"],
                                                       r["attention"]) == (bed, tname, d, kv, mode))
                    ch = paired_change(per_cache[kv][mode]["kld"][sel], per_cache[caches[0]][mode]["kld"][sel],
                                       block=block)
                    row.update({"cache_base": caches[0], **{"cache_" + k: v for k, v in ch.items()}})
    return rows_out


def drift(bed: str, model: str, tokens: int, threads: int, names: list[str]) -> list[dict]:
    """Without a reference checkpoint at hand: how far bf16 moves the logits from f32's, per
    cache (KL(f32 attention || bf16) per position, mean and p99; top-1 agreement)."""
    rows = []
    for tname, text in texts().items():
        if names and tname not in names:
            continue
        for kv in CACHES:
            out = {}
            for mode in MODES:
                with load(model, mode, n_threads=threads, n_ctx=tokens, kv_cache=kv) as llm:
                    ids = llm.tokenizer.encode(text, parse_special=False)[:tokens]
                    out[mode] = llm.logits(ids)
            d = kld_positions(out["f32"], out["bf16"])
            rows.append({"bed": bed, "text": tname, "tokens": len(ids), "kv_cache": kv,
                         "kld_bf16_vs_f32": float(d.mean()), "kld_bf16_vs_f32_p99": float(np.percentile(d, 99)),
                         "top1_bf16_vs_f32": float((out["f32"][:-1].argmax(-1) == out["bf16"][:-1].argmax(-1)).mean())})
            print(rows[-1], file=sys.stderr)
    return rows


def speed(model: str, threads: int, depths: list[int], n_gen: int, reps: int) -> list[dict]:
    rows = []
    for rep in range(reps):
        for depth in depths:
            for mode in MODES:   # alternated: a busy machine hits both alike
                with load(model, mode, n_threads=threads, n_ctx=depth + n_gen + 8, kv_cache="f16") as llm:
                    rng = np.random.default_rng(rep)
                    normal = np.nonzero(np.asarray(llm.tokenizer.token_types) == 1)[0]
                    ids = [int(t) for t in rng.choice(normal, depth)]
                    rt = llm.model.runtime
                    la = os.getloadavg()[0]
                    rt.profile_ops(True)
                    t0 = time.perf_counter()
                    logits = llm.model.eval(ids)
                    t1 = time.perf_counter()
                    ops, _ = rt.op_profile()
                    rt.profile_ops(False)
                    for _ in range(n_gen):
                        logits = llm.model.step(int(np.argmax(logits)))
                    t2 = time.perf_counter()
                attn = ops.get("attention", 0.0)
                rows.append({"attention": mode, "depth": depth, "rep": rep, "load": la,
                             "prefill_tok_s": depth / (t1 - t0), "decode_tok_s": n_gen / (t2 - t1),
                             "prefill_attention_s": attn, "prefill_s": t1 - t0, "ops": ops})
                print({k: v for k, v in rows[-1].items() if k != "ops"}, file=sys.stderr)
    return rows


def kernel_speed(reps: int, n: int = 4096) -> list[dict]:
    """The attention op alone (pyklei._ext.attend_group: pk_attend_rows over a cache of n
    positions): a prefill window's 8 rows and a decode row, f32 and bf16 alternated."""
    from pyklei import _ext
    rng = np.random.default_rng(0)
    rows_out = []
    for g, hd in ((3, 64), (4, 128)):          # SmolLM2 135M; Llama 3.1 8B
        for cache in CACHES:
            k, v = (rng.standard_normal((n, hd)).astype(np.float32) for _ in range(2))
            k, v = (_ext.kv_q8_rows(k), _ext.kv_q8_rows(v)) if cache == "q8" else (k.astype(np.float16), v.astype(np.float16))
            for rows in (8, 1):
                q = rng.standard_normal((rows, g, hd)).astype(np.float32)
                n_pos = np.arange(n - rows + 1, n + 1)
                t = {m: [] for m in MODES}
                for _ in range(reps):
                    for mode in MODES:
                        t0 = time.perf_counter()
                        _ext.attend_group(q, k, v, n_pos=n_pos, bf16=mode == "bf16")
                        t[mode].append(time.perf_counter() - t0)
                rows_out.append({"group": g, "hd": hd, "kv_cache": cache, "rows": rows, "positions": n,
                                 "load": os.getloadavg()[0], **{f"{m}_ms": 1e3 * statistics.median(t[m]) for m in MODES}})
                print(rows_out[-1], file=sys.stderr)
    return rows_out


BOUND = 0.01   # issue 45: bf16 attention may raise the KLD against fp32 by this much at most


def quality_table(q: list[dict]) -> str:
    """The quality rows as one markdown table, a line per (bed, text, window, KV cache): f32's
    and bf16's figures side by side. docs/QUALITY.md repeats it between DOC_BLOCK's markers
    (tests/docs/test_doc_figures.py checks it against the results files)."""
    lines = ["| bed | text | positions | KV cache | KLD f32 | KLD bf16 | bf16 change (95% interval) | "
             f"within +{100 * BOUND:.0f}% | KLD p99 f32 / bf16 | top-1 f32 / bf16 | perplexity f32 / bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in q:
        if r["attention"] != "bf16":
            continue
        f = next(x for x in q if all(x[k] == r[k] for k in ("bed", "text", "depth", "positions", "kv_cache"))
                 and x["attention"] == "f32")
        lines.append(f"| {r['bed']} | {r['text']} | {r['depth']}-{r['depth'] + r['positions'] - 1} | {r['kv_cache']} | "
                     f"{f['kld']:.4f} | {r['kld']:.4f} | {100 * r['kld_change']:+.1f}% ({100 * r['kld_change_lo']:+.1f}% "
                     f".. {100 * r['kld_change_hi']:+.1f}%) | {'yes' if r['kld_change'] <= BOUND else '**no**'} | "
                     f"{f['kld_p99']:.3f} / {r['kld_p99']:.3f} | {100 * f['top1']:.1f}% / {100 * r['top1']:.1f}% | "
                     f"{f['ppl']:.3f} / {r['ppl']:.3f} |")
    return "\n".join(lines)


DOC_BLOCK = re.compile(r"(<!-- attention-bf16-kld:begin -->\n)(.*?)(<!-- attention-bf16-kld:end -->)", re.S)


def report(res: dict) -> str:
    lines = ["# Attention in bf16 against f32", "",
             f"Command: `{res['command']}`; {res['date']}; {res['cpu']}; {res['threads']} threads; load "
             f"average {res['loadavg_start'][0]:.2f} at the start, {res['loadavg_end'][0]:.2f} at the end "
             f"(2 shared CPUs); {res['wall_s']:.0f} s.", ""]
    if res["quality"]:
        lines += [f"## Quality: KLD against transformers fp32, {res['window']} positions from each depth", "",
                  quality_table(res["quality"]), ""]
        paired = [r for r in res["quality"] if "cache_kld_change" in r]
        if paired:
            lines += ["## Each KV cache against the first, the same attention, the same positions", "",
                      "| bed | text | positions | attention | KLD, base cache | KLD, this cache | change (95% interval) |",
                      "|---|---|---|---|---|---|---|"]
            for r in paired:
                b = next(x for x in res["quality"] if x["kv_cache"] == r["cache_base"] and all(
                    x[k] == r[k] for k in ("bed", "text", "depth", "positions", "attention")))
                lines.append(f"| {r['bed']} | {r['text']} | {r['depth']}-{r['depth'] + r['positions'] - 1} | "
                             f"{r['attention']} | {b['kv_cache']} {b['kld']:.4f} | {r['kv_cache']} {r['kld']:.4f} | "
                             f"{100 * r['cache_kld_change']:+.1f}% ({100 * r['cache_kld_change_lo']:+.1f}% .. "
                             f"{100 * r['cache_kld_change_hi']:+.1f}%) |")
            lines.append("")
    if res.get("drift"):
        lines += ["## bf16 against f32 attention (no reference checkpoint): KL(f32 || bf16) per position", "",
                  "| bed | text | tokens | KV cache | mean | p99 | top-1 agreement |", "|---|---|---|---|---|---|---|"]
        for r in res["drift"]:
            lines.append(f"| {r['bed']} | {r['text']} | {r['tokens']} | {r['kv_cache']} | {r['kld_bf16_vs_f32']:.5f} | "
                         f"{r['kld_bf16_vs_f32_p99']:.5f} | {r['top1_bf16_vs_f32']:.4f} |")
        lines.append("")
    if res.get("kernels"):
        lines += ["## The attention op alone (one thread, one K/V head's cache, medians)", "",
                  "| group, head size | KV cache | rows | positions | f32 ms | bf16 ms | f32 / bf16 | load |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in res["kernels"]:
            lines.append(f"| {r['group']}, {r['hd']} | {r['kv_cache']} | {r['rows']} | {r['positions']} | "
                         f"{r['f32_ms']:.3f} | {r['bf16_ms']:.3f} | {r['f32_ms'] / r['bf16_ms']:.2f}x | {r['load']:.1f} |")
        lines.append("")
    if res["speed"]:
        lines += ["## Speed: f16 cache, medians of the alternated rounds", "",
                  "| depth | attention | prefill tok/s | decode tok/s | attention share of the prefill | bf16 / f32 prefill | bf16 / f32 decode | loads |",
                  "|---|---|---|---|---|---|---|---|"]
        s = res["speed"]
        for depth in sorted({r["depth"] for r in s}):
            med = {}
            for mode in MODES:
                rr = [r for r in s if r["depth"] == depth and r["attention"] == mode]
                med[mode] = (statistics.median(r["prefill_tok_s"] for r in rr),
                             statistics.median(r["decode_tok_s"] for r in rr),
                             statistics.median(r["prefill_attention_s"] / r["prefill_s"] for r in rr),
                             [round(r["load"], 1) for r in rr])
            for mode in MODES:
                p, d, share, loads = med[mode]
                ratio = (f"{p / med['f32'][0]:.2f}x | {d / med['f32'][1]:.2f}x" if mode == "bf16" else "| ")
                lines.append(f"| {depth} | {mode} | {p:.0f} | {d:.1f} | {100 * share:.0f}% | {ratio} | {loads} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    from pyklei import _ext
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bed", action="append", default=[], metavar="NAME=MODEL.gguf:HF_DIR",
                    help="a test bed: a pyklei file and the checkpoint it came from (repeatable; no "
                         "checkpoint, NAME=MODEL.gguf: only bf16's drift from f32)")
    ap.add_argument("--tokens", type=int, default=4096, help="drift (a bed without its checkpoint): positions")
    ap.add_argument("--at", default="0,4096", help="quality: comma list of depths, a window scored from each")
    ap.add_argument("--window", type=int, default=1024, help="quality: positions scored from each depth")
    ap.add_argument("--caches", default=",".join(CACHES), help="quality: comma list of KV caches (f16, q8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="512,4096", help="speed: comma list of prompt lengths")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="speed rounds (0: quality only)")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--texts", default="", help="comma list of benchmarks/quality.py's texts (default: all)")
    ap.add_argument("--kernel-reps", type=int, default=0, help="rounds of the attention op alone (0: none)")
    ap.add_argument("--out", default="attention-bf16")
    args = ap.parse_args(argv)
    if not _ext.attention_bf16_runs():
        ap.error("this CPU has no AVX-512 BF16: bf16 attention would run the plain C reference")
    beds = {}
    for b in args.bed:
        name, _, rest = b.partition("=")
        model, _, hf = rest.rpartition(":") if ":" in rest else (rest, "", "")
        beds[name] = (model, Path(hf))
    if not beds and not args.kernel_reps:
        ap.error("give at least one --bed")
    t0, load0 = time.time(), os.getloadavg()
    names = [t for t in args.texts.split(",") if t]
    at, caches = [int(d) for d in args.at.split(",")], args.caches.split(",")
    q = [] if args.no_quality else [r for name, (m, hf) in beds.items() if str(hf) not in ("", ".")
                                    for r in quality(name, m, hf, at, args.window, args.threads, names, caches)]
    dr = [] if args.no_quality else [r for name, (m, hf) in beds.items() if str(hf) in ("", ".")
                                     for r in drift(name, m, args.tokens, args.threads, names)]
    kern = kernel_speed(args.kernel_reps) if args.kernel_reps else []
    s = speed(next(iter(beds.values()))[0], args.threads, [int(d) for d in args.depths.split(",")], args.n_gen,
              args.reps) if args.reps and beds else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "threads": args.threads, "window": args.window,
           "beds": {k: [v[0], str(v[1])] for k, v in beds.items()}, "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "wall_s": time.time() - t0, "quality": q, "drift": dr, "speed": s, "kernels": kern,
           "command": "python benchmarks/attention_bf16.py " + " ".join(argv or sys.argv[1:])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=1))
    (RESULTS / f"{args.out}.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
