"""The `pyklei` command line, run as a user would: subprocesses on the real converted SmolLM2
(the smollm2_q4 fixture), and the chat REPL driven through a pseudo-terminal.

Every run uses one thread (-t 1) and few tokens: the machine is small and shared.
"""
import fcntl
import json
import math
import os
import re
import select
import shutil
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from child_watch import TIME_SCALE, sigint_as_in_a_terminal, thread_cpu_seconds, wait_for_thread_work
from paths import ROOT, SEED

TEXT = (
    "The river runs through the middle of the old town, and on summer evenings people walk "
    "along its banks to watch the boats come in. Most of the houses near the water were built "
    "more than two hundred years ago, when the town was a busy trading port. Today the old "
    "warehouses have become shops, cafes and small museums, but the narrow streets still follow "
    "the paths they did when merchants carried goods from the docks to the market square.\n"
)


def pyklei(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "pyklei", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def assert_user_error(r, command):
    """One line on stderr, 'pyklei COMMAND: error: ...', exit code 2, no traceback."""
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert "\n" not in err, f"expected one line, got:\n{r.stderr}"
    assert err.startswith(f"pyklei {command}: error: " if command else "pyklei: error: "), err
    return err


# ---- help ---------------------------------------------------------------------------------

def test_help_for_every_command():
    r = pyklei("--help")
    assert r.returncode == 0
    for cmd in ("convert", "generate", "chat", "bench", "info", "perplexity"):
        assert cmd in r.stdout
        h = pyklei(cmd, "--help")
        assert h.returncode == 0, h.stderr
        assert h.stdout.startswith(f"usage: pyklei {cmd}")
    h = pyklei("generate", "--help").stdout
    for opt in ("--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed",
                "--max-tokens", "--stop", "--threads", "--ctx-size", "--chat", "--stats"):
        assert opt in h
    h = pyklei("chat", "--help").stdout
    for s in ("/reset", "/stats", "/exit", "oldest turns are dropped", "Ctrl-C"):
        assert s in " ".join(h.split()), s
    h = pyklei("bench", "--help").stdout
    for s in ("--prompt-lengths", "--n-gen", "--threads", "--repeats", "--price-per-hour", "--json"):
        assert s in h


def test_console_script_is_installed():
    exe = shutil.which("pyklei")
    if exe is None:
        pytest.skip("the pyklei console script is not on PATH (pip install -e .)")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("pyklei ")



def test_sampling_flags_follow_the_schema():
    """The CLI's sampling flags are made from pyklei.sampler.SAMPLING_OPTIONS: their defaults
    are SamplingParams' and a value out of the schema's range is refused by both."""
    from pyklei.cli import build_parser
    from pyklei.cli._common import _sampling
    from pyklei.sampler import SAMPLING_OPTIONS, SamplingParams

    args = build_parser().parse_args(["generate", "m.gguf", "-p", "hi"])
    assert SamplingParams(**_sampling(args)) == SamplingParams()
    assert args.max_tokens == 128
    bad = {"max_tokens": "-2", "temperature": "-1", "top_k": "-1", "top_p": "0", "min_p": "1",
           "repetition_penalty": "0", "repetition_window": "-1", "seed": "x",
           "presence_penalty": "3", "frequency_penalty": "-2.5"}
    for o in SAMPLING_OPTIONS:
        r = pyklei("generate", "m.gguf", "-p", "hi", o.flags[-1], bad[o.name])
        assert o.flags[-1] in assert_user_error(r, "generate")
        if o.name not in ("max_tokens", "seed"):
            with pytest.raises(ValueError, match=f"{o.name} must be"):
                SamplingParams(**{o.name: o.kind(bad[o.name])})


def test_measure_speed_runs_any_engine():
    """pyklei.bench.measure_speed (pyklei bench and benchmarks/compare.py) on a fake engine:
    a warm-up, `repeats` prefills per length from an empty context, decode after
    decode_context tokens, one step per token."""
    import numpy as np

    from pyklei.bench import measure_speed

    calls = []

    def prefill(ids):
        calls.append(("prefill", len(ids)))
        return np.zeros(8, np.float32)

    def step(tok):
        calls.append(("step", tok))
        return np.zeros(8, np.float32)

    stages = []
    m = measure_speed(prefill, step, lambda n: [1] * n, [4, 16], n_gen=5, repeats=3,
                      decode_context=2, progress=lambda i, n, stage: stages.append((i, n, stage)))
    assert calls[0] == ("prefill", 8)
    assert [c for c in calls if c[0] == "prefill"][1:] == [("prefill", 4)] * 3 + \
        [("prefill", 16)] * 3 + [("prefill", 2)] * 3
    assert sum(c[0] == "step" for c in calls) == 15
    assert [p["tokens"] for p in m["prefill"]] == [4, 16]
    assert all(p["tok_s"] > 0 and p["ttft_s"] > 0 and len(p["samples_s"]) == 3 for p in m["prefill"])
    assert m["decode"]["tokens"] == 5 and len(m["decode"]["samples_s"]) == 3
    assert stages[0] == (0, 10, "warm-up") and stages[-1] == (10, 10, "done")
    assert measure_speed(prefill, step, lambda n: [1] * n, [4], n_gen=0, repeats=1)["decode"] is None

    # at a depth: each run prefills `depth` tokens untimed, then extends by the prompt; decode
    # starts from the depth
    calls.clear()

    def extend(ids):
        calls.append(("extend", len(ids)))
        return np.zeros(8, np.float32)

    m = measure_speed(prefill, step, lambda n: [1] * n, [4], n_gen=2, repeats=2, depth=100, extend=extend)
    assert calls[1:] == [("prefill", 100), ("extend", 4)] * 2 + [("prefill", 100), ("step", 0), ("step", 0)] * 2
    assert m["depth"] == 100
    with pytest.raises(ValueError, match="depth needs extend"):
        measure_speed(prefill, step, lambda n: [1] * n, [4], n_gen=0, depth=10)

# ---- generate -----------------------------------------------------------------------------

def test_generate_streams_and_prints_stats(smollm2_q4):
    r = pyklei("generate", smollm2_q4, "-p", "The capital of France is", "-n", "8",
               "--temperature", "0", "--stats", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    err = r.stderr
    assert re.search(r"prompt:\s+\d+ tokens?, [\d.]+ tok/s prefill", err), err
    assert re.search(r"generated:\s+8 tokens, [\d.]+ tok/s decode \(finish: length\)", err), err
    assert re.search(r"time to first token: \d+ ms; peak RSS: \d+ MB; load: [\d.]+ s", err), err


def test_generate_chat_template_and_stop(smollm2_q4, tmp_path):
    r = pyklei("generate", smollm2_q4, "--chat", "-p", "What is the capital of France?",
               "--system", "Answer in one sentence.", "-n", "24", "--temperature", "0", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    # plain continuation " Paris, France. ..." cut before the stop string, which is not printed
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is", encoding="utf-8")
    r = pyklei("generate", smollm2_q4, "-f", prompt, "-n", "16", "--temperature", "0",
               "--stop", ",", "--stop", "zzz", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Paris"


def test_generate_seed_is_repeatable(smollm2_q4):
    args = ("generate", smollm2_q4, "-p", "Once upon a time", "-n", "12", "--temperature", "1.0",
            "--top-k", "0", "--min-p", "0", "--seed", "1234", "-t", "1")
    a, b = pyklei(*args), pyklei(*args)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip()


SEA = "Give me three emojis about the sea."    # SmolLM2 answers in emojis of 2 tokens each


def test_a_reply_cut_inside_a_character_ends_before_it(smollm2_q4):
    """max_tokens that ends inside an emoji: the API (streamed or not, single or batched as the
    server runs it) and the CLI reply with the characters before it, no U+FFFD."""
    import pyklei

    llm = pyklei.load(smollm2_q4, n_threads=1, n_ctx=256)
    messages = [{"role": "user", "content": SEA}]
    # Where the greedy reply's tokens end inside a character: a streamed response that comes
    # more than one token after the one before (the tokens between added no complete text),
    # after some text (a cut in the first character would leave an empty reply).
    cut, before, n = None, "", 0
    for r in llm.chat(messages, max_tokens=40, temperature=0.0, stream=True):
        if r.generation_tokens > n + 1 and before:
            cut = n + 1
            break
        before, n = before + r.text, r.generation_tokens
    assert cut is not None and before, "the reply has no character split over tokens"

    llm.reset()
    r = llm.chat(messages, max_tokens=cut, temperature=0.0)
    assert (r.text, r.finish_reason, r.generation_tokens) == (before, "length", cut)
    llm.reset()
    parts = list(llm.chat(messages, max_tokens=cut, temperature=0.0, stream=True))
    assert "".join(p.text for p in parts) == before and parts[-1].finish_reason == "length"
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    (b,) = llm.generate_batch([ids], max_tokens=cut, temperature=0.0)
    assert b.text == before
    llm.close()

    r = subprocess.run([sys.executable, "-m", "pyklei", "generate", str(smollm2_q4), "--chat",
                        "-p", SEA, "-n", str(cut), "--temperature", "0", "-t", "1"],
                       capture_output=True, encoding="utf-8", timeout=180, cwd=ROOT,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert r.returncode == 0, r.stderr
    assert "\ufffd" not in r.stdout and r.stdout.strip() == before.strip()


@pytest.mark.parametrize("module", ["uvicorn", "starlette", "prometheus_client"])
def test_serve_without_its_extra_says_how_to_install_it_before_loading(module, tmp_path):
    """The serve extra's modules hidden (as if not installed): one line naming the pip command,
    exit 2, and the model is never loaded (loading raises here)."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "import pyklei.cli.serve as s\n"
            "def no_load(*a, **k): raise AssertionError('the model was loaded')\n"
            "s._load = no_load\n"
            "from pyklei.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    for model in (SEED, tmp_path / "absent.gguf"):
        r = subprocess.run([sys.executable, "-c", code, "serve", str(model), "--port", "0"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert_user_error(r, "serve")
        assert "pip install -e '.[serve]'" in r.stderr and module in r.stderr, r.stderr


def test_serve_checks_every_module_of_its_extra():
    import tomllib

    from pyklei.cli.route import ROUTE_EXTRA_MODULES
    from pyklei.cli.serve import SERVE_EXTRA_MODULES

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    # pyklei[grammar] (llguidance) is in the extra too, but the server starts without it: a
    # constrained request then gets a 400 naming it; httpx is `pyklei route`'s alone
    assert {re.split(r"[<>=!~\[ ;]", d)[0] for d in extra} - {"pyklei"} == \
        set(SERVE_EXTRA_MODULES) | set(ROUTE_EXTRA_MODULES)
    assert set(SERVE_EXTRA_MODULES) <= set(ROUTE_EXTRA_MODULES)


# ---- info / bench / perplexity ------------------------------------------------------------

def test_info(smollm2_q4):
    from pyklei.kernels import selected_kernel
    from pyklei.runtime.kernels import selected_kernel_for

    r = pyklei("info", smollm2_q4)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for s in ("SmolLM2-135M-Instruct", "architecture   llama", "134.5 M", "context        8192",
              "49152 tokens", "chat template  yes", "qsi4c32 (group 32)", "4.50", "cpu features"):
        assert s in out, s
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-8:]}
    assert set(rows) == {"q", "k", "v", "o", "gate", "up", "down", "lm_head"}
    assert rows["gate"][1:4] == ["1536", "x", "576"]
    # an unrotated file: auto runs qsi8d32 activations, one row per token
    assert rows["down"][-2:] == [selected_kernel_for("qsi4c32", 1, "qsi8d32"),
                                 selected_kernel_for("qsi4c32", 256, "qsi8d32")]

    info = json.loads(pyklei("info", smollm2_q4, "--json", "--activations", "qai8dx").stdout)
    assert info["m_decode"] == 1 and info["m_prefill"] == 256
    assert info["formats"]["qsi4c32"]["tensors"] == 30 * 7
    assert math.isclose(info["formats"]["qsi4c32"]["bits_per_weight"], 4.5)
    assert info["params"] == 134_515_008
    assert {r["decode_kernel"] for r in info["layers"] if r["format"] == "qsi4c32"} == \
        {selected_kernel("qsi4c32", 1)}


def test_info_of_llamacpps_smollm2(not_models):
    """`pyklei info` on llama.cpp's SmolLM2 GGUF: what it holds (checked against the gguf
    package's reading of it) and the convert line, as text and --json."""
    from collections import Counter

    import gguf

    src = not_models["llamacpp"]
    r = pyklei("info", src)
    assert r.returncode == 0, r.stderr
    for line in ("architecture   llama", "llama.cpp file type Q4_1", "context        8192 tokens",
                 "shape          30 layers, embedding 576, feed-forward 1536, heads 9 (kv 3), head dim 64",
                 "vocab          49152 tokens, byte-level BPE (pre-tokenizer smollm)",
                 "chat template  yes", f"pyklei convert {src} -o {src.stem}.pyklei.gguf"):
        assert line in r.stdout, (line, r.stdout)
    info = json.loads(pyklei("info", src, "--json").stdout)
    ref = gguf.GGUFReader(src)
    assert {k: v["tensors"] for k, v in info["tensor_types"].items()} == \
        dict(Counter(t.tensor_type.name for t in ref.tensors))
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in ref.tensors)
    assert info["params"] == sum(int(t.n_elements) for t in ref.tensors)
    assert info["tokenizer"]["vocab_size"] == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert info["hparams"]["tied_embeddings"] == ("output.weight" not in {t.name for t in ref.tensors})


def test_bench_json_and_table(smollm2_q4):
    r = pyklei("bench", smollm2_q4, "-p", "16", "-n", "8", "--repeats", "1", "-t", "1",
               "--price-per-hour", "0.1", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["file_bytes"] == Path(smollm2_q4).stat().st_size
    (res,) = rep["results"]
    assert res["threads"] == 1 and res["load_s"] > 0 and res["peak_rss_mb"] > 50
    (pp,) = res["prefill"]
    assert pp["tokens"] == 16 and pp["tok_s"] > 0 and pp["ttft_s"] > 0
    assert math.isclose(pp["usd_per_mtok"], 0.1 / 3600 / pp["tok_s"] * 1e6)
    assert res["decode"]["tokens"] == 8
    assert math.isclose(res["decode"]["usd_per_mtok"], 0.1 / 3600 / res["decode"]["tok_s"] * 1e6)

    r = pyklei("bench", smollm2_q4, "-p", "16", "-n", "8", "-r", "1", "-t", "1",
               "--price-per-hour", "0.1")
    assert r.returncode == 0, r.stderr
    for s in ("threads", "tok/s", "TTFT ms", "$/M tokens", "peak RSS MB", "prefill 16", "decode 8"):
        assert s in r.stdout, s

    r = pyklei("bench", smollm2_q4, "-p", "16", "-n", "4", "-r", "1", "-t", "1", "-d", "40",
               "--kv-cache", "q8")
    assert r.returncode == 0, r.stderr
    for s in ("KV q8", "ctx 56, depth 40", "prefill 16 @ 40", "decode 4 @ 40", "after 40 tokens"):
        assert s in r.stdout, s
    r = pyklei("bench", smollm2_q4, "-p", "16", "-n", "4", "-d", "40", "-c", "50")
    assert r.returncode == 2 and "--ctx-size 50 is smaller than the longest test (56 tokens)" in r.stderr


def test_bench_depth_runs_the_prompt_after_the_depth(smollm2_q4, monkeypatch):
    """run_bench(depth=D): each timed prefill runs only its N new tokens, at positions D.., on
    top of the D cached ones (Model.eval takes the whole context and reuses the cached prefix)."""
    from pyklei.bench import run_bench
    from pyklei.model import Model

    runs = []
    real = Model.eval

    def eval_spy(self, tokens, owner=None):
        out = real(self, tokens, owner)
        runs.append((len(tokens), self.last_eval_tokens))
        return out

    monkeypatch.setattr(Model, "eval", eval_spy)
    run_bench(smollm2_q4, prompt_lengths=[16], n_gen=0, threads=[1], repeats=2, depth=40)
    # warm-up 8; then per repeat: the depth (40 run), then 56 tokens of context of which 16 run
    assert runs == [(8, 8)] + [(40, 40), (56, 16)] * 2, runs


def test_perplexity(smollm2_q4, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT, encoding="utf-8")
    r = pyklei("perplexity", smollm2_q4, "-f", f, "--ctx-size", "64", "--stride", "32", "-t", "1")
    assert r.returncode == 0, r.stderr
    ppl = float(re.search(r"perplexity: ([\d.]+)", r.stdout).group(1))
    assert 2 < ppl < 100, ppl      # plain English under a real model; a broken one gives ~1e4
    assert "windows of 64 (stride 32)" in r.stdout


def test_convert_command(tiny64, tmp_path):
    hf, _ = tiny64
    out = tmp_path / "tiny.gguf"
    r = subprocess.run([sys.executable, "-m", "pyklei", "convert", str(hf), "-o", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=180, cwd=ROOT,
                       preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "converted" in r.stdout
    assert out.stat().st_mode & 0o777 == 0o640      # a new file's mode under the umask, not 0600
    assert_user_error(pyklei("convert", hf, "-o", out, "--no-progress"), "convert")
    r = pyklei("generate", out, "-p", "hello", "-n", "4", "-t", "1")
    assert r.returncode == 0, r.stderr


# ---- user mistakes ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def not_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("notmodels")
    (d / "notes.txt").write_text("not a model\n")
    from pyklei_dev.assets import smollm2_gguf
    return {"txt": d / "notes.txt", "dir": d, "llamacpp": smollm2_gguf()}


@pytest.mark.parametrize("args, command, expect", [
    (["generate", "{missing}", "-p", "hi"], "generate", "no such model file"),
    (["generate", "{txt}", "-p", "hi"], "generate", "not a GGUF file"),
    (["generate", "{llamacpp}", "-p", "hi"], "generate", "pyklei convert"),
    (["generate", "{dir}", "-p", "hi"], "generate", "pyklei convert"),
    (["chat", "{missing}"], "chat", "no such model file"),
    (["info", "{txt}"], "info", "not a GGUF file"),
    (["bench", "{llamacpp}", "-p", "8", "-n", "1"], "bench", "pyklei convert"),
    (["perplexity", "{model}", "-f", "{missing}"], "perplexity", "no such text file"),
    (["perplexity", "{model}"], "perplexity", "-f/--file"),
    (["generate", "{model}"], "generate", "-p PROMPT or -f FILE"),
    (["generate", "{model}", "-p", "hi", "--temperature", "-1"], "generate", "--temperature"),
    (["generate", "{model}", "-p", "hi", "--top-p", "0"], "generate", "--top-p"),
    (["generate", "{model}", "-p", "hi", "--min-p", "1"], "generate", "--min-p"),
    (["generate", "{model}", "-p", "hi", "-n", "many"], "generate", "--max-tokens"),
    (["generate", "{model}", "-p", "hi", "-t", "0"], "generate", "--threads"),
    (["generate", "{model}", "-p", "hi", "--ctx-size", "100000"], "generate", "context length"),
    (["generate", "{model}", "-p", "hi", "-c", "64", "-n", "100"], "generate", "--max-tokens"),
    (["bench", "{model}", "-p", "0"], "bench", "--prompt-lengths"),
    (["bench", "{model}", "--threads", "1,x"], "bench", "--threads"),
    (["bench", "{model}", "--price-per-hour", "-2"], "bench", "--price-per-hour"),
    (["perplexity", "{model}", "-f", "{txt}", "-c", "32", "--stride", "64"], "perplexity", "--stride"),
    (["convert", "{missing}", "-o", "{missing}.out"], "convert", "does not exist"),
    (["frobnicate"], "", "invalid choice"),
])
def test_user_mistakes_are_one_line_errors(args, command, expect, smollm2_q4, not_models, tmp_path):
    paths = {**not_models, "model": smollm2_q4, "missing": tmp_path / "missing.gguf"}
    r = pyklei(*(a.format(**paths) for a in args))
    err = assert_user_error(r, command)
    assert expect in err, err
    assert r.stdout == ""


def test_debug_shows_the_traceback(tmp_path):
    r = pyklei("generate", tmp_path / "missing.gguf", "-p", "hi", "--debug")
    assert r.returncode != 0
    assert "Traceback" in r.stderr and "no such model file" in r.stderr


# ---- the chat REPL through a pseudo-terminal ----------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\r")


class Terminal:
    """A child process on a pty that is its controlling terminal, so \\x03 is a real Ctrl-C
    (its SIGINT as in a terminal, whatever the test runner inherited). Timeouts are wall-clock
    ceilings, scaled by PYKLEI_TEST_TIME_SCALE."""

    def __init__(self, argv):
        self.fd, slave = os.openpty()
        env = dict(os.environ, TERM="dumb", INPUTRC="/dev/null", COLUMNS="120", LINES="40")

        def make_controlling_tty():
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            sigint_as_in_a_terminal()

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=ROOT, start_new_session=True,
                                     preexec_fn=make_controlling_tty)
        os.close(slave)
        self.raw = b""
        self.seen = ""       # everything read so far, escapes and \r removed

    def expect(self, pattern, timeout=90):
        """Reads until the text after the last match matches pattern; returns that text."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout * TIME_SCALE
        while True:
            text = ANSI.sub("", self.raw.decode("utf-8", "replace"))
            m = rx.search(text)
            if m:
                self.raw = text[m.end():].encode()
                self.seen += text[:m.end()]
                return text[:m.end()]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; screen:\n{text[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:       # EIO: the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"the program ended waiting for {pattern!r}:\n{text[-3000:]}")
                self.raw += data

    def type(self, text):
        os.write(self.fd, text.encode())

    def wait(self, timeout=20):
        return self.proc.wait(timeout * TIME_SCALE)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.fd)


PROMPT = r"\n> $"


@pytest.fixture
def terminal():
    terms = []

    def start(*args):
        t = Terminal([sys.executable, "-m", "pyklei", *map(str, args)])
        terms.append(t)
        return t

    yield start
    for t in terms:
        t.close()


def test_chat_repl_session(smollm2_q4, terminal):
    t = terminal("chat", smollm2_q4, "--temperature", "0", "-n", "300", "-t", "1", "-c", "1024")
    banner = t.expect(PROMPT)
    assert "pyklei chat" in banner and "/help" in banner

    t.type("What is the capital of France?\r")
    answer = t.expect(PROMPT)
    assert "Paris" in answer.split("France?", 1)[1]

    t.type("/stats\r")
    stats = t.expect(PROMPT)
    assert re.search(r"last reply: \d+ tokens at [\d.]+ tok/s", stats), stats
    assert re.search(r"context: \d+ of 1024 tokens in use; 1 turn in the history", stats), stats
    assert "peak RSS" in stats

    # Ctrl-C during a long reply stops it and returns to the prompt
    t.type("Write a long story about a dragon who learns to bake bread.\r")
    t.expect(r"bread\.\n")               # our line, echoed
    t.expect(r"\w+ \w+ \w+")              # the reply has started streaming
    t.type("\x03")
    stopped = t.expect(PROMPT, timeout=30)
    assert "[stopped]" in stopped

    # the REPL still works, and the conversation (with the partial reply) was kept
    t.type("/stats\r")
    stats = t.expect(PROMPT)
    assert "2 turns in the history" in stats, stats
    t.type("What is the capital of Italy?\r")
    t.expect(PROMPT)
    t.type("/stats\r")
    stats = t.expect(PROMPT)
    reused = int(re.search(r"(\d+) reused from the cache", stats).group(1))
    assert reused > 30, stats            # only the new turn ran

    t.type("/help\r")
    assert "/reset" in t.expect(PROMPT)
    t.type("/frob\r")
    assert "unknown command /frob" in t.expect(PROMPT)
    t.type("/reset\r")
    assert "conversation reset" in t.expect(PROMPT)
    t.type("/stats\r")
    assert "0 turns in the history" in t.expect(PROMPT)
    t.type("/exit\r")
    assert t.wait() == 0


def test_chat_drops_oldest_turns_and_ctrl_d_leaves(smollm2_q4, terminal):
    # 128 tokens with 40 kept for the reply: turns must be dropped by the fourth question
    # whatever the (greedy) answers' lengths (each turn is >= ~15 tokens with the template)
    t = terminal("chat", smollm2_q4, "--temperature", "0", "-n", "40", "-t", "1", "-c", "128",
                 "--system", "You are brief.")
    t.expect(PROMPT)
    notes = ""
    for q in ("Name a colour.", "Name a fruit.", "Name an animal.", "Name a city.", "Name a tree."):
        t.type(q + "\r")
        notes += t.expect(PROMPT)
    assert "[dropped the oldest" in notes and "128-token context" in notes
    t.type("/stats\r")
    stats = t.expect(PROMPT)
    used = int(re.search(r"context: (\d+) of 128", stats).group(1))
    assert used <= 128
    t.type("\x04")                        # Ctrl-D at the prompt
    assert t.wait() == 0


def test_chat_ctrl_c_during_a_long_prefill_keeps_the_model_right(smollm2_q4, terminal):
    """Issue 13's walk: ask, paste a ~9 KB message, Ctrl-C while its prompt is being run, ask
    again: the answer is as good as before (it was garbage until /reset when the C pass went on
    writing into the KV cache after the interrupt)."""
    t = terminal("chat", smollm2_q4, "--temperature", "0", "-n", "24", "-t", "1", "-c", "4096")
    t.expect(PROMPT)
    t.type("What is the capital of France?\r")
    assert "Paris" in t.expect(PROMPT).split("France?", 1)[1]
    for _ in range(11):                   # continued lines: a canonical tty line holds 4 KB
        t.type(TEXT.strip()[:1000] + " \\\r")
        t.expect(r"\.\.\. $")
    # Ctrl-C inside the prefill of ~2800 tokens: once the C pass (a thread of its own, runtime/model.py)
    # has run 0.3 s of CPU, whatever the machine's load; no reply text before "[stopped]"
    since = thread_cpu_seconds(t.proc.pid)
    t.type("Summarise this.\r")
    t.expect(r"Summarise this\.\n")
    wait_for_thread_work(t.proc.pid, 0.3, since)
    t.type("\x03")
    stopped = t.expect(PROMPT, timeout=30)
    assert stopped.replace("^C", "").split() == ["[stopped]", ">"], stopped
    t.type("What is the capital of France?\r")       # no /reset: the model must be right as is
    assert "Paris" in t.expect(PROMPT).split("France?", 1)[1]
    t.type("/exit\r")
    assert t.wait() == 0


@pytest.mark.parametrize("flags,expect", [
    (["--no-calibrate", "--gptq"], "--gptq belongs to the default GPTQ method"),
    (["--calibrate", "--no-rotate"], "--no-rotate belongs to the default GPTQ method"),
    (["--rotate"], "the default method rotates already"),
    (["--calibrate", "--rotate"], "cannot go with --rotate"),
    (["--recipe", "q4m", "--bits", "5"], "not allowed with argument"),
    (["--no-calibrate", "--bits", "4.2"], "below qsi4c32's 4.5"),
])
def test_convert_method_flags_that_do_not_mix_are_one_line_errors(tiny64, tmp_path, flags, expect):
    hf, _ = tiny64
    out = tmp_path / "x.gguf"
    err = assert_user_error(pyklei("convert", hf, "-o", out, "--no-progress", *flags), "convert")
    assert expect in err, err
    assert not out.exists()
