#!/usr/bin/env bash
# Runs Keel's GPU checks on a lent GPU machine: the kernels' GPU-against-CPU equivalence tests and
# CPU reference tests (tests/kernels/), kernels_gpu_bench, gemm_width_bench (the expert GEMMs'
# throughput by inner width: cost_model.gemm_efficiency), the engine tests with CUDA slot buffers,
# the CUDA device memory, NCCL communicator and NCCL transport tests, device_bench (the engine's
# copies, staging and sums against the device-copy ceiling), migration between 4 processes with
# their experts on the GPU (random plans, byte-exact) and its 64 MiB bandwidth against a device
# copy, and `keel demo --memory device` against `--memory host` (same final-weights checksum).
# Logs, gtest XML and benchmark JSON go to $OUT when it is set (the device tool brings that folder
# back), else to bench/gpu/out/.
#
# The GPU machine has CUDA, CMake and ninja but none of the project's Debian dependencies, so the
# programs are built on the machine without a GPU and carried:
#   bench/gpu/prepare.sh   (googletest sources into .gpu-deps/)
#   bench/gpu/pack.sh      (the GPU-facing programs for sm_90 and their libraries, .gpu-deps/prebuilt)
#   then through the device tool:  run(command="bash bench/gpu/run.sh", carry=[".gpu-deps"])
# Without .gpu-deps/prebuilt it builds the kernels standalone (bench/gpu/CMakeLists.txt) and tries
# the whole project, which needs the Debian packages that scripts/dev installs.
# Environment: KEEL_GPU_SANITIZE=1 also runs the kernels' GPU tests under compute-sanitizer
# (memcheck, racecheck, synccheck); KEEL_GPU_BENCH_RUNS=N sets the timed runs per kernel (default
# 50); KEEL_GPU_BUILD sets the standalone build folder (default /tmp/keel-gpu-build).
# Exit status: 0 when every step that ran succeeded.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/bench/gpu/out}
prebuilt=$root/.gpu-deps/prebuilt
mkdir -p "$out"
status=0

{ nvidia-smi; nvcc --version; cmake --version; } >"$out/machine.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true

# run NAME TIMEOUT COMMAND...: runs one step with its output in $out/NAME.log and prints the
# gtest summary lines (or the last lines) of it.
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  if grep -qE '^\[  (PASSED|FAILED) ' "$out/$name.log"; then
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  SKIPPED \]|Skipped|skipped' "$out/$name.log" |
      sort | uniq | head -n 40
  else
    tail -n 25 "$out/$name.log"
  fi
  [ $rc -eq 0 ] || { echo "$name: exit $rc"; status=1; }
  return $rc
}

if [ -d "$prebuilt/bin" ]; then
  tests=$prebuilt/bin benches=$prebuilt/bin
  # NCCL is not carried (218 MB): the one installed on the GPU machine.
  nccl=$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -n 1)
  export LD_LIBRARY_PATH="$prebuilt/lib${nccl:+:$(dirname "$nccl")}:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "== prebuilt programs from $prebuilt (NCCL: ${nccl:-none found})"
  whole=1
else
  build=${KEEL_GPU_BUILD:-/tmp/keel-gpu-build}
  echo "== build kernels standalone ($build)"
  if ! { cmake -S "$root/bench/gpu" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$build" -j "$(nproc)"; } >"$out/build.log" 2>&1; then
    tail -n 60 "$out/build.log"
    echo "run.sh: build failed (full log: $out/build.log)"
    exit 1
  fi
  tests=$build benches=$build
  full=${KEEL_GPU_FULL_BUILD:-/tmp/keel-gpu-full-build}
  echo "== whole project ($full)"
  whole=0
  if { cmake -S "$root" -B "$full" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_WITH_PYTHON=OFF &&
    cmake --build "$full" -j "$(nproc)" --target keel_engine_tests keel_migration_tests \
      keel_comm_tests device_bench keel; } >"$out/full_build.log" 2>&1; then
    whole=1
    ln -sf "$full/tests/"keel_*_tests "$full/bin/"* "$build/" 2>/dev/null
  else
    echo "whole project not built here (see $out/full_build.log): it needs the Debian packages"
    echo "that scripts/dev installs; bench/gpu/pack.sh builds it elsewhere"
    tail -n 5 "$out/full_build.log"
  fi
fi

run kernels_tests 300 "$tests/keel_kernels_tests" --gtest_output="xml:$out/kernels_tests.xml"
if [ "${KEEL_GPU_SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    run "sanitize_$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$tests/keel_kernels_tests" --gtest_filter='KernelsGpuTest.*'
  done
fi
run kernels_bench 300 "$benches/kernels_gpu_bench" --json "$out/kernels_bench.json" \
  --runs "${KEEL_GPU_BENCH_RUNS:-50}"
# The expert GEMMs by inner width (cost_model.gemm_efficiency): the cost model's default expert,
# and a DeepSeek-V3-like one (hidden 7168, ffn 2048, gated).
run gemm_width 120 "$benches/gemm_width_bench" --json "$out/gemm_width.json"
run gemm_width_v3 120 "$benches/gemm_width_bench" --hidden 7168 --ffn 2048 --matrices 3 \
  --json "$out/gemm_width_v3.json"

if [ "$whole" = 1 ]; then
  run engine_cuda 300 "$tests/keel_engine_tests" \
    --gtest_filter='*/Cuda:*DeviceMemory*:*Cuda*' --gtest_output="xml:$out/engine_cuda.xml"
  run migration_cuda 300 "$tests/keel_migration_tests" \
    --gtest_filter='Cuda*:*Nccl*:*DeviceMemory*' --gtest_output="xml:$out/migration_cuda.xml"
  run comm_nccl 120 "$tests/keel_comm_tests" --gtest_filter='*Nccl*' \
    --gtest_output="xml:$out/comm_nccl.xml"
  KEEL_BENCH_MEMORY=cuda run device_bench 300 "$benches/device_bench" \
    --benchmark_out="$out/device_bench.json" --benchmark_out_format=json
  # Migration between processes with their experts on the GPU, through page-locked staging over
  # UCX shared memory: 50 random plans checked byte for byte, then 64 MiB transfers against a
  # device-to-device copy.
  if [ -x "$benches/keel_migration_multiprocess" ]; then
    UCX_TLS=sm run migration_staged_cuda 300 "$benches/keel_migration_multiprocess" --launch 4 \
      --scenario random --plans 50 --device cuda
    UCX_TLS=sm run migration_bench_cuda 300 "$benches/migration_bench" --ucx --device
  fi
  # The demo on CUDA slot buffers must end with the host run's final-weights checksum.
  for memory in host device; do
    run "demo_$memory" 300 "$benches/keel" demo --memory "$memory" --quiet \
      --report "$out/demo_$memory.json"
  done
  sums=$(grep -hoE '"final_weights_checksum": *"[0-9a-f]+"' "$out/demo_host.json" \
    "$out/demo_device.json" | sort -u)
  echo "demo final-weights checksums (host, device): $sums"
  if [ ! -s "$out/demo_device.json" ] || [ "$(echo "$sums" | wc -l)" != 1 ]; then
    echo "demo: no device run, or device and host checksums differ"
    status=1
  fi
fi

echo "run.sh: exit $status (logs in $out)"
exit $status
