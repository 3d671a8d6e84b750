#!/usr/bin/env bash
# keel.torch on a lent GPU machine, in one call: builds the keel Python package there against the
# machine's own python3 (torch with CUDA), runs the Python test suite's CUDA cases
# (KEEL_TEST_DEVICE=cuda: 4 gloo ranks sharing the GPU, and a one-rank NCCL group), then
# benchmarks one MoE layer through keel.torch against plain torch (bench/gpu/torch_layer_bench.py),
# then checks keel.integrations.megatron against Megatron-Core's own MoELayer on the GPU
# (bench/gpu/megatron_check.py; megatron-core from the wheel bench/gpu/pack.sh carries).
# Logs, JUnit XML and the benchmark's JSON go to $OUT when it is set, else to bench/gpu/out/.
#
# The GPU machine has python3 with torch, pybind11, pytest and a C++ compiler, but none of the
# project's Debian dependencies and no network, so libkeel comes prebuilt from this machine:
#   bench/gpu/pack.sh     (libkeel for sm_90 with the libraries it needs, .gpu-deps/prebuilt)
#   then through the device tool:  run(command="bash bench/gpu/torch_check.sh", carry=[".gpu-deps"])
# Only the extension (bindings/python/keel_module.cc, over include/keel/ alone) is compiled there.
# Environment: KEEL_TORCH_CHECK_TESTS (default: the keel.torch test files) names the pytest files;
# KEEL_TORCH_BENCH_ARGS adds arguments to the benchmark; KEEL_PYTEST_WORKERS (default 4) runs that
# many test files' cases at once (pytest-xdist, when installed).
# Exit status: 0 when every step succeeded.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/bench/gpu/out}
prebuilt=$root/.gpu-deps/prebuilt
mkdir -p "$out"
status=0

python=$(command -v python3)
{ nvidia-smi; "$python" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__,
  "cuda", torch.version.cuda, "available", torch.cuda.is_available())'; } >"$out/torch_machine.log" 2>&1
tail -n 2 "$out/torch_machine.log"

if [ ! -f "$prebuilt/lib/libkeel.so" ] || [ ! -f "$prebuilt/include/keel/version.hpp" ]; then
  echo "torch_check.sh: no prebuilt libkeel in $prebuilt: run bench/gpu/pack.sh here first"
  exit 1
fi
nccl=$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -n 1)
export LD_LIBRARY_PATH="$prebuilt/lib${nccl:+:$(dirname "$nccl")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# The package: the pure-Python files as they are in the tree, plus the extension built here.
package=${KEEL_TORCH_PACKAGE:-/tmp/keel-torch-check}
rm -rf "$package"
mkdir -p "$package"
cp -r "$root/bindings/python/keel" "$package/keel"
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
echo "== building keel._keel for $("$python" --version 2>&1)"
started=$SECONDS
read -r -a includes <<<"$("$python" -m pybind11 --includes)"  # -I python's and pybind11's
if ! c++ -O2 -DNDEBUG -std=c++20 -shared -fPIC "${includes[@]}" \
    -I"$root/include" -I"$prebuilt/include" "$root/bindings/python/keel_module.cc" \
    -L"$prebuilt/lib" -lkeel -Wl,-rpath,"$prebuilt/lib" -o "$package/keel/_keel$suffix" \
    >"$out/torch_build.log" 2>&1; then
  tail -n 40 "$out/torch_build.log"
  echo "torch_check.sh: the extension did not build (log: $out/torch_build.log)"
  exit 1
fi
echo "built in $((SECONDS - started)) s"
export PYTHONPATH="$package:$root/tests/python${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c 'import keel, keel.torch; print("keel", keel.__version__, "cuda build:",
  keel._keel.with_cuda)' || status=1

echo "== keel.torch tests on CUDA"
read -r -a tests <<<"${KEEL_TORCH_CHECK_TESTS:-test_dispatcher.py test_routing.py test_failures.py test_torch_devices.py}"
workers=()
if "$python" -c 'import xdist' 2>/dev/null; then
  workers=(-n "${KEEL_PYTEST_WORKERS:-4}")
fi
(cd "$root/tests/python" &&
  KEEL_TEST_DEVICE=cuda UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 420 "$python" -m pytest -q \
    -p no:cacheprovider -rs "${workers[@]}" --junitxml="$out/torch_tests.xml" "${tests[@]}" \
    >"$out/torch_tests.log" 2>&1)
rc=$?
tail -n 30 "$out/torch_tests.log"
[ $rc -eq 0 ] || { echo "tests: exit $rc"; status=1; }

echo "== one MoE layer: keel.torch against plain torch"
# shellcheck disable=SC2086
timeout 240 "$python" "$root/bench/gpu/torch_layer_bench.py" --json "$out/torch_layer.json" \
  ${KEEL_TORCH_BENCH_ARGS:-} >"$out/torch_layer.log" 2>&1
rc=$?
tail -n 40 "$out/torch_layer.log"
[ $rc -eq 0 ] || { echo "bench: exit $rc"; status=1; }

echo "== keel.integrations.megatron against Megatron-Core's MoELayer on the GPU"
# megatron-core's wheel for this python3 (bench/gpu/pack.sh downloads it: no network here),
# unpacked onto PYTHONPATH for this step only; it depends on nothing but torch, numpy, packaging.
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheel=$(ls "$root"/.gpu-deps/wheels/megatron_core-*-"$tag"-*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then
  echo "no megatron-core wheel for $tag in .gpu-deps/wheels: run bench/gpu/pack.sh here first"
  status=1
else
  site=/tmp/keel-megatron-core
  rm -rf "$site"
  "$python" -m zipfile -e "$wheel" "$site"
  (cd "$root/tests/python" && PYTHONPATH="$site:$PYTHONPATH" UCX_TLS=tcp,self UCX_NET_DEVICES=lo \
    timeout 420 "$python" "$root/bench/gpu/megatron_check.py" --json "$out/megatron_check.json" \
    >"$out/megatron_check.log" 2>&1)
  rc=$?
  tail -n 30 "$out/megatron_check.log"
  [ $rc -eq 0 ] || { echo "megatron check: exit $rc"; status=1; }
fi

echo "torch_check.sh: exit $status (logs in $out)"
exit $status
