#!/usr/bin/env bash
# The C code under AddressSanitizer + UndefinedBehaviorSanitizer (a separate debug build).
#
#   scripts/test_sanitizers.sh [--no-python | --python-only]
#
# 1. tests/kernels/c/test_llama.c: the forward pass (pyklei_ext/model) with the whole kernel layer on
#    random tiny weights, Llama's shapes and each family's features (sliding windows and their
#    rings, q/k norms, biases, NoPE, partial RoPE, GeGLU, scales, soft cap): prefill vs decode,
#    chunking, batches vs solo rows, KV copies, bad tokens/positions, interrupts, bad
#    hyperparameters; LeakSanitizer on at exit.
# 2. tests/kernels/c/test_matmul.c --quick: every kernel this CPU runs against the reference.
# 3. (unless --no-python) the Python extension itself built with
#    PYKLEI_DEBUG_BUILD="-fsanitize=address,undefined" in a scratch copy of the tree, then
#    tests/formats/test_fuzz_loader.py (mutated model files through read_model -> Model -> forward)
#    and the fast reliability tests (threads and Ctrl-C, generation edges, hand-made hostile
#    files, converter failures: RELIABILITY below), with libasan preloaded into python.
#    Leak detection is off there (the interpreter keeps memory until exit by design), and the
#    RSS-based leak tests are left out (ASan's quarantine holds freed memory: RSS grows).
# Any sanitizer report fails the run (-fno-sanitize-recover, halt_on_error).
# Installs gcc/libasan with apt-get when missing. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_TESTS=1
C_TESTS=1
for arg in "$@"; do
    case "$arg" in
        --no-python) PYTHON_TESTS=0 ;;
        --python-only) C_TESTS=0 ;;
        *) echo "usage: $0 [--no-python | --python-only]" >&2; exit 2 ;;
    esac
done

T0=$(date +%s)
say() { printf '[sanitizers %3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyklei_sanitizers.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

SAN=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
probe() {
    echo 'int main(void){return 0;}' | gcc "${SAN[@]}" -x c - -o "$WORK/probe" 2>/dev/null && "$WORK/probe"
}
if ! probe; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    say "installing gcc and the sanitizer runtimes"
    export DEBIAN_FRONTEND=noninteractive
    if ! $SUDO apt-get install -y --no-install-recommends gcc libc6-dev libasan8 libubsan1 >/dev/null 2>&1; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends gcc libc6-dev libasan8 libubsan1 >/dev/null
    fi
    probe || { say "FAIL: gcc cannot build AddressSanitizer+UBSan programs"; exit 1; }
fi
say "$(gcc --version | head -1)"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
source scripts/cflags.sh   # PK_CFLAGS: pyklei_ext/cflags.txt, as setup.py
CFLAGS=(-O1 -g "${PK_CFLAGS[@]}" -Ipyklei_ext "${SAN[@]}")
KERNEL_SRCS=(pyklei_ext/contract/*.c pyklei_ext/ops/*.c pyklei_ext/isa/*.c)
# the fast reliability tests (runtime/test_leaks.py stays out: ASan's quarantine grows RSS)
RELIABILITY=(tests/runtime/test_threads_and_interrupts.py tests/runtime/test_generate_edges.py
             tests/formats/test_hostile_files.py
             tests/converters/test_converter_failures.py::test_converter_bad_shards_and_lying_configs)
FAILED=0

run_c() {   # NAME LOG-CHECK ARGS...
    local name=$1; shift
    local rc=0
    "$WORK/$name" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
    if [ $rc -eq 0 ] && tail -n 1 "$WORK/$name.log" | grep -qE '^[0-9]+ passed, 0 failed$' \
       && ! grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:' "$WORK/$name.log"; then
        say "  $name: ok: $(tail -n 1 "$WORK/$name.log")"
    else
        FAILED=1
        say "  $name: FAILED (exit $rc)"
        grep -E "ERROR|SUMMARY|runtime error|^FAIL|^    #[0-9]" "$WORK/$name.log" | head -40 | sed 's/^/    | /'
        tail -n 3 "$WORK/$name.log" | sed 's/^/    | /'
    fi
}

if [ $C_TESTS -eq 1 ]; then
    say "building tests/kernels/c/test_llama.c and tests/kernels/c/test_matmul.c with -fsanitize=address,undefined"
    # the kernel layer once for both programs, on every core
    TEST_SRCS=(tests/kernels/c/test_llama.c tests/kernels/c/test_matmul.c tests/kernels/c/pk_testhook.c)
    MODEL_SRCS=(pyklei_ext/model/*.c)
    pk_compile_objects gcc "$WORK/objs" "${TEST_SRCS[@]}" "${MODEL_SRCS[@]}" "${KERNEL_SRCS[@]}" -- "${CFLAGS[@]}" \
        || { say "FAIL: the sanitizer build did not compile"; exit 1; }
    O_LLAMA=${PK_OBJS[0]} O_MATMUL=${PK_OBJS[1]} O_HOOK=${PK_OBJS[2]}
    O_MODEL=("${PK_OBJS[@]:3:${#MODEL_SRCS[@]}}")
    O_KERNELS=("${PK_OBJS[@]:$((3 + ${#MODEL_SRCS[@]}))}")
    gcc "${CFLAGS[@]}" "$O_LLAMA" "${O_MODEL[@]}" "${O_KERNELS[@]}" -lm -o "$WORK/test_llama"
    gcc "${CFLAGS[@]}" "$O_MATMUL" "$O_HOOK" "${O_KERNELS[@]}" -lm -o "$WORK/test_matmul"
    say "test_llama (forward pass)"
    run_c test_llama --verbose
    say "test_matmul --quick (kernels)"
    run_c test_matmul --quick
fi

if [ $PYTHON_TESTS -eq 1 ]; then
    say "building pyklei._ext with PYKLEI_DEBUG_BUILD=-fsanitize=address,undefined (scratch copy)"
    SRC="$WORK/src"
    mkdir -p "$SRC"
    cp -r setup.py pyproject.toml pyklei pyklei_dev pyklei_ext tests "$SRC/"
    rm -f "$SRC"/pyklei/_ext*.so "$SRC"/pyklei_ext/_ext.c
    rm -rf "$SRC/build"
    # LDFLAGS: setup.py puts the sanitizer flags on the compile line only; the link needs them
    # too, so that the .so depends on libasan and libubsan
    # through ccache when it is installed (CI keeps its cache): the scratch copy's folder changes
    # every run, so paths are hashed relative to it (BASEDIR) and the -g output's folder not at all
    LAUNCH_CC=${CC:-gcc}
    command -v ccache >/dev/null && [[ "$LAUNCH_CC" != ccache* ]] && LAUNCH_CC="ccache $LAUNCH_CC"
    if ! (cd "$SRC" && CC="$LAUNCH_CC" CCACHE_BASEDIR="$SRC" CCACHE_NOHASHDIR=true PYKLEI_DEBUG_BUILD="-fsanitize=address,undefined -fno-sanitize-recover=undefined" \
            LDFLAGS="${LDFLAGS:-} -fsanitize=address,undefined" \
            python setup.py -q build_ext --inplace -j "$(nproc)" >"$WORK/build.log" 2>&1); then
        say "  build FAILED"; tail -n 30 "$WORK/build.log" | sed 's/^/    | /'; exit 1
    fi
    LIBASAN=$(gcc -print-file-name=libasan.so)
    DEPS=$(ldd "$SRC"/pyklei/_ext*.so)
    [[ "$DEPS" == *libubsan* && "$DEPS" == *libasan* ]] || { say "  the extension is not linked to libasan/libubsan"; exit 1; }
    say "pytest tests/formats/test_fuzz_loader.py and the reliability tests (fast) under ASan+UBSan"
    rc=0
    # PYKLEI_TEST_TIME_SCALE: this build's C pass is many times slower (the Ctrl-C test's prefill
    # chunks of 256 rows took 0.5, 1.5 and 2.5 s here; the whole 8192-token prefill takes ~4 s in
    # the normal build), and Ctrl-C takes effect at a chunk's end, so the Ctrl-C tests'
    # wall-clock bounds are widened here, not in the normal run.
    (cd "$SRC" && LD_PRELOAD="$LIBASAN" PYKLEI_TEST_TIME_SCALE=4 \
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" PYTHONPATH="$SRC" \
        PYKLEI_FUZZ_EXAMPLES="${PYKLEI_FUZZ_EXAMPLES:-150}" PYKLEI_FUZZ_SECONDS="${PYKLEI_FUZZ_SECONDS:-60}" \
        python -m pytest -q -p no:cacheprovider -m "not slow" -k "not no_leak" \
            tests/formats/test_fuzz_loader.py "${RELIABILITY[@]}" >"$WORK/pytest.log" 2>&1) || rc=$?
    if [ $rc -eq 0 ] && ! grep -qE 'ERROR: AddressSanitizer|runtime error:' "$WORK/pytest.log"; then
        # the extension really was the sanitized one
        if (cd "$SRC" && LD_PRELOAD="$LIBASAN" ASAN_OPTIONS=detect_leaks=0 PYTHONPATH="$SRC" python -c \
              "import pyklei._ext as e, sys; sys.exit(0 if e.__file__.startswith('$SRC') else 1)"); then
            say "  pytest: ok: $(tail -n 1 "$WORK/pytest.log")"
        else
            FAILED=1; say "  pytest: FAILED: the sanitized extension was not the one imported"
        fi
    else
        FAILED=1
        say "  pytest: FAILED (exit $rc)"
        grep -E "ERROR: AddressSanitizer|SUMMARY|runtime error|^FAILED|^E  " "$WORK/pytest.log" | head -40 | sed 's/^/    | /'
        tail -n 5 "$WORK/pytest.log" | sed 's/^/    | /'
    fi
fi

if [ $FAILED -ne 0 ]; then
    say "FAILED"
    exit 1
fi
say "all sanitizer runs passed"
