#!/usr/bin/env python
"""Speculative decoding with prompt lookup (issue 25): decode speed with speculative="lookup"
beside plain decoding, on tasks whose reply quotes its input and on free-form chat; greedy (and two
chats sampled under one seed), and the two replies must be the same text (asserted).

    python benchmarks/speculative.py [--model M.gguf] [--threads 1] [--reps 3] [--max-tokens 300]

Tasks (chat prompts built from this repository's own files, so the run is reproducible):
  quote-summary  summarise a long document (docs/CLI.md, its first ~1,500 tokens), quoting it
  rename         rewrite a ~300-line Python file (pyklei/sampler.py) with a variable renamed
  form           fill a form (name, dates, places, ...) from a short biography
  rag            answer a question from a retrieved passage (docs/FORMAT.md), quoting it
  chat-*         free-form chat: a story, an explanation, advice, a poem (nothing to quote;
                 SmolLM2-135M's greedy replies repeat themselves, which lookup drafts from)
  chat-*-rp      the same with repetition_penalty 1.3 (both arms): replies that repeat little,
                 where drafts mostly fail and the off-switch has to keep lookup at plain speed
  chat-*-t0.8    two of them sampled at temperature 0.8, seed 1 (both arms: the same text)

Each task runs plain and lookup alternately, `reps` times each (the prompt is prefilled once:
the KV cache keeps it between runs, so every run decodes the same prompt); the speed is
generated tokens over this process's CPU time (with one thread, the time the decode itself
ran: robust on a machine shared with other work), the median of the reps; the ratio is lookup
over plain, and the wall-clock ratio is reported beside it. The load average of the machine
is recorded too: on a shared machine compare the ratios, not the absolute figures.

Predicted outputs: an edit of a Python file whose reply is mostly that file, plain, with
lookup and with the file as OpenAI's `prediction` (drafts from its start), alternated.

Engine: the quoting tasks twice each, 8 requests decoded together (pyklei.engine), plain
batching vs lookup drafts inside the batched steps; aggregate tokens over CPU time. With
--engine-draft-model FILE, a third arm drafts with that model (a KV cache slot per request).

llama.cpp (--llamacpp Q4_0, or another kind of benchmarks/llamacpp_quality.py; its tools from
LLAMACPP_BIN, the file made by its own llama-quantize from the same HF weights, cached): each
greedy task's prompt (the same chat-templated text) through `llama-lookup` with its n-gram
drafting (--spec-draft-n-max 3, its default, 8 and 16) and with none (0: its plain decode, the
same program), alternated with pyklei's arms in every rep. Its figures are its own decode speed
("decoded N tokens in S seconds", wall clock), so pyklei's wall-clock figures stand beside
them; the ratios: each engine's speculative over its plain, and pyklei lookup over llama.cpp's
best setting for that task. Sampled tasks (t0.8) are not run there.

--model may name another file: benchmarks/results/speculative-1b.md ran on the 1B-shaped random
model (scripts/make_llama32_1b_random.py, then `pyklei convert DIR --no-calibrate -o
llama1b-q4.gguf`), with --activations qai8dx (what a rotated file gets): its replies are noise,
so its ratios show the mechanics on a bigger model, not quoting.

Results: benchmarks/results/speculative.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyklei  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "pyklei" / "smollm2-135m-instruct-q4.gguf"

BIOGRAPHY = (
    "Grace Brewster Murray Hopper was born on December 9, 1906, in New York City. She earned a "
    "bachelor's degree in mathematics and physics from Vassar College in 1928, and a master's "
    "degree (1930) and a PhD in mathematics (1934) from Yale University. In 1943 she joined the "
    "United States Navy Reserve and was assigned to the Bureau of Ships Computation Project at "
    "Harvard University, where she programmed the Harvard Mark I. In 1949 she joined the "
    "Eckert-Mauchly Computer Corporation in Philadelphia, where she developed the A-0 compiler. "
    "Her work led to FLOW-MATIC and later to COBOL. She retired from the Navy in 1986 with the "
    "rank of rear admiral. She died on January 1, 1992, in Arlington, Virginia, and is buried in "
    "Arlington National Cemetery.")

FORM = ("Full name:\nDate of birth:\nPlace of birth:\nUniversity degrees:\nMilitary service:\n"
        "Employer in 1949:\nSoftware developed:\nDate of death:\nPlace of death:")


def _head(text: str, llm, n_tokens: int) -> str:
    """The text's first n_tokens tokens (cut at a line end)."""
    ids = llm.encode(text, add_bos=False)[:n_tokens]
    cut = llm.decode(ids)
    return cut[:cut.rfind("\n") + 1] or cut


def tasks(llm) -> list[tuple[str, str, str, dict]]:
    """(name, kind, user message, sampling options) of each task; kind "quote" or "chat"."""
    cli_doc = _head((ROOT / "docs" / "CLI.md").read_text(), llm, 1500)
    code = (ROOT / "pyklei" / "sampler.py").read_text()
    fmt = (ROOT / "docs" / "FORMAT.md").read_text()
    passage = _head(fmt, llm, 900)
    chats = [("chat-story", "Write a short story about a lighthouse keeper who finds a map."),
             ("chat-explain", "Explain why the sky is blue and sunsets are red."),
             ("chat-advice", "I want to start running. Give me a plan for the first month."),
             ("chat-poem", "Write a poem about autumn in a city.")]
    return [(n, k, m, {}) for n, k, m in [
        ("quote-summary", "quote",
         "Here is a document.\n\n" + cli_doc + "\n\nSummarise this document section by section. "
         "For each section, quote its most important sentences word for word."),
        ("rename", "quote",
         "Here is a Python file.\n\n```python\n" + code + "```\n\nRewrite the whole file with the "
         "variable `logits` renamed to `scores` everywhere. Output only the complete code."),
        ("form", "quote",
         BIOGRAPHY + "\n\nFill in this form from the text above, copying the facts exactly:\n\n"
         + FORM),
        ("rag", "quote",
         "Retrieved passage:\n\n" + passage + "\n\nUsing only the passage, answer: what does a "
         "pyklei model file store, and how are the weights laid out? Quote the passage."),
    ]] + [(n, "chat", m, {}) for n, m in chats] + [
        (n + "-rp", "chat", m, {"repetition_penalty": 1.3}) for n, m in chats] + [
        (n + "-t0.8", "chat", m, {"temperature": 0.8, "seed": 1}) for n, m in chats[:2]]


def reply_sources(prompt: list[int], reply: list[int], n: int = 4) -> tuple[float, float]:
    """What a reply is made of, as lookup sees it: the shares of its tokens whose n-gram
    (the token and the n - 1 before it) occurs in the prompt ("quoted"), or only earlier in
    the reply ("repeated": a loop). The rest is new text, which no lookup can draft."""
    text = list(prompt) + list(reply)
    seen_prompt = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    seen_reply: set = set()
    quoted = repeated = 0
    for i in range(len(prompt), len(text)):
        g = tuple(text[i - n + 1:i + 1])
        if g in seen_prompt:
            quoted += 1
        elif g in seen_reply:
            repeated += 1
        seen_reply.add(g)
    return quoted / max(len(reply), 1), repeated / max(len(reply), 1)


def run_task(llm, ids: list[int], spec, max_tokens: int, sampling: dict):
    """(response, decode tokens/s by the wall clock, by this process's CPU time). The prompt
    is cached after the first run, so a call is its decode (and a one-token prefill)."""
    w, c = time.perf_counter(), time.process_time()
    r = llm.generate(ids, max_tokens=max_tokens, speculative=spec,
                     **{"temperature": 0.0, **sampling})
    w, c = time.perf_counter() - w, time.process_time() - c
    return r, r.generation_tokens / w, r.generation_tokens / c


def pass_costs(llm, contexts=(100, 1000, 4000), rows=(1, 2, 4, 8), reps=7) -> dict:
    """CPU ms of one pass of n rows of one sequence after `context` cached tokens (n = 1: a
    decode step; more: Model.verify), the median of reps: what a drafted token costs."""
    m = llm.model
    ids = llm.encode((ROOT / "pyklei" / "sampler.py").read_text() * 2)
    out = {}
    for ctx in contexts:
        m.reset()
        m.eval(ids[:ctx])
        out[ctx] = {}
        for n in rows:
            ts = []
            for _ in range(reps):
                t = time.process_time()
                m.step(ids[ctx]) if n == 1 else m.verify(ids[ctx:ctx + n])
                ts.append(time.process_time() - t)
                m.truncate_seq(0, ctx)
            out[ctx][n] = round(statistics.median(ts) * 1e3, 2)
    m.reset()
    return out


def step_after_pass(llm, context=300, rows=9, reps=15) -> dict:
    """CPU ms of a decode step after `context` cached tokens, medians: in a run of steps (as
    plain decoding's), right after a verification pass of `rows` rows (as lookup's steps), and
    right after a busy wait as long as that pass (no memory traffic of this process): where the
    last two exceed the first, plain decoding's steps found weights still cached from the step
    before, which a pass's length lets other work evict (a shared last-level cache)."""
    m = llm.model
    ids = llm.encode((ROOT / "pyklei" / "sampler.py").read_text() * 2)
    m.reset()
    m.eval(ids[:context])
    tok = ids[context]

    def step() -> float:
        t = time.process_time()
        m.step(tok)
        t = time.process_time() - t
        m.truncate_seq(0, context)
        return t

    for _ in range(5):
        step()
    run = [step() for _ in range(reps)]
    after, waited, pass_s = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        m.verify(ids[context:context + rows])
        pass_s.append(time.perf_counter() - t)
        m.truncate_seq(0, context)
        after.append(step())
        t = time.perf_counter()
        while time.perf_counter() - t < pass_s[-1]:
            pass
        waited.append(step())
    m.reset()
    ms = lambda v: round(statistics.median(v) * 1e3, 2)
    return dict(context=context, rows=rows, run_ms=ms(run), after_pass_ms=ms(after),
                after_wait_ms=ms(waited), pass_ms=ms(pass_s), llc=last_level_cache())


def last_level_cache() -> str | None:
    """The size of this CPU's last-level cache as Linux reports it ("480 MiB"), or None."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    if not caches:
        return None
    size = caches[-1].read_text().strip()   # "491520K"
    return f"{int(size[:-1]) // 1024} MiB" if size.endswith("K") and size[:-1].isdigit() else size


LLAMACPP_DRAFTS = (3, 8, 16)     # llama-lookup's --spec-draft-n-max settings (3: its default)


def llamacpp_file(kind: str) -> Path:
    """llama.cpp's `kind` file of SmolLM2-135M-Instruct, made by its own tools (cached)."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llamacpp_quality as lcpp
    from models import smollm2_hf_dir

    from pyklei_dev.assets import cache_dir
    if not (lcpp.LLAMACPP_BIN / "llama-lookup").is_file():
        raise SystemExit(f"no llama-lookup in {lcpp.LLAMACPP_BIN} (set LLAMACPP_BIN)")
    return lcpp.make_files(smollm2_hf_dir(), cache_dir() / "llamacpp" / "smollm2", [kind],
                           log=lambda m: print(m, file=sys.stderr))[kind]


def llamacpp_lookup(path: Path, prompt: str, n_draft: int, max_tokens: int, threads: int,
                    sampling: dict) -> dict:
    """One greedy run of llama.cpp's llama-lookup (n_draft 0: no drafts, its plain decode):
    its decode tokens/s (its own clock), generated / drafted / accepted tokens, and the reply
    (stdout after the prompt)."""
    import llamacpp_quality as lcpp
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        cmd = [lcpp.LLAMACPP_BIN / "llama-lookup", "-m", path, "-f", f.name, "-n", max_tokens,
               "-t", threads, "-c", 8192, "-b", 8192,    # it evaluates the prompt as one batch
               "--temp", 0, "--spec-draft-n-max", n_draft,
               "--repeat-penalty", sampling.get("repetition_penalty", 1.0)]
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"llama-lookup failed (rc {r.returncode}): {r.stderr[-2000:]}")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s",
                  r.stderr)
    num = lambda key: int(re.search(rf"{key}\s+= (\d+)", r.stderr).group(1))  # noqa: E731
    marker = "<|im_start|>assistant\n"
    text = r.stdout[r.stdout.rfind(marker) + len(marker):]
    text = text[:-4] if text.endswith("\n" * 4) else text    # the two "\n\n" it ends with
    return dict(tps=float(m.group(3)), generated=int(m.group(1)), drafted=num("n_drafted"),
                accepted=num("n_accept"), text=text)


def llamacpp_arms(rows: list[dict], runs: dict) -> None:
    """Adds to each task's row llama.cpp's medians (runs: task -> arm -> list of results)."""
    for row in rows:
        got = runs.get(row["task"])
        if not got:
            continue
        med = {arm: statistics.median(x["tps"] for x in rs) for arm, rs in got.items()}
        plain = med.pop("plain")
        best = max(med, key=med.get)
        text = got["plain"][0]["text"]
        last = got[best][-1]
        n = min(len(text), len(last["text"]))
        row["llamacpp"] = dict(
            plain_tps=round(plain, 1), lookup_tps={a: round(v, 1) for a, v in med.items()},
            best=best, best_tps=round(med[best], 1), ratio=round(med[best] / plain, 3),
            drafted=last["drafted"], accepted=last["accepted"],
            # it stops a few tokens past -n (a draft's tail): compare the common length
            same_text=text[:n] == last["text"][:n],
            pyklei_vs_llamacpp=round(row["wall_lookup_tps"] / med[best], 3),
            plain_pyklei_vs_llamacpp=round(row["wall_plain_tps"] / plain, 3),
            plain_all=[round(x["tps"], 1) for x in got["plain"]],
            lookup_all={a: [round(x["tps"], 1) for x in rs] for a, rs in got.items()
                        if a != "plain"})


def engine_run(llm, prompts: list[list[int]], spec, max_tokens: int):
    """All prompts submitted at once to an Engine (one slot each), greedy: (texts, generated
    tokens, CPU s, wall s, drafted, accepted). spec: None, "lookup" or a draft Model (with a
    slot per prompt)."""
    from pyklei.runtime.engine import Engine
    from pyklei.runtime.sampler import SamplingParams

    eng = Engine(llm.model, llm.tokenizer, n_parallel=len(prompts), max_queue=len(prompts),
                 speculative=spec)
    try:
        w, c = time.perf_counter(), time.process_time()
        streams = [eng.submit(p, max_tokens=max_tokens, params=SamplingParams(temperature=0.0),
                              eos_ids=llm.eos_ids) for p in prompts]
        lasts, texts = [], []
        for st in streams:
            rs = list(st)
            texts.append("".join(r.text for r in rs))
            lasts.append(rs[-1])
        w, c = time.perf_counter() - w, time.process_time() - c
    finally:
        eng.shutdown(cancel=True)
    return (texts, sum(r.generation_tokens for r in lasts), c, w,
            sum(r.drafted_tokens for r in lasts), sum(r.accepted_tokens for r in lasts))


def engine_bench(args, reps: int, max_tokens: int) -> dict:
    """The quoting tasks, each twice (8 requests), decoded together by the engine: plain
    batching vs lookup drafts inside the batched steps (and a draft model's, with
    --engine-draft-model), alternated; aggregate tokens/s."""
    llm = pyklei.load(args.model, n_threads=args.threads, n_ctx=8192, n_seq=8,
                      activations=args.activations)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                                 add_generation_prompt=True, tokenize=True)
               for name, kind, msg, _ in tasks(llm) if kind == "quote"] * 2
    arms = {"plain": None, "lookup": "lookup"}
    if args.engine_draft_model:
        arms["draft"] = pyklei.load(args.engine_draft_model, n_threads=args.threads, n_ctx=8192,
                                    n_seq=8, activations=args.activations).model
    # prefill: the slots keep the prompts. The draft model fills its slots while the requests
    # decode (prefill_chunk rows a step, for all of them): 80 tokens give it the time to.
    for arm, spec in arms.items():
        engine_run(llm, prompts, spec, 80 if arm == "draft" else 1)
    cpu, wall = {a: [] for a in arms}, {a: [] for a in arms}
    texts, counts = {}, {}
    for rep in range(reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            t, n, c, w, d, a = engine_run(llm, prompts, arms[arm], max_tokens)
            assert texts.setdefault(arm, t) == t
            cpu[arm].append(n / c)
            wall[arm].append(n / w)
            counts[arm] = (n, d, a)
    for arm in arms:
        assert texts[arm] == texts["plain"], f"engine: {arm} changed a text"
    llm.close()
    p, wp = statistics.median(cpu["plain"]), statistics.median(wall["plain"])
    out = dict(requests=len(prompts), max_tokens=max_tokens, generated=counts["plain"][0],
               plain_tps=round(p, 1), wall_plain_tps=round(wp, 1),
               plain_cpu_tps_all=[round(x, 1) for x in cpu["plain"]])
    for arm in arms:
        if arm == "plain":
            continue
        c, w = statistics.median(cpu[arm]), statistics.median(wall[arm])
        n, d, a = counts[arm]
        pre = "" if arm == "lookup" else "draft_"
        out.update({f"{arm}_tps": round(c, 1), f"{pre}ratio": round(c / p, 3),
                    f"wall_{arm}_tps": round(w, 1), f"{pre}wall_ratio": round(w / wp, 3),
                    f"{pre}drafted": d, f"{pre}accepted": a,
                    f"{arm}_cpu_tps_all": [round(x, 1) for x in cpu[arm]]})
    if args.engine_draft_model:
        out["draft_model"] = Path(args.engine_draft_model).name
        arms["draft"].close()
    return out


def add_sources(rep: dict, args) -> None:
    """The quoted / repeated shares of each task's reply, its greedy reply decoded again (the
    same text as the run's: checked against its head)."""
    llm = pyklei.load(args.model, n_threads=2, n_ctx=8192, n_seq=1, activations=args.activations)
    by_name = {n: (m, samp) for n, _, m, samp in tasks(llm)}
    for row in rep["rows"]:
        msg, sampling = by_name[row["task"]]
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                                add_generation_prompt=True, tokenize=True)
        r = llm.generate(ids, max_tokens=rep["max_tokens"], **{"temperature": 0.0, **sampling})
        if r.text[:160] != row["reply_head"]:
            raise SystemExit(f"{row['task']}: the reply decoded now is not the run's")
        row["quoted"], row["repeated"] = reply_sources(ids, llm.encode(r.text, add_bos=False))
    llm.close()


def edit_task(llm) -> tuple[str, str]:
    """(user message, prediction) of the predicted-outputs task: edit a Python file (the first
    ~1,200 tokens of pyklei/sampler.py) and output all of it; the prediction is the file as it
    is, what a client that knows the reply is mostly that file sends (OpenAI's predicted
    outputs)."""
    code = _head((ROOT / "pyklei" / "sampler.py").read_text(), llm, 1200)
    msg = ("Here is a Python file.\n\n```python\n" + code + "```\n\nAdd a comment line "
           "'# checked' at the top. Output only the complete code.")
    return msg, "```python\n# checked\n" + code + "```"


def prediction_bench(llm, reps: int, max_tokens: int) -> dict:
    """The edit task (edit_task) plain, with speculative="lookup", and with the prediction,
    alternated; greedy; the same text in all three (asserted). CPU tok/s, medians."""
    msg, pred = edit_task(llm)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                            add_generation_prompt=True, tokenize=True)
    llm.generate(ids, max_tokens=1)
    arms = ["plain", "lookup", "prediction"]
    cpu = {a: [] for a in arms}
    texts, last = {}, {}
    for rep in range(reps):
        for arm in arms[rep % 3:] + arms[:rep % 3]:
            c = time.process_time()
            r = llm.generate(ids, max_tokens=max_tokens, temperature=0.0,
                             speculative="lookup" if arm == "lookup" else None,
                             prediction=pred if arm == "prediction" else None)
            cpu[arm].append(r.generation_tokens / (time.process_time() - c))
            texts[arm], last[arm] = r.text, r
    assert texts["plain"] == texts["lookup"] == texts["prediction"], "a draft changed the text"
    med = {a: statistics.median(v) for a, v in cpu.items()}
    return dict(prompt_tokens=len(ids), prediction_tokens=len(llm.encode(pred, add_bos=False)),
                generated=last["plain"].generation_tokens,
                tps={a: round(v, 1) for a, v in med.items()},
                ratio={a: round(med[a] / med["plain"], 3) for a in arms[1:]},
                drafted={a: last[a].drafted_tokens for a in arms[1:]},
                accepted={a: last[a].accepted_tokens for a in arms[1:]},
                reply_head=texts["plain"][:160])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--activations", default="auto", help="pyklei.load's activations")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--tasks", default="", help="comma-separated task names (default: all)")
    ap.add_argument("--engine-reps", type=int, default=2,
                    help="runs per arm of the 8-request engine batch (0: skip it)")
    ap.add_argument("--engine-max-tokens", type=int, default=200)
    ap.add_argument("--prediction-reps", type=int, default=3,
                    help="runs per arm of the predicted-outputs task (0: skip it)")
    ap.add_argument("--engine-draft-model", metavar="FILE",
                    help="a third engine arm: this draft model (same vocabulary)")
    ap.add_argument("--llamacpp", metavar="KIND", default="",
                    help="beside llama.cpp's llama-lookup on its own file of this kind "
                         "(Q4_0, Q4_K_M: benchmarks/llamacpp_quality.py; SmolLM2 only)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative"))
    ap.add_argument("--render", metavar="JSON", help="only write the .md of a results .json")
    ap.add_argument("--sources", action="store_true",
                    help="with --render: first add the replies' quoted / repeated shares to the "
                         "json (a run from before they were recorded), decoding each greedy "
                         "reply again with --model")
    args = ap.parse_args()
    if args.sources and not args.render:
        ap.error("--sources goes with --render FILE.json (it fills in a finished run's shares)")
    if args.render:
        try:
            rep = json.loads(Path(args.render).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--render {args.render}: not a results file this script wrote ({e})")
        rep["pass_costs_ms"] = {int(c): {int(n): v for n, v in row.items()}
                                for c, row in rep["pass_costs_ms"].items()}
        if args.sources:
            add_sources(rep, args)
            Path(args.render).write_text(json.dumps(rep, indent=1) + "\n")
        Path(args.render).with_suffix(".md").write_text(markdown(rep))
        return 0

    llm = pyklei.load(args.model, n_threads=args.threads, n_ctx=8192, n_seq=1,
                      activations=args.activations)
    lc_path = llamacpp_file(args.llamacpp) if args.llamacpp else None
    lc_runs: dict = {}
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    costs = pass_costs(llm)
    print("CPU ms of a pass of n rows, by context:", costs, flush=True)
    after = step_after_pass(llm)
    print("CPU ms of a step in a run of steps, after a pass, after a wait:", after, flush=True)
    rows = []
    for name, kind, msg, sampling in tasks(llm):
        if args.tasks and name not in args.tasks.split(","):
            continue
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                                add_generation_prompt=True, tokenize=True)
        llm.generate(ids, max_tokens=1)          # prefill once: every run below decodes
        tps = {"plain": [], "lookup": []}
        cpu = {"plain": [], "lookup": []}
        texts, last = {}, {}
        lc_arms = (["plain"] + [f"n{d}" for d in LLAMACPP_DRAFTS]
                   if lc_path and "temperature" not in sampling else [])
        if lc_arms:
            text = llm.tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                                     add_generation_prompt=True, tokenize=False)
            lc_runs[name] = {a: [] for a in lc_arms}
        for rep in range(args.reps):
            arms = ["plain", "lookup"] + ["lc-" + a for a in lc_arms]
            arms = arms[rep % len(arms):] + arms[:rep % len(arms)]   # each rep starts elsewhere
            for arm in arms:
                if arm.startswith("lc-"):
                    a = arm[3:]
                    lc_runs[name][a].append(llamacpp_lookup(
                        lc_path, text, 0 if a == "plain" else int(a[1:]), args.max_tokens,
                        args.threads, sampling))
                    continue
                r, wall_tps, cpu_tps = run_task(llm, ids, "lookup" if arm == "lookup" else None,
                                                args.max_tokens, sampling)
                tps[arm].append(wall_tps)
                cpu[arm].append(cpu_tps)
                if arm in texts:
                    assert texts[arm] == r.text, f"{name}: {arm} gave two texts"
                texts[arm], last[arm] = r.text, r
        assert texts["plain"] == texts["lookup"], f"{name}: lookup changed the text"
        plain, spec = statistics.median(cpu["plain"]), statistics.median(cpu["lookup"])
        wplain, wspec = statistics.median(tps["plain"]), statistics.median(tps["lookup"])
        r = last["lookup"]
        row = dict(task=name, kind=kind, prompt_tokens=r.prompt_tokens,
                   generated=r.generation_tokens, plain_tps=round(plain, 1),
                   lookup_tps=round(spec, 1), ratio=round(spec / plain, 3),
                   wall_plain_tps=round(wplain, 1), wall_lookup_tps=round(wspec, 1),
                   wall_ratio=round(wspec / wplain, 3),
                   drafted=r.drafted_tokens, accepted=r.accepted_tokens,
                   accept_rate=(round(r.accepted_tokens / r.drafted_tokens, 3)
                                if r.drafted_tokens else None),
                   drafted_share=round(r.accepted_tokens / max(r.generation_tokens, 1), 3),
                   plain_cpu_tps_all=[round(x, 1) for x in cpu["plain"]],
                   lookup_cpu_tps_all=[round(x, 1) for x in cpu["lookup"]],
                   plain_wall_tps_all=[round(x, 1) for x in tps["plain"]],
                   lookup_wall_tps_all=[round(x, 1) for x in tps["lookup"]],
                   identical=True, reply_head=texts["plain"][:160])
        row["quoted"], row["repeated"] = reply_sources(
            ids, llm.encode(texts["plain"], add_bos=False))
        rows.append(row)
        row["load"] = round(os.getloadavg()[0], 2)
        print(f"{name:16s} {row['generated']:4d} tok  cpu: plain {plain:6.1f}  lookup {spec:6.1f} "
              f"tok/s x{row['ratio']:.2f}  wall x{row['wall_ratio']:.2f}  accepted "
              f"{r.accepted_tokens}/{r.drafted_tokens}"
              f"  load {row['load']:.2f}", flush=True)
        if lc_arms:
            llamacpp_arms([row], lc_runs)
            lc = row["llamacpp"]
            print(f"{'':16s} llama.cpp: plain {lc['plain_tps']:6.1f}  lookup {lc['best']} "
                  f"{lc['best_tps']:6.1f} tok/s x{lc['ratio']:.2f}  pyklei lookup / llama.cpp "
                  f"x{lc['pyklei_vs_llamacpp']:.2f}  same text {lc['same_text']}", flush=True)
    predicted = None
    if args.prediction_reps:
        predicted = prediction_bench(llm, args.prediction_reps, args.max_tokens)
        print(f"predicted outputs (edit): plain {predicted['tps']['plain']} tok/s, lookup "
              f"x{predicted['ratio']['lookup']:.2f}, prediction x{predicted['ratio']['prediction']:.2f}"
              f"  accepted {predicted['accepted']['prediction']}/{predicted['drafted']['prediction']}",
              flush=True)
    llm.close()
    engine = None
    if args.engine_reps:
        engine = engine_bench(args, args.engine_reps, args.engine_max_tokens)
        print(f"engine, {engine['requests']} requests: cpu plain {engine['plain_tps']} lookup "
              f"{engine['lookup_tps']} tok/s x{engine['ratio']:.2f}  "
              f"wall x{engine['wall_ratio']:.2f}"
              f"  accepted {engine['accepted']}/{engine['drafted']}", flush=True)
        if "draft_ratio" in engine:
            print(f"engine, draft model {engine['draft_model']}: cpu {engine['draft_tps']} tok/s "
                  f"x{engine['draft_ratio']:.2f}  wall x{engine['draft_wall_ratio']:.2f}  "
                  f"accepted {engine['draft_accepted']}/{engine['draft_drafted']}", flush=True)
    load1 = os.getloadavg()
    report = dict(command="python benchmarks/speculative.py " + " ".join(sys.argv[1:]),
                  model=Path(args.model).name, threads=args.threads, reps=args.reps,
                  activations=llm.model.activations,
                  max_tokens=args.max_tokens, machine=platform.machine(), cpus=os.cpu_count(),
                  processor=platform.processor(), loadavg_start=load0, loadavg_end=load1,
                  wall_s=round(time.perf_counter() - t_start, 1),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), pass_costs_ms=costs,
                  step_after_pass=after, rows=rows, engine=engine, predicted=predicted, llamacpp=(
                      dict(kind=args.llamacpp, file=lc_path.name,
                           drafts=list(LLAMACPP_DRAFTS)) if lc_path else None))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


def markdown(rep: dict) -> str:
    def gmean(xs):
        return statistics.geometric_mean(xs) if xs else float("nan")
    quote = [r["ratio"] for r in rep["rows"] if r["kind"] == "quote"]
    chat = [r["ratio"] for r in rep["rows"] if r["kind"] == "chat"]
    lines = [
        "# Speculative decoding with prompt lookup (issue 25)", "",
        f"`{rep.get('command', 'python benchmarks/speculative.py')}` on {rep['model']} "
        f"(activations "
        f"{rep.get('activations', '?')}), {rep['date']}; greedy, chat "
        f"template; {rep['cpus']} CPUs ({rep['machine']}), shared with other work: load average "
        f"{rep['loadavg_start'][0]:.2f} at the start, {rep['loadavg_end'][0]:.2f} at the end. "
        f"Decode tokens/s by this process's CPU time (one thread: the time the decode ran, "
        f"whatever else the machine ran), median of {rep['reps']} runs per arm, the arms "
        f"alternated; ratio = lookup / plain; the wall-clock ratio beside it. Every lookup "
        f"reply is the plain reply, character for character (asserted).", "",
        f"Geometric mean of the ratios: quoting tasks x{gmean(quote):.2f}, free-form chat "
        f"x{gmean(chat):.2f}; lowest x{min(quote + chat, default=float('nan')):.2f}.", "",
        "Read with care (the replies are listed below): SmolLM2-135M's greedy replies loop, a "
        "random-weight model's are noise, and lookup drafts from a loop as well as from the "
        "prompt, so these ratios mix quoting with repetition, and free chat can gain too; the "
        "sampled chats (t0.8) repeat least and are the off-switch's test. The last column "
        "says which: the shares of the reply's tokens whose 4-gram is in the prompt (quoted) "
        "or only earlier in the reply (repeated: a loop).", "",
        "| task | prompt tok | generated | plain tok/s | lookup tok/s | ratio | wall ratio | "
        "drafted | accepted | accept rate | tokens from drafts | reply quoted / repeated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rep["rows"]:
        rate = f"{r['accept_rate']:.0%}" if r["accept_rate"] is not None else "-"
        lines.append(f"| {r['task']} | {r['prompt_tokens']} | {r['generated']} | "
                     f"{r['plain_tps']} | {r['lookup_tps']} | x{r['ratio']:.2f} | "
                     f"x{r['wall_ratio']:.2f} | {r['drafted']} | "
                     f"{r['accepted']} | {rate} | {r['drafted_share']:.0%} | "
                     + (f"{r['quoted']:.0%} / {r['repeated']:.0%} |" if 'quoted' in r else "- |"))
    e = rep.get("engine")
    if e:
        lines += ["", f"Engine (pyklei.engine, continuous batching): the {e['requests'] // 2} "
                  f"quoting tasks twice each, {e['requests']} requests decoded together in one "
                  f"slot each, {e['max_tokens']} tokens at most, greedy; aggregate tokens over "
                  f"the batch's CPU time, median of {len(e['plain_cpu_tps_all'])} runs per arm: "
                  f"plain batching {e['plain_tps']} tok/s, lookup {e['lookup_tps']} tok/s, "
                  f"x{e['ratio']:.2f} (wall x{e['wall_ratio']:.2f}); {e['accepted']} of "
                  f"{e['drafted']} drafted tokens accepted, {e['generated']} generated; every "
                  f"text the same as plain batching's (asserted)."]
        if "draft_ratio" in e:
            lines += ["", f"With the draft model {e['draft_model']} (a KV cache slot per "
                      f"request, its passes batched before each step): {e['draft_tps']} tok/s, "
                      f"x{e['draft_ratio']:.2f} plain batching (wall x{e['draft_wall_ratio']:.2f});"
                      f" {e['draft_accepted']} of {e['draft_drafted']} drafted tokens accepted; "
                      f"the same texts (asserted)."]
            if e["draft_model"] == rep["model"]:
                lines[-1] += (" The draft is the model itself (no smaller model of its vocabulary "
                              "here): its drafts all hold, but drafting a token costs what "
                              "decoding one does, so this shows what the mechanics cost, not "
                              "what a small draft would gain.")
    pr = rep.get("predicted")
    if pr:
        lines += ["", "Predicted outputs (OpenAI's `prediction`; pyklei.request's prediction=): "
                  f"edit a Python file ({pr['prompt_tokens']} prompt tokens) and output all of "
                  f"it, the file as it was ({pr['prediction_tokens']} tokens) the prediction; "
                  f"{pr['generated']} tokens generated, greedy, the three arms alternated, "
                  f"the same text in all (asserted). CPU tok/s, medians:", "",
                  "| plain | lookup | ratio | accepted / drafted | prediction | ratio | "
                  "accepted / drafted |", "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {pr['tps']['plain']} | {pr['tps']['lookup']} | x{pr['ratio']['lookup']:.2f} | "
                  f"{pr['accepted']['lookup']} / {pr['drafted']['lookup']} | "
                  f"{pr['tps']['prediction']} | x{pr['ratio']['prediction']:.2f} | "
                  f"{pr['accepted']['prediction']} / {pr['drafted']['prediction']} |", "",
                  f"Reply: `{excerpt(pr['reply_head'])}`"]
    lc_rows = [r for r in rep["rows"] if r.get("llamacpp")]
    if lc_rows:
        lc = rep["llamacpp"]
        sp = [r["llamacpp"]["ratio"] for r in lc_rows if r["kind"] == "quote"]
        vs = [r["llamacpp"]["pyklei_vs_llamacpp"] for r in lc_rows if r["kind"] == "quote"]
        mine = [r["wall_ratio"] for r in lc_rows if r["kind"] == "quote"]
        lines += ["", f"## Beside llama.cpp's prompt lookup", "",
                  f"llama.cpp's `llama-lookup` (n-gram drafting; greedy; 1 program for both arms: "
                  f"--spec-draft-n-max 0 is its plain decode) on its own {lc['kind']} file of the "
                  f"same weights ({lc['file']}, made by its llama-quantize), the same chat-"
                  f"templated prompts, {rep['threads']} thread(s), alternated with pyklei's arms "
                  f"in every rep. Decode tokens/s by the wall clock (llama.cpp's own decode "
                  f"timer; pyklei's wall figures), medians; llama.cpp's best of draft lengths "
                  f"{', '.join(map(str, lc['drafts']))} per task; \"same text\": its lookup reply "
                  f"is its plain one (over their common length: it stops a few tokens past the "
                  f"budget). Load average: the column.", "",
                  f"Quoting tasks, geometric means: llama.cpp lookup / its plain "
                  f"x{gmean(sp):.2f}; pyklei lookup / its plain (wall) x{gmean(mine):.2f}; "
                  f"pyklei lookup / llama.cpp's best lookup x{gmean(vs):.2f}.", "",
                  "| task | load | pyklei plain | pyklei lookup | ratio | llama.cpp plain | "
                  "llama.cpp lookup (best n) | ratio | pyklei / llama.cpp, lookup | "
                  "pyklei / llama.cpp, plain | llama.cpp accepted / drafted | "
                  "llama.cpp same text |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in lc_rows:
            x = r["llamacpp"]
            lines.append(f"| {r['task']} | {r.get('load', '-')} | {r['wall_plain_tps']} | "
                         f"{r['wall_lookup_tps']} | x{r['wall_ratio']:.2f} | {x['plain_tps']} | "
                         f"{x['best_tps']} ({x['best']}) | x{x['ratio']:.2f} | "
                         f"x{x['pyklei_vs_llamacpp']:.2f} | x{x['plain_pyklei_vs_llamacpp']:.2f} | "
                         f"{x['accepted']} / {x['drafted']} | {'yes' if x['same_text'] else 'no'} |")
    costs = rep["pass_costs_ms"]
    ns = list(next(iter(costs.values())))
    lines += ["", "What a drafted token costs: CPU ms of one pass of n rows of one sequence (n = 1 "
              "is a decode step, more is Model.verify), after a cached context of c tokens, and "
              "its ratio to the step:", "",
              "| context | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in ns) + " |",
              "|---:|" + "---:|" * len(ns)]
    for ctx, row in costs.items():
        base = row[ns[0]]
        lines.append(f"| {ctx} | " + " | ".join(f"{row[n]} (x{row[n] / base:.2f})" for n in ns)
                     + " |")
    short, long_ = costs[min(costs)], costs[max(costs)]
    lines += ["", f"What limits it: the gain of a draft is the tokens it adds per pass over "
              f"the pass's cost. Checking 1 drafted token (2 rows) costs "
              f"x{short[2] / short[1]:.2f} "
              f"a step after {min(costs)} tokens of context, but 3 drafted tokens (4 rows) "
              f"x{short[4] / short[1]:.2f} and 7 (8 rows) x{short[8] / short[1]:.2f}: the "
              f"kernels' multi-row path is not free on this CPU, so even a fully accepted "
              f"8-row pass yields {8 / (short[8] / short[1]):.1f} tokens per step's time. After "
              f"{max(costs)} tokens of context every row also pays its own attention over it "
              f"(x{long_[2] / long_[1]:.2f} for 2 rows, x{long_[8] / long_[1]:.2f} for 8), which "
              f"is why a long prompt (rename) gains least. In the engine's batch the weights "
              f"are shared by the requests already, so a drafted row costs a large part of what "
              f"a request's own row does (pyklei.speculative.PassCost fits it per batch)."]
    sa = rep.get("step_after_pass")
    if sa:
        llc = f"; a {sa['llc']} last-level cache, shared" if sa["llc"] else ""
        lines += ["", f"Steps in a run, and after a pass: a decode step after {sa['context']} "
                  f"tokens took {sa['run_ms']} CPU ms in a run of steps (as plain decoding's), "
                  f"{sa['after_pass_ms']} right after a {sa['rows']}-row verification pass "
                  f"(x{sa['after_pass_ms'] / sa['run_ms']:.2f}, as lookup's steps and passes), "
                  f"and {sa['after_wait_ms']} after a busy wait as long as that pass "
                  f"({sa['pass_ms']} ms; x{sa['after_wait_ms'] / sa['run_ms']:.2f}). Where the "
                  f"last two exceed the first, plain decoding's steps found weights still cached "
                  f"from the step before ({rep['model']}{llc}), which the time a pass takes lets "
                  f"other work evict: plain decoding gains from it, lookup's passes far less, "
                  f"and every ratio above is lower for it (by up to that factor)."]
    lines += ["", "Replies (first 160 characters, the same in both arms):", ""]
    for r in rep["rows"]:
        lines.append(f"- {r['task']}: `{excerpt(r['reply_head'])}`")
    return "\n".join(lines) + "\n"


def excerpt(text: str) -> str:
    """A reply's first 160 characters for a Markdown code span: newlines as " / ", backquotes as
    quotes, and other control characters escaped (a random-weight model's replies hold NULs,
    which made git take the results file for a binary one)."""
    text = text[:160].replace("\n", " / ").replace("`", "'")
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


if __name__ == "__main__":
    raise SystemExit(main())
