"""Tokenizer speed: pyklei.Tokenizer beside the Hugging Face `tokenizers` package.

    python benchmarks/bench_tokenizer.py [--repeat 3] [--vocab smollm2 llama3 llama2]

Encodes the test corpus (tests/fixtures/data/tokenizer_corpus.py, ~400 KB) text by text, then as one
joined document, and decodes the ids, with pyklei and with the reference tokenizers the tests
build (tests/text/test_tokenizer.py). Both run on one thread (TOKENIZERS_PARALLELISM=false,
sequential calls). Reports tokens/s (best of --repeat) and checks that the ids agree.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))   # paths.py, which the test module imports


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vocab", nargs="*", default=["smollm2", "llama3", "llama2"])
    args = ap.parse_args()

    tests = _load("bench_test_tokenizer", ROOT / "tests" / "text" / "test_tokenizer.py")
    texts = tests.CORPUS
    doc = "\n".join(texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    print(f"corpus: {len(texts)} texts, {nbytes} bytes; best of {args.repeat}; one thread")
    print(f"{'vocab':8} {'what':14} {'tokens':>8} {'pyklei tok/s':>14} {'tokenizers tok/s':>17} {'ratio':>6}  ids")
    for name in args.vocab:
        try:
            t0 = time.perf_counter()
            ours = tests._ours(name)
            load = time.perf_counter() - t0
            ref = tests._reference(name)
        except BaseException as e:  # pytest.skip raises a BaseException subclass
            print(f"{name:8} skipped: {e}")
            continue
        print(f"{name:8} load from GGUF: {load * 1000:.0f} ms")

        t_ours, ids_ours = _best(lambda: [ours.encode(t, add_bos=False) for t in texts], args.repeat)
        t_ref, ids_ref = _best(lambda: [ref.encode(t, add_special_tokens=False).ids for t in texts], args.repeat)
        n = sum(map(len, ids_ref))
        same = "same" if ids_ours == ids_ref else "DIFFER"
        print(f"{name:8} {'encode texts':14} {n:8d} {n / t_ours:14,.0f} {n / t_ref:17,.0f} {t_ref / t_ours:6.2f}  {same}")

        t_ours, d_ours = _best(lambda: ours.encode(doc, add_bos=False), args.repeat)
        t_ref, d_ref = _best(lambda: ref.encode(doc, add_special_tokens=False).ids, args.repeat)
        n = len(d_ref)
        same = "same" if d_ours == d_ref else "DIFFER"
        print(f"{name:8} {'encode doc':14} {n:8d} {n / t_ours:14,.0f} {n / t_ref:17,.0f} {t_ref / t_ours:6.2f}  {same}")

        t_ours, s_ours = _best(lambda: [ours.decode(i) for i in ids_ref], args.repeat)
        t_ref, s_ref = _best(lambda: [ref.decode(i, skip_special_tokens=False) for i in ids_ref], args.repeat)
        n = sum(map(len, ids_ref))
        same = "same" if s_ours == s_ref else "DIFFER"
        print(f"{name:8} {'decode texts':14} {n:8d} {n / t_ours:14,.0f} {n / t_ref:17,.0f} {t_ref / t_ours:6.2f}  {same}")

        def stream():
            out = []
            for ids in ids_ref:
                det = ours.detokenizer()
                out.append("".join(det.add_token(i) for i in ids) + det.finalize())
            return out
        t_ours, _ = _best(stream, args.repeat)
        print(f"{name:8} {'stream detok':14} {n:8d} {n / t_ours:14,.0f} {'-':>17} {'-':>6}")


if __name__ == "__main__":
    main()
