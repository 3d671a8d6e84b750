#!/usr/bin/env bash
# Builds, on this machine, the whole project's GPU-facing programs for the lent GPU (sm_90) and packs
# them with the shared libraries they need into .gpu-deps/prebuilt/{bin,lib}, which the device tool
# carries with .gpu-deps; libkeel and the generated keel/version.hpp (prebuilt/include) let
# bench/gpu/torch_check.sh build the Python extension there. The GPU machine has CUDA but none of the project's Debian dependencies
# (yaml-cpp, UCX, Open MPI, TBB, GLPK, prometheus-cpp, ...), so bench/gpu/run.sh runs these programs
# there instead of building the whole project. Left out of lib/: the C and C++ runtimes, the CUDA
# driver and NCCL (218 MB; run.sh finds the one installed on the GPU machine). It also downloads
# megatron-core's wheel into .gpu-deps/wheels for bench/gpu/megatron_check.py (the GPU machine has
# no network).
# Usage: bench/gpu/pack.sh   (KEEL_GPU_PACK_BUILD sets the build folder, default build-gpu; the
#                             kernels' standalone build of run.sh needs bench/gpu/prepare.sh instead)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${KEEL_GPU_PACK_BUILD:-$root/build-gpu}
pack=$root/.gpu-deps/prebuilt
programs=(tests/keel_kernels_tests tests/keel_engine_tests tests/keel_migration_tests
          tests/keel_comm_tests bin/device_bench bin/kernels_gpu_bench bin/gemm_width_bench bin/keel
          bin/keel_migration_multiprocess bin/migration_bench)

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEEL_WITH_PYTHON=OFF \
  -DKEEL_WITH_CUDA=ON -DKEEL_WITH_NCCL=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
targets=()
for p in "${programs[@]}"; do targets+=("$(basename "$p")"); done
targets+=(keel_shared)  # libkeel, which bench/gpu/torch_check.sh links the Python extension to
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

# .gpu-deps/ is the device tool's carry folder, never committed.
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
case $exclude in /*) ;; *) exclude=$root/$exclude ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qxF /.gpu-deps/ "$exclude" 2>/dev/null || echo /.gpu-deps/ >>"$exclude"
rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/lib"
for p in "${programs[@]}"; do
  cp "$build/$p" "$pack/bin/"
  strip --strip-debug "$pack/bin/$(basename "$p")"
done
# Every shared library the programs load, less those any Linux with CUDA has (cuBLAS is part of
# the toolkit there, and far larger than the carry allows).
system='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread\.|libdl\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libnccl\.|libcublas)'
cp -L "$build/lib/libkeel.so.0" "$pack/lib/"
strip --strip-debug "$pack/lib/libkeel.so.0"
for p in "$pack"/bin/* "$pack/lib/libkeel.so.0"; do
  ldd "$p" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $system ]] || cp -L "$path" "$pack/lib/$name"
done
# torch_check.sh compiles the extension against these, on the GPU machine's own python3.
mkdir -p "$pack/include/keel"
cp "$build/generated/keel/version.hpp" "$pack/include/keel/"
ln -sf libkeel.so.0 "$pack/lib/libkeel.so"  # the link name -lkeel looks for
# megatron-core's wheel for bench/gpu/megatron_check.py, for the GPU machine's python3 (3.12; set
# KEEL_GPU_PYTHON_VERSION for another): pinned as in scripts/requirements-dev.txt, without its
# dependencies (torch, numpy and packaging are there already).
megatron=$(grep -E '^megatron-core==' "$root/scripts/requirements-dev.txt")
rm -rf "$root/.gpu-deps/wheels"
pip_python=$root/.venv/bin/python3
[ -x "$pip_python" ] || pip_python=python3
"$pip_python" -m pip download "$megatron" --no-deps --only-binary=:all: \
  --python-version "${KEEL_GPU_PYTHON_VERSION:-3.12}" --platform manylinux_2_28_x86_64 \
  -d "$root/.gpu-deps/wheels" >/dev/null
echo "pack.sh: $(ls "$root/.gpu-deps/wheels") in $root/.gpu-deps/wheels"
echo "pack.sh: $(du -sh "$pack" | cut -f1) in $pack (bin: ${#programs[@]} programs," \
  "lib: $(ls "$pack/lib" | wc -l) libraries)"
