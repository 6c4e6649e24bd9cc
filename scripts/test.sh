#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs pyklei with its test extras (torch is
# the local CPU build, torch==2.13.0), runs the pytest suite, then the C kernel tests natively,
# under ASan/UBSan and cross-compiled for aarch64 under qemu (scripts/test_arm.sh installs the
# Debian cross toolchain and qemu-user when they are missing).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e '.[test]'
python -m pytest -q -m "not slow" "$@"
bash scripts/test_arm.sh
bash scripts/test_sanitizers.sh
