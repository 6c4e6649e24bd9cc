#!/usr/bin/env bash
# The pytest suite under an emulated aarch64 CPython 3.11 (qemu-user), with pyklei._ext
# cross-built for aarch64.
#
#   scripts/test_arm_pytest.sh [--cpu cortex-a53|neoverse-n1|max] [pytest args...]
#
# Default: --cpu max, tests/kernels/test_kernels.py tests/formats/test_formats.py (the tests that need only
# numpy, pytest and hypothesis; the converter / tokenizer / HF-reference tests need torch,
# transformers, ... which are not fetched for aarch64 here).
#
# What it does (Debian 12, as root or via sudo; network: Debian apt + PyPI only):
#   - dpkg --add-architecture arm64 (once) and apt-get download Debian's arm64 python3.11
#     and its libraries, unpacked with dpkg -x into a private root (nothing arm64 is
#     installed on the host);
#   - pip download the aarch64 cp311 wheels of numpy (the host's numpy version), pytest,
#     hypothesis, unpacked into a private site directory;
#   - cythonizes pyklei_ext/_ext.pyx with the host's Cython and cross-compiles it with the C
#     sources setup.py uses (aarch64-linux-gnu-gcc, the same flags);
#   - stages a copy of pyklei/, pyklei_dev/ and tests/ in a temp dir
#     (so the host's x86 pyklei/_ext never shadows the aarch64 one, and nothing is written
#     into the checkout) and runs pytest in qemu-aarch64 -L <root>. sys.executable is a
#     wrapper script (qemu -0), so the tests' subprocesses run emulated too.
# The downloads are cached in $PK_ARM_CACHE (default ~/.cache/pyklei-arm-py).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

CPU=max
if [ "${1:-}" = "--cpu" ]; then CPU=$2; shift 2; fi
if [ $# -eq 0 ]; then set -- tests/kernels/test_kernels.py tests/formats/test_formats.py; fi

T0=$(date +%s)
say() { printf '[test_arm_pytest %3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { say "FAIL: $*"; exit 1; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

# ---- host tools ----------------------------------------------------------------------------
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
[ -e /usr/aarch64-linux-gnu/lib/libc.so ] || need+=(libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    $SUDO apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
        || { $SUDO apt-get update -qq && $SUDO apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
fi
PY=${PYTHON:-python3}
"$PY" -c "import Cython, numpy" 2>/dev/null \
    || die "$PY needs Cython and numpy (pip install -e '.[test]' or pip install cython numpy)"
NUMPY_VERSION=$("$PY" -c "import numpy; print(numpy.__version__)")

CACHE=${PK_ARM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyklei-arm-py}
ROOT=$CACHE/root
SITE=$CACHE/site-numpy-$NUMPY_VERSION
mkdir -p "$CACHE/debs" "$CACHE/wheels"

# ---- arm64 CPython 3.11 (Debian packages, unpacked) -----------------------------------------
DEBS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev
      libc6 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libuuid1
      libncursesw6 libtinfo6 libreadline8 libcrypt1 libgcc-s1 libstdc++6)
if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        say "dpkg --add-architecture arm64 (package lists only; nothing arm64 is installed)"
        $SUDO dpkg --add-architecture arm64
        $SUDO apt-get update -qq
    fi
    say "downloading Debian arm64 python3.11"
    ( cd "$CACHE/debs" && { apt-get download "${DEBS[@]/%/:arm64}" >/dev/null 2>&1 \
        || { $SUDO apt-get update -qq && apt-get download "${DEBS[@]/%/:arm64}" >/dev/null; }; } )
    rm -rf "$ROOT.tmp" && mkdir -p "$ROOT.tmp"
    for d in "$CACHE"/debs/*_arm64.deb; do dpkg -x "$d" "$ROOT.tmp"; done
    rm -rf "$ROOT" && mv "$ROOT.tmp" "$ROOT"
fi

# ---- aarch64 wheels -------------------------------------------------------------------------
if [ ! -d "$SITE/numpy" ]; then
    say "downloading aarch64 wheels (numpy==$NUMPY_VERSION, pytest, hypothesis)"
    "$PY" -m pip download -q --dest "$CACHE/wheels" --only-binary=:all: \
        --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 \
        --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
        "numpy==$NUMPY_VERSION" pytest hypothesis 2>&1 | grep -v "^WARNING: Location" || true
    rm -rf "$SITE.tmp" && mkdir -p "$SITE.tmp"
    for w in "$CACHE"/wheels/*.whl; do
        case "$w" in *numpy-*) case "$w" in *"numpy-$NUMPY_VERSION-"*) ;; *) continue ;; esac ;; esac
        "$PY" -m zipfile -e "$w" "$SITE.tmp"
    done
    rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
fi

# ---- cross-built extension + staged tree -------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyklei_arm_pytest.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/stage
mkdir -p "$STAGE" "$WORK/bin"
cp -r pyklei "$STAGE/pyklei"
find "$STAGE/pyklei" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
cp -r pyklei_dev "$STAGE/pyklei_dev"   # the tests' model files (not part of the package)
cp -r tests "$STAGE/tests"   # the tests, their fixtures and data (the self-check test's model)
find "$STAGE/tests" -name __pycache__ -prune -exec rm -rf {} +
cp pyproject.toml "$STAGE/"

say "cythonize + cross-compile pyklei._ext for aarch64"
"$PY" -m cython -3 -I pyklei_ext pyklei_ext/_ext.pyx -o "$WORK/_ext.c" >/dev/null
# as setup.py with PYKLEI_TEST_HOOKS=1 (a test build: tests/kernels/test_kernels.py's self-check tests
# break a kernel through the hook)
C_SOURCES=$(ls pyklei_ext/contract/*.c pyklei_ext/ops/*.c pyklei_ext/isa/*.c pyklei_ext/model/*.c \
            tests/kernels/c/pk_testhook.c 2>/dev/null)
source scripts/cflags.sh   # PK_CFLAGS: pyklei_ext/cflags.txt, as setup.py (-w: Cython's warnings)
# shellcheck disable=SC2086
aarch64-linux-gnu-gcc -shared -fPIC -O3 "${PK_CFLAGS[@]}" -w \
    -DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION -Ipyklei_ext \
    -I"$ROOT/usr/include/python3.11" -I"$ROOT/usr/include" -I"$SITE/numpy/_core/include" \
    "$WORK/_ext.c" $C_SOURCES -lm -o "$STAGE/pyklei/_ext.cpython-311-aarch64-linux-gnu.so"

# sys.executable = this wrapper, so subprocess.run([sys.executable, ...]) is emulated too
cat >"$WORK/bin/python3" <<EOF
#!/bin/sh
exec qemu-aarch64 -cpu "$CPU" -L "$ROOT" -0 "\$0" "$ROOT/usr/bin/python3.11" "\$@"
EOF
chmod +x "$WORK/bin/python3"

export PYTHONHOME=$ROOT/usr PYTHONPATH=$STAGE:$SITE PYTHONDONTWRITEBYTECODE=1
unset PYKLEI_KERNEL PYKLEI_LOG
say "emulated: $("$WORK/bin/python3" -c 'import platform, sys, numpy, pyklei; print(platform.machine(), "python", sys.version.split()[0], "numpy", numpy.__version__, "cpu features:", " ".join(pyklei.cpu_features()))')"
say "qemu-aarch64 -cpu $CPU: pytest $*"
cd "$STAGE"
rc=0
"$WORK/bin/python3" -m pytest -p no:cacheprovider -q "$@" || rc=$?
say "pytest exit status $rc"
exit $rc
