#!/usr/bin/env bash
# Bad input as a new user might give it: each case must exit 2 with a message naming what is wrong,
# or work correctly; none may crash, hang or be silently accepted.
#   - a keel trace whose count is -0.0 (a zero count), under every policy;
#   - a folder where a file is expected: every trace format, `keel plan --input`, `--config`;
#   - a FIFO or a device as `--output`: written through, not replaced;
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
  "$keel" plan --policy eplb --input "$work/folder.json" --config "$work/folder.yaml"
expect_usage_error "config --check folder" "is a folder, expected a file" \
  "$keel" config --check "$work/folder.yaml"

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

# Durations a clock cannot hold.
expect_usage_error "--serve-seconds 9.3e9" "--serve-seconds must be in [0, 1e9], got" \
  "$keel" replay --trace synthetic --serve-metrics 127.0.0.1:0 --serve-seconds 9.3e9 --quiet
expect_usage_error "--pace 1e10" "--pace must be in [0, 1e9] seconds, got" \
  "$keel" replay --trace synthetic --pace 1e10 --quiet
echo "hostile_input_cli: ok"
