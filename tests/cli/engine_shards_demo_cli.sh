#!/usr/bin/env bash
# End-to-end test of `keel demo` with the engine's sharded experts: --shard-hot shards each
# layer's hottest expert from the start, --shard-experts lets the keel policy cut and join experts
# as it replans (their weights and Adam state cut by the FFN's tensor layout); both train the
# model of whole experts (ep) to float rounding, threads and MPI processes bit for bit alike, and
# bad combinations exit 2 and say why.
# $1: path of the keel binary.
set -euo pipefail
source "$(dirname "$0")/../common/mpi_demo.sh"

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-engine-shards-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "engine_shards_demo_cli: $*" >&2
  exit 1
}

small=(--ranks 4 --layers 2 --experts 8 --tokens 32 --hidden 16 --ffn 64 --steps 8 --zipf 1.5
  --quiet)
# One spare slot per rank, no transient slots, and the cost model's experts large against a
# step's rows: sharding a hot expert costs less than replicating it. Replans adopted at the next
# step: the reshards, and so the rounding, are the same on threads and processes.
cat >"$work/config.yaml" <<'EOF'
topology: {num_nodes: 1, gpus_per_node: 4, intra_node_gb_per_s: 4.0, inter_node_gb_per_s: 4.0}
slots: {persistent_per_rank: 3, transient_per_rank: 0}
cost_model: {expert_tflops: 0.002, hidden_size: 16, expert_ffn_size: 4096, dtype_bytes: 4}
policy: {name: keel, plan_adoption: next_step, keel: {transient_replicas: false}}
EOF

# The sharded run against ep: within the rounding tolerance, the same loss to 1e-6. $3: the
# fewest layer reshards the keel policy must have made.
check_shards() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
hot, reshards = int(sys.argv[2]), int(sys.argv[3])
assert r["mode_order"] == ["ep", "shards"], r["mode_order"]
s = r["engine_shards"]
assert s["shard_hot"] == hot and s["reshards"] >= reshards, s
assert s["final_weights_relative_difference"] <= 1e-3, s
assert not r["final_weights_identical"], "sharded experts should round differently"
ep, sharded = r["modes"]["ep"], r["modes"]["shards"]
for a, b in zip(ep["loss"], sharded["loss"]):
    assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (ep["loss"], sharded["loss"])
PY
}

"$keel" demo "${small[@]}" --config "$work/config.yaml" --shard-hot 1 --shard-degree 2 \
  --report "$work/hot.json" >"$work/out" 2>"$work/err" || fail "--shard-hot: $(cat "$work/err")"
grep -q "shards: 1 hottest experts per layer cut 2 ways" "$work/out" || fail "$(cat "$work/out")"
grep -q "final weights vs ep: .* (tolerance 1e-03: within)" "$work/out" || fail "$(cat "$work/out")"
check_shards "$work/hot.json" 1 0 || fail "--shard-hot report is wrong"

# The keel policy shards the hot experts itself: at least one layer resharded.
"$keel" demo "${small[@]}" --config "$work/config.yaml" --shard-experts \
  --report "$work/auto.json" >"$work/out" 2>"$work/err" || fail "--shard-experts: $(cat "$work/err")"
check_shards "$work/auto.json" 0 1 || fail "--shard-experts report is wrong: $(cat "$work/out")"

model=("${small[@]}")
expect_usage_error() {
  local words="$1"
  shift
  local got=0
  "$keel" demo "${model[@]}" "$@" >/dev/null 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$* exited $got, expected 2: $(cat "$work/err")"
  grep -q -- "$words" "$work/err" || fail "$*: $(cat "$work/err")"
}
expect_usage_error "--shard-hot 9 is not in \[0, 8\]" --shard-hot 9
expect_usage_error "do not combine with --strategy" --shard-hot 1 --strategy esp
# The small model with --ffn 18, which 4 shards do not divide (each flag is given once).
model=("${small[@]}")
for i in "${!model[@]}"; do [[ "${model[i]}" != --ffn ]] || model[i + 1]=18; done
expect_usage_error "--shard-hot: --ffn 18 does not split into 4 shards" --shard-hot 1
model=("${small[@]}")
"$keel" demo --help >"$work/help" || fail "demo --help failed"
for flag in --shard-hot --shard-experts; do
  grep -q -- "$flag" "$work/help" || fail "help lacks $flag"
done

if keel_can_run_mpi "$keel"; then
  keel_mpi_demo 180 "$keel" "${small[@]}" --config "$work/config.yaml" --shard-experts \
    --report "$work/mpi.json" >"$work/out" 2>"$work/err" ||
    fail "mpi --shard-experts failed: $(tail -20 "$work/err")"
  check_shards "$work/mpi.json" 0 1 || fail "mpi --shard-experts report is wrong"
  # Threads and processes reshard and train the same, bit for bit.
  python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); assert a["modes"]["shards"]["loss"]==b["modes"]["shards"]["loss"] and a["final_weights_checksum"]==b["final_weights_checksum"] and a["engine_shards"]["reshards"]==b["engine_shards"]["reshards"]' \
    "$work/auto.json" "$work/mpi.json" || fail "threads and MPI sharded runs differ"
  echo "engine_shards_demo_cli: ok (threads and mpi)"
else
  echo "engine_shards_demo_cli: ok (threads; mpi skipped: needs mpirun and a keel with ucx and mpi)"
fi
