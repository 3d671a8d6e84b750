#!/usr/bin/env bash
# `pip wheel .` and the wheel it makes (pyproject.toml: scikit-build-core over the project's
# CMake): builds the wheel once, checks what it holds, installs it into a fresh virtual
# environment and, from outside the source tree, imports keel and keel.torch, plans a placement,
# runs the `keel` command and the PyTorch example's --help.
# Nothing is downloaded: the wheel builds without build isolation from PYTHON's environment
# (.venv: scikit-build-core, pybind11, ninja), and the fresh environment sees PYTHON's
# site-packages (torch, numpy, pyyaml) through a .pth file instead of installing torch again.
# WHEEL_BUILD_DIR keeps the wheel's CMake build between runs, so a rerun rebuilds only what
# changed (ccache is used when it is installed).
# Usage: pip_wheel.sh PYTHON WHEEL_BUILD_DIR VERSION
# Exit 77 (skipped) when PYTHON lacks scikit-build-core or pybind11 (scripts/dev's .venv has both).
set -euo pipefail

if [ $# -ne 3 ]; then
  echo "usage: pip_wheel.sh PYTHON WHEEL_BUILD_DIR VERSION" >&2
  exit 2
fi
python=$1
wheel_build=$2
version=$3
source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
name=install.pip_wheel
fail() { echo "$name: $*" >&2; exit 1; }

# The build tree's package must not shadow the installed one (scripts/dev exports PYTHONPATH).
unset PYTHONPATH PYTHONHOME
export PIP_DISABLE_PIP_VERSION_CHECK=1
# ctest gives this test 2 processors (PROCESSORS 2).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

"$python" -c 'import scikit_build_core, pybind11' 2>/dev/null || {
  echo "$name: skipped: $python lacks scikit-build-core or pybind11 (scripts/dev venv installs them)" >&2
  exit 77
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
seconds() { date +%s; }

# 1. The wheel, built once, without the CUDA kernels and NCCL and at -O1 instead of the release's
# -O3: the regular build compiles the kernels, nvcc is the slowest compiler of the build, -O1
# compiles in two thirds of the time, and what this test checks (what the wheel holds, that it
# installs and runs from outside the tree) depends on neither. KEEL_TEST_WHEEL_AS_RELEASED=1
# builds it as `pip install .` does for a user: CUDA as CMake detects it, -O3.
settings=(--config-settings=build-dir="$wheel_build")
if [ "${KEEL_TEST_WHEEL_AS_RELEASED:-0}" != 1 ]; then
  settings+=(--config-settings=cmake.define.KEEL_WITH_CUDA=OFF
             --config-settings=cmake.define.KEEL_WITH_NCCL=OFF
             "--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG")
fi
if command -v ccache >/dev/null; then
  settings+=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
             --config-settings=cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
start=$(seconds)
(cd "$source_dir" && "$python" -m pip wheel --no-build-isolation --no-deps --no-index -v \
   -w "$work/dist" "${settings[@]}" .) >"$work/wheel.log" 2>&1 ||
  { tail -n 80 "$work/wheel.log"; fail "pip wheel . failed (the last lines of its log above)"; }
echo "$name: pip wheel . took $(($(seconds) - start)) s"
wheels=("$work"/dist/keel-"$version"-*.whl)
if [ ${#wheels[@]} -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
  fail "expected one keel-$version-*.whl in $work/dist, found: $(ls "$work/dist")"
fi
wheel=${wheels[0]}

# What the wheel holds: the package, libkeel and the command inside it, the console script;
# nothing of the C++ install (headers, CMake package) and no compiled Python caches.
"$python" - "$wheel" "$version" <<'PY' || fail "the wheel's contents are wrong"
import sys, zipfile
wheel, version = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
info = f"keel-{version}.dist-info/"
for name in ("keel/__init__.py", "keel/_cli.py", "keel/torch/__init__.py", "keel/py.typed",
             "keel/integrations/__init__.py", "keel/integrations/torchtitan.py",
             "keel/integrations/deepspeed.py", "keel/integrations/megatron.py",
             "keel/lib/libkeel.so", "keel/bin/keel", info + "METADATA", info + "entry_points.txt"):
    assert name in names, f"{name} is not in the wheel: {names}"
assert any(n.startswith("keel/_keel.") and n.endswith(".so") for n in names), names
stray = [n for n in names if not (n.startswith("keel/") or n.startswith(info))
         or "__pycache__" in n]
assert not stray, f"unexpected files in the wheel: {stray}"
entry_points = zipfile.ZipFile(wheel).read(info + "entry_points.txt").decode()
assert "keel = keel._cli:main" in entry_points, entry_points
metadata = zipfile.ZipFile(wheel).read(info + "METADATA").decode()
assert f"Version: {version}\n" in metadata, metadata[:400]
print(f"wheel: {len(names)} files, version {version}")
PY

# 2. A fresh environment that borrows PYTHON's packages (torch among them) through a .pth file.
start=$(seconds)
"$python" -m venv "$work/venv"
fresh="$work/venv/bin/python"
fresh_site=$("$fresh" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$python" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' |
  sort -u >"$fresh_site/keel-test-borrowed-packages.pth"
(cd "$work" && "$fresh" -m pip install --no-index "$wheel") >"$work/install.log" 2>&1 ||
  { cat "$work/install.log"; fail "pip install of $(basename "$wheel") failed"; }
echo "$name: fresh venv + pip install of the wheel took $(($(seconds) - start)) s"

# 3. From outside the source tree, with the fresh environment first on PATH.
mkdir "$work/elsewhere"
cd "$work/elsewhere"
export PATH="$work/venv/bin:$PATH"
[ "$(command -v keel)" = "$work/venv/bin/keel" ] ||
  fail "keel on PATH is $(command -v keel || echo nothing), not the fresh venv's console script"

"$fresh" - "$fresh_site" "$version" <<'PY' || fail "the installed package misbehaves"
import pathlib, subprocess, sys
from importlib.metadata import version as installed_version

site, version = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2]
import keel
import keel.torch
import torch

package = pathlib.Path(keel.__file__).resolve().parent
assert package.parent == site, f"keel imported from {package}, not from the fresh venv {site}"
assert keel.__version__ == version, (keel.__version__, version)
assert installed_version("keel") == version
assert keel.torch.KeelMoE and keel.torch.ffn_expert
# DeepSeek EPLB's README example, through the installed extension and libkeel.
weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
phy2log, log2phy, logcnt = keel.plan("eplb", weight, num_replicas=16, num_groups=4,
                                     num_nodes=2, num_gpus=8)
assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]], phy2log
assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]], logcnt
try:
    keel.plan("eplb", weight, 10, 1, 1, 4)
    raise AssertionError("a bad num_replicas was accepted")
except keel.InvalidArgumentError as error:
    assert "num_replicas 10" in str(error), error
# The extension and the command load the package's own libkeel, with no LD_LIBRARY_PATH.
for binary in [*package.glob("_keel*.so"), package / "bin" / "keel"]:
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    assert "not found" not in ldd, f"{binary}: {ldd}"
    found = [line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines()
             if "libkeel.so =>" in line]
    assert found and pathlib.Path(found[0]).resolve() == package / "lib" / "libkeel.so", \
        f"{binary} loads libkeel from {found}, not from the package"
print(f"import keel {keel.__version__} (torch {torch.__version__}) from {package}: ok")
PY

env -u LD_LIBRARY_PATH keel --help >"$work/help.out" 2>&1 || { cat "$work/help.out"; fail "keel --help failed"; }
grep -q "^Usage: keel <command>" "$work/help.out" || { cat "$work/help.out"; fail "keel --help: no usage"; }
keel version >"$work/version.out" 2>&1 || { cat "$work/version.out"; fail "keel version failed"; }
grep -qF "$version" "$work/version.out" ||
  { cat "$work/version.out"; fail "keel version does not print $version"; }
keel plan --help >/dev/null 2>&1 || fail "keel plan --help failed"

"$fresh" "$source_dir/examples/torch/train_moe_lm.py" --help >"$work/example.out" 2>&1 ||
  { cat "$work/example.out"; fail "examples/torch/train_moe_lm.py --help failed"; }
grep -q "^usage:" "$work/example.out" || { cat "$work/example.out"; fail "the example's --help has no usage"; }
echo "$name: keel --help, keel version, the example's --help: ok"
