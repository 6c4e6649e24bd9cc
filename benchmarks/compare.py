"""pyklei beside llama.cpp (llama-cpp-python) and transformers: speed, memory and quality.

    python benchmarks/compare.py                 # SmolLM2-135M, threads 1 and 2, 3 repeats
    python benchmarks/compare.py --with-1b       # also a random model with Llama 3.2 1B's shape

Every engine runs in its own process (a fresh interpreter per measurement, engines
alternated), so one's memory and threads never touch another's; figures are medians over
--repeats (each prefill and decode figure itself the median of 3 in the process). All engines get the
same token ids. Files are made from the same weights:
pyklei q4 by `pyklei convert` (with and without an importance matrix), llama.cpp Q4_0 / Q8_0 by
llama.cpp's own quantizer from an F16 GGUF of the checkpoint, transformers from the checkpoint.

Installs its own extras when missing: llama-cpp-python (built from source with the CPU's
features; AMX and AVX-VNNI off unless present: GCC 12 builds llama.cpp's AMX path so that it
dies with SIGILL), torch (the local CPU build), transformers, matplotlib. Built wheels and
model files are cached under ~/.cache/pyklei.
Results: benchmarks/results/compare.md, compare.json and compare.png (compare-1b.* with
--only-1b); docs/BENCHMARKS.md's tables are refreshed in place (--no-readme keeps them).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)
RESULTS = ROOT / "benchmarks" / "results"
LLAMA_CPP_VERSION = "0.3.36"


# ---- set-up ------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llama_cpp_cmake_args() -> str:
    f = cpu_flags()
    on = lambda flag: "ON" if flag in f else "OFF"  # noqa: E731
    args = {
        "GGML_NATIVE": "OFF", "GGML_AVX": on("avx"), "GGML_AVX2": on("avx2"), "GGML_FMA": on("fma"),
        "GGML_F16C": on("f16c"), "GGML_BMI2": on("bmi2"), "GGML_AVX_VNNI": on("avx_vnni"),
        "GGML_AVX512": on("avx512f"), "GGML_AVX512_VBMI": on("avx512vbmi"),
        "GGML_AVX512_VNNI": on("avx512_vnni"), "GGML_AVX512_BF16": on("avx512_bf16"),
        # GCC 12 drops the tile-config stores of llama.cpp's AMX path: SIGILL at the first tile load
        "GGML_AMX_INT8": "OFF", "GGML_AMX_TILE": "OFF",
    }
    return " ".join(f"-D{k}={v}" for k, v in args.items())


def pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True)


def ensure_extras():
    from pyklei_dev.assets import cache_dir
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        pip("torch==2.13.0", "transformers")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pip("matplotlib")
    try:
        import llama_cpp  # noqa: F401
        return
    except ImportError:
        pass
    cmake = llama_cpp_cmake_args()
    tag = hashlib.sha1(cmake.encode()).hexdigest()[:10]
    wheels = cache_dir() / "wheels" / f"llama-cpp-{tag}"
    found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if not found:
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION} (several minutes): {cmake}", file=sys.stderr)
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w",
                        str(wheels), f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                       check=True, env=dict(os.environ, CMAKE_ARGS=cmake))
        found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    pip("--no-deps", str(found[-1]))
    pip("diskcache", "jinja2", "typing-extensions")


def llamacpp_f16(pyklei_f16: Path, out: Path) -> Path:
    """A plain llama.cpp F16 GGUF (default alignment, no pyklei keys) from pyklei's f16 file:
    llama.cpp's quantizer writes broken files from inputs with general.alignment = 64."""
    import gguf
    if out.exists():
        return out
    r = gguf.GGUFReader(pyklei_f16)
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(tmp, "llama")
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "pyklei.")) or k in ("general.alignment", "general.architecture"):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], f.types[1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=[int(x) for x in reversed(t.shape.tolist())],
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def llamacpp_quantize(src: Path, out: Path, ftype_name: str) -> Path:
    import llama_cpp
    if out.exists():
        return out
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    p.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype_name}")
    tmp.replace(out)
    return out


def prepare_models(hf_dir: Path, work: Path, tag: str, group_sizes=(32,), imatrix=True) -> dict:
    """{label: (engine, path)} made from one HF checkpoint."""
    from pyklei.converters import convert
    work.mkdir(parents=True, exist_ok=True)
    models = {}

    def pyklei_convert(out, any_version=False, **kw):
        if not out.exists() or not (any_version or current(out)):
            convert(hf_dir, out, progress=False, force=True, **kw)
        return out

    def current(path):   # made by this converter version (older files load, but measure old choices)
        from pyklei.converters.core import CONVERTER_VERSION
        from pyklei.formats import gguf_keys as K
        from pyklei.formats.gguf_reader import read_gguf_metadata
        return read_gguf_metadata(path, prefixes=(K.KEY_CONVERTER_VERSION,)).get(K.KEY_CONVERTER_VERSION) == CONVERTER_VERSION

    from pyklei.converters import ConversionError
    for gs in group_sizes:
        try:
            models[f"pyklei q4 g{gs}"] = ("pyklei", pyklei_convert(work / f"{tag}-q4-g{gs}.gguf", group_size=gs))
        except ConversionError as e:          # e.g. SmolLM2's K = 576 has no blocks of 128
            print(f"skipping group size {gs}: {e}", file=sys.stderr)
    # calibrated: importance matrix measured on an 8-bit draft (what `pyklei convert --calibrate` does)
    cal = work / f"{tag}-q4-g32-imatrix.gguf"
    if imatrix and not (cal.exists() and current(cal)):
        from pyklei.calibration import collect_imatrix_from_text, default_calibration_text
        draft = pyklei_convert(work / f"{tag}-q8-draft.gguf", keep=["*=q8"])
        imat, _ = collect_imatrix_from_text(draft, default_calibration_text(), max_tokens=8192)
        pyklei_convert(cal, imatrix=imat)
    if imatrix:
        models["pyklei q4 g32 +imatrix"] = ("pyklei", cal)
    f16 = pyklei_convert(work / f"{tag}-f16-pyklei.gguf", any_version=True, keep=["*=f16"], embedding_bits=16)
    lc16 = llamacpp_f16(f16, work / f"{tag}-f16-llamacpp.gguf")
    models["llama.cpp Q4_0"] = ("llamacpp", llamacpp_quantize(lc16, work / f"{tag}-Q4_0.gguf", "Q4_0"))
    models["llama.cpp Q8_0"] = ("llamacpp", llamacpp_quantize(lc16, work / f"{tag}-Q8_0.gguf", "Q8_0"))
    models["transformers fp32"] = ("transformers", hf_dir)
    models["transformers bf16"] = ("transformers-bf16", hf_dir)
    return models


# ---- workers: one engine, one process -----------------------------------------------------

def peak_rss_mb() -> float:
    from pyklei.runtime.generate import peak_rss_mb as vm_hwm   # VmHWM: not inherited from the parent
    return vm_hwm()


class PykleiEngine:
    def __init__(self, path, threads, n_ctx):
        from pyklei.runtime.model import Model
        self.m = Model(path, n_threads=threads, n_ctx=n_ctx)

    def prefill(self, ids):
        self.m.reset()
        return self.m.eval(ids)

    def step(self, tok):
        return self.m.step(tok)

    def window_logits(self, ids):
        return self.m.logits(ids)


class LlamaCppEngine:
    def __init__(self, path, threads, n_ctx, logits_all=False):
        from llama_cpp import Llama
        self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, n_ubatch=512, logits_all=logits_all, verbose=False)

    def prefill(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return self.llm.scores[self.llm.n_tokens - 1]

    def step(self, tok):
        self.llm.eval([tok])
        return self.llm.scores[self.llm.n_tokens - 1]

    def window_logits(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[:len(ids)])


class TorchEngine:
    def __init__(self, path, threads, n_ctx, dtype="float32"):
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.past = None

    def prefill(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids]), use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def step(self, tok):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([[tok]]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def window_logits(self, ids):
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids])).logits[0].float().numpy()


ENGINES = {"pyklei": PykleiEngine, "llamacpp": LlamaCppEngine, "transformers": TorchEngine,
           "transformers-bf16": lambda path, threads, n_ctx: TorchEngine(path, threads, n_ctx, "bfloat16")}


def worker_speed(engine, path, threads, prompt_lengths, n_gen, ids):
    """`pyklei bench`'s loop (pyklei.bench.measure_speed) on any engine, the same token ids
    for all: each figure the median of 3 in-process (one hiccup of the VM is not a figure);
    decode after a 16-token prompt."""
    from pyklei.bench import measure_speed
    t0 = time.perf_counter()
    e = ENGINES[engine](path, threads, max(prompt_lengths) + n_gen + 8)
    load_s = time.perf_counter() - t0
    m = measure_speed(e.prefill, e.step, lambda n: ids[:n], prompt_lengths, n_gen, repeats=3,
                      decode_context=16)
    return {"load_s": load_s,
            "prefill_tps": {p["tokens"]: p["tok_s"] for p in m["prefill"]},
            "ttft_s": {p["tokens"]: p["ttft_s"] for p in m["prefill"]},
            "decode_tps": m["decode"]["tok_s"] if m["decode"] else None,
            "peak_rss_mb": peak_rss_mb()}


def worker_ppl(engine, path, threads, ids, n_ctx, stride):
    from pyklei.perplexity import perplexity
    kw = {"logits_all": True} if engine == "llamacpp" else {}
    e = ENGINES[engine](path, threads, n_ctx + 8, **kw)
    r = perplexity(e.window_logits, ids, n_ctx, stride)
    return {"ppl": r.ppl, "tokens": r.tokens_scored}


def run_worker(job: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(job)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- report --------------------------------------------------------------------------------

def median_of(runs: list[dict], key: str, n=None):
    """Median of run[key] (or run[key][n], for per-prompt-length figures) over successful runs."""
    vals = []
    for r in runs:
        v = r.get(key)
        if n is not None and isinstance(v, dict):
            v = v.get(str(n))
        if isinstance(v, (int, float)):
            vals.append(v)
    return statistics.median(vals) if vals else None


def render(report: dict) -> str:
    lines = [f"# pyklei vs llama.cpp vs transformers — {report['model']}", "",
             f"Machine: {report['cpu']} ({report['cores']} cores); CPU features: {report['features']}.",
             f"Command: `{report['command']}`; {report['date']}; medians of {report['repeats']} runs, "
             "each engine in its own process, engines alternated; in each process every prefill and "
             "decode figure is the median of 3 passes.", ""]
    pls = report["prompt_lengths"]
    ref = "pyklei q4 g32"
    for t in report["threads"]:
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "",
                  "| engine | " + " | ".join(f"prefill {n} tok/s" for n in pls)
                  + f" | decode {report['n_gen']} tok/s | TTFT {pls[-1]} (ms) | load (s) | peak RSS (MB) | file (MB) |",
                  "|---" * (len(pls) + 6) + "|"]
        for label, row in report["speed"].items():
            runs = row["runs"].get(str(t), [])
            if not runs or all("error" in r for r in runs):
                err = runs[0].get("error", "not run") if runs else "not run"
                lines.append(f"| {label} | {err} |")
                continue
            cells = [median_of(runs, "prefill_tps", n) for n in pls]
            cells += [median_of(runs, "decode_tps"), (median_of(runs, "ttft_s", pls[-1]) or 0) * 1e3,
                      median_of(runs, "load_s"), median_of(runs, "peak_rss_mb")]
            lines.append(f"| {label} | " + " | ".join("—" if c is None else f"{c:.1f}" for c in cells)
                         + f" | {row['file_mb']:.1f} |")
        # ratios pyklei / llama.cpp Q4_0
        if ref in report["speed"] and "llama.cpp Q4_0" in report["speed"]:
            a, b = report["speed"][ref]["runs"].get(str(t), []), report["speed"]["llama.cpp Q4_0"]["runs"].get(str(t), [])
            if a and b and not any("error" in r for r in a + b):
                ratio = lambda *k: median_of(a, *k) / median_of(b, *k)  # noqa: E731
                lines += ["", f"Ratios {ref} / llama.cpp Q4_0 ({t} thread{'s' if t > 1 else ''}): "
                          + ", ".join(f"prefill {n} **{ratio('prefill_tps', n):.2f}**" for n in pls)
                          + f", decode **{ratio('decode_tps'):.2f}**, TTFT({pls[-1]}) "
                          f"**{ratio('ttft_s', pls[-1]):.2f}**, peak RSS **{ratio('peak_rss_mb'):.2f}** "
                          "(speed: higher is better; TTFT and RSS: lower is better)."]
        lines.append("")
    if report.get("ppl"):
        lines += [f"## Quality: perplexity on {report['ppl_text']} ({report['ppl_tokens']} tokens, "
                  f"context {report['ppl_ctx']}, stride {report['ppl_stride']})", "",
                  "| engine | perplexity | × transformers fp32 |", "|---|---|---|"]
        base = report["ppl"].get("transformers fp32", {}).get("ppl")
        for label, r in report["ppl"].items():
            if "ppl" in r:
                lines.append(f"| {label} | {r['ppl']:.3f} | {r['ppl'] / base:.3f} |" if base else
                             f"| {label} | {r['ppl']:.3f} | — |")
            else:
                lines.append(f"| {label} | {r.get('error')} | |")
        lines.append("")
    return "\n".join(lines)


def readme_section(report: dict) -> str:
    """The README's benchmark table: the highest thread count, the main engines, and the
    ratio line (what `render` writes in full to benchmarks/results/)."""
    t = max(report["threads"])
    pls = report["prompt_lengths"]
    head = (f"| {t} threads | " + " | ".join(f"prefill {n}" for n in pls)
            + f" | decode {report['n_gen']} | TTFT {pls[-1]} | peak RSS | file |")
    lines = [f"{report['model']}, {report['date']}, `{report['command']}` (medians of {report['repeats']}):", "",
             head, "|---" * (len(pls) + 5) + "|"]
    for label, row in report["speed"].items():
        runs = [r for r in row["runs"].get(str(t), []) if "error" not in r]
        if not runs:
            continue
        cells = [f"{median_of(runs, 'prefill_tps', n):.0f} tok/s" for n in pls]
        cells += [f"{median_of(runs, 'decode_tps'):.1f} tok/s", f"{median_of(runs, 'ttft_s', pls[-1]):.2f} s",
                  f"{median_of(runs, 'peak_rss_mb'):.0f} MB", f"{row['file_mb']:.0f} MB"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    full = render(report).splitlines()
    ratio = [ln for ln in full if ln.startswith(f"Ratios pyklei q4 g32 / llama.cpp Q4_0 ({t} ")]
    ppl = []
    if any(ln.startswith("## Quality") for ln in full):   # the perplexity table, as in render
        i = next(i for i, ln in enumerate(full) if ln.startswith("## Quality"))
        ppl = ["", full[i][3:] + ":", ""] + [ln for ln in full[i + 1:] if ln.startswith("|")]
    return "\n".join(lines + [""] + ratio + ppl) + "\n"


def update_readme(report: dict, key: str):
    """Replaces the text between <!-- {key}:begin --> and <!-- {key}:end --> in
    docs/BENCHMARKS.md."""
    readme = ROOT / "docs" / "BENCHMARKS.md"
    text = readme.read_text()
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    if begin not in text or end not in text:
        print(f"docs/BENCHMARKS.md has no {begin} ... {end} section; not updated", file=sys.stderr)
        return
    a, b = text.index(begin) + len(begin), text.index(end)
    readme.write_text(text[:a] + "\n" + readme_section(report) + text[b:])


def chart(report: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(report["speed"])
    t = max(report["threads"])
    pls = report["prompt_lengths"]
    metrics = [("prefill", n) for n in pls] + [("decode", None)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        runs = [r for r in report["speed"][label]["runs"].get(str(t), []) if "error" not in r]
        vals = [(median_of(runs, "prefill_tps", n) if kind == "prefill" else median_of(runs, "decode_tps")) or 0
                for kind, n in metrics]
        ax.bar(np.arange(len(metrics)) + i * width, vals, width, label=label)
    ax.set_xticks(np.arange(len(metrics)) + width * (len(labels) - 1) / 2)
    ax.set_xticklabels([f"prefill {n}" if k == "prefill" else f"decode {report['n_gen']}" for k, n in metrics])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{report['model']}, {t} threads, {report['cpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main ---------------------------------------------------------------------------------

def bench_model(name, hf_dir, tag, args, work):
    from pyklei.calibration import evaluation_text
    from pyklei.text.tokenizer import Tokenizer
    models = prepare_models(hf_dir, work, tag, group_sizes=args.group_sizes,
                            imatrix=not getattr(args, "no_imatrix", False))
    tok = Tokenizer.from_gguf(models["pyklei q4 g32"][1])
    text = evaluation_text()
    ids = tok.encode(text, add_bos=False)
    rng = np.random.default_rng(0)
    while len(ids) < max(args.prompt_lengths) + 64:
        ids += ids
    speed = {label: {"runs": {str(t): [] for t in args.threads},
                     "file_mb": (sum(f.stat().st_size for f in Path(p).glob("*.safetensors")) if Path(p).is_dir()
                                 else Path(p).stat().st_size) / 1e6}
             for label, (eng, p) in models.items()}
    for rep in range(args.repeats):
        for t in args.threads:
            order = list(models.items())
            rng.shuffle(order)            # alternate engines, in a different order each round
            for label, (eng, p) in order:
                if eng.startswith("transformers") and args.skip_torch_speed:
                    continue
                job = {"mode": "speed", "engine": eng, "path": str(p), "threads": t,
                       "prompt_lengths": args.prompt_lengths, "n_gen": args.n_gen, "ids": ids[:max(args.prompt_lengths)]}
                r = run_worker(job)
                speed[label]["runs"][str(t)].append(r)
                print(f"[{name}] round {rep + 1} t={t} {label}: "
                      + (r.get("error") or f"pp{args.prompt_lengths[-1]} {r['prefill_tps'][str(args.prompt_lengths[-1])]:.0f} "
                         f"tg {r['decode_tps']:.1f} tok/s, rss {r['peak_rss_mb']:.0f} MB"), file=sys.stderr)
    ppl = {}
    if not args.skip_ppl:
        ppl_ids = tok.encode(text, add_bos=False)[:args.ppl_tokens]
        for label, (eng, p) in models.items():
            ppl[label] = run_worker({"mode": "ppl", "engine": eng, "path": str(p), "threads": max(args.threads),
                                     "ids": ppl_ids, "n_ctx": args.ppl_ctx, "stride": args.ppl_ctx // 2})
            print(f"[{name}] ppl {label}: {ppl[label]}", file=sys.stderr)
    import pyklei
    return {"model": name, "cpu": cpu_name(), "cores": os.cpu_count(),
            "features": " ".join(pyklei.cpu_features()), "command": " ".join(["python"] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
            "threads": args.threads, "prompt_lengths": args.prompt_lengths, "n_gen": args.n_gen,
            "speed": speed, "ppl": ppl, "ppl_text": "Python's Language Reference (topics types, "
            "specialnames, execmodel, compound; never used for calibration)",
            "ppl_tokens": min(args.ppl_tokens, len(tok.encode(text))), "ppl_ctx": args.ppl_ctx,
            "ppl_stride": args.ppl_ctx // 2}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 512])
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--group-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128])
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-torch-speed", action="store_true")
    ap.add_argument("--with-1b", action="store_true", help="also the random Llama 3.2 1B-shaped model")
    ap.add_argument("--only-1b", action="store_true", help="only the random Llama 3.2 1B-shaped model")
    ap.add_argument("--no-readme", action="store_true", help="do not refresh README.md's tables")
    args = ap.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        if job["mode"] == "speed":
            out = worker_speed(job["engine"], job["path"], job["threads"], job["prompt_lengths"], job["n_gen"], job["ids"])
        else:
            out = worker_ppl(job["engine"], job["path"], job["threads"], job["ids"], job["n_ctx"], job["stride"])
        print(json.dumps(out))
        return
    ensure_extras()
    from pyklei_dev.assets import cache_dir
    from pyklei_dev.gguf_to_hf import smollm2_hf
    work = cache_dir() / "bench"
    RESULTS.mkdir(parents=True, exist_ok=True)
    reports = [] if args.only_1b else [bench_model("SmolLM2-135M-Instruct", smollm2_hf(), "smollm2", args, work)]
    if args.with_1b or args.only_1b:
        hf1b = cache_dir() / "llama32-1b-random"
        if not (hf1b / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_llama32_1b_random.py")], check=True)
        a1 = argparse.Namespace(**vars(args))
        # random weights: perplexity and calibration mean nothing; fp32 decode of 1.2 B
        # parameters takes minutes per run
        a1.group_sizes, a1.skip_ppl, a1.no_imatrix, a1.skip_torch_speed = [32], True, True, True
        reports.append(bench_model("random Llama-3.2-1B-shaped", hf1b, "llama32-1b", a1, work))
    md = "\n".join(render(r) for r in reports)
    name = "compare-1b" if args.only_1b else "compare"
    (RESULTS / f"{name}.md").write_text(md)
    (RESULTS / f"{name}.json").write_text(json.dumps(reports, indent=1))
    chart(reports[0], RESULTS / f"{name}.png")
    if not args.no_readme:
        for r in reports:
            update_readme(r, "compare-1b" if "1B" in r["model"] else "compare")
    print(md)


if __name__ == "__main__":
    main()
