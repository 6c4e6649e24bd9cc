"""Quality of pyklei files against transformers fp32 on the original weights (issue 15, item 1).

    python benchmarks/quality.py                       # both test beds, both texts
    python benchmarks/quality.py --beds smollm2 --variants default
    python benchmarks/quality.py --beds gemma3 --variants rtn,gptq,default --llamacpp Q4_0 \
        --tokens 1100 --out quality-gemma3           # Gemma 3 270M's llama.cpp file (issue 42)

For each test bed (SmolLM2-135M-Instruct as shipped; its off-grid twin, tests/fixtures/models.py) and
each text never used for calibration (Python's Language Reference topics of
pyklei.imatrix.EVAL_TOPICS; the GPL-3 licence text), the first --tokens tokens run through
transformers in float32 (the reference) and through pyklei on each converted variant, in one
context. Per variant: KL divergence KL(ref || pyklei) of the next-token distribution (mean
over positions), top-1 agreement, perplexity, and the file size beside them.

The gemma3 test bed is a llama.cpp file (Gemma 3 270M's Q4_K_M, GEMMA3_270M): the reference
is that file in transformers float32 (dequantized), pyklei converts the file, and the llama.cpp
rows are its requantizations (llama-quantize --allow-requantize; without llama-quantize built,
the same float weights through ggml's own quantizers at the types llama-quantize picks:
llamacpp_quality.requant_rows). A variant that cannot convert the bed (a family the rotation
does not cover yet) is left out with its reason.

llama.cpp's own files of the same weights (Q4_0, IQ4_NL, Q4_K_M, Q5_0, Q6_K, Q8_0, and
Q4_0 / IQ4_NL / Q4_K_M with llama-imatrix on pyklei's calibration text) are scored beside them
on their dequantized weights: benchmarks/llamacpp_quality.py (--llamacpp; skipped, with a
note, when llama.cpp's tools are not found).

Results: benchmarks/results/quality.md, quality.json and quality.png (KLD against file size,
benchmarks/quality_chart.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))          # tests/fixtures/models.py: the test beds
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)
RESULTS = ROOT / "benchmarks" / "results"
GPL3 = Path("/usr/share/common-licenses/GPL-3")
# A test bed that is a llama.cpp file (issue 42): Gemma 3 270M's Q4_K_M, its reference the same
# file in transformers (dequantized), its llama.cpp rows requantizations of it.
GEMMA3_270M = Path.home() / ".cache/pyklei/gemma3-270m/gemma-3-270m-q4_k_m.gguf"

VARIANTS = {      # name -> how to convert (and "same": score another variant's file; "activations")
    "default": {"rotate": True, "gptq": True},    # `pyklei convert`'s default, run as loaded
                                                  # (one activation plane: rotated, "auto")
    "default-qai8dx2": {"same": "default", "activations": "qai8dx2"},   # two activation planes
    "default-qai8dx": {"same": "default", "activations": "qai8dx"},     # one, whatever the file
    "default-qsi8d32": {"same": "default", "activations": "qsi8d32"},   # one, a scale per block of 32
    "emb8": {"rotate": True, "gptq": True, "embedding_bits": 8},   # the default, 8-bit embedding
    "b4.9": {"rotate": True, "gptq": True, "bits": 4.9},      # the ladder, < llama.cpp Q4_0's size
    "q4m": {"rotate": True, "gptq": True, "recipe": "q4m"},
    "b6.0": {"rotate": True, "gptq": True, "bits": 6.0},      # the ladder, < llama.cpp Q4_K_M's size
    "rtn": {},                                    # --no-calibrate: plain rounding (the old default)
    "calibrated": {"calibrate": True},            # --calibrate: the importance matrix
    "g64": {"group_size": 64},
    "gptq": {"gptq": True, "rotate": False},      # --no-rotate
    "gptq-qai8dx2": {"same": "gptq", "activations": "qai8dx2"},   # the unrotated file's schemes
    "gptq-qai8dx": {"same": "gptq", "activations": "qai8dx"},
    "gptq-qsi8d32": {"same": "gptq", "activations": "qsi8d32"},
    "rotate": {"rotate": True},                   # --no-calibrate --rotate
}
# The ladder's sensitivity study (--variants sensitivity --out sensitivity): the default with one
# kind of block linear at qsi6c32 in every layer; pyklei/converters/recipes.py's
# PROMOTION_ORDER ranks
# the kinds by the KLD this buys per byte.
SENSITIVITY = {f"6bit-{part}": {"rotate": True, "gptq": True, "keep": [f"blk.*.{part}.weight=q6"]}
               for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
VARIANTS.update(SENSITIVITY)
MAIN_VARIANTS = [v for v in VARIANTS if v not in SENSITIVITY]


def texts() -> dict[str, str]:
    from pyklei.calibration import evaluation_text
    out = {"langref": evaluation_text()}
    if GPL3.is_file():
        out["gpl3"] = GPL3.read_text()
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kld_positions(ref: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(ref || logits) of the next-token distribution at every position but the last."""
    a, b = log_softmax(ref[:-1]), log_softmax(logits[:-1])
    return (np.exp(a) * (a - b)).sum(-1)


def score(ref_logits: np.ndarray, logits: np.ndarray, ids: list[int]) -> dict:
    kld = kld_positions(ref_logits, logits)
    lp_ref, lp = log_softmax(ref_logits[:-1]), log_softmax(logits[:-1])
    nxt = np.asarray(ids[1:])
    return {"kld": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)),
            "top1": float((lp_ref.argmax(-1) == lp.argmax(-1)).mean()),
            "ppl": float(np.exp(-lp[np.arange(len(nxt)), nxt].mean()))}


def paired_change(kld: np.ndarray, kld_base: np.ndarray, block: int = 128, n: int = 2000,
                  seed: int = 0) -> dict:
    """What a change (a KV cache type, an attention, an activation scheme) does to the KLD
    against fp32, relative to the base's KLD on the same positions, with a 95% interval: the
    positions' paired differences resampled in blocks of `block` positions (neighbouring
    positions share their context, so they are not independent draws). Small changes move the
    logits far more than their size (an f16 cache against f32: a KLD of ~3e-3, likely through
    the int8 rounding of later activations), a little either way at each position; the
    interval says what that noise allows."""
    d = kld - kld_base
    nb = len(d) // block
    blocks = d[:nb * block].reshape(nb, block).mean(1)
    rng = np.random.default_rng(seed)
    means = blocks[rng.integers(0, nb, size=(n, nb))].mean(1)
    base = float(kld_base.mean())
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"kld_change": float(d.mean()) / base, "kld_change_lo": float(lo) / base,
            "kld_change_hi": float(hi) / base}


def reference_model(src: Path):
    """transformers float32 of a checkpoint directory, or of a GGUF file (dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM
    if src.is_file():
        return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def reference(hf_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    model = reference_model(hf_dir)
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].numpy()
    del model
    return out


def convert_variant(hf_dir: Path, out: Path, spec: dict) -> float:
    from pyklei.converters import convert
    from pyklei.calibration import convert_calibrated
    t0 = time.perf_counter()
    if not out.exists():
        kw = {k: v for k, v in spec.items() if k not in ("calibrate", "gptq", "activations")}
        if spec.get("gptq"):
            from pyklei.calibration import convert_gptq
            convert_gptq(hf_dir, out, progress=False, **kw)
        elif spec.get("calibrate"):
            convert_calibrated(hf_dir, out, progress=False, log=lambda m: None, **kw)
        else:
            convert(hf_dir, out, **kw)
    return time.perf_counter() - t0


def sensitivity_ranking(rows: list[dict]) -> list[str]:
    """The study's ranking: per 6bit-<kind> variant, its KLD over the default's in each (bed,
    text), their geometric mean, and its log per MB added (most negative: most KLD bought per
    byte). Empty without the study's rows."""
    kld = {(r["bed"], r["text"], r["variant"]): (r["kld"], r["bytes"]) for r in rows}
    cells = sorted({(b, t) for b, t, v in kld if v == "pyklei default"})
    out = []
    for v in SENSITIVITY:
        if not cells or not all((b, t, f"pyklei {v}") in kld for b, t in cells):
            continue
        ratios = [kld[(b, t, f"pyklei {v}")][0] / kld[(b, t, "pyklei default")][0] for b, t in cells]
        b, t = cells[0]
        mb = (kld[(b, t, f"pyklei {v}")][1] - kld[(b, t, "pyklei default")][1]) / 1e6
        geo = float(np.exp(np.mean(np.log(ratios))))
        out.append((np.log(geo) / mb, v, mb, ratios, geo))
    if not out:
        return []
    lines = ["", "Sensitivity (KLD of the variant / the default's, per test bed and text; "
             "geometric mean; its log per MB added):", "",
             "| variant | + MB | " + " | ".join(f"{b} {t}" for b, t in cells) + " | geo. mean | log / MB |",
             "|---|---|" + "---|" * len(cells) + "---|---|"]
    for per_mb, v, mb, ratios, geo in sorted(out):
        lines.append(f"| {v} | {mb:.2f} | " + " | ".join(f"{x:.3f}" for x in ratios)
                     + f" | {geo:.3f} | {per_mb:+.4f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--beds", default="smollm2,offgrid", help="smollm2, offgrid (comma list)")
    ap.add_argument("--variants", default=",".join(MAIN_VARIANTS),
                    help="comma list of " + ", ".join(MAIN_VARIANTS) + ", 6bit-<kind> or 'sensitivity' "
                    "(default with the study's 6bit-* variants; the default: all but those)")
    ap.add_argument("--out", default="quality", help="results name (default quality: "
                    "benchmarks/results/quality.{md,json,png})")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of each text (default 1024)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", type=Path, default=None, help="where converted files are cached")
    ap.add_argument("--paired", default=None, metavar="VARIANT",
                    help="also each variant's KLD change against this variant's on the same "
                    "positions, with a 95%% interval (paired_change)")
    ap.add_argument("--llamacpp", default="all", help="llama.cpp files to score: comma list of "
                    "benchmarks/llamacpp_quality.py's KINDS, 'all' or 'none'")
    args = ap.parse_args(argv)

    from models import smollm2_hf_dir, smollm2_offgrid_dir

    from pyklei_dev.assets import cache_dir
    from pyklei.converters import ConversionError
    from pyklei.llm import LLM
    from pyklei.text.tokenizer import Tokenizer

    beds = {"smollm2": smollm2_hf_dir, "offgrid": lambda: smollm2_offgrid_dir(0.5),
            "gemma3": lambda: GEMMA3_270M}
    variants = [x for v in args.variants.split(",")
                for x in (["default", *SENSITIVITY] if v == "sensitivity" else [v])]
    work = args.work or cache_dir() / "quality"
    work.mkdir(parents=True, exist_ok=True)
    import llamacpp_quality as lcpp
    kinds = [] if args.llamacpp == "none" else \
        list(lcpp.KINDS) if args.llamacpp == "all" else args.llamacpp.split(",")
    hf_kinds = kinds       # from a checkpoint: llama.cpp's converter, llama-imatrix, llama-quantize
    if kinds and lcpp.tools_missing() and not all(beds[b]().is_file() for b in args.beds.split(",")):
        print(f"llama.cpp's files of checkpoints not scored: {', '.join(lcpp.tools_missing())} "
              f"missing (LLAMACPP_SRC, LLAMACPP_BIN)", file=sys.stderr)
        hf_kinds = []
    if args.paired is not None and args.paired not in variants:
        ap.error(f"--paired {args.paired}: not one of the variants scored ({args.variants})")
    rows, paired = [], []
    for bed in args.beds.split(","):
        hf = beds[bed]()
        files = {}
        for v in variants:
            if "same" in VARIANTS[v]:
                files[v] = work / f"{bed}-{VARIANTS[v]['same']}.gguf"
                continue
            out = work / f"{bed}-{v}.gguf"
            try:
                secs = convert_variant(hf, out, VARIANTS[v])
            except ConversionError as e:     # e.g. rotation of a family it does not cover yet
                print(f"{bed} {v}: not converted: {e}", file=sys.stderr)
                continue
            files[v] = out
            print(f"{bed} {v}: {out.stat().st_size / 1e6:.1f} MB ({secs:.0f} s)", file=sys.stderr)
        tok = Tokenizer.from_gguf(next(iter(files.values())))
        refs = {}
        for tname, text in texts().items():
            ids = tok.encode(text, parse_special=False)[:args.tokens]
            ref = refs[tname] = reference(hf, ids)
            rows.append({"bed": bed, "text": tname, "variant": "transformers fp32", "bytes": None,
                         **score(ref, ref, ids)})
            per_position = {}
            for v, path in files.items():
                act = VARIANTS[v].get("activations", "auto")
                with LLM(path, n_threads=args.threads, n_ctx=len(ids), activations=act) as llm:
                    logits = llm.logits(ids)
                per_position[v] = kld_positions(ref, logits)
                rows.append({"bed": bed, "text": tname, "variant": f"pyklei {v}",
                             "bytes": path.stat().st_size, **score(ref, logits, ids)})
                print(rows[-1], file=sys.stderr)
            if args.paired in per_position:
                for v, kld in per_position.items():
                    if v != args.paired:
                        paired.append({"bed": bed, "text": tname, "variant": v, "positions": len(kld),
                                       **paired_change(kld, per_position[args.paired])})
        if kinds and hf.is_file():         # a llama.cpp file: its requantizations
            ids = {t: tok.encode(x, parse_special=False)[:args.tokens] for t, x in texts().items()}
            rows += lcpp.requant_rows(bed, hf, ids, refs, kinds, cache_dir() / "llamacpp" / bed)
        elif hf_kinds:
            ids = {t: tok.encode(x, parse_special=False)[:args.tokens] for t, x in texts().items()}
            rows += lcpp.llamacpp_rows(bed, hf, ids, hf_kinds, cache_dir() / "llamacpp" / bed,
                                       threads=args.threads or 2)
    groups = list(dict.fromkeys((r["bed"], r["text"]) for r in rows))
    rows.sort(key=lambda r: groups.index((r["bed"], r["text"])))  # stable: a text's rows together
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"tokens": args.tokens, "rows": rows,
                                                             "paired": paired}, indent=1))
    lines = [f"`python benchmarks/quality.py` ({args.tokens} tokens per text; KLD = KL(fp32 || "
             f"variant), mean over positions):", "",
             "| test bed | text | variant | file | KLD | KLD p99 | top-1 | perplexity |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['bytes'] / 1e6:.1f} MB" if r["bytes"] else "—"
        lines.append(f"| {r['bed']} | {r['text']} | {r['variant']} | {size} | {r['kld']:.4f} | "
                     f"{r['kld_p99']:.3f} | {100 * r['top1']:.1f}% | {r['ppl']:.3f} |")
    if paired:
        lines += ["", f"KLD change against `{args.paired}` on the same positions, 95% interval "
                  "(blocks of 128 positions resampled):", "",
                  "| test bed | text | variant | positions | KLD change | 95% interval |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {p['bed']} | {p['text']} | {p['variant']} | {p['positions']} | "
                  f"{100 * p['kld_change']:+.1f}% | {100 * p['kld_change_lo']:+.1f}% .. "
                  f"{100 * p['kld_change_hi']:+.1f}% |" for p in paired]
    lines += sensitivity_ranking(rows)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        from quality_chart import draw
        draw(rows, list(texts()), args.tokens, RESULTS / f"{args.out}.png")
    except ImportError as e:                 # matplotlib: the tables stand without the chart
        print(f"no chart: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
