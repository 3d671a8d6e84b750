#!/usr/bin/env bash
# Runs every CPU benchmark of docs/benchmarks.md and writes the results to out/bench/:
# planner, monitor, migration and demo-expert micro-benchmarks (Google Benchmark JSON), the UCX
# transfers between processes (JSON lines), trace replays (keel replay reports), and scrapes of
# the metrics endpoint under idle and slow clients (JSON lines).
# Usage: bench/run.sh [build-dir]   (default: build; run `scripts/dev build` first)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build}
out=$root/out/bench
traces=${KEEL_SHARED_TRACES:-$root/../shared/traces}
mkdir -p "$out"
keel=$build/bin/keel

for bench in eplb_bench keel_policy_bench balancers_bench quota_bench monitor_bench migration_bench \
  demo_expert_bench; do
  echo "== $bench"
  "$build/bin/$bench" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$bench.json" --benchmark_out_format=json
done

if "$keel" version | grep -q "ucx=on"; then
  echo "== migration: 64 MiB over UCX shared memory between processes, 16-expert plan on 4"
  UCX_TLS=sm "$build/bin/migration_bench" --ucx | tee "$out/migration-ucx.jsonl"
else
  echo "== skipping the UCX migration benchmark: built without UCX"
fi

echo "== replay: synthetic trace (seed 1), all policies"
"$keel" replay --trace synthetic --quiet --report "$out/replay-synthetic.json"

smartmoe=$traces/smartmoe-ae/moe_trace.tar.xz
if [ -f "$smartmoe" ]; then
  echo "== replay: SmartMoE trace, configs/smartmoe-16gpu.yaml (whole command timed)"
  start=$(date +%s%N)
  "$keel" replay --trace "$smartmoe" --config "$root/configs/smartmoe-16gpu.yaml" --quiet \
    --report "$out/replay-smartmoe.json" --plot "$out/replay-smartmoe.svg"
  echo "whole command: $(( ($(date +%s%N) - start) / 1000000 )) ms"
  converted=$out/smartmoe.jsonl
  [ -f "$converted" ] || "$keel" trace convert --input "$smartmoe" --output "$converted"
  echo "== replay: SmartMoE, oracle"
  "$keel" replay --trace "$converted" --config "$root/configs/smartmoe-16gpu.yaml" --oracle \
    --quiet --report "$out/replay-smartmoe-oracle.json"
  echo "== replay: SmartMoE, hierarchical EPLB (one expert group per node)"
  sed 's/num_groups: 1 /num_groups: 0 /' "$root/configs/smartmoe-16gpu.yaml" >"$out/hier.yaml"
  "$keel" replay --trace "$converted" --config "$out/hier.yaml" --policy eplb --quiet \
    --report "$out/replay-smartmoe-eplb-hier.json"
else
  echo "== skipping SmartMoE replays: $smartmoe not found"
fi
echo "== metrics endpoint: scrapes with 200 idle and 40 dripping clients (docs/monitor.md)"
python3 "$root/bench/scrape_under_abuse.py" --keel "$keel" | tee "$out/scrape-under-abuse.jsonl"
echo "== results in $out"
