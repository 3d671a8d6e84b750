#!/usr/bin/env bash
# Bad input as a new user might give it: each case must exit 2 with a message naming what is wrong,
# or work correctly; none may crash, hang or be silently accepted.
#   - a keel trace whose count is -0.0 (a zero count), under every policy;
#   - a folder where a file is expected: every trace format, `keel plan --input`, `--config`;
#   - a truncated .tar.xz trace; traces accepted without a word before (duplicate or negative
#     step ids, a Keel trace without its header, Megatron counts of two lengths, ESFT gate weights
#     that are not probabilities, file numbers beyond 64 bits);
#   - a FIFO or a device as `--output`: written through, not replaced;
#   - sizes without a bound: config slots, an aggregating rank outside the job, demo sizes, plan
#     sizes;
#   - what only the aggregating rank opens: a trace in a missing folder, an unbindable address
#     (every rank fails at once, no collective's deadline);
#   - durations beyond what a clock can hold: `--serve-seconds`, `--pace`.
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-hostile-cli-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "hostile_input_cli: $*" >&2
  exit 1
}

# expect_usage_error NAME TEXT COMMAND...: exit status 2 and TEXT on stderr or stdout.
expect_usage_error() {
  local name="$1" text="$2"
  shift 2
  local got=0
  timeout 60 "$@" >"$work/out" 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$name: exited $got, expected 2: $(cat "$work/err")"
  grep -qF -- "$text" "$work/err" "$work/out" ||
    fail "$name: no '$text' in: $(cat "$work/err" "$work/out")"
}

# -0.0 is a zero count: every policy replays it as it replays 0.
printf '{"keel_trace":1,"num_layers":1,"num_experts":2,"num_sources":2}\n' >"$work/nz.jsonl"
printf '{"step":0,"layers":[[-0.0,1,1,1]]}\n{"step":1,"layers":[[3,-0.0,2,1]]}\n' >>"$work/nz.jsonl"
sed 's/-0\.0/0/g' "$work/nz.jsonl" >"$work/z.jsonl"
for trace in nz z; do
  "$keel" replay --trace "$work/$trace.jsonl" --quiet --report "$work/$trace.json" \
    >"$work/out" 2>"$work/err" || fail "replay of the $trace trace failed: $(cat "$work/err")"
done
python3 - "$work/nz.json" "$work/z.json" <<'PY' || fail "-0.0 and 0 replay differently"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
for name, policy in a["policies"].items():
    other = b["policies"][name]
    for key in ["imbalance", "sim_step_seconds", "moved_slots_total", "moved_bytes_total"]:
        assert policy[key] == other[key], (name, key, policy[key], other[key])
PY

# A folder where a file is expected.
mkdir "$work/folder.jsonl" "$work/folder.yaml" "$work/folder.json"
for format in keel esft smartmoe megatron olmoe; do
  expect_usage_error "--format $format on a folder" "folder.jsonl" \
    "$keel" replay --trace "$work/folder.jsonl" --format "$format" --quiet
done
expect_usage_error "keel trace named as a folder" "is a folder, expected a file" \
  "$keel" replay --trace "$work/folder.jsonl" --format keel --quiet
expect_usage_error "plan --input folder" "is a folder, expected a file" \
  "$keel" plan --policy eplb --input "$work/folder.json"
expect_usage_error "replay --config folder" "is a folder, expected a file" \
  "$keel" replay --trace synthetic --config "$work/folder.yaml" --quiet
expect_usage_error "plan --config folder" "is a folder, expected a file" \
  "$keel" plan --policy keel --input "$work/folder.json" --config "$work/folder.yaml"
expect_usage_error "config --check folder" "is a folder, expected a file" \
  "$keel" config --check "$work/folder.yaml"

# Traces that used to be accepted without a word.
header='{"keel_trace":1,"num_layers":1,"num_experts":2,"num_sources":0}'
printf '%s\n{"step":0,"layers":[[1,2]]}\n{"step":0,"layers":[[3,4]]}\n' "$header" >"$work/dup.jsonl"
expect_usage_error "duplicate step id" "dup.jsonl:3: step 0 does not follow step 0" \
  "$keel" trace info "$work/dup.jsonl"
printf '%s\n{"step":-4,"layers":[[1,2]]}\n' "$header" >"$work/neg.jsonl"
expect_usage_error "negative step id" "neg.jsonl:2: step -4 is negative" \
  "$keel" trace info "$work/neg.jsonl"
printf '{"step":0,"layers":[[1,2]]}\n' >"$work/headless.jsonl"
expect_usage_error "Keel steps without a header" "the header line" \
  "$keel" trace info "$work/headless.jsonl"
printf '{"iteration":1}\n' >"$work/router.jsonl"
expect_usage_error "a guessed format says so" "read as megatron (the format guessed" \
  "$keel" trace info "$work/router.jsonl"
printf '{"step":1,"layer":0,"expert_counts":[1,2,3]}\n{"step":1,"layer":1,"expert_counts":[1,2]}\n' \
  >"$work/ragged_router.jsonl"
expect_usage_error "megatron counts of two lengths" "expert_counts has 2 entries" \
  "$keel" trace info "$work/ragged_router.jsonl" --format megatron
mkdir "$work/esft"
printf '1\t2\t\t0.5\tnan\n' >"$work/esft/expert_weights_1.txt"
expect_usage_error "ESFT gate weight nan" "gate weight 1 ('nan') is not a finite non-negative" \
  "$keel" trace info "$work/esft" --format esft
printf '1\t2\t\t0.5\t-0.25\n' >"$work/esft/expert_weights_1.txt"
expect_usage_error "ESFT negative gate weight" "gate weight 1 ('-0.25')" \
  "$keel" trace info "$work/esft" --format esft
printf '1\t2\t\t0.5\t0.5\n' >"$work/esft/expert_weights_1.txt"
touch "$work/esft/expert_weights_99999999999999999999.txt"
expect_usage_error "ESFT file number overflows" "does not fit in 64 bits" \
  "$keel" trace info "$work/esft" --format esft

# A truncated archive is a bad trace: exit 2.
printf '\xfd7zXZ\0truncated' >"$work/moe_trace.tar.xz"
expect_usage_error "truncated .tar.xz" "the archive is truncated, corrupt or not .tar.xz" \
  "$keel" replay --trace "$work/moe_trace.tar.xz" --format smartmoe --quiet

# Output to something that is not a regular file is written through, never replaced.
printf '{"weight": [[1, 2, 3, 4]], "num_replicas": 4, "num_groups": 1, "num_nodes": 1,
  "num_gpus": 2}' >"$work/in.json"
mkfifo "$work/fifo"
cat "$work/fifo" >"$work/from_fifo" &
reader=$!
timeout 60 "$keel" plan --policy eplb --input "$work/in.json" --output "$work/fifo" ||
  fail "plan --output FIFO failed"
wait "$reader"
[[ -p "$work/fifo" ]] || fail "the FIFO was replaced by a regular file"
grep -q '"phy2log"' "$work/from_fifo" || fail "nothing came through the FIFO"

# Sizes without a bound: refused by name before anything is allocated.
printf 'slots:\n  persistent_per_rank: 2147483647\n' >"$work/big_slots.yaml"
expect_usage_error "config with 2^31-1 slots" "slots.persistent_per_rank: 2147483647" \
  "$keel" config --check "$work/big_slots.yaml"
printf 'topology:\n  num_nodes: 1\n  gpus_per_node: 2\nmonitor:\n  aggregating_rank: 1000\n' \
  >"$work/far_rank.yaml"
expect_usage_error "aggregating rank beyond the job" \
  "monitor.aggregating_rank: 1000 is not a rank of the job (it has 2 ranks)" \
  "$keel" config --check "$work/far_rank.yaml"
expect_usage_error "demo --hidden 1000000" "--hidden 1000000 must be in [1, 65536]" \
  "$keel" demo --hidden 1000000 --quiet
expect_usage_error "demo --ffn 2147483647" "--ffn 2147483647 must be in [1, 65536]" \
  "$keel" demo --ffn 2147483647 --quiet
expect_usage_error "demo --tokens 1000000000" "--tokens 1000000000 must be in [1, 1048576]" \
  "$keel" demo --tokens 1000000000 --quiet
expect_usage_error "demo --layers 100000" "--layers 100000 must be in [1, 1024]" \
  "$keel" demo --layers 100000 --quiet
expect_usage_error "demo too big in all" "GiB, more than the demo's 16 GiB limit" \
  "$keel" demo --hidden 65536 --ffn 65536 --quiet
printf '{"weight": [[0, 6666666666666666666666666666666, 56]], "num_replicas": 6,
  "num_groups": 1, "num_nodes": 1, "num_gpus": 2}' >"$work/huge_load.json"
expect_usage_error "plan with a load of 6.7e30 tokens" "weight[0][1] = " \
  "$keel" plan --policy keel --input "$work/huge_load.json"
grep -qF "is more than 1e15 tokens" "$work/out" || fail "huge load: $(cat "$work/out")"
printf '{"weight": [[1, 2]], "num_replicas": 1000000000, "num_groups": 1, "num_nodes": 1,
  "num_gpus": 1000000000}' >"$work/huge_plan.json"
expect_usage_error "plan with 1e9 replicas" "num_replicas = 1000000000 is more than" \
  "$keel" plan --policy eplb --input "$work/huge_plan.json"

# What only the aggregating rank opens: a trace in a missing folder, an address it cannot bind.
printf 'slots:\n  persistent_per_rank: 5\nmonitor:\n  trace_path: %s\n' \
  "$work/no/such/folder/t.jsonl" >"$work/lost_trace.yaml"
expect_usage_error "demo trace in a missing folder" "monitor.trace_path: cannot create trace" \
  "$keel" demo --config "$work/lost_trace.yaml" --steps 2 --quiet
expect_usage_error "metrics on a foreign address" "the address is not one of this host's" \
  "$keel" replay --trace synthetic --serve-metrics 192.0.2.1:0 --quiet
# Addresses that are not [v6addr]:port, host:port or port, by every way in: the same reader.
expect_usage_error "metrics on 256.1.1.1" \
  "--serve-metrics: address '256.1.1.1:0': '256.1.1.1' is not an IPv4 address" \
  "$keel" replay --trace synthetic --serve-metrics 256.1.1.1:0 --quiet
expect_usage_error "metrics on an IPv6 address without brackets" \
  "--metrics: address '::1:9400': write an IPv6 host in brackets, e.g. [::1]:9400" \
  "$keel" demo --metrics ::1:9400 --steps 2 --quiet
printf 'monitor:\n  metrics_address: "127.0.0.1:9400,9401"\n' >"$work/two_ports.yaml"
expect_usage_error "metrics_address listing two ports" \
  "monitor.metrics_address: address '127.0.0.1:9400,9401': port '9400,9401' is not a number" \
  "$keel" demo --config "$work/two_ports.yaml" --steps 2 --quiet

# Durations a clock cannot hold.
expect_usage_error "--serve-seconds 9.3e9" "--serve-seconds must be in [0, 1e9], got" \
  "$keel" replay --trace synthetic --serve-metrics 127.0.0.1:0 --serve-seconds 9.3e9 --quiet
expect_usage_error "--pace 1e10" "--pace must be in [0, 1e9] seconds, got" \
  "$keel" replay --trace synthetic --pace 1e10 --quiet
echo "hostile_input_cli: ok"
