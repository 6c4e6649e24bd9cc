#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs pyklei with its test extras (torch is
# the local CPU build, torch==2.13.0), runs the pytest suite, then the C kernel tests natively,
# under ASan/UBSan and cross-compiled for aarch64 under qemu (scripts/test_arm.sh installs the
# Debian cross toolchain and qemu-user when they are missing). The server tests want chromium
# and its driver (the chat page in a headless browser) and nginx (two replicas behind it):
# installed here with apt-get when missing, so CI runs those tests rather than skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."
need_pkgs=()
command -v chromium >/dev/null || need_pkgs+=(chromium)
command -v chromedriver >/dev/null || need_pkgs+=(chromium-driver)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need_pkgs+=(nginx-light)
if [ ${#need_pkgs[@]} -gt 0 ] && command -v apt-get >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "[test.sh] installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # apt-get update only when the package lists cannot satisfy the install
    if ! $SUDO apt-get install -y --no-install-recommends "${need_pkgs[@]}" >/dev/null 2>&1; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends "${need_pkgs[@]}" >/dev/null
    fi
fi
python -m pip install --quiet --disable-pip-version-check -e '.[test]'
python -m pytest -q -m "not slow" "$@"
bash scripts/test_arm.sh
bash scripts/test_sanitizers.sh
