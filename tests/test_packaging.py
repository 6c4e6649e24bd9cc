"""Packaging: scripts/ run on an installed pyklei whatever the install, and
scripts/build_wheels.sh (README "Wheels and platforms")."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_scripts_run_on_a_regular_install_layout(tmp_path):
    # A wheel's layout: pyklei/ alone (pyklei_dev/ is not installed). python -S keeps site's .pth
    # files out, so no editable install's finder can map pyklei into some checkout; the
    # dependencies come from this interpreter's path entries (none of them holding a pyklei) on
    # PYTHONPATH. The script runs from another directory, as a user would run it.
    site = tmp_path / "site"
    shutil.copytree(ROOT / "pyklei", site / "pyklei",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    cache = tmp_path / "cache"
    (cache / "llama32-1b-random").mkdir(parents=True)
    # an existing checkpoint: the script imports everything it uses, then skips the 2.5 GB write
    (cache / "llama32-1b-random" / "model.safetensors.index.json").write_text("{}")
    deps = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / "pyklei").exists()
            and not (Path(p) / "pyklei_dev").exists()]
    env = {**os.environ, "PYKLEI_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(site)] + deps)}
    script = ROOT / "scripts" / "make_llama32_1b_random.py"
    # the script as `python script` runs it (its directory first on sys.path), then which
    # copies of pyklei and pyklei_dev it ran on: the installed one, and the checkout's helpers
    probe = (f"import runpy, sys; sys.path[0] = {str(script.parent)!r}; "
             f"sys.argv = [{str(script)!r}]; runpy.run_path({str(script)!r}, run_name='__main__'); "
             "print(sys.modules['pyklei'].__file__, sys.modules['pyklei_dev'].__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", probe],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    made, used = r.stdout.strip().splitlines()
    assert made == str(cache / "llama32-1b-random")
    assert used.split() == [str(site / "pyklei" / "__init__.py"),
                            str(ROOT / "pyklei_dev" / "__init__.py")]


def test_build_wheels_script_parses_and_refuses_unknown_targets(tmp_path):
    for script in ("build_wheels.sh", "test_arm.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    # the arguments are checked before anything is installed or built
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheels.sh"), "--only", "riscv64",
                        str(tmp_path / "w")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_build_wheels_x86_64_installs_and_generates_without_a_compiler(tmp_path, request):
    if platform.machine() != "x86_64":
        pytest.skip("the x86_64 wheel is built natively")
    model = Path.home() / ".cache" / "pyklei" / "smollm2-135m-instruct-q4.gguf"
    if not model.is_file():
        model = request.getfixturevalue("smollm2_q4")
    out = tmp_path / "wheels"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheels.sh"), "--only", "x86_64",
                        str(out)], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "PYKLEI_WHEEL_MODEL": str(model)})
    assert r.returncode == 0, r.stderr[-3000:]
    wheels = [p.name for p in out.glob("*.whl")]
    assert len(wheels) == 1 and re.fullmatch(r"pyklei-.*-manylinux_2_\d+_x86_64\.whl", wheels[0])
    line = next(ln for ln in r.stderr.splitlines() if "generated with no compiler on PATH" in ln)
    assert "Paris" in line, line                  # greedy SmolLM2
