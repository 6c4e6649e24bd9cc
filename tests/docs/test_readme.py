"""README.md's Python snippets run as written, in order (the second uses the first's `llm`), on
the real SmolLM2 converted by pyklei: the smollm2_q4 fixture, put where the README loads it
from (~/.cache/pyklei/smollm2-135m-instruct-q4.gguf, under a HOME of the test's own).

The README's other blocks are tests/docs/test_docs.py's, which also checks that these three are
the README's Python blocks.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "=== README block"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def test_readme_python_snippets_run_as_written(smollm2_q4, tmp_path):
    blocks = python_blocks()
    assert len(blocks) == 3
    # the structured-output block needs the optional llguidance: without it, the others run
    have_llg = importlib.util.find_spec("llguidance") is not None
    blocks = blocks if have_llg else blocks[:2]
    home = tmp_path / "home"
    (home / ".cache" / "pyklei").mkdir(parents=True)
    (home / ".cache" / "pyklei" / "smollm2-135m-instruct-q4.gguf").symlink_to(smollm2_q4)
    script = "".join(f"print({MARK + ' ' + str(i)!r}, flush=True)\n{b}\n"
                     for i, b in enumerate(blocks))
    env = {k: v for k, v in os.environ.items() if k != "PYKLEI_CACHE"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env={**env, "HOME": str(home)})
    assert r.returncode == 0, r.stderr
    outs = re.split(rf"{MARK} \d+\n", r.stdout)[1:]
    assert len(outs) == len(blocks), r.stdout
    quick, engine, structured = outs + [""] * (3 - len(outs))
    assert "Paris" in quick                       # greedy "The capital of France is ... Paris."
    assert re.search(r"\nlength [\d.]+ [\d.]+ [\d.]+ [\d.]+\n", quick), quick   # the stats line
    # the joke: an instruct model answers in its template (a bare prompt printed nothing); the
    # reply is sampled without a seed, so a short one ("What's an idea?") is fair
    assert len(engine.split()) >= 2, engine
    if not have_llg:
        return
    person, yes_no = structured.splitlines()      # the JSON-schema reply parsed, then the regex's
    assert person.startswith("{'name': ") and "'age': " in person, structured
    assert yes_no in ("yes", "no"), structured
