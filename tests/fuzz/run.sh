#!/usr/bin/env bash
# Runs the libFuzzer targets of a KEEL_FUZZ build, each for SECONDS, starting from its seeds
# (tests/fuzz/seeds/<target>, and configs/ for the config loader) with its dictionary of keys and
# hostile tokens when it has one (tests/fuzz/dicts/<target>.dict). New inputs go to a scratch
# corpus that is removed afterwards; a crash, hang or sanitizer report is saved as
# BUILD/fuzz/artifacts/<target>-crash-* (reproduce: BUILD/fuzz/<target>_fuzz FILE) and fails the run.
# Targets run side by side, KEEL_FUZZ_JOBS at a time (default: the number of cores), each on one
# core, so the whole run takes about SECONDS x targets / jobs.
# python_api (tests/fuzz/python_api_fuzz.py, atheris) fuzzes the keel Python package that a
# regular build made: KEEL_FUZZ_PYTHONPATH (default: build/python) with KEEL_FUZZ_PYTHON (default:
# .venv/bin/python3, which has atheris); it is skipped with a word when neither was set and the
# default package is missing.
# Usage: tests/fuzz/run.sh BUILD [SECONDS] [TARGET...]   (default 30 s; targets config trace plan
#        c_api checkpoint python_api)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:?usage: tests/fuzz/run.sh BUILD [SECONDS] [TARGET...]}
seconds=${2:-30}
shift $(($# < 2 ? $# : 2))
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(config trace plan c_api checkpoint python_api)
jobs=${KEEL_FUZZ_JOBS:-$(nproc)}
mkdir -p "$build/fuzz/artifacts"

python=${KEEL_FUZZ_PYTHON:-$root/.venv/bin/python3}
python_path=${KEEL_FUZZ_PYTHONPATH:-$root/build/python}

# One target's run; prints its one-line verdict and returns its status.
fuzz_one() {  # target
  local target=$1 program=("$build/fuzz/$1_fuzz") log="$build/fuzz/$1.log" seeds scratch rc runs
  if [ "$target" = python_api ]; then
    if [ -z "${KEEL_FUZZ_PYTHON:-}${KEEL_FUZZ_PYTHONPATH:-}" ] && [ ! -d "$python_path/keel" ]; then
      echo "fuzz: python_api: skipped: no keel package at $python_path (a regular build makes it)"
      return 0
    fi
    program=(env "PYTHONPATH=$python_path" "$python" "$root/tests/fuzz/python_api_fuzz.py")
  elif [ ! -x "${program[0]}" ]; then
    echo "fuzz: ${program[0]} is missing (configure with CXX=clang++-14 -DKEEL_FUZZ=ON)" >&2
    return 1
  fi
  seeds=("$root/tests/fuzz/seeds/$target")
  [ "$target" = config ] && seeds+=("$root/configs")
  local dictionary=() words="$root/tests/fuzz/dicts/$target.dict"
  [ -f "$words" ] && dictionary=(-dict="$words")
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/keel-fuzz-$target-XXXXXX")
  "${program[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$build/fuzz/artifacts/$target-" "${dictionary[@]}" \
    "$scratch" "${seeds[@]}" >"$log" 2>&1
  rc=$?
  rm -rf "$scratch"
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  if [ $rc -eq 0 ]; then
    echo "fuzz: $target: ${runs:-?} inputs in ${seconds} s, no crash"
    return 0
  fi
  {
    echo "fuzz: $target: FAILED (exit $rc); log $log, input saved as:"
    grep -E 'Test unit written to|ERROR: |SUMMARY: ' "$log"
  } >&2
  return 1
}

status=0
running=0
for target in "${targets[@]}"; do
  if [ $running -ge "$jobs" ]; then
    wait -n || status=1
    running=$((running - 1))
  fi
  fuzz_one "$target" &
  running=$((running + 1))
done
while [ $running -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done
exit $status
