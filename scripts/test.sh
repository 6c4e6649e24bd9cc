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
# a test build: PYKLEI_TEST_HOOKS=1 links the PYKLEI_TEST_BREAK_KERNEL hook (tests/kernels/c/pk_testhook.c)
# that tests/kernels/test_kernels.py's self-check tests use, and PYKLEI_REQUIRE_TEST_HOOKS=1 makes
# them fail rather than skip without it. setuptools keeps an up-to-date extension built without
# the hook, so that one is rebuilt.
export PYKLEI_TEST_HOOKS=1 PYKLEI_REQUIRE_TEST_HOOKS=1
python -m pip install --quiet --disable-pip-version-check -e '.[test]'
if ! python -c "import ctypes, pyklei._ext as e; ctypes.CDLL(e.__file__).pk_test_hook_kernels_to_check" 2>/dev/null; then
    echo "[test.sh] rebuilding pyklei._ext with the test hook"
    python setup.py -q build_ext --inplace --force -j "$(nproc)"
fi
python -m pytest -q -m "not slow" "$@"
bash scripts/test_arm.sh
bash scripts/test_sanitizers.sh
