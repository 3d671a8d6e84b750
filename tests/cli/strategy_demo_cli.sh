#!/usr/bin/env bash
# End-to-end test of `keel demo` with sharded experts: esp, ppmoe and parm train the same model as
# whole experts (ep) to float rounding, and the same on threads and MPI processes; Parm's
# de-duplicated dispatch sends each (token, k) row once per MP group instead of once per member
# and trains bit for bit as the run without it, in the demo's exchanges and through the engine's
# MP groups; bad combinations exit 2 and say why.
# $1: path of the keel binary.
set -euo pipefail
source "$(dirname "$0")/../common/mpi_demo.sh"

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-strategy-demo-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "strategy_demo_cli: $*" >&2
  exit 1
}

small=(--ranks 4 --layers 2 --experts 8 --tokens 256 --hidden 8 --ffn 16 --steps 5 --quiet)

# Each strategy against ep: within the rounding tolerance, the same loss to 1e-6.
check_sharded() {
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
name = sys.argv[2]
assert r["mode_order"] == ["ep", name], r["mode_order"]
s = r["strategy"]
assert s["name"] == name and s["final_weights_relative_difference"] <= 1e-3, s
ep, sharded = r["modes"]["ep"], r["modes"][name]
for a, b in zip(ep["loss"], sharded["loss"]):
    assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (ep["loss"], sharded["loss"])
# Sharded experts need no sync and no migration; their rows move inside the group.
assert sharded["epochs"] == 0 and sharded["bytes_moved"] == 0, sharded
assert sharded["group_bytes_per_step"] > 0, sharded
assert ep["group_bytes_per_step"] == 0 and ep["all_to_all_bytes_per_step"] > 0, ep
PY
}
for strategy in esp ppmoe parm; do
  "$keel" demo "${small[@]}" --strategy "$strategy" --report "$work/$strategy.json" \
    >"$work/out" 2>"$work/err" || fail "$strategy: $(cat "$work/err" "$work/out")"
  grep -q "final weights vs ep: .* (tolerance 1e-03: within)" "$work/out" ||
    fail "$strategy: $(cat "$work/out")"
  check_sharded "$work/$strategy.json" "$strategy" || fail "$strategy report is wrong"
done
# ppmoe has no all-to-all at all; esp over 2 ranks of 4 exchanges rows between the two groups.
python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["modes"]["ppmoe"]; assert m["all_to_all_bytes_per_step"]==0, m' \
  "$work/ppmoe.json" || fail "ppmoe sent rows between ranks"
"$keel" demo "${small[@]}" --strategy esp --shard-degree 2 --report "$work/esp2.json" \
  >"$work/out" 2>"$work/err" || fail "esp over 2: $(cat "$work/err")"
check_sharded "$work/esp2.json" esp || fail "esp over 2 report is wrong"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["strategy"]["shard_degree"]==2 and r["modes"]["esp"]["all_to_all_bytes_per_step"]>0, r["strategy"]' \
  "$work/esp2.json" || fail "esp over 2 did not exchange between groups"

# Parm: each member sends its share, so exactly half the all-to-all bytes of every member
# sending the pair's rows, and bitwise the same weights. Through the engine's MP groups (whole
# experts): every (token, k) dispatched once, the same rows as without MP groups plus the pairs'
# all-gathers, and bitwise the same weights.
check_mp() {
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["mode_order"] == ["parm-all", "parm", "keel", "engine-mp"], r["mode_order"]
every, share = r["modes"]["parm-all"], r["modes"]["parm"]
assert every["all_to_all_bytes_per_step"] == 2 * share["all_to_all_bytes_per_step"] > 0, r["modes"]
assert every["loss"] == share["loss"]
assert r["final_weights_identical"] and r["targets"]["parm_all_to_all_bytes_ratio"]["met"]
keel, engine = r["modes"]["keel"], r["modes"]["engine-mp"]
m = r["model"]
entries = r["ranks"] * m["tokens_per_rank"] * m["top_k"] * m["layers"]
assert r["engine_mp"]["rows_dispatched_per_step"] == entries == engine["rows_dispatched_per_step"], r["engine_mp"]
assert r["engine_mp"]["final_weights_identical_to_keel"], r["engine_mp"]
assert engine["all_to_all_bytes_per_step"] == keel["all_to_all_bytes_per_step"] > 0, (keel, engine)
# Each member all-gathers its outputs (forward) and input gradients (backward) to its partner:
# tokens x hidden floats per layer and pass.
hidden = m["hidden"]
assert engine["group_bytes_per_step"] == r["ranks"] * m["tokens_per_rank"] * hidden * 4 * 2 * m["layers"], engine
assert keel["group_bytes_per_step"] == 0 and engine["loss"] == keel["loss"]
PY
}
"$keel" demo "${small[@]}" --mp 2 --report "$work/mp.json" >"$work/out" 2>"$work/err" ||
  fail "--mp 2: $(cat "$work/err" "$work/out")"
grep -q "final weights identical:     yes (bitwise)" "$work/out" || fail "--mp 2: $(cat "$work/out")"
grep -q "engine-mp final weights: *bitwise those of keel without MP groups" "$work/out" ||
  fail "--mp 2: $(cat "$work/out")"
check_mp "$work/mp.json" || fail "--mp 2 report is wrong"

model=("${small[@]}")
expect_usage_error() {
  local words="$1"
  shift
  local got=0
  "$keel" demo "${model[@]}" "$@" >/dev/null 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$* exited $got, expected 2: $(cat "$work/err")"
  grep -q -- "$words" "$work/err" || fail "$*: $(cat "$work/err")"
}
expect_usage_error "--strategy 'tp' is not ep, esp, parm or ppmoe" --strategy tp
expect_usage_error "strategy.mp_degree: 3 does not divide topology.gpus_per_node (4)" --mp 3
# The small model with --ffn 18, which 4 shards do not divide (each flag is given once).
model=("${small[@]}")
for i in "${!model[@]}"; do [[ "${model[i]}" != --ffn ]] || model[i + 1]=18; done
expect_usage_error "esp: --ffn 18 does not split into 4 shards" --strategy esp
model=("${small[@]}")
expect_usage_error "in host memory" --strategy esp --memory guarded-host
expect_usage_error "does not combine with --strategy esp" --mp 2 --strategy esp
"$keel" demo --help >"$work/help" || fail "demo --help failed"
for flag in --strategy --shard-degree --mp; do
  grep -q -- "$flag" "$work/help" || fail "help lacks $flag"
done

if keel_can_run_mpi "$keel"; then
  keel_mpi_demo 180 "$keel" \
    "${small[@]}" --strategy esp --report "$work/mpi.json" \
    >"$work/out" 2>"$work/err" || fail "mpi esp failed: $(tail -20 "$work/err")"
  check_sharded "$work/mpi.json" esp || fail "mpi esp report is wrong"
  # Threads and processes train the same sharded model: the same loss curve, bit for bit.
  python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); assert a["modes"]["esp"]["loss"]==b["modes"]["esp"]["loss"] and a["final_weights_checksum"]==b["final_weights_checksum"]' \
    "$work/esp.json" "$work/mpi.json" || fail "threads and MPI esp runs differ"
  keel_mpi_demo 180 "$keel" \
    "${small[@]}" --mp 2 --report "$work/mpi-mp.json" \
    >"$work/out" 2>"$work/err" || fail "mpi --mp 2 failed: $(tail -20 "$work/err")"
  check_mp "$work/mpi-mp.json" || fail "mpi --mp 2 report is wrong"
  echo "strategy_demo_cli: ok (threads and mpi)"
else
  echo "strategy_demo_cli: ok (threads; mpi skipped: needs mpirun and a keel with ucx and mpi)"
fi
