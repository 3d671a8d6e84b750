#!/usr/bin/env bash
# End-to-end test of `keel demo`'s Luffy runs at a small size. --sequence-migration: 4 ranks
# (threads, then MPI processes over UCX where both are there) train with sequences that move to
# where their experts are; the final weights must equal the run without it bit for bit, fewer
# rows must leave their rank, and sequences must move. --condense 1.0 condenses only identical
# tokens and must train bit for bit as exact training while saving rows; --condense 0.99 saves at
# least as many and reports the loss difference. Bad combinations are usage errors (exit 2).
# $1: path of the keel binary.
set -euo pipefail
source "$(dirname "$0")/../common/mpi_demo.sh"

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-luffy-demo-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "luffy_demo_cli: $*" >&2
  exit 1
}

small=(--layers 2 --experts 8 --tokens 512 --steps 6 --sequence-tokens 64 --quiet)

check_migration() {
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["mode_order"] == ["keel", "keel+seq"], r["mode_order"]
assert r["final_weights_identical"] is True, "final weights differ"
plain, moved = r["modes"]["keel"], r["modes"]["keel+seq"]
assert plain["sequences_moved_per_step"] == 0 and plain["sequence_bytes_per_step"] == 0, plain
assert moved["sequences_moved_per_step"] > 0 and moved["sequence_bytes_per_step"] > 0, moved
# Sequences go where their topic's experts are: fewer rows leave their rank.
assert moved["remote_row_fraction"] < 0.8 * plain["remote_row_fraction"], \
    (moved["remote_row_fraction"], plain["remote_row_fraction"])
# Moving sequences moves work, never math (the weights above). The reported loss is summed per
# rank, so over other tokens per rank: equal up to the order of that sum.
for a, b in zip(plain["loss"], moved["loss"]):
    assert abs(a - b) <= 1e-12 * abs(a), (plain["loss"], moved["loss"])
t = r["targets"]["sequence_migration_step_ratio"]
assert t["met"] == (t["value"] <= t["target"]) and t["target"] == 0.9, t
assert r["sequences"]["tokens_per_sequence"] == 64, r["sequences"]
PY
}

"$keel" demo --ranks 4 "${small[@]}" --sequence-migration --link-gb-per-s 0.5 \
  --report "$work/seq.json" >"$work/out" 2>"$work/err" ||
  fail "sequence migration demo failed: $(cat "$work/err")"
check_migration "$work/seq.json" || fail "sequence migration report is wrong"
grep -q "keel+seq / keel parallel step" "$work/out" || fail "no ratio line: $(cat "$work/out")"

# Condensation at 1.0: identical tokens only, so exact training bit for bit, and rows saved.
"$keel" demo --ranks 4 "${small[@]}" --condense 1.0 --report "$work/c1.json" >"$work/out" \
  2>"$work/err" || fail "condense 1.0 failed: $(cat "$work/err")"
"$keel" demo --ranks 4 "${small[@]}" --condense 0.99 --report "$work/c99.json" >"$work/out" \
  2>"$work/err" || fail "condense 0.99 failed: $(cat "$work/err")"
grep -q "rows saved by condensation" "$work/out" || fail "no rows-saved line: $(cat "$work/out")"
python3 - "$work/c1.json" "$work/c99.json" <<'PY' || fail "condensation reports are wrong"
import json, sys
one, low = (json.load(open(p)) for p in sys.argv[1:])
assert one["mode_order"] == ["exact", "condensed"], one["mode_order"]
assert one["final_weights_identical"] is True, "threshold 1.0 changed the weights"
assert one["modes"]["exact"]["loss"] == one["modes"]["condensed"]["loss"], "losses differ"
saved_one = one["condensation"]["rows_saved_fraction"]
saved_low = low["condensation"]["rows_saved_fraction"]
# Repeated tokens (a quarter, half of them exact) are condensed.
assert 0.03 < saved_one < 0.25, saved_one
assert saved_low >= saved_one, (saved_low, saved_one)
assert one["condensation"]["mean_loss_difference"] == 0.0, one["condensation"]
assert "mean_loss_difference" in low["condensation"] and low["condensation"]["threshold"] == 0.99
assert one["sequences"]["token_repeat"] == 0.25, one["sequences"]
PY

expect_usage_error() {
  local words="$1"
  shift
  local got=0
  "$keel" demo "$@" >/dev/null 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$* exited $got, expected 2"
  grep -q -- "$words" "$work/err" || fail "$*: $(cat "$work/err")"
}
expect_usage_error "give one" --sequence-migration --condense 1
expect_usage_error "must be a cosine threshold in (0, 1]" --condense 1.5
expect_usage_error "is not a multiple of --sequence-tokens 100" --sequence-migration \
  --tokens 512 --sequence-tokens 100
expect_usage_error "--sequence-affinity 2" --sequence-migration --sequence-affinity 2
expect_usage_error "--link-gb-per-s -1" --link-gb-per-s -1
"$keel" demo --help >"$work/help" || fail "demo --help failed"
for flag in --sequence-migration --condense --sequence-tokens --sequence-affinity --token-repeat \
  --link-gb-per-s; do
  grep -q -- "$flag" "$work/help" || fail "help lacks $flag"
done

if keel_can_run_mpi "$keel"; then
  keel_mpi_demo 180 "$keel" \
    "${small[@]}" --sequence-migration --link-gb-per-s 0.5 --report "$work/mpi.json" \
    >"$work/out" 2>"$work/err" || fail "mpi sequence migration failed: $(tail -20 "$work/err")"
  check_migration "$work/mpi.json" || fail "mpi sequence migration report is wrong"
  # Threads and processes train the same model: the same loss curve.
  python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); assert a["modes"]["keel+seq"]["loss"]==b["modes"]["keel+seq"]["loss"]' \
    "$work/seq.json" "$work/mpi.json" || fail "threads and MPI loss curves differ"
  echo "luffy_demo_cli: ok (threads and mpi)"
else
  echo "luffy_demo_cli: ok (threads; mpi skipped: needs mpirun and a keel with ucx and mpi)"
fi
