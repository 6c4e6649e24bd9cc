"""Decode against the memory's read bandwidth, each measured right beside the other: a decode
step streams every weight once (the token embedding aside: one row of it), so tokens per second
times the bytes streamed per token is the bandwidth decode draws, and the ceiling is what the
machine can read at that moment (benchmarks/read_bandwidth.c).

    python benchmarks/decode_bandwidth.py --model llama31-8b --rounds 5
    python benchmarks/decode_bandwidth.py --model smollm2 --threads 1 --peers Q4_0

On a shared VM the read bandwidth itself moves (measured here at 2 threads: 31.5 and 59.0 GB/s
half an hour apart, 63.5 and 35.6 one minute apart), so a fraction taken against a figure
from another time means little. Each engine's decode (pyklei bench / llama-bench, tg N) is
therefore measured between two bandwidth passes of the same thread count, and its fraction is
taken against their mean; the engines alternate round after round, and each figure is the
median over the rounds. The files are speed_vs_llamacpp.py's for the same --model.

Results: benchmarks/results/decode-bandwidth-MODEL.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed_vs_llamacpp as svl  # noqa: E402  (also puts tests/fixtures and the root on the path)


def streamed_bytes(path: Path) -> int:
    """Bytes a decode step reads from a GGUF file's tensors: all of them but the token
    embedding (and its scales), of which a step reads one row."""
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
               if not t.name.startswith("token_embd."))


def read_bandwidth_tool() -> Path:
    """benchmarks/read_bandwidth.c built once into the cache (rebuilt when the source is newer)."""
    from pyklei_dev.assets import cache_dir
    src = ROOT / "benchmarks" / "read_bandwidth.c"
    exe = cache_dir() / "bin" / "read_bandwidth"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        exe.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-O2", "-march=native", "-pthread", str(src), "-o", str(exe)], check=True)
    return exe


def read_gbs(exe: Path, threads: int) -> float:
    out = subprocess.run([str(exe), str(threads), "4096"], check=True, capture_output=True, text=True).stdout
    return float(re.search(r"read ([\d.]+) GB/s", out).group(1))


STEADY = 0.10   # a round whose two bandwidth passes differ by less than this: a steady machine


def report(data: dict) -> str:
    """The results file's text: medians, then each round's fraction beside the bandwidth it was
    taken against, the steady rounds (both passes within 10%) apart from the others."""
    rows, size, tg = data["rounds"], data["streamed_bytes"], data["tg"]
    loads = [r["load"] for rs in rows.values() for r in rs]
    med = lambda e, k: statistics.median(r[k] for r in rows[e])  # noqa: E731
    lines = [f"# Decode against the read bandwidth: {data['title']}", "",
             f"`{data['command']}`; {data['date']}; {data['cpu']}; {data['seconds']:.0f} s; "
             f"{data['threads']} threads; 1-min load average {min(loads):.1f}-{max(loads):.1f}. Each "
             f"engine's {tg} between two passes of benchmarks/read_bandwidth.c; medians of the rounds.", "",
             f"| engine | streamed per token | {tg} tok/s | drawn GB/s | read GB/s beside it | fraction |",
             "|---|---|---|---|---|---|"]
    for e in rows:
        read = statistics.median(sum(r["read_gbs"]) / 2 for r in rows[e])
        lines.append(f"| {e} | {size[e] / 1e6:.1f} MB | {med(e, 'tok_s'):.2f} | {med(e, 'drawn_gbs'):.1f} | "
                     f"{read:.1f} | **{100 * med(e, 'fraction'):.0f}%** |")
    lines += ["", "Each round, fraction at the mean read bandwidth beside it (steady: the two passes "
              f"within {100 * STEADY:.0f}% of each other; the others moved during the decode):", ""]
    for e in rows:
        def cell(r):
            a, b = r["read_gbs"]
            return f"{100 * r['fraction']:.0f}% at {(a + b) / 2:.1f} GB/s"
        steady = [cell(r) for r in rows[e] if abs(r["read_gbs"][0] - r["read_gbs"][1]) < STEADY * max(r["read_gbs"])]
        moved = [cell(r) for r in rows[e] if abs(r["read_gbs"][0] - r["read_gbs"][1]) >= STEADY * max(r["read_gbs"])]
        lines.append(f"- {e}: steady {', '.join(steady) or 'none'}; moved {', '.join(moved) or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import llamacpp_quality as lcpp
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama31-8b",
                    choices=("smollm2", *svl.LLAMA_SHAPES, "gemma3", *svl.RANDOM))
    ap.add_argument("--peers", default="Q4_0", help="llama.cpp's files (default Q4_0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=64)
    args = ap.parse_args(argv)

    peers = args.peers.split(",")
    title, ours, theirs = svl.model_files(args.model, peers)
    engines = {"pyklei default": ("pyklei", ours), **{f"llama.cpp {k}": ("llama.cpp", f) for k, f in theirs.items()}}
    size = {e: streamed_bytes(p) for e, (_, p) in engines.items()}
    exe, bench = read_bandwidth_tool(), lcpp.LLAMACPP_BIN / "llama-bench"
    tg = f"tg{args.n_gen}"
    rows = {e: [] for e in engines}
    t0 = time.time()
    for rnd in range(args.rounds):
        for e, (kind, path) in engines.items():
            before = read_gbs(exe, args.threads)
            got, _ = (svl.pyklei_run(path, args.threads, [16], args.n_gen, "auto", 0, "f16") if kind == "pyklei"
                      else svl.llamacpp_run(bench, path, args.threads, [16], args.n_gen, 0, "f16"))
            after = read_gbs(exe, args.threads)
            drawn = size[e] * got[tg] / 1e9
            rows[e].append({"tok_s": got[tg], "drawn_gbs": drawn, "read_gbs": [before, after],
                            "fraction": drawn / ((before + after) / 2), "load": os.getloadavg()[0]})
            print(f"round {rnd + 1}: {e}: {got[tg]:.2f} tok/s, {drawn:.1f} GB/s of "
                  f"{before:.1f}/{after:.1f} GB/s read", file=sys.stderr)

    cmd = "python benchmarks/decode_bandwidth.py " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"command": cmd, "title": title, "threads": args.threads, "cpu": svl.cpu_model(),
            "date": time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), "seconds": time.time() - t0,
            "tg": tg, "streamed_bytes": size, "rounds": rows}
    md = report(data)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"decode-bandwidth-{args.model}"
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
