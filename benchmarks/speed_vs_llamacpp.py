"""Prefill and decode speed of pyklei's default file beside llama.cpp's Q4_K_M and Q4_0 of the
same weights, on this machine, in one run: at several depths of context and with each KV cache
type beside llama.cpp's own (issue 24: f16 beside f16, q8 beside q8_0).

    python benchmarks/speed_vs_llamacpp.py                 # SmolLM2, 2 threads, 5 rounds
    python benchmarks/speed_vs_llamacpp.py --threads 1,2 --rounds 3
    python benchmarks/speed_vs_llamacpp.py --depths 0,4096 --kv-caches f16,q8 --rounds 3
    python benchmarks/speed_vs_llamacpp.py --busy 1 --out speed-vs-llamacpp-busy
    python benchmarks/speed_vs_llamacpp.py --model llama32-1b --depths 0,4096,16384 --rounds 1
    python benchmarks/speed_vs_llamacpp.py --model gemma3 --depths 0,4096    # the real Gemma 3 270M
    python benchmarks/speed_vs_llamacpp.py --model qwen3-1.7b --peers Q4_0   # or gemma3-1b
    python benchmarks/speed_vs_llamacpp.py --model gemma3 --before /tmp/main-tree  # a change's before/after

pyklei's file is what `pyklei convert` makes by default (rotation + GPTQ; the quality
harness's cached "default" file, benchmarks/quality.py), measured by `pyklei bench` with its
default activations (one plane on a rotated file). --model llama32-1b (llama32-3b, llama31-8b):
the random checkpoint of Llama 3.2 1B's shape (3.2 3B's, 3.1 8B's; scripts/
make_llama32_1b_random.py --shape), converted rotated without
calibration (`--no-calibrate --rotate`: the default file's format and speed; GPTQ's minutes
buy nothing on random weights); llama.cpp's files come from its own
llama-quantize (benchmarks/llamacpp_quality.py's cache). --model gemma3: the real Gemma 3 270M,
whose only source here is llama.cpp's Q4_K_M file: pyklei's default conversion of it beside that
file and llama-quantize's requantizations of it (--allow-requantize). --model qwen3-1.7b /
gemma3-1b: random checkpoints of the published shapes with the families' real tokenizers
(benchmarks/random_family.py), converted like the 1B above, llama.cpp's files through its
convert_hf_to_gguf.py and llama-quantize. llama.cpp's files are measured by llama-bench with
flash attention on (`-fa 1`: its faster path at depth, and the one a quantized V cache needs)
and the same cache type (`-ctk/-ctv`). At a depth D both engines prefill D tokens untimed
before each test (`-d D`). The engines alternate, round after round, each in its own process,
so that a busy neighbour on a shared VM slows all of them alike; in each round an engine
reports the median (pyklei bench) or the mean (llama-bench) of its repetitions (3 at depth 0,
1 at a depth), and each figure here is the median over the rounds, with the load average
beside the run, and each engine's peak RSS (the kernel's count for its process, wait4). Quality of the same files: benchmarks/results/quality.md and kv-cache.md.

--busy N runs N busy loops (one process each, `while True: pass`) beside every measurement: the
machine another job is using (issue 24: pyklei should keep >= 40% of its idle decode speed and
never fall below llama.cpp under the same load). Each round then also measures every engine idle
(the busy loops stopped with SIGSTOP for it: "... idle" rows), and the report gives each
engine's busy / idle ratio.

Results: benchmarks/results/speed-vs-llamacpp.md and .json (--out NAME: NAME.md / .json); the
run also rewrites the block of the same name where README.md or docs/BENCHMARKS.md has one, and
docs/QUALITY.md's speed table (SmolLM2 at depth 0).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
sys.path.append(str(ROOT))  # pyklei_dev/ (not installed: its __init__.py)


# pyklei's KV cache type -> llama.cpp's (-ctk / -ctv)
LLAMACPP_KV = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8": "q8_0"}


def llamacpp_kv(kv: str, override: str | None) -> str:
    """llama.cpp's cache type beside pyklei's kv: --llamacpp-kv when given, else the match."""
    return override or LLAMACPP_KV[kv]
IDLE = " idle"   # an engine name's suffix: measured with --busy's loops stopped


def _reps(depth: int) -> int:
    return 1 if depth else 3      # a deep prefill before every repetition is the cost


def _key(test: str, depth: int) -> str:
    return f"{test} @ d{depth}" if depth else test


def run_measured(cmd: list[str], tree: Path | None = None) -> tuple[str, float]:
    """(stdout, peak RSS in MB) of a command: the kernel's count of the child's largest resident
    set (wait4's ru_maxrss), the same measure for both engines whatever they report themselves.
    Output goes through temporary files so that the child is reaped here, by wait4. tree: run
    from that directory with it first on PYTHONPATH (the pyklei it holds imported)."""
    import tempfile
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=tree)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, out.read(), err.read())
        return out.read(), usage.ru_maxrss / 1024


def pyklei_run(path: Path, threads: int, pl: list[int], n_gen: int, act: str, depth: int,
               kv: str, tree: Path | None = None) -> tuple[dict, float]:
    out, rss = run_measured([sys.executable, "-m", "pyklei", "bench", str(path), "-t", str(threads),
                             "-p", ",".join(map(str, pl)), "-n", str(n_gen), "-r", str(_reps(depth)),
                             "-d", str(depth), "--kv-cache", kv, "--json", "--no-progress",
                             "--activations", act], tree)
    res = json.loads(out)["results"][0]
    got = {_key(f"pp{r['tokens']}", depth): r["tok_s"] for r in res["prefill"]}
    got[_key(f"tg{n_gen}", depth)] = res["decode"]["tok_s"]
    return got, rss


def llamacpp_run(bench: Path, path: Path, threads: int, pl: list[int], n_gen: int, depth: int,
                 kv: str) -> tuple[dict, float]:
    """kv: llama.cpp's own name of the cache type (f16, q8_0, ...)."""
    out, rss = run_measured([str(bench), "-m", str(path), "-t", str(threads), "-p", ",".join(map(str, pl)),
                             "-n", str(n_gen), "-r", str(_reps(depth)), "-d", str(depth), "-fa", "1",
                             "-ctk", kv, "-ctv", kv, "-o", "json"])
    got = {}
    for r in json.loads(out):
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        got[_key(key, depth)] = r["avg_ts"]
    return got, rss


def llamacpp_files_from_pyklei_f16(hf: Path, work: Path, kinds: list[str]) -> dict[str, Path]:
    """llama.cpp's files of a checkpoint its convert_hf_to_gguf.py refuses (the random 1B's
    synthetic tokenizer has no pre-tokenizer hash it knows): pyklei's f16 GGUF, rewritten as a
    plain llama.cpp one (benchmarks/compare.py), then llama-quantize. Cached in `work`."""
    import llamacpp_quality as lcpp
    from compare import llamacpp_f16

    from pyklei.converters import convert
    work.mkdir(parents=True, exist_ok=True)
    files = {k: work / f"{k}.gguf" for k in kinds}
    missing = [k for k, f in files.items() if not f.is_file()]
    if missing:
        f16 = work / "f16-pyklei.gguf"
        if not f16.exists():
            convert(hf, f16, progress=False, force=True, keep=["*=f16"], embedding_bits=16)
        lc16 = llamacpp_f16(f16, work / "f16-llamacpp.gguf")
        for k in missing:
            tmp = work / f"{k}.part.gguf"
            subprocess.run([str(lcpp.LLAMACPP_BIN / "llama-quantize"), str(lc16), str(tmp), k, "2"],
                           check=True, capture_output=True)
            tmp.rename(files[k])
        f16.unlink()
        lc16.unlink()
    return files


DOC = ROOT / "docs" / "QUALITY.md"
DOC_BLOCK = re.compile(r"(<!-- speed-vs-llamacpp:begin -->\n).*?(<!-- speed-vs-llamacpp:end -->)", re.S)


def doc_table(results: dict) -> str:
    """docs/QUALITY.md's speed table from speed-vs-llamacpp.json: at depth 0 with the default
    f16 cache, pyklei's default file against each llama.cpp file, per thread count (the
    median over the rounds; tests/docs/test_doc_figures.py checks the doc against this)."""
    med = {}
    for key, rounds in results["rounds"].items():
        engine, threads, kv = key.split(" | ")
        if kv == "f16":
            med[(engine, threads)] = {t: statistics.median(r[t] for r in rounds) for t in rounds[0]}
    tests = [t for t in next(iter(med.values())) if " @ " not in t]
    names = {t: ("prefill " + t[2:]) if t.startswith("pp") else ("decode " + t[2:]) for t in tests}
    lines = ["| tok/s, pyklei default / llama.cpp | " + " | ".join(names[t] for t in tests) + " |",
             "|---|" + "---|" * len(tests)]
    for (engine, threads), m in med.items():
        if not engine.startswith("llama.cpp"):
            continue
        ours = med[("pyklei default", threads)]
        lines.append(f"| {threads} thread{'s' if threads != '1' else ''}, {engine.split()[-1]} | "
                     + " | ".join(f"{ours[t]:.0f} / {m[t]:.0f} = **{ours[t] / m[t]:.2f}x**" for t in tests) + " |")
    return "\n".join(lines) + "\n"


README = ROOT / "README.md"
TABLE_DOCS = (README, ROOT / "docs" / "BENCHMARKS.md")   # where the generated blocks stand


def readme_block(name: str) -> re.Pattern:
    """README.md's generated block NAME (the results file's name)."""
    return re.compile(rf"(<!-- {re.escape(name)}:begin -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)


def readme_table(results: dict) -> str:
    """README.md's block from a results file: every test and cache type, tok/s medians over the
    rounds for each engine, and pyklei's ratio to each llama.cpp file in bold
    (tests/docs/test_doc_figures.py checks the README against the results files)."""
    med = {}
    for key, rounds in results["rounds"].items():
        engine, threads, kv = key.split(" | ")
        med[(engine, threads, kv)] = {t: statistics.median(r[t] for r in rounds) for t in rounds[0]}
    tests = list(next(iter(med.values())))
    rss = {k: statistics.median(v) for k, v in results.get("peak_rss_mb", {}).items()}
    lines = [f"{results['title']}, `{results['command']}`, {results['date']}, 1-min load average "
             f"{min(results['loadavg']):.1f}-{max(results['loadavg']):.1f} (tok/s, medians of the rounds"
             + ("; peak RSS of the engine's process" if rss else "") + "):", "",
             "| engine | threads | KV | " + " | ".join(tests) + " |" + " peak RSS |" * bool(rss),
             "|---|---|---|" + "---|" * (len(tests) + bool(rss))]
    for (e, t, kv), m in med.items():
        shown = results.get("llamacpp_kv", kv) if e.startswith("llama.cpp") else kv   # what it ran
        lines.append(f"| {e} | {t} | {shown} | " + " | ".join(f"{m[x]:.1f}" for x in tests) + " |"
                     + (f" {rss[f'{e} | {t} | {kv}']:.0f} MB |" if rss else ""))
    for (e, t, kv), m in med.items():
        if e.startswith("llama.cpp"):
            for ours_name in dict.fromkeys(x for x, _, _ in med if x.startswith("pyklei")):
                if e.endswith(IDLE) != ours_name.endswith(IDLE):
                    continue
                ours = med[(ours_name, t, kv)]
                name = ours_name.removesuffix(IDLE).replace("pyklei default", "pyklei").replace(",", "")
                lines.append(f"| {name} / {e.split()[-1]} | {t} | {kv} | "
                             + " | ".join(f"**{ours[x] / m[x]:.2f}x**" for x in tests) + " |" + " |" * bool(rss))
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    """The CPU's model name, as the tables date themselves with it."""
    return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                platform.processor())


def measure_rounds(args, engines, runs, depths, pl, bench, loads, busy, rss) -> None:
    """Every (engine, threads, cache type) once per round, all depths in one go; fills runs,
    loads (the 1-min load average after each) and rss (each round's largest peak RSS, MB). An
    engine named "... idle" runs with the busy loops stopped."""
    for rnd in range(args.rounds):
        for (e, t, kv) in runs:
            kind, path, act, *tree = engines[e.removesuffix(IDLE)]
            got, peak = {}, 0.0
            pause = e.endswith(IDLE) and busy
            for b in busy if pause else ():
                b.send_signal(signal.SIGSTOP)
            try:
                for d in depths:
                    one, mb = (pyklei_run(path, int(t), pl, args.n_gen, act, d, kv, *tree) if kind == "pyklei"
                               else llamacpp_run(bench, path, int(t), pl, args.n_gen, d,
                                                 llamacpp_kv(kv, args.llamacpp_kv)))
                    got.update(one)
                    peak = max(peak, mb)
            finally:
                for b in busy if pause else ():
                    b.send_signal(signal.SIGCONT)
            loads.append(os.getloadavg()[0])
            runs[(e, t, kv)].append(got)
            rss[(e, t, kv)].append(peak)
            ran = kv if kind == "pyklei" else llamacpp_kv(kv, args.llamacpp_kv)
            print(f"round {rnd + 1}: {e}, {t} threads, KV {ran}: {got} (load {loads[-1]:.1f})",
                  file=sys.stderr)


# --model NAME for a random Llama checkpoint of a published shape (scripts/make_llama32_1b_random.py
# --shape): (its --shape, its directory, the tables' title)
LLAMA_SHAPES = {"llama32-1b": ("1b", "llama32-1b-random", "random Llama-3.2-1B-shaped"),
                "llama32-3b": ("3b", "llama32-3b-random", "random Llama-3.2-3B-shaped"),
                "llama31-8b": ("8b", "llama31-8b-random", "random Llama-3.1-8B-shaped")}
# --model NAME for a random checkpoint of a published shape (benchmarks/random_family.py)
RANDOM = {"qwen3-1.7b": "Qwen3-1.7B", "gemma3-1b": "gemma-3-1b-it"}


def model_files(model: str, peers: list[str]) -> tuple[str, Path, dict[str, Path]]:
    """(title, pyklei's file, {peer: llama.cpp's file}) of --model, each made once and cached."""
    import llamacpp_quality as lcpp
    from quality import GEMMA3_270M, VARIANTS, convert_variant

    from pyklei_dev.assets import cache_dir
    work = cache_dir() / "llamacpp" / model
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if model == "smollm2":
        from models import smollm2_hf_dir
        hf = smollm2_hf_dir()
        ours = cache_dir() / "quality" / "smollm2-default.gguf"
        convert_variant(hf, ours, VARIANTS["default"])
        return "SmolLM2-135M-Instruct", ours, lcpp.make_files(hf, work, peers, log=log)
    if model == "gemma3":
        # the real model is llama.cpp's own Q4_K_M file: that is its Q4_K_M, and its other
        # files are llama-quantize's requantizations of it (what a llama.cpp user can make)
        ours = cache_dir() / "quality" / "gemma3-default.gguf"
        convert_variant(GEMMA3_270M, ours, VARIANTS["default"])
        return "Gemma 3 270M (llama.cpp's Q4_K_M file)", ours, requantized(GEMMA3_270M, work, peers)
    # random checkpoints: converted rotated without calibration (`--no-calibrate --rotate`: the
    # default file's format and speed; GPTQ's minutes buy nothing on random weights)
    if model in LLAMA_SHAPES:
        shape, name, title = LLAMA_SHAPES[model]
        hf = cache_dir() / name
        ours = cache_dir() / ("speed1b" if shape == "1b" else f"speed-{model}") / "pyklei-rotated.gguf"
        # the checkpoint only while a file is still to be made: the 8B's is 16 GB on disk,
        # and its f16 copies (llamacpp_files_from_pyklei_f16) need room of their own
        made = ours.exists() and all((work / f"{k}.gguf").is_file() for k in peers)
        if not made and not (hf / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_llama32_1b_random.py"),
                            "--shape", shape], check=True)
    else:
        from random_family import random_checkpoint
        hf, title = random_checkpoint(RANDOM[model]), f"random {RANDOM[model]}-shaped"
        ours = cache_dir() / f"speed-{model}" / "pyklei-rotated.gguf"
    if not ours.exists():
        ours.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pyklei", "convert", str(hf), "--no-calibrate", "--rotate",
                        "-o", str(ours), "--no-progress"], check=True)
    theirs = (llamacpp_files_from_pyklei_f16(hf, work, peers) if model in LLAMA_SHAPES
              else lcpp.make_files(hf, work, peers, log=log))
    return title, ours, theirs


def requantized(source: Path, work: Path, kinds: list[str]) -> dict[str, Path]:
    """{kind: file}: `source` itself for its own type (Q4_K_M), else llama-quantize
    --allow-requantize of it, cached in `work`."""
    import llamacpp_quality as lcpp
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in kinds:
        qtype, with_imatrix = lcpp.KINDS[kind]
        if with_imatrix:
            raise SystemExit(f"--peers {kind}: no imatrix for a requantized file here")
        files[kind] = source if kind == "Q4_K_M" else work / f"{kind}.gguf"
        if not files[kind].is_file():
            tmp = work / f"{kind}.part.gguf"
            lcpp._run([lcpp.LLAMACPP_BIN / "llama-quantize", "--allow-requantize", source, tmp, qtype, "2"],
                      work / f"quantize-{kind}.log")
            tmp.rename(files[kind])
    return files


def main(argv=None) -> int:
    import llamacpp_quality as lcpp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="2", help="comma list (default 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-lengths", default="128,512")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--model", choices=("smollm2", *LLAMA_SHAPES, "gemma3", *RANDOM), default="smollm2",
                    help="smollm2 (default), gemma3 (the real Gemma 3 270M), or a random checkpoint "
                    "of a published shape (module doc)")
    ap.add_argument("--peers", default="Q4_K_M,Q4_0", help="llama.cpp's files (default Q4_K_M,Q4_0)")
    ap.add_argument("--depths", default="0", help="comma list of context depths (default 0)")
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the engines")
    ap.add_argument("--out", default=None, help="results file name, no suffix (default "
                    "speed-vs-llamacpp, -1b for the 1B-shaped model)")
    ap.add_argument("--kv-caches", default="f16", help="comma list of pyklei KV cache types "
                    "(f32, f16, bf16, q8; llama.cpp gets f32, f16, bf16, q8_0) (default f16)")
    ap.add_argument("--llamacpp-kv", default=None, choices=sorted(set(LLAMACPP_KV.values())),
                    help="llama.cpp's cache type beside every pyklei one (e.g. f16 beside pyklei's "
                         "bf16: the same bytes; default: the matching type)")
    ap.add_argument("--one-plane", action="store_true", help="also pyklei's file with one activation "
                    "plane (--activations qai8dx), where auto runs two (a file not wholly rotated)")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="also the default file run by the pyklei package in DIR (a copy of another "
                    "tree with its built extension, e.g. main's), as 'pyklei default, before', "
                    "alternating with the others: a change's before and after in one run")
    args = ap.parse_args(argv)
    if args.before is not None and not (args.before / "pyklei" / "__init__.py").is_file():
        ap.error(f"--before {args.before}: no pyklei package there")
    if args.busy < 0 or args.rounds < 1:
        ap.error(f"--busy must be >= 0 and --rounds >= 1 (got {args.busy}, {args.rounds})")
    default_out = "speed-vs-llamacpp" + {"smollm2": "", "llama32-1b": "-1b"}.get(args.model, "-" + args.model)
    args.out = args.out or default_out
    pl = [int(x) for x in args.prompt_lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    kvs = args.kv_caches.split(",")
    bench = lcpp.LLAMACPP_BIN / "llama-bench"
    missing = [str(p) for p in (bench, lcpp.LLAMACPP_BIN / "llama-quantize") if not p.is_file()]
    if args.model == "smollm2" or args.model in RANDOM:     # through convert_hf_to_gguf.py
        missing += [m for m in lcpp.tools_missing() if m not in missing
                    if args.model == "smollm2" or not m.endswith("llama-imatrix")]
    if missing:
        print(f"llama.cpp's tools are missing ({', '.join(missing)}); set LLAMACPP_SRC / LLAMACPP_BIN",
              file=sys.stderr)
        return 2
    peers = args.peers.split(",")
    # made in a child: making a file loads a checkpoint, and every engine process started later
    # would count this process's size at its exec as its own peak (wait4's ru_maxrss)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        title, ours, theirs = pool.apply(model_files, (args.model, peers))
    engines = {"pyklei default": ("pyklei", ours, "auto"),
               **({"pyklei default, qai8dx": ("pyklei", ours, "qai8dx")} if args.one_plane else {}),
               **({"pyklei default, before": ("pyklei", ours, "auto", args.before.resolve())} if args.before else {}),
               **{f"llama.cpp {k}": ("llamacpp", theirs[k], None) for k in peers}}
    names = [n for e in engines for n in ((e, e + IDLE) if args.busy else (e,))]
    runs = {(e, t, kv): [] for kv in kvs for t in args.threads.split(",") for e in names}
    rss = {k: [] for k in runs}
    loads = []
    t_start = time.time()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        measure_rounds(args, engines, runs, depths, pl, bench, loads, busy, rss)
    finally:
        for b in busy:
            b.kill()
            b.wait()

    tests = [_key(f"pp{p}", d) for d in depths for p in pl] + [_key(f"tg{args.n_gen}", d) for d in depths]
    med = {k: {x: statistics.median(r[x] for r in v) for x in tests} for k, v in runs.items()}
    cpu = cpu_model()
    cmd = (f"python benchmarks/speed_vs_llamacpp.py --threads {args.threads} --rounds {args.rounds}"
           + (f" --model {args.model}" if args.model != "smollm2" else "")
           + (f" --peers {args.peers}" if args.peers != "Q4_K_M,Q4_0" else "")
           + (f" --prompt-lengths {args.prompt_lengths} --n-gen {args.n_gen}"
              if (args.prompt_lengths, args.n_gen) != ("128,512", 128) else "")
           + (f" --depths {args.depths}" if depths != [0] else "")
           + (f" --kv-caches {args.kv_caches}" if kvs != ["f16"] else "")
           + (f" --llamacpp-kv {args.llamacpp_kv}" if args.llamacpp_kv else "")
           + (f" --busy {args.busy}" if args.busy else "")
           + (" --one-plane" if args.one_plane else "")
           + (f" --before {args.before}" if args.before else "")
           + (f" --out {args.out}" if args.out != default_out else ""))
    lines = [f"# pyklei's default file beside llama.cpp {' / '.join(peers)}: {title}", "",
             f"`{cmd}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu}; "
             f"{time.time() - t_start:.0f} s; 1-min load average {min(loads):.1f}-{max(loads):.1f} "
             f"during the run ({os.cpu_count()} CPUs, shared). Tokens per second, median of "
             f"{args.rounds} alternating rounds (pp = prefill of N tokens, tg = decode; "
             f"@ dD: after D tokens of context). KV: pyklei's cache type and llama.cpp's "
             f"({', '.join(f'{k} = {llamacpp_kv(k, args.llamacpp_kv)}' for k in kvs)}; llama.cpp with -fa 1)."
             + (f" **{args.busy} busy-loop process{'es' if args.busy > 1 else ''} ran beside every "
                f"measurement.**" if args.busy else ""), "",
             "| engine | file | threads | KV | " + " | ".join(tests) + " | peak RSS |",
             "|---|---|---|---|" + "---|" * (len(tests) + 1)]
    for (e, t, kv), m in med.items():
        size = engines[e.removesuffix(IDLE)][1].stat().st_size / 1e6
        shown = args.llamacpp_kv or kv if e.startswith("llama.cpp") else kv   # the type it ran
        lines.append(f"| {e} | {size:.1f} MB | {t} | {shown} | " + " | ".join(f"{m[x]:.1f}" for x in tests)
                     + f" | {statistics.median(rss[(e, t, kv)]):.0f} MB |")
    lines += ["", "pyklei / llama.cpp, the same threads and "
              + (f"llama.cpp's cache {args.llamacpp_kv}" if args.llamacpp_kv else "cache type")
              + " (the ratio of the medians; in brackets the lowest and highest of the rounds' own ratios):", ""]

    def spread(ours, peer, x):
        r = [a[x] / b[x] for a, b in zip(runs[ours], runs[peer])]
        return f"({min(r):.2f}-{max(r):.2f})"
    for kv in kvs:
        for t in args.threads.split(","):
            for ours in (e for e in engines if e.startswith("pyklei")):
                for peer in (f"llama.cpp {k}" for k in peers):
                    r = [f"{x} **{med[(ours, t, kv)][x] / med[(peer, t, kv)][x]:.2f}** "
                         f"{spread((ours, t, kv), (peer, t, kv), x)}" for x in tests]
                    lines.append(f"- {ours} / {peer}, {t} thread{'s' if t != '1' else ''}, KV {kv}: "
                                 + ", ".join(r))
    if args.busy:
        lines += ["", "Busy / idle, each engine against itself in the same rounds:", ""]
        for (e, t, kv), m in med.items():
            if not e.endswith(IDLE):
                idle = med[(e + IDLE, t, kv)]
                lines.append(f"- {e}, {t} thread{'s' if t != '1' else ''}, KV {kv}: "
                             + ", ".join(f"{x} **{m[x] / idle[x]:.2f}**" for x in tests))
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = {"rounds": {f"{e} | {t} | {kv}": v for (e, t, kv), v in runs.items()},
               "peak_rss_mb": {f"{e} | {t} | {kv}": v for (e, t, kv), v in rss.items()}, "cpu": cpu,
               "loadavg": loads, "command": cmd, "title": title,
               "date": time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
               **({"llamacpp_kv": args.llamacpp_kv} if args.llamacpp_kv else {})}
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1))
    if args.out == "speed-vs-llamacpp" and "f16" in kvs and 0 in depths:   # the doc's table
        DOC.write_text(DOC_BLOCK.sub(lambda m: m.group(1) + doc_table(results) + m.group(2), DOC.read_text()))
    block = readme_block(args.out)
    for doc in TABLE_DOCS:                 # the doc that shows this run (speed-vs-llamacpp, -1b)
        if block.search(doc.read_text()):
            doc.write_text(block.sub(lambda m: m.group(1) + readme_table(results) + m.group(2),
                                     doc.read_text()))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
