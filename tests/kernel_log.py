"""Shared by the tests of a kernel family's run-time choice: PYKLEI_KERNEL forces it and
PYKLEI_LOG=kernels names it (tests/test_rotation.py, tests/test_attention.py)."""
import os
import subprocess
import sys


def check_forced_choice(code: str, best: str, log_line: str) -> None:
    """Runs `code` (which prints the chosen ISA) with PYKLEI_KERNEL set to a tag, to a kernel
    name's suffix and unset: each prints what was forced (or `best`), and stderr holds
    log_line.format(want)."""
    for force, want in (("scalar", "scalar"), ("qai8dx_qsi4c32_1x1_scalar", "scalar"), (None, best)):
        env = {k: v for k, v in os.environ.items() if k != "PYKLEI_KERNEL"}
        env["PYKLEI_LOG"] = "kernels"
        if force:
            env["PYKLEI_KERNEL"] = force
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want
        assert log_line.format(want) in out.stderr
