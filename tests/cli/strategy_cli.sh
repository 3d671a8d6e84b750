#!/usr/bin/env bash
# End-to-end test of `keel replay --strategy` and `keel pool build`: every strategy side by side
# on the synthetic trace (table, JSON report with each part of the step, SVG plot), a pool built
# and read back, bad flags and pools refused with exit 2 and the reason. With the shared traces
# present, auto with a pool built on each is never slower than the best fixed strategy.
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-strategy-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "strategy_cli: $*" >&2
  exit 1
}

"$keel" replay --trace synthetic --strategy all --report "$work/report.json" \
  --plot "$work/plot.svg" --quiet >"$work/out" 2>"$work/err" || fail "replay: $(cat "$work/err")"
for strategy in ep esp parm ppmoe auto; do
  grep -q "^$strategy " "$work/out" || fail "no row for $strategy: $(cat "$work/out")"
done
python3 - "$work/report.json" <<'PY' || fail "report: $(cat "$work/report.json")"
import json, sys
r = json.load(open(sys.argv[1]))["strategy_replay"]
assert r["ep_policy"] == "keel" and r["mode"] == "causal", r
s = r["strategies"]
assert sorted(s) == ["auto", "ep", "esp", "parm", "ppmoe"], list(s)
for name, m in s.items():
    parts = sum(m[k] for k in ("compute_seconds", "all_to_all_seconds", "all_reduce_seconds",
                               "sync_seconds", "migration_seconds"))
    assert abs(parts - m["sim_step_seconds"]["mean"]) <= 1e-9 * parts, (name, m)
    assert m["imbalance"]["mean"] >= 1.0 and m["link_gb_per_step"] > 0, (name, m)
    assert m["messages_per_rank"] > 0, (name, m)
# Shapes of the strategies: ppmoe never exchanges tokens between ranks, esp shards every expert
# over the node so its compute is even.
assert s["ppmoe"]["all_to_all_seconds"] == 0, s["ppmoe"]
assert s["esp"]["imbalance"]["max"] == 1.0, s["esp"]
assert "switches" in s["auto"] and "switches" not in s["ep"]
assert sum(s["auto"]["layer_steps_in"].values()) == r["steps"] * r["layers"], s["auto"]
PY
grep -q "Simulated step time per strategy" "$work/plot.svg" || fail "plot has no step panel"
for strategy in ep esp parm ppmoe auto; do
  grep -q ">$strategy<" "$work/plot.svg" || fail "plot has no line for $strategy"
done

# A pool of one per layer: auto starts in it and never leaves, so it replays as that strategy.
"$keel" trace generate --output "$work/trace.jsonl" --steps 40 >/dev/null 2>&1 ||
  fail "could not write a trace"
"$keel" pool build --trace "$work/trace.jsonl" --size 1 --profile-steps 20 \
  --out "$work/pool.json" --quiet >"$work/out" 2>"$work/err" || fail "pool: $(cat "$work/err")"
grep -q "pool of 1 per layer" "$work/out" || fail "pool summary: $(cat "$work/out")"
python3 - "$work/pool.json" <<'PY' || fail "pool file: $(cat "$work/pool.json")"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["format"] == "keel-strategy-pool" and "20 steps" in p["source"], p
assert len(p["layers"]) == 4 and all(len(l) == 1 for l in p["layers"]), p
PY
"$keel" replay --trace "$work/trace.jsonl" --strategy ep,esp,parm,ppmoe,auto \
  --pool "$work/pool.json" --report "$work/pooled.json" --quiet >/dev/null 2>"$work/err" ||
  fail "pooled replay: $(cat "$work/err")"
python3 - "$work/pooled.json" <<'PY' || fail "pooled report: $(cat "$work/pooled.json")"
import json, sys
r = json.load(open(sys.argv[1]))["strategy_replay"]
a = r["strategies"]["auto"]
assert a["switches"] == 0, a
ran = [name for name, n in a["layer_steps_in"].items() if n > 0]
assert all(layer[0] in ran for layer in r["pool"]["layers"]), (ran, r["pool"])
PY

# Errors name the flag or the value.
expect_usage_error() {
  local words="$1"
  shift
  local got=0
  "$@" >/dev/null 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$* exited $got, expected 2"
  grep -q -- "$words" "$work/err" || fail "$*: $(cat "$work/err")"
}
expect_usage_error "'tp' is not one of ep, esp, parm, ppmoe, auto" \
  "$keel" replay --trace synthetic --strategy ep,tp
expect_usage_error "--pool is only meaningful with --strategy" \
  "$keel" replay --trace synthetic --pool "$work/pool.json"
expect_usage_error "--strategy runs one policy for ep" \
  "$keel" replay --trace synthetic --strategy all --policy keel,eplb
expect_usage_error "belongs to the policy replay" \
  "$keel" replay --trace synthetic --strategy all --serve-metrics 0
echo '{"format": "keel-strategy-pool", "layers": [["ep"], ["parm", "nope"]]}' >"$work/bad.json"
expect_usage_error "layers\[1\]: strategy 'nope'" \
  "$keel" replay --trace "$work/trace.jsonl" --strategy auto --pool "$work/bad.json"
# A pool from a pipe: read as a stream when KEEL_ALLOW_STREAMS=1 says so.
expect_usage_error "the pool has 2 layers, the trace 4" \
  env KEEL_ALLOW_STREAMS=1 "$keel" replay --trace "$work/trace.jsonl" --strategy auto \
  --pool <(echo '{"format": "keel-strategy-pool", "layers": [["ep"], ["ppmoe"]]}')
expect_usage_error "--size must be in \[1, 4\]" \
  "$keel" pool build --trace "$work/trace.jsonl" --size 5 --out "$work/p.json"
printf 'strategy:\n  mp_degree: 3\n' >"$work/mp3.yaml"
expect_usage_error "strategy.mp_degree: 3 does not divide topology.gpus_per_node (8)" \
  "$keel" replay --trace synthetic --strategy all --config "$work/mp3.yaml"
"$keel" pool --help | grep -q "keel pool build" || fail "pool --help"
"$keel" pool build --help >"$work/help" || fail "pool build --help failed"
grep -q -- "--profile-steps" "$work/help" || fail "pool build --help: $(cat "$work/help")"

# The shared traces: auto, with a pool built on the first part of each, is never slower than
# the best fixed strategy.
if [[ -n "${KEEL_SHARED_TRACES:-}" && -d "$KEEL_SHARED_TRACES/smartmoe-ae" ]]; then
  configs="${KEEL_SOURCE_DIR:-.}/configs"
  while read -r trace config profile; do
    "$keel" pool build --trace "$KEEL_SHARED_TRACES/$trace" --config "$configs/$config" \
      --size 2 --profile-steps "$profile" --out "$work/shared-pool.json" --quiet \
      >/dev/null 2>"$work/err" || fail "pool on $trace: $(cat "$work/err")"
    "$keel" replay --trace "$KEEL_SHARED_TRACES/$trace" --config "$configs/$config" \
      --strategy all --pool "$work/shared-pool.json" --report "$work/shared.json" --quiet \
      >/dev/null 2>"$work/err" || fail "replay of $trace: $(cat "$work/err")"
    python3 - "$work/shared.json" "$trace" <<'PY' || fail "auto lost on $trace"
import json, sys
s = json.load(open(sys.argv[1]))["strategy_replay"]["strategies"]
mean = {name: m["sim_step_seconds"]["mean"] for name, m in s.items()}
best = min(v for k, v in mean.items() if k != "auto")
assert mean["auto"] <= best * (1 + 1e-12), (sys.argv[2], mean)
PY
  done <<'LIST'
smartmoe-ae smartmoe-16gpu.yaml 100
esft-dsv2lite esft-dsv2lite-2x4.yaml 106
olmoe-mixtral-routing olmoe-8gpu.yaml 3
LIST
fi
echo "strategy_cli: ok"
