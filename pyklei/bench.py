"""llama-bench-style measurements: prefill of N tokens, decode of N tokens, medians of repeats,
cost per million tokens.

    report = run_bench("smollm2.gguf", prompt_lengths=[64, 512], n_gen=128, threads=[1, 2])
    print(bench_text(report))                    # what `pyklei bench` prints (--json: report)

measure_speed is the loop itself, for any engine that has prefill(ids) -> logits of the last
position (from an empty context) and step(token) -> logits: `pyklei bench` runs it on a pyklei
model, benchmarks/compare.py on pyklei, llama.cpp and transformers alike.

- prefill: tok/s = N / the median time of the forward pass over N prompt tokens; TTFT = the
  median time of that pass and the choice of the first (greedy) token.
- decode: N greedy steps after a prefill of `decode_context` tokens, sampling excluded;
  tok/s = N / the median time.
- depth D (llama-bench's -d): every test starts from D tokens already in the cache, prefilled
  untimed before each run: prefill of N tokens at positions D.., decode of N tokens from D.
- cost: price per hour / 3600 / (tok/s) x 1e6 = USD per million tokens for the whole machine.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ._report import mb, plural, table
from .runtime.options import model_default

WARMUP_TOKENS = 8       # one prefill before the measured runs: touches the weights once
DECODE_CONTEXT = 1      # prompt tokens before `pyklei bench`'s decode test
MIN_BENCH_CTX = 16      # run_bench's smallest default context


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def cost_per_mtok(price_per_hour: float | None, tps: float) -> float | None:
    """USD per million tokens at tps tokens/s on a machine of price_per_hour USD (None: no price)."""
    if price_per_hour is None or not tps or not math.isfinite(tps):
        return None
    return price_per_hour / 3600.0 / tps * 1e6


def measure_speed(prefill: Callable[[list[int]], np.ndarray], step: Callable[[int], np.ndarray],
                  tokens: Callable[[int], list[int]], prompt_lengths: Sequence[int], n_gen: int,
                  repeats: int = 3, decode_context: int = DECODE_CONTEXT,
                  warmup: int = WARMUP_TOKENS,
                  progress: Callable[[int, int, str], None] | None = None, depth: int = 0,
                  extend: Callable[[list[int]], np.ndarray] | None = None) -> dict:
    """Prefill speed and TTFT for each prompt length, and decode speed, each the median of
    `repeats` runs (see the module doc). tokens(n) gives n prompt tokens; it is called for every
    run. With depth > 0 each run first prefills `depth` tokens (untimed), and the timed prompt
    goes through extend(ids) (the engine's eval continuing its cache); decode starts at depth.
    progress(i, n, stage): i of n runs done, `stage` ("warm-up", "prefill 64", "decode 128")
    next. -> {"prefill": [{"tokens", "tok_s", "ttft_s", "samples_s"}, ...], "decode":
    {"tokens", "tok_s", "ms_per_token", "samples_s"} or None when n_gen is 0, "depth"}."""
    if depth and extend is None:
        raise ValueError("a depth needs extend(), the engine's eval continuing its cache")
    n_runs = 1 + repeats * (len(prompt_lengths) + (1 if n_gen else 0))
    done = 0

    def tick(stage):
        nonlocal done
        if progress:
            progress(done, n_runs, stage)
        done += 1

    tick("warm-up")
    prefill(tokens(warmup))
    res = {"prefill": [], "decode": None, "depth": depth}
    at = f" @ {depth}" if depth else ""
    for p in prompt_lengths:
        dts, ttfts = [], []
        for _ in range(repeats):
            tick(f"prefill {p}{at}")
            if depth:
                prefill(tokens(depth))
            toks = tokens(p)
            t = time.perf_counter()
            logits = extend(toks) if depth else prefill(toks)
            dts.append(time.perf_counter() - t)
            int(np.argmax(logits))                  # the first token (greedy)
            ttfts.append(time.perf_counter() - t)
        res["prefill"].append({"tokens": p, "tok_s": p / _median(dts), "ttft_s": _median(ttfts),
                               "samples_s": dts})
    if n_gen:
        times = []
        for _ in range(repeats):
            tick(f"decode {n_gen}{at}")
            logits = prefill(tokens(depth or decode_context))
            t = time.perf_counter()
            for _ in range(n_gen):
                logits = step(int(np.argmax(logits)))
            times.append(time.perf_counter() - t)
        dt = _median(times)
        res["decode"] = {"tokens": n_gen, "tok_s": n_gen / dt, "ms_per_token": dt / n_gen * 1e3,
                         "samples_s": times}
    if progress:
        progress(done, n_runs, "done")
    return res


def _longest_test(prompt_lengths: Sequence[int], n_gen: int, depth: int) -> int:
    """Tokens the longest test holds: depth + a prompt, or depth (or DECODE_CONTEXT) + n_gen."""
    return max(depth + max(prompt_lengths, default=0), (depth or DECODE_CONTEXT) + n_gen if n_gen else 0)


def _check_fits(n_ctx: int, prompt_lengths: Sequence[int], n_gen: int, depth: int = 0) -> None:
    """Every test within the context, by token_budget's rule: a prefill of depth + N tokens
    with nothing generated, a decode of n_gen tokens after depth (or DECODE_CONTEXT)."""
    from .runtime.request import token_budget

    try:
        for p in prompt_lengths:
            token_budget(n_ctx, depth + p, 0)
        if n_gen:
            token_budget(n_ctx, depth or DECODE_CONTEXT, n_gen)
    except ValueError:
        longest = _longest_test(prompt_lengths, n_gen, depth)
        raise ValueError(f"--ctx-size {n_ctx} is smaller than the longest test ({longest} "
                         f"tokens)") from None


def _loadavg():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def run_bench(path, prompt_lengths: Sequence[int] = (64, 128, 512), n_gen: int = 128,
              threads: Sequence[int] | None = None, repeats: int = 3, seed: int = 0,
              price_per_hour: float | None = None, n_ctx: int | None = None,
              n_batch: int = model_default("n_batch"), kv_cache: str = model_default("kv_cache"),
              activations: str = model_default("activations"),
              progress: Callable[[int, int, str], None] | None = None, depth: int = 0) -> dict:
    """Loads the model once per thread count (default: the physical cores) and measures it
    with measure_speed on random ordinary tokens (the same for every thread count: `seed`),
    every test at `depth` tokens of context (default 0). n_ctx defaults to the longest test.
    progress(i, n, stage) counts runs over all thread counts. -> the report `pyklei bench
    --json` prints."""
    import gc

    from .formats.model_file import check_model_path, is_model_file
    from .hub import model_file
    from .runtime.generate import peak_rss_mb
    from .runtime.kernels import cpu_features, selected_kernel_for
    from .llm import LLM
    from .runtime.model import physical_cores

    path = check_model_path(model_file(path, is_model=is_model_file))   # org/name:file.gguf: fetched
    lengths = list(prompt_lengths)
    if depth < 0:
        raise ValueError(f"depth must be >= 0, not {depth}")
    n_ctx = n_ctx or max(_longest_test(lengths, n_gen, depth), MIN_BENCH_CTX)
    _check_fits(n_ctx, lengths, n_gen, depth)
    if not lengths and n_gen == 0:
        raise ValueError("nothing to measure: give -p lengths or -n > 0")
    thread_counts = list(threads or [physical_cores()])
    runs_per_thread = 1 + repeats * (len(lengths) + (1 if n_gen else 0))
    n_runs = runs_per_thread * len(thread_counts)
    report = {"model": str(path), "name": None, "file_bytes": path.stat().st_size, "params": None,
              "activations": activations, "kv_cache": kv_cache, "batch_size": n_batch,
              "ctx_size": n_ctx, "depth": depth, "repeats": repeats, "price_per_hour_usd": price_per_hour,
              "cpu_features": cpu_features(), "kernels": {}, "cpu_count": os.cpu_count(),
              "loadavg": _loadavg(), "results": []}
    for k, th in enumerate(thread_counts):
        base = k * runs_per_thread
        if progress:
            progress(base, n_runs, f"{th} thread(s): load")
        t0 = time.perf_counter()
        llm = LLM(path, n_threads=th, n_ctx=n_ctx, n_batch=n_batch, kv_cache=kv_cache,
                  activations=activations)
        load_s = time.perf_counter() - t0
        model = llm.model
        if report["params"] is None:   # the first load: the file read once, "auto" resolved
            activations = report["activations"] = model.activations
            kv_cache = report["kv_cache"] = model.kv_cache
            planes = 2 if activations == "qai8dx2" else 1
            report["params"] = sum(math.prod(t.shape) for t in model.file.tensors.values())
            report["name"] = model.file.metadata.get("general.name")
            report["kernels"] = {
                "decode": {f: selected_kernel_for(f, planes, activations) for f in ("qsi4c32", "qsi6c32", "qsi8cx")},
                "prefill": {f: selected_kernel_for(f, planes * n_batch, activations)
                            for f in ("qsi4c32", "qsi6c32", "qsi8cx")}}
        rng = np.random.default_rng(seed)
        normal = np.nonzero(np.asarray(llm.tokenizer.token_types) == 1)[0]
        pool = normal if normal.size else np.arange(model.vocab_size)

        def tokens(n):
            return [int(t) for t in rng.choice(pool, n)]

        def prefill(ids):
            model.reset()
            return model.eval(ids)

        def runs(i, n, stage, base=base, th=th):
            if progress:
                progress(base + i, n_runs, f"{th} thread(s): {stage}")

        def extend(ids):
            # eval takes the whole context (it reuses the cached prefix): the cached tokens
            # and the new ones, so only `ids` run
            return model.eval(model.cached_tokens + ids)

        m = measure_speed(prefill, model.step, tokens, lengths, n_gen, repeats,
                          warmup=min(WARMUP_TOKENS, n_ctx), progress=runs, depth=depth,
                          extend=extend)
        for r in m["prefill"] + ([m["decode"]] if m["decode"] else []):
            r["usd_per_mtok"] = cost_per_mtok(price_per_hour, r["tok_s"])
        res = {"threads": th, "load_s": load_s, **m, "state_bytes": model.state_bytes,
               "peak_rss_mb": peak_rss_mb()}
        report["results"].append(res)
        del llm, model
        gc.collect()
    report["loadavg_end"] = _loadavg()
    return report


def bench_text(rep: dict) -> str:
    """run_bench's report as the table `pyklei bench` prints."""
    price = rep["price_per_hour_usd"]
    head = (f"model: {rep['name'] or Path(rep['model']).name}  {mb(rep['file_bytes'])}, "
            f"{rep['params'] / 1e6:.1f} M params; activations {rep['activations']}, "
            f"KV {rep['kv_cache']}, batch {rep['batch_size']}, ctx {rep['ctx_size']}"
            + (f", depth {rep['depth']}" if rep.get("depth") else ""))
    at = f" @ {rep['depth']}" if rep.get("depth") else ""
    kd, kp = rep["kernels"]["decode"]["qsi4c32"], rep["kernels"]["prefill"]["qsi4c32"]
    cpu = (f"cpu: {' '.join(rep['cpu_features']) or 'baseline'} ({rep['cpu_count']} logical CPUs"
           + (f", 1-min load average {rep['loadavg'][0]:.1f} at the start" if rep.get("loadavg") else "")
           + (f", {rep['loadavg_end'][0]:.1f} at the end" if rep.get("loadavg_end") else "") + ")")
    kern = f"kernels (qsi4c32): decode {kd}, prefill {kp}"
    cols = ["threads", "test", "tok/s", "TTFT ms", "ms/token"]
    if price is not None:
        cols.append("$/M tokens")
    cols += ["load s", "peak RSS MB"]
    rows = [cols]
    for r in rep["results"]:
        tests = [(f"prefill {p['tokens']}{at}", p, f"{p['ttft_s'] * 1e3:.0f}",
                  f"{p['ttft_s'] / p['tokens'] * 1e3:.2f}") for p in r["prefill"]]
        if r["decode"]:
            d = r["decode"]
            tests.append((f"decode {d['tokens']}{at}", d, "-", f"{d['ms_per_token']:.2f}"))
        for i, (name, t, ttft, ms) in enumerate(tests):
            row = [str(r["threads"]), name, f"{t['tok_s']:.1f}", ttft, ms]
            if price is not None:
                row.append(f"{t['usd_per_mtok']:.4f}")
            first = i == 0
            row += [f"{r['load_s']:.2f}" if first else "", f"{r['peak_rss_mb']:.0f}" if first else ""]
            rows.append(row)
    lines = [head, cpu, kern, ""] + table(rows, right=range(2, len(cols)), rule=True)
    notes = [f"median of {plural(rep['repeats'], 'run')}; TTFT = prefill of the prompt + the first "
             f"(greedy) token; "
             + (f"every test after {rep['depth']} tokens of context (prefilled untimed)"
                if rep.get("depth") else "decode from an empty context") + ", sampling excluded"]
    if price is not None:
        notes.append(f"cost at ${price:g}/hour for the whole machine: $/M tokens = "
                     f"price / 3600 / (tok/s) x 1e6")
    return "\n".join(lines + [""] + notes)
