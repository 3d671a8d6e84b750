#!/usr/bin/env bash
# End-to-end test of `keel demo` at a small size: 4 ranks as threads train the MoE model under the
# static placement and the keel policy; the report must show bitwise identical final weights,
# lower imbalance under keel, a decreasing loss and at least one committed epoch. When Open MPI
# and UCX are available, the same run as 4 MPI processes over the UCX transport. The threads run
# again with every slot buffer in guarded device memory (--memory guarded-host), which must give
# the same final weights bit for bit; --memory device without a GPU says it needs one. Bad flags
# are usage errors (exit 2).
# $1: path of the keel binary.
set -euo pipefail
source "$(dirname "$0")/../common/mpi_demo.sh"

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-demo-cli-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "demo_cli: $*" >&2
  exit 1
}

small=(--layers 2 --experts 8 --tokens 512 --steps 12)

check_report() {
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ranks = int(sys.argv[2])
assert r["final_weights_identical"] is True, "final weights differ"
assert r["ranks"] == ranks and r["config"]["num_ranks"] == ranks, r["ranks"]
s, k = r["modes"]["static"], r["modes"]["keel"]
assert k["mean_imbalance"] < s["mean_imbalance"], (k["mean_imbalance"], s["mean_imbalance"])
assert s["mean_imbalance"] > 1.2, s["mean_imbalance"]
assert k["epochs"] >= 1, k["epochs"]
assert s["epochs"] == 0 and s["bytes_moved"] == 0, (s["epochs"], s["bytes_moved"])
for name, m in (("static", s), ("keel", k)):
    loss = m["loss"]
    assert len(loss) == 12 and loss[-1] < loss[0], (name, loss)
    steps = m["parallel_step_seconds"]
    assert steps["mean"] > 0 and len(steps["per_step"]) == 12, (name, steps)
    assert 0 <= m["engine_overhead_fraction"] < 1, (name, m["engine_overhead_fraction"])
# Placement never changes the math: the same loss curve, bit for bit.
assert s["loss"] == k["loss"], "loss curves differ"
for key in ("keel_parallel_step_ratio", "keel_mean_imbalance", "keel_engine_overhead_fraction"):
    t = r["targets"][key]
    assert t["met"] == (t["value"] <= t["target"]), (key, t)
PY
}

"$keel" demo --ranks 4 "${small[@]}" --report "$work/threads.json" >"$work/out" 2>"$work/err" ||
  fail "threads demo failed: $(cat "$work/err")"
grep -q "final weights identical:     yes (bitwise)" "$work/out" || fail "no verdict: $(cat "$work/out")"
grep -q "imbalance" "$work/err" || fail "no progress on stderr"
check_report "$work/threads.json" 4 || fail "threads report: $(cat "$work/threads.json")"

# Slot buffers in guarded device memory: the engine reaches them only through the device
# interface (a stray host access would crash the run), and the bits equal host memory's.
"$keel" demo --ranks 4 "${small[@]}" --memory guarded-host --report "$work/guarded.json" \
  >"$work/out" 2>"$work/err" || fail "guarded-host demo failed: $(cat "$work/err")"
check_report "$work/guarded.json" 4 || fail "guarded-host report: $(cat "$work/guarded.json")"
python3 - "$work/threads.json" "$work/guarded.json" <<'PY' || fail "guarded-host weights differ"
import json, sys
host, guarded = (json.load(open(p)) for p in sys.argv[1:])
assert guarded["memory"] == "guarded-host" and host["memory"] == "host"
assert len(host["final_weights_checksum"]) == 16
assert guarded["final_weights_checksum"] == host["final_weights_checksum"], (
    guarded["final_weights_checksum"], host["final_weights_checksum"])
assert guarded["modes"]["keel"]["loss"] == host["modes"]["keel"]["loss"]
PY
if ! "$keel" version | grep -q "cuda=on" || ! command -v nvidia-smi >/dev/null 2>&1; then
  got=0
  "$keel" demo --memory device --quiet >/dev/null 2>"$work/err" || got=$?
  [[ "$got" != 0 ]] && grep -q -- "--memory device needs a GPU" "$work/err" ||
    fail "--memory device without a GPU: exit $got, $(cat "$work/err")"
fi

# --quiet writes nothing on stderr.
"$keel" demo --ranks 2 --layers 1 --experts 4 --tokens 64 --steps 3 --quiet >/dev/null \
  2>"$work/err" || fail "quiet demo failed: $(cat "$work/err")"
[[ ! -s "$work/err" ]] || fail "--quiet still wrote to stderr: $(cat "$work/err")"

# Usage errors exit 2 and name the flag.
got=0
"$keel" demo --comm carrier-pigeon >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q -- "--comm 'carrier-pigeon'" "$work/err" || fail "bad --comm: exit $got"
got=0
"$keel" demo --top-k 9 --experts 8 >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q -- "--top-k 9 exceeds --experts 8" "$work/err" || fail "top-k: exit $got"
"$keel" demo --help >"$work/help.txt" && grep -q -- "--transport NAME" "$work/help.txt" ||
  fail "help lacks --transport"

# The same run as MPI processes over UCX, where both are there.
if keel_can_run_mpi "$keel"; then
  keel_mpi_demo 120 "$keel" "${small[@]}" \
    --report "$work/mpi.json" >"$work/out" 2>"$work/err" ||
    fail "mpi demo failed: $(tail -20 "$work/err")"
  check_report "$work/mpi.json" 4 || fail "mpi report: $(cat "$work/mpi.json")"
  # Threads and processes train the same model: the same loss curve.
  python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); assert a["modes"]["keel"]["loss"]==b["modes"]["keel"]["loss"]' \
    "$work/threads.json" "$work/mpi.json" || fail "threads and MPI loss curves differ"
  echo "demo_cli: ok (threads and mpi)"
else
  echo "demo_cli: ok (threads; mpi skipped: needs mpirun and a keel with ucx and mpi)"
fi
