"""Packaging: scripts/ run on an installed pyklei whatever the install, and
scripts/build_wheels.sh (README "Wheels and platforms")."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scripts_run_on_a_regular_install_layout(tmp_path):
    # A wheel's layout: converters/ sits inside the package as pyklei/converters (setup.py's
    # package_dir). python -S keeps site's .pth files out, so no editable install's finder can
    # map pyklei.converters back into some checkout; the dependencies come from this
    # interpreter's path entries (none of them holding a pyklei) on PYTHONPATH.
    site = tmp_path / "site"
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "pyklei", site / "pyklei", ignore=skip)
    shutil.copytree(ROOT / "converters", site / "pyklei" / "converters", ignore=skip)
    cache = tmp_path / "cache"
    (cache / "llama32-1b-random").mkdir(parents=True)
    # an existing checkpoint: the script imports everything it uses, then skips the 2.5 GB write
    (cache / "llama32-1b-random" / "model.safetensors.index.json").write_text("{}")
    deps = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / "pyklei").exists()]
    env = {**os.environ, "PYKLEI_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(site)] + deps)}
    r = subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "make_llama32_1b_random.py")],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(cache / "llama32-1b-random")
