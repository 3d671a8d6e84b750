#!/usr/bin/env bash
# Runs the libFuzzer targets of a KEEL_FUZZ build, each for SECONDS, starting from its seeds
# (tests/fuzz/seeds/<target>, and configs/ for the config loader). New inputs go to a scratch
# corpus that is removed afterwards; a crash, hang or sanitizer report is saved as
# BUILD/fuzz/artifacts/<target>-crash-* (reproduce: BUILD/fuzz/<target>_fuzz FILE) and fails the run.
# Usage: tests/fuzz/run.sh BUILD [SECONDS] [TARGET...]   (default 30 s; targets config trace plan
#        c_api)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:?usage: tests/fuzz/run.sh BUILD [SECONDS] [TARGET...]}
seconds=${2:-30}
shift $(($# < 2 ? $# : 2))
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(config trace plan c_api)
mkdir -p "$build/fuzz/artifacts"
status=0
for target in "${targets[@]}"; do
  program="$build/fuzz/${target}_fuzz"
  if [ ! -x "$program" ]; then
    echo "fuzz: $program is missing (configure with CXX=clang++-14 -DKEEL_FUZZ=ON)" >&2
    status=1
    continue
  fi
  seeds=("$root/tests/fuzz/seeds/$target")
  [ "$target" = config ] && seeds+=("$root/configs")
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/keel-fuzz-$target-XXXXXX")
  log="$build/fuzz/$target.log"
  "$program" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$build/fuzz/artifacts/$target-" \
    "$scratch" "${seeds[@]}" >"$log" 2>&1
  rc=$?
  rm -rf "$scratch"
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  if [ $rc -eq 0 ]; then
    echo "fuzz: $target: ${runs:-?} inputs in ${seconds} s, no crash"
  else
    echo "fuzz: $target: FAILED (exit $rc); log $log, input saved as:" >&2
    grep -E 'Test unit written to|ERROR: |SUMMARY: ' "$log" >&2
    status=1
  fi
done
exit $status
