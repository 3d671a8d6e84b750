#!/usr/bin/env bash
# End-to-end test of `keel replay`: a synthetic trace under every policy writes a JSON report and
# an SVG plot; a bad policy name, a missing trace, a format or seed that does not fit the trace,
# or a bad config (reported before the trace is read) is a usage error (exit 2).
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-replay-cli-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "replay_cli: $*" >&2
  exit 1
}

"$keel" replay --trace synthetic --seed 3 --report "$work/report.json" --plot "$work/plot.svg" \
  >"$work/out" 2>"$work/err" || fail "replay failed: $(cat "$work/err")"
grep -q "imbalance mean" "$work/out" || fail "no summary table: $(cat "$work/out")"
[[ -s "$work/plot.svg" ]] || fail "no plot written"
grep -q "</svg>" "$work/plot.svg" || fail "plot is not a complete SVG"
if ls "$work"/*.tmp.* >/dev/null 2>&1; then fail "temporary files left behind"; fi
python3 - "$work/report.json" <<'PY' || fail "report is incomplete"
import json, sys
r = json.load(open(sys.argv[1]))
names = ["static", "eplb", "flexmoe", "smartmoe", "fastermoe", "velb", "lplb", "swiftmoe",
         "trtllm", "keel"]
assert r["mode"] == "causal" and r["policy_order"] == names, r["policy_order"]
assert r["config"]["num_ranks"] == 8, r["config"]
for name in names:
    p = r["policies"][name]
    i = p["imbalance"]
    assert 1.0 - 1e-9 <= i["p50"] <= i["p90"] <= i["p99"] <= i["max"], (name, i)
    for key in ["lb_gap", "moved_slots_per_replan", "moved_slots_total", "moved_bytes_total"]:
        assert key in p, (name, key)
    assert p["sim_step_seconds"]["mean"] > 0 and "median" in p["planner_seconds_per_layer"]
assert r["policies"]["static"]["moved_bytes_total"] == 0
PY
if command -v rsvg-convert >/dev/null 2>&1; then
  rsvg-convert "$work/plot.svg" -o "$work/plot.png" || fail "rsvg-convert cannot render the plot"
fi

# Oracle mode on two policies, quietly.
"$keel" replay --synthetic --policy static,keel --oracle --quiet --report "$work/oracle.json" \
  >/dev/null 2>"$work/err" || fail "oracle replay failed: $(cat "$work/err")"
[[ ! -s "$work/err" ]] || fail "--quiet still wrote to stderr: $(cat "$work/err")"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["mode"]=="oracle" and r["policy_order"]==["static","keel"]' \
  "$work/oracle.json" || fail "oracle report is wrong"

# Usage errors exit 2 and say why.
got=0
"$keel" replay --trace synthetic --policy static,bogus >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] || fail "bad policy: exit $got"
grep -q "unknown policy 'bogus' (known: static, eplb" "$work/err" || fail "$(cat "$work/err")"
got=0
"$keel" replay --policy keel >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q -- "--trace" "$work/err" || fail "missing --trace: exit $got"
got=0
"$keel" replay --trace synthetic --frobnicate >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q "unknown flag --frobnicate" "$work/err" || fail "unknown flag: $got"
got=0
"$keel" replay --trace synthetic --format csv >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q -- "--format csv names how to read a trace file" "$work/err" ||
  fail "--format with a synthetic trace: exit $got: $(cat "$work/err")"
got=0
"$keel" replay --trace "$work/report.json" --seed 4 >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q -- "--seed picks a synthetic trace" "$work/err" ||
  fail "--seed with a trace file: exit $got: $(cat "$work/err")"
got=0
"$keel" replay --trace "$work/report.json" --format csv >/dev/null 2>"$work/err" || got=$?
[[ "$got" == 2 ]] && grep -q -- "--format: unknown trace format 'csv'" "$work/err" ||
  fail "unknown --format: exit $got: $(cat "$work/err")"
# A bad config is reported before the trace is read: the trace here does not exist.
printf 'topology:\n  num_nodes: 0\n' >"$work/bad.yaml"
got=0
"$keel" replay --trace "$work/missing.jsonl" --config "$work/bad.yaml" >/dev/null 2>"$work/err" ||
  got=$?
[[ "$got" == 2 ]] && grep -q "topology.num_nodes" "$work/err" ||
  fail "bad config with a missing trace: exit $got: $(cat "$work/err")"
"$keel" replay --help >"$work/help.txt" && grep -q "keel config --markdown" "$work/help.txt" ||
  fail "help lacks the config pointer"
echo "replay_cli: ok"
