"""Where a decode step's time goes: wall time per operation of the C forward pass, and the
share of each generated token spent in Python (sampling, detokenizing, stop strings, the
call into C).

    python benchmarks/profile_decode.py                       # SmolLM2 q4 from the bench cache
    python benchmarks/profile_decode.py MODEL.gguf --threads 1 --tokens 256

Tokens are generated with pyklei.generate.stream_generate (greedy, EOS ignored so every run
makes the same number of tokens) after a short prompt; the operation timer (two clock reads
per operation) runs only over the decode steps. Writes benchmarks/results/profile-decode.md
(--out NAME: NAME.md) unless --no-write.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "Explain in a few sentences why the sky is blue, for a curious ten-year-old."


def default_model() -> Path:
    from pyklei_dev.assets import cache_dir
    for p in (cache_dir() / "bench" / "smollm2-q4-g32.gguf", cache_dir() / "smollm2-135m-instruct-q4.gguf"):
        if p.exists():
            return p
    from pyklei.converters import convert
    from pyklei_dev.gguf_to_hf import smollm2_hf
    out = cache_dir() / "bench" / "smollm2-q4-g32.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(smollm2_hf(), out, group_size=32)
    return out


def profile(path: Path, threads: int, tokens: int) -> dict:
    import pyklei
    from pyklei.runtime.generate import SamplingParams, stream_generate
    llm = pyklei.load(str(path), n_threads=threads, n_ctx=tokens + 256)
    rt = llm.model.runtime
    prompt = llm.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0)
    for _ in stream_generate(llm.model, llm.tokenizer, prompt, max_tokens=8, params=greedy, eos_ids=[]):
        pass                                               # warm-up
    llm.model.reset()
    gen = stream_generate(llm.model, llm.tokenizer, prompt, max_tokens=tokens, params=greedy, eos_ids=[])
    next(gen)                                              # prefill + first token: not profiled
    rt.profile_ops(True)
    t0 = time.perf_counter()
    steps = sum(1 for _ in gen)
    wall = time.perf_counter() - t0
    ops, calls = rt.op_profile()
    rt.profile_ops(False)
    c_total = sum(ops.values())
    return {"model": path.name, "threads": threads, "steps": steps, "calls": calls, "wall_s": wall,
            "ops_s": ops, "c_s": c_total, "python_s": wall - c_total,
            "features": " ".join(pyklei.cpu_features())}


def render(r: dict) -> str:
    per = 1e3 / r["steps"]
    lines = [f"# One decode step of {r['model']}, {r['threads']} thread(s)", "",
             f"Command: `python benchmarks/profile_decode.py {r['model']} --threads {r['threads']} "
             f"--tokens {r['steps'] + 1}`; "
             f"{r['steps']} greedy steps (EOS ignored) after a short chat prompt; "
             f"CPU features: {r['features']}.", "",
             f"Token rate through `stream_generate`: **{r['steps'] / r['wall_s']:.1f} tok/s** "
             f"({r['wall_s'] * per:.3f} ms per token).", "",
             "| operation | ms per token | share of the step |", "|---|---:|---:|"]
    for name, s in sorted(r["ops_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {s * per:.3f} | {100 * s / r['wall_s']:.1f}% |")
    lines.append(f"| **Python** (sampling, detokenizer, stop strings, call overhead) | "
                 f"{r['python_s'] * per:.3f} | **{100 * r['python_s'] / r['wall_s']:.1f}%** |")
    lines.append("")
    lines.append("qkv, o_proj, gate_up, down and lm_head are the matmuls (GEMVs at decode); the "
                 "rest runs on the pool's threads too except embed, residual and output_norm.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default="profile-decode", help="results file name, no suffix")
    args = ap.parse_args(argv)
    r = profile(args.model or default_model(), args.threads, args.tokens)
    md = render(r)
    print(md)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.out}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
