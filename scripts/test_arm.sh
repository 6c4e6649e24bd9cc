#!/usr/bin/env bash
# Kernel and forward-pass tests for aarch64 under qemu-user, plus the same test programs natively.
#
#   scripts/test_arm.sh [--full] [--objects DIR]
#
# Cross-compiles tests/kernels/c/test_matmul.c (and the test hook, tests/kernels/c/pk_testhook.c) with the
# whole kernel layer (pyklei_ext/contract, pyklei_ext/ops, pyklei_ext/isa), and
# tests/kernels/c/test_llama.c with the kernel layer and the forward pass (pyklei_ext/model), for
# aarch64 (static), runs them under qemu-aarch64 with three CPU models
# and checks from test_matmul's output which code paths ran:
#   cortex-a53   features "neon"               -> neon kernels run, dotprod/i8mm skipped
#   neoverse-n1  features "neon dotprod"       -> neon + dotprod kernels run, i8mm skipped
#   max          features "neon dotprod i8mm"  -> every kernel runs
# (each also runs the KV cache's NEON f16 conversion and attention over f16 and q8 caches
# against the reference); test_llama (its --quick set: the Llama shapes and each family's
# features, a Gemma 3 shape past a sliding layer's ring, ~10-30 s a CPU) runs the forward pass
# on whichever kernels the CPU model has, and must end "<P> passed, 0 failed";
# then builds and runs both programs natively (scripts/test_sanitizers.sh runs both under
# AddressSanitizer + UBSan). --full runs the
# large shape set and every test_llama configuration under qemu too (slower).
# --objects DIR links the test programs with the aarch64 objects of a wheel build
# (DIR/pyklei_ext/{contract,ops,isa,model}/*.o, setuptools' build/temp.* directory;
# scripts/build_wheels.sh)
# instead of compiling the sources, so the qemu runs test the very code the wheel ships (a DIR
# without model objects: test_llama's forward pass is compiled from the tree, and says so); the
# native runs are then left out.
# Installs the toolchain with apt-get when missing (Debian 12; as root or via sudo).
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

FULL=0
OBJDIR=""
usage() { echo "usage: $0 [--full] [--objects DIR]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --full) FULL=1 ;;
        --objects) [ $# -ge 2 ] || usage; OBJDIR=$(cd "$2" && pwd); shift ;;
        *) usage ;;
    esac
    shift
done

T0=$(date +%s)
say() { printf '[test_arm %3ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { say "FAIL: $*"; exit 1; }

# ---- toolchain -----------------------------------------------------------------------------
need_pkgs=()
command -v aarch64-linux-gnu-gcc >/dev/null || need_pkgs+=(gcc-aarch64-linux-gnu)
[ -e /usr/aarch64-linux-gnu/lib/libc.a ] || need_pkgs+=(libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need_pkgs+=(qemu-user)
command -v gcc >/dev/null || need_pkgs+=(gcc libc6-dev)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "missing ${need_pkgs[*]} and not root (no sudo)"
        SUDO="sudo"
    fi
    say "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # apt-get update only when the package lists cannot satisfy the install
    if ! $SUDO apt-get install -y --no-install-recommends "${need_pkgs[@]}" >/dev/null 2>&1; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends "${need_pkgs[@]}" >/dev/null
    fi
fi
say "$(aarch64-linux-gnu-gcc --version | head -1); $(qemu-aarch64 --version | head -1)"

# ---- build -------------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyklei_test_arm.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# the kernel layer's sources, and the test program with the test hook (test builds only: the
# dispatcher's weak reference to it, ops/pk_dispatch.c); the forward pass and its test program
SRCS=(pyklei_ext/contract/*.c pyklei_ext/ops/*.c pyklei_ext/isa/*.c)
TEST_SRCS=(tests/kernels/c/test_matmul.c tests/kernels/c/pk_testhook.c)
MODEL_SRCS=(pyklei_ext/model/*.c)
LLAMA_SRCS=(tests/kernels/c/test_llama.c)
# the flags of setup.py (pyklei_ext/cflags.txt: no fp contraction), at the arch baseline, and
# its -O3: -O2 vectorizes less, and a cloned RoPE that became vfmaddsub passed at -O2 only
source scripts/cflags.sh
CFLAGS=(-O3 "${PK_CFLAGS[@]}" -Ipyklei_ext)
# the test program itself at -O2: Debian's aarch64-linux-gnu-gcc 12.2 crashes on it at -O3
# (internal compiler error in vect_transform_reduction)
TEST_CFLAGS=("${CFLAGS[@]/-O3/-O2}")

# build CC TAG [LDFLAGS...]: the kernel and model sources with CFLAGS, one object each (all
# cores at once), then $WORK/test_matmul_TAG (kernels) and $WORK/test_llama_TAG (kernels and
# forward pass)
build() {
    local cc=$1 tag=$2 kobjs mobjs
    shift 2
    pk_compile_objects "$cc" "$WORK/$tag.objs" "${SRCS[@]}" "${MODEL_SRCS[@]}" -- "${CFLAGS[@]}" \
        || die "$cc could not compile the sources"
    kobjs=("${PK_OBJS[@]:0:${#SRCS[@]}}")
    mobjs=("${PK_OBJS[@]:${#SRCS[@]}}")
    "$cc" "${TEST_CFLAGS[@]}" "$@" "${TEST_SRCS[@]}" "${kobjs[@]}" -lm -o "$WORK/test_matmul_$tag" \
        || die "$cc could not link test_matmul_$tag"
    "$cc" "${TEST_CFLAGS[@]}" "$@" "${LLAMA_SRCS[@]}" "${mobjs[@]}" "${kobjs[@]}" -lm -o "$WORK/test_llama_$tag" \
        || die "$cc could not link test_llama_$tag"
}

if [ -n "$OBJDIR" ]; then
    # the objects of the same sources as SRCS
    OBJS=("$OBJDIR"/pyklei_ext/contract/*.o "$OBJDIR"/pyklei_ext/ops/*.o "$OBJDIR"/pyklei_ext/isa/*.o)
    [ "${#OBJS[@]}" -eq "${#SRCS[@]}" ] \
        || die "$OBJDIR: ${#OBJS[@]} objects for ${#SRCS[@]} kernel sources"
    for o in "${OBJS[@]}"; do
        readelf -h "$o" | grep -q 'Machine:.*AArch64' || die "$o is not an aarch64 object"
    done
    say "linking tests/kernels/c/test_matmul.c with the ${#OBJS[@]} aarch64 objects of $OBJDIR (static)"
    aarch64-linux-gnu-gcc "${TEST_CFLAGS[@]}" -static "${TEST_SRCS[@]}" "${OBJS[@]}" -lm \
        -o "$WORK/test_matmul_aarch64"
    KOBJS=("${OBJS[@]}")
    shopt -s nullglob
    MOBJS=("$OBJDIR"/pyklei_ext/model/*.o)
    shopt -u nullglob
    if [ "${#MOBJS[@]}" -eq 0 ]; then
        say "$OBJDIR has no pyklei_ext/model objects: compiling the forward pass from the tree for test_llama"
        pk_compile_objects aarch64-linux-gnu-gcc "$WORK/model.objs" "${MODEL_SRCS[@]}" -- "${CFLAGS[@]}" \
            || die "aarch64-linux-gnu-gcc could not compile the forward pass"
        MOBJS=("${PK_OBJS[@]}")
    else
        [ "${#MOBJS[@]}" -eq "${#MODEL_SRCS[@]}" ] \
            || die "$OBJDIR: ${#MOBJS[@]} objects for ${#MODEL_SRCS[@]} model sources"
        for o in "${MOBJS[@]}"; do
            readelf -h "$o" | grep -q 'Machine:.*AArch64' || die "$o is not an aarch64 object"
        done
        say "linking tests/kernels/c/test_llama.c with the ${#MOBJS[@]} model and ${#KOBJS[@]} kernel objects of $OBJDIR"
    fi
    aarch64-linux-gnu-gcc "${TEST_CFLAGS[@]}" -static "${LLAMA_SRCS[@]}" "${MOBJS[@]}" "${KOBJS[@]}" -lm \
        -o "$WORK/test_llama_aarch64"
else
    say "cross-compiling for aarch64 (armv8-a baseline, static)"
    build aarch64-linux-gnu-gcc aarch64 -static
    say "compiling natively ($(uname -m))"
    build gcc native
fi

# ---- runs --------------------------------------------------------------------------------
FAILED=0

# check_run NAME LOG RC WANT_FEATURES RUN_TAGS SKIP_TAGS DEFAULT_DISPATCH
#   RUN_TAGS: ISA suffixes whose kernels must have run and passed; SKIP_TAGS: must be skipped;
#   DEFAULT_DISPATCH: what the unforced table must pick for qsi4c32 ("m=1 -> A, m=64 -> B").
check_run() {
    local name=$1 log=$2 rc=$3 feats=$4 run_tags=$5 skip_tags=$6 want_default=$7 bad=0 tag line
    grep -qx "cpu features: $feats" "$log" \
        || { say "  $name: expected 'cpu features: $feats', got '$(grep '^cpu features' "$log")'"; bad=1; }
    for tag in $run_tags; do
        local n_run n_total
        n_total=$(grep -cE "^kernel qai8dx_[a-z0-9]+_[0-9]+x[0-9]+_${tag}:" "$log" || true)
        n_run=$(grep -cE "^kernel qai8dx_[a-z0-9]+_[0-9]+x[0-9]+_${tag}: [1-9][0-9]* cases passed( \(|$)" "$log" || true)
        if [ "$n_total" -eq 0 ] || [ "$n_run" -ne "$n_total" ]; then
            say "  $name: $tag kernels: $n_run of $n_total ran and passed"; bad=1
        fi
        # every format has a kernel of this tag, so forcing it must pick it for m=1
        grep -qE "^PYKLEI_KERNEL=${tag} qsi4c32: dispatch m=1 -> qai8dx_qsi4c32_[0-9]+x[0-9]+_${tag}," "$log" \
            || { say "  $name: PYKLEI_KERNEL=$tag did not dispatch a $tag kernel"; bad=1; }
    done
    for tag in $skip_tags; do
        local n_skip n_total
        n_total=$(grep -cE "^kernel qai8dx_[a-z0-9]+_[0-9]+x[0-9]+_${tag}:" "$log" || true)
        n_skip=$(grep -cE "^kernel qai8dx_[a-z0-9]+_[0-9]+x[0-9]+_${tag}: skipped" "$log" || true)
        if [ "$n_total" -eq 0 ] || [ "$n_skip" -ne "$n_total" ]; then
            say "  $name: $tag kernels: $n_skip of $n_total skipped (all expected skipped)"; bad=1
        fi
        grep -qE "^PYKLEI_KERNEL=${tag}: refused" "$log" \
            || { say "  $name: PYKLEI_KERNEL=$tag was not refused"; bad=1; }
    done
    grep -qx "PYKLEI_KERNEL=(unset) qsi4c32: dispatch $want_default" "$log" \
        || { say "  $name: default dispatch is not '$want_default'"; bad=1; }
    # the KV cache: the NEON f16 conversion (baseline AdvSIMD, every CPU model) ran and attention
    # read through it matched the reference
    grep -qx "f16_to_f32_neon: 65536 values and tails bit-exact with scalar" "$log" \
        || { say "  $name: f16_to_f32_neon did not run or differs"; bad=1; }
    grep -qE "^attention: f32 [1-9][0-9]* cases, bf16 [1-9][0-9]* cases.*, f16 by f16_to_f32_neon [1-9][0-9]* cases.*, q8 by f16_to_f32_neon [1-9][0-9]* cases bit-identical" "$log" \
        || { say "  $name: attention over bf16, f16 and q8 caches (f16 and q8 read by f16_to_f32_neon) did not run or differs"; bad=1; }
    grep -qE "^attention rows: [1-9][0-9]* pk_attend_rows cases bit-identical" "$log" \
        || { say "  $name: pk_attend_rows did not run or differs"; bad=1; }
    line=$(tail -n 1 "$log")
    [[ "$line" =~ ^[0-9]+\ passed,\ 0\ failed$ ]] || { say "  $name: last line '$line'"; bad=1; }
    [ "$rc" -eq 0 ] || { say "  $name: exit status $rc"; bad=1; }
    grep -E "^(FAIL|kernel .*FAILED)" "$log" | head -20 | sed "s/^/    /" || true
    if [ $bad -eq 0 ]; then
        say "  $name: ok: $(grep '^cpu features' "$log"); $line"
        grep -E "^kernel .*(cases passed|skipped)" "$log" | sed -E 's/ \(random cases.*//; s/^/      /'
        grep -E "^PYKLEI_KERNEL=\(unset\)" "$log" | sed 's/^/      /'
        grep -E "^(f16_to_f32_|attention)" "$log" | sed 's/^/      /'
    else
        FAILED=1
        say "  $name: FAILED (log follows)"
        sed 's/^/    | /' "$log" | tail -n 40
    fi
}

# check_llama NAME LOG RC: test_llama passed: exit 0, "<P> passed, 0 failed" last, and every
# configuration it ran ok (with its time)
check_llama() {
    local name=$1 log=$2 rc=$3 line n_ok
    line=$(tail -n 1 "$log")
    n_ok=$(grep -cE '^config .*: ok' "$log" || true)
    if [ "$rc" -eq 0 ] && [[ "$line" =~ ^[0-9]+\ passed,\ 0\ failed$ ]] && [ "$n_ok" -gt 0 ] \
       && ! grep -qE '^config .*: FAILED' "$log"; then
        say "  $name: ok: $n_ok configurations; $line"
    else
        FAILED=1
        say "  $name: FAILED (exit $rc)"
        grep -E '^(FAIL|config .*: FAILED)' "$log" | head -20 | sed 's/^/    | /'
        tail -n 1 "$log" | sed 's/^/    | /'
    fi
}

# --emulated: the thread pool's drop under contention depends on the scheduler's timing, which
# the emulator changes (tests/kernels/c/test_matmul.c, pool_contention_child); the native runs require it
QARGS=(--quick --emulated)
LARGS=(--quick)
[ $FULL -eq 1 ] && QARGS=(--emulated) && LARGS=()
Q4=qai8dx_qsi4c32
SPECS=("cortex-a53|neon|neon|dotprod i8mm|m=1 -> ${Q4}_1x4_neon, m=64 -> ${Q4}_1x4_neon"
       "neoverse-n1|neon dotprod|neon dotprod|i8mm|m=1 -> ${Q4}_1x4_dotprod, m=64 -> ${Q4}_4x4_dotprod"
       "max|neon dotprod i8mm|neon dotprod i8mm||m=1 -> ${Q4}_1x4_dotprod, m=64 -> ${Q4}_4x4_i8mm")
# the three CPU models' runs side by side (each emulator is mostly one busy thread; the runs
# share nothing but the binaries), each writing its logs and exit statuses; checked in order
say "qemu-aarch64 -cpu cortex-a53 / neoverse-n1 / max: test_matmul ${QARGS[*]}, then test_llama ${LARGS[*]}"
for spec in "${SPECS[@]}"; do
    cpu=${spec%%|*}
    (
        rc=0
        qemu-aarch64 -cpu "$cpu" "$WORK/test_matmul_aarch64" "${QARGS[@]}" >"$WORK/$cpu.log" 2>&1 || rc=$?
        echo $rc >"$WORK/$cpu.rc"
        rc=0
        qemu-aarch64 -cpu "$cpu" "$WORK/test_llama_aarch64" "${LARGS[@]}" >"$WORK/$cpu.llama.log" 2>&1 || rc=$?
        echo $rc >"$WORK/$cpu.llama.rc"
    ) &
done
wait
for spec in "${SPECS[@]}"; do
    IFS='|' read -r cpu feats run_tags skip_tags want_default <<<"$spec"
    check_run "$cpu" "$WORK/$cpu.log" "$(cat "$WORK/$cpu.rc" 2>/dev/null || echo 99)" "$feats" "$run_tags" "$skip_tags" "$want_default"
    check_llama "$cpu test_llama" "$WORK/$cpu.llama.log" "$(cat "$WORK/$cpu.llama.rc" 2>/dev/null || echo 99)"
done

if [ -n "$OBJDIR" ]; then
    [ $FAILED -eq 0 ] || { say "FAILED"; exit 1; }
    say "all aarch64 (qemu) kernel and forward-pass tests passed on the objects of $OBJDIR"
    exit 0
fi

say "native $(uname -m) run (full shape set)"
rc=0
"$WORK/test_matmul_native" >"$WORK/native.log" 2>&1 || rc=$?
if [ $rc -eq 0 ] && tail -n 1 "$WORK/native.log" | grep -qE '^[0-9]+ passed, 0 failed$'; then
    say "  native: ok: $(grep '^cpu features' "$WORK/native.log"); $(tail -n 1 "$WORK/native.log")"
    grep -E "^kernel " "$WORK/native.log" | sed -E 's/ \(random cases.*//; s/^/      /'
else
    FAILED=1
    say "  native: FAILED (exit $rc)"
    grep -E "^(FAIL|kernel)" "$WORK/native.log" | head -30 | sed 's/^/    | /'
    tail -n 1 "$WORK/native.log" | sed 's/^/    | /'
fi

say "native $(uname -m) run of test_llama (every configuration)"
rc=0
"$WORK/test_llama_native" >"$WORK/native.llama.log" 2>&1 || rc=$?
check_llama "native test_llama" "$WORK/native.llama.log" "$rc"

# quick_verdict NAME LOG RC PATTERN: a native quick-set run passed (exit 0, "N passed, 0 failed"
# last), or FAILED with the log's lines that match PATTERN.
quick_verdict() {
    local name=$1 log=$2 rc=$3 pattern=$4
    if [ "$rc" -eq 0 ] && tail -n 1 "$log" | grep -qE '^[0-9]+ passed, 0 failed$'; then
        say "  $name: ok: $(tail -n 1 "$log")"
    else
        FAILED=1
        say "  $name: FAILED (exit $rc)"
        grep -E "$pattern" "$log" | head -20 | sed 's/^/    | /'
        tail -n 1 "$log" | sed 's/^/    | /'
    fi
}

# The plain C loops (attention, SwiGLU, the rotation) run as the clone of the CPU's widest ISA;
# on an AVX-512 machine the AVX2 clone's code would otherwise never run here. One ISA's code:
# -DPK_NO_CLONES -march=x86-64-v3 (the quick shape set: the kernels above ran in full).
if [ "$(uname -m)" = x86_64 ] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo \
   && grep -qw f16c /proc/cpuinfo; then
    say "native run of the AVX2 code (-march=x86-64-v3, no clones; quick shape set)"
    pk_compile_objects gcc "$WORK/v3.objs" "${TEST_SRCS[@]}" "${SRCS[@]}" -- "${CFLAGS[@]}" \
        -DPK_NO_CLONES -march=x86-64-v3 || die "gcc could not compile the x86-64-v3 build"
    gcc "${PK_OBJS[@]}" -lm -o "$WORK/test_matmul_v3"
    rc=0
    "$WORK/test_matmul_v3" --quick >"$WORK/v3.log" 2>&1 || rc=$?
    quick_verdict x86-64-v3 "$WORK/v3.log" $rc "^FAIL"
fi

if [ $FAILED -ne 0 ]; then
    say "FAILED"
    exit 1
fi
say "all aarch64 (qemu) and native kernel and forward-pass tests passed"
