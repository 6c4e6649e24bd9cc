"""Matmul kernel benchmark: pyklei qsi4c32 kernels beside torch fp32 on the same shapes.

    python benchmarks/bench_kernels.py [--threads 1,2] [--quick] [--out benchmarks/results/kernels.md]

GEMV (M = 1) and GEMM (M = 128) for every kernel this CPU runs (plus the one the dispatch
picks), threads 1 and 2, on Llama 3.2 1B and SmolLM2-135M linear shapes. Reported:
  GEMV  GB/s of weights streamed (qs + bf16 scales bytes for pyklei, 4*N*K for torch fp32)
        and the ratio pyklei/torch of those bytes/s (goal >= 0.8);
  GEMM  GOP/s = 2*M*N*K / time, and the ratio pyklei/torch (goal >= 3 with VNNI);
  time of one call (us), as seen from Python (includes activation quantization and the
  ~1-2 us of Python call overhead);
  a memory-copy probe (numpy copy of a 256 MiB buffer, read + write bytes / time).
Times are the minimum over repetitions (the machine may be shared). Not a test.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np
import torch

from pyklei import _ext
from pyklei.formats import f32_to_bf16, pack_nibbles

LLAMA_1B = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (128256, 2048)]
SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def best_time(fn, min_time=0.05, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            t = time.perf_counter() - t0
            if t >= min_time:
                break
        best = min(best, t / n)
    return best


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def copy_probe(mib=256):
    a = np.ones(mib << 18, np.float32)
    b = np.empty_like(a)
    t = best_time(lambda: np.copyto(b, a), min_time=0.2, reps=5)
    return 2 * a.nbytes / t / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, skip the 128256 and 49152 rows")
    ap.add_argument("--gemm-m", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/kernels.md")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    reps = 3 if args.quick else 5
    shapes = [("Llama-3.2-1B", s) for s in LLAMA_1B] + [("SmolLM2-135M", s) for s in SMOLLM2]
    if args.quick:
        shapes = [s for s in shapes if s[1][0] < 40000]
    ks = [k for k in _ext.kernels() if k["format"] == "qsi4c32" and k["supported"]
          and k["isa"] not in ("scalar", "amx_emul")]
    gemv_k = [k["name"] for k in ks if k["m_min"] == 1]
    gemm_k = [k["name"] for k in ks if k["m_min"] > 1]
    auto_gemv = _ext.selected_kernel("qsi4c32", 1)
    auto_gemm = _ext.selected_kernel("qsi4c32", args.gemm_m)
    load0 = os.getloadavg()
    rng = np.random.default_rng(0)
    gemv_rows, gemm_rows = [], []
    for model, (n, k) in shapes:
        qs = pack_nibbles(rng.integers(-8, 8, (n, k), dtype=np.int8))
        sc = f32_to_bf16(rng.uniform(1e-3, 0.05, (n, k // 32)).astype(np.float32))
        w = _ext.QWeight("qsi4c32", qs, sc, 32)
        wbytes = qs.nbytes + sc.nbytes
        W = torch.randn(n, k)
        for th in threads:
            ops = _ext.Ops(th)
            torch.set_num_threads(th)
            # GEMV
            x = rng.standard_normal((1, k)).astype(np.float32)
            out = np.empty((1, n), np.float32)
            X, O = torch.from_numpy(x), torch.empty(1, n)
            tt = best_time(lambda: torch.matmul(X, W.T, out=O), reps=reps)
            for kn in gemv_k:
                t = best_time(lambda: ops.matmul(w, x, out=out, kernel=kn), reps=reps)
                gemv_rows.append((model, n, k, th, kn + (" (auto)" if kn == auto_gemv else ""), t, wbytes / t / 1e9,
                                  tt, 4 * n * k / tt / 1e9))
            # GEMM
            m = args.gemm_m
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), np.float32)
            X, O = torch.from_numpy(x), torch.empty(m, n)
            mt = 0.02 if n * k < 4e7 else 0.0
            tt = best_time(lambda: torch.matmul(X, W.T, out=O), min_time=mt, reps=reps if mt else 2)
            for kn in gemm_k:
                t = best_time(lambda: ops.matmul(w, x, out=out, kernel=kn), min_time=mt, reps=reps if mt else 2)
                gemm_rows.append((model, n, k, th, kn + (" (auto)" if kn == auto_gemm else ""), t,
                                  2 * m * n * k / t / 1e9, tt, 2 * m * n * k / tt / 1e9))
            print(f"{model} {n}x{k} t={th} done", file=sys.stderr, flush=True)
        del W
    copy_gbs = copy_probe()
    load1 = os.getloadavg()

    md = ["# Kernel benchmark: pyklei qsi4c32 vs torch fp32", ""]
    md.append(f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    md.append(f"- CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; pyklei features: "
              f"{' '.join(_ext.cpu_features())}")
    md.append(f"- torch {torch.__version__}, numpy {np.__version__}, Python {platform.python_version()}")
    md.append(f"- Command: `python {' '.join(sys.argv)}` (from the repository root)")
    md.append(f"- Load average before/after: {load0[0]:.2f} / {load1[0]:.2f} (other processes share the "
              "cores; times are the minimum over repetitions)")
    md.append(f"- Memory-copy probe (numpy copyto, 256 MiB, read+write bytes): {copy_gbs:.1f} GB/s (1 thread)")
    md.append("- Weights: random int4 with bf16 scales, bl = 32 (4.5 bits/weight); GEMV bytes = qs + scales; "
              "torch bytes = 4*N*K (fp32). Times include activation quantization and Python call overhead.")
    md.append("")
    md.append("## GEMV (M = 1)")
    md.append("")
    md.append("| model | N x K | thr | kernel | pyklei us | pyklei GB/s | torch us | torch GB/s | bytes/s ratio |")
    md.append("|---|---|---|---|---:|---:|---:|---:|---:|")
    for (model, n, k, th, kn, t, gbs, tt, tgbs) in gemv_rows:
        md.append(f"| {model} | {n}x{k} | {th} | {kn} | {t*1e6:.1f} | {gbs:.1f} | {tt*1e6:.1f} | {tgbs:.1f} | "
                  f"{gbs/tgbs:.2f} |")
    md.append("")
    md.append(f"## GEMM (M = {args.gemm_m})")
    md.append("")
    md.append("| model | N x K | thr | kernel | pyklei ms | pyklei GOP/s | torch ms | torch GFLOP/s | ratio |")
    md.append("|---|---|---|---|---:|---:|---:|---:|---:|")
    for (model, n, k, th, kn, t, gops, tt, tgops) in gemm_rows:
        md.append(f"| {model} | {n}x{k} | {th} | {kn} | {t*1e3:.2f} | {gops:.1f} | {tt*1e3:.2f} | {tgops:.1f} | "
                  f"{gops/tgops:.2f} |")
    md.append("")
    text = "\n".join(md)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
