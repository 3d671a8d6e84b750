#!/usr/bin/env bash
# Builds and runs the CUDA kernels' tests and benchmark on a lent GPU machine, standalone
# (bench/gpu/CMakeLists.txt, sm_90): the GPU-against-CPU equivalence tests and the CPU reference
# tests (tests/kernels/), then kernels_gpu_bench; then, where the machine has the project's
# dependencies, the whole project's engine tests with CUDA slot buffers and device_bench (the
# engine's copies, staging and sums against the device-copy ceiling). Logs, the gtest XML and
# the benchmark JSON go to $OUT when it is set (the device tool brings that folder back), else to
# bench/gpu/out/.
#
# Once, on the machine without a GPU:   bench/gpu/prepare.sh   (googletest into .gpu-deps/)
# Then through the device tool:         run(command="bash bench/gpu/run.sh", carry=[".gpu-deps"])
# Environment: KEEL_GPU_SANITIZE=1 also runs the GPU tests under compute-sanitizer (memcheck,
# racecheck, synccheck); KEEL_GPU_BENCH_RUNS=N sets the timed runs per kernel (default 50);
# KEEL_GPU_BUILD sets the build folder (default /tmp/keel-gpu-build).
# Exit status: 0 when the build, every test and the benchmark succeeded.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/bench/gpu/out}
build=${KEEL_GPU_BUILD:-/tmp/keel-gpu-build}
mkdir -p "$out"
status=0

{ nvidia-smi; nvcc --version; cmake --version; } >"$out/machine.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true

echo "== build ($build)"
if ! { cmake -S "$root/bench/gpu" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release &&
  cmake --build "$build" -j "$(nproc)"; } >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log"
  echo "run.sh: build failed (full log: $out/build.log)"
  exit 1
fi

echo "== tests"
"$build/keel_kernels_tests" --gtest_output="xml:$out/tests.xml" >"$out/tests.log" 2>&1 || status=1
grep -vE '^\[ (RUN|      OK) |^\[----------\]|^$|^Running main' "$out/tests.log" | tail -n 80

if [ "${KEEL_GPU_SANITIZE:-0}" = 1 ]; then
  echo "== compute-sanitizer"
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/keel_kernels_tests" \
      --gtest_filter='KernelsGpuTest.*' >>"$out/sanitize.log" 2>&1 || status=1
    echo "$tool: $(grep -cE 'ERROR SUMMARY: [1-9]' "$out/sanitize.log") run(s) with errors so far"
  done
fi

echo "== benchmark"
"$build/kernels_gpu_bench" --json "$out/bench.json" --runs "${KEEL_GPU_BENCH_RUNS:-50}" \
  >"$out/bench.log" 2>&1 || status=1
grep -v '^  timed ' "$out/bench.log"

# The whole project, where the machine has its dependencies (yaml-cpp, prometheus-cpp, ...):
# the engine's training tests with CUDA slot buffers and the CUDA device memory tests.
full=${KEEL_GPU_FULL_BUILD:-/tmp/keel-gpu-full-build}
echo "== whole project ($full)"
if { cmake -S "$root" -B "$full" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_WITH_PYTHON=OFF &&
  cmake --build "$full" -j "$(nproc)" --target keel_engine_tests keel_migration_tests \
    device_bench; } \
  >"$out/full_build.log" 2>&1; then
  "$full/tests/keel_engine_tests" --gtest_filter='*/Cuda:CApiEngineTest.DeviceMemory*' \
    --gtest_output="xml:$out/engine_cuda.xml" >"$out/engine_cuda.log" 2>&1 || status=1
  "$full/tests/keel_migration_tests" --gtest_filter='Cuda*:*DeviceMemory*:*Memory*' \
    --gtest_output="xml:$out/device_memory.xml" >"$out/device_memory.log" 2>&1 || status=1
  grep -hE '^\[  (PASSED|FAILED|SKIPPED) ' "$out/engine_cuda.log" "$out/device_memory.log"
  echo "== engine device path against the device-copy ceiling (device_bench, CUDA memory)"
  KEEL_BENCH_MEMORY=cuda "$full/bin/device_bench" --benchmark_out="$out/device_bench.json" \
    --benchmark_out_format=json >"$out/device_bench.log" 2>&1 || status=1
  grep '^BM_' "$out/device_bench.log"
else
  echo "whole project not built here (see $out/full_build.log; it needs the Debian packages"
  echo "that scripts/dev installs): engine tests with CUDA memory not run"
  tail -n 5 "$out/full_build.log"
fi

echo "run.sh: exit $status (logs in $out)"
exit $status
