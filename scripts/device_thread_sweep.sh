#!/usr/bin/env bash
# Thread scaling beside llama.cpp on a lent many-core machine (issue 24), from a bare start:
#   bash scripts/device_thread_sweep.sh RESULTS_DIR [THREADS] [ROUNDS] [PROMPT_LENGTHS] [N_GEN]
# Needs beside the checkout (both made on the developer's machine, which has the internet):
#   .dev/whl/gguf-*.whl          pip download --no-deps --only-binary=:all: -d .dev/whl gguf
#   .dev/llamacpp-src.tar.xz     llama-cpp-python 0.3.36's vendored llama.cpp, CPU sources only
#                                (its vendor/llama.cpp less docs, models, media, tests, benches,
#                                tools/ui and the GPU backends: ~5 MB)
# Steps, each logged with its time into RESULTS_DIR: build pyklei's extension and llama.cpp
# (GGML_NATIVE) side by side; when the CPU has AMX, the C kernel tests on it; the memory read
# bandwidth at every thread count (benchmarks/read_bandwidth.c: decode's ceiling); the random
# Llama-3.2-1B-shaped checkpoint, pyklei's rotated file and llama.cpp's Q4_0 of the same
# weights; then benchmarks/speed_vs_llamacpp.py over THREADS (default 1,2,4,8,16).
# Every step's output stays under RESULTS_DIR (at most 8 files: the device tool's limit).
# On the 16-core Xeon it took 15 min: builds 3, conversion 4, sweep 5.5 (2026-11-24, pp128,512
# tg64); since then the extension builds 16 files at a time (build_ext -j) and pyklei's file and
# llama.cpp's are converted side by side, and the defaults are pp512 tg32. The lent machine goes
# back after 30 s idle, taking everything with it: start this detached (setsid) in the first
# call and poll it from calls issued back to back, with any further command written beforehand.
set -euo pipefail
cd "$(dirname "$0")/.."
res=$(realpath -m "${1:?usage: $0 RESULTS_DIR [THREADS] [ROUNDS]}")
threads=${2:-1,2,4,8,16}
rounds=${3:-2}
prompts=${4:-512}
n_gen=${5:-32}
work=${WORK:-/tmp/pk-sweep}
mkdir -p "$res" "$work"
export PYKLEI_CACHE=$work/cache LLAMACPP_BIN=$work/llama-build/bin
log() { echo "[$(date -u +%T)] $*" | tee -a "$res/steps.log"; }

{ grep -m1 "model name" /proc/cpuinfo; nproc; grep -m1 flags /proc/cpuinfo; free -g; gcc --version | head -1
  python3 --version; uptime; } >"$res/machine.txt"
log "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) CPUs"

python3 -m pip install -q --no-index --no-deps --target "$work/site" .dev/whl/*.whl
export PYTHONPATH=$work/site:$PWD

log "building llama.cpp and pyklei's extension"
(set -e
 [ -d "$work/llama.cpp" ] || tar -xJf .dev/llamacpp-src.tar.xz -C "$work"
 cmake -S "$work/llama.cpp" -B "$work/llama-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
     -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
 cmake --build "$work/llama-build" -j "$(nproc)" --target llama-bench llama-quantize) \
    >"$work/llama-build.log" 2>&1 &
lcpp=$!
python3 setup.py build_ext --inplace -q -j "$(nproc)" >"$work/ext-build.log" 2>&1 || { tail -30 "$work/ext-build.log" >>"$res/steps.log"; exit 1; }
source scripts/cflags.sh
gcc -O3 -Ipyklei_ext "${PK_CFLAGS[@]}" tests/kernels/c/test_matmul.c tests/kernels/c/pk_testhook.c pyklei_ext/contract/*.c pyklei_ext/ops/*.c pyklei_ext/isa/*.c -lm \
    -o "$work/test_matmul"
gcc -O2 -march=native -pthread benchmarks/read_bandwidth.c -o "$work/read_bandwidth"
wait $lcpp || { tail -30 "$work/llama-build.log" >>"$res/steps.log"; exit 1; }
log "built"

if grep -qw amx_int8 /proc/cpuinfo; then
    log "AMX on this CPU: C kernel tests"
    "$work/test_matmul" >"$res/test_matmul.log" 2>&1 && log "test_matmul: $(tail -1 "$res/test_matmul.log")" \
        || { log "test_matmul FAILED: $(tail -3 "$res/test_matmul.log")"; }
fi

log "read bandwidth"
"$work/read_bandwidth" "$(echo "$threads" | tr ',' '\n' | sort -rn | paste -sd,)" 4096 >"$res/bandwidth.txt"
cat "$res/bandwidth.txt" >>"$res/steps.log"

log "the 1B-shaped checkpoint and its files"
python3 scripts/make_llama32_1b_random.py >"$work/make.log" 2>&1
# pyklei's rotated file and llama.cpp's Q4_0 side by side, each as speed_vs_llamacpp.py would
# make it (it finds both cached and goes straight to the sweep)
mkdir -p "$PYKLEI_CACHE/speed1b"
python3 -m pyklei convert "$PYKLEI_CACHE/llama32-1b-random" --no-calibrate --rotate --no-progress \
    -o "$PYKLEI_CACHE/speed1b/pyklei-rotated.gguf" >"$work/convert.log" 2>&1 &
conv=$!
(cd benchmarks && python3 -c "import sys; from pathlib import Path; from speed_vs_llamacpp import \
llamacpp_files_from_pyklei_f16 as f; c = Path(sys.argv[1]); f(c / 'llama32-1b-random', \
c / 'llamacpp' / 'llama32-1b', ['Q4_0'])" "$PYKLEI_CACHE") >"$work/llamacpp-files.log" 2>&1 \
    || { log "llama.cpp's files FAILED"; tail -20 "$work/llamacpp-files.log" >>"$res/steps.log"; exit 1; }
wait $conv || { log "convert FAILED"; tail -20 "$work/convert.log" >>"$res/steps.log"; exit 1; }
log "sweep"
python3 benchmarks/speed_vs_llamacpp.py --model llama32-1b --peers Q4_0 --threads "$threads" \
    --rounds "$rounds" --prompt-lengths "$prompts" --n-gen "$n_gen" --out speed-vs-llamacpp-1b-threads \
    >"$res/sweep.log" 2>&1 || { log "sweep FAILED"; tail -20 "$res/sweep.log" >>"$res/steps.log"; exit 1; }
cp benchmarks/results/speed-vs-llamacpp-1b-threads.{md,json} "$res/"
python3 -m pyklei info "$PYKLEI_CACHE/speed1b/pyklei-rotated.gguf" >>"$res/steps.log" 2>&1 || true
log "done"
