#!/usr/bin/env bash
# End-to-end test of `keel replay --serve-metrics`: a synthetic replay serves Prometheus metrics
# on a free port, the scrape holds the documented families with data and passes
# `promtool check metrics`, and the process exits on --serve-seconds and on SIGTERM. Bad
# combinations of flags are usage errors (exit 2). Skips (77) without promtool or python3.
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
command -v promtool >/dev/null 2>&1 || { echo "replay_metrics_cli: no promtool, skipping"; exit 77; }
command -v python3 >/dev/null 2>&1 || { echo "replay_metrics_cli: no python3, skipping"; exit 77; }
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-replay-metrics-XXXXXX")"
pid=""
cleanup() {
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
  if [[ -n "$pid" ]]; then wait "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

fail() {
  echo "replay_metrics_cli: $*" >&2
  [[ -f "$work/err" ]] && sed 's/^/  stderr: /' "$work/err" >&2
  exit 1
}

# The bound address from the "serving metrics on http://HOST:PORT/metrics" line, waiting up to
# 20 s for it.
wait_for_address() {
  local address=""
  for _ in $(seq 200); do
    address="$(grep -o 'serving metrics on http://[^ ]*/metrics' "$work/err" 2>/dev/null |
      sed 's|serving metrics on http://||; s|/metrics||' | head -n 1 || true)"
    [[ -n "$address" ]] && { echo "$address"; return 0; }
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

scrape() {
  python3 - "$1" <<'PY'
import sys, urllib.request
with urllib.request.urlopen("http://" + sys.argv[1] + "/metrics", timeout=10) as response:
    sys.stdout.write(response.read().decode())
PY
}

# 1. A whole trace at full speed, then serving until --serve-seconds.
"$keel" replay --trace synthetic --seed 5 --policy keel --serve-metrics 127.0.0.1:0 \
  --serve-seconds 30 --quiet >"$work/out" 2>"$work/err" &
pid=$!
address="$(wait_for_address)" || fail "no 'serving metrics on' line"
[[ "$address" == 127.0.0.1:* ]] || fail "exporter not on 127.0.0.1: $address"
# The synthetic trace has 200 steps; wait until the replay has published all of them.
for _ in $(seq 200); do
  scrape "$address" >"$work/metrics" || fail "scrape failed"
  grep -q '^keel_steps_total 200$' "$work/metrics" && break
  sleep 0.1
done
grep -q '^keel_steps_total 200$' "$work/metrics" || fail "steps_total never reached 200"
promtool check metrics <"$work/metrics" >"$work/promtool" 2>&1 ||
  fail "promtool check metrics: $(cat "$work/promtool")"
python3 - "$work/metrics" <<'PY' || fail "metrics content"
import re, sys
series = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    name_labels, value = line.rsplit(" ", 1)
    series[name_labels] = float(value)
def values(prefix):
    return {k: v for k, v in series.items() if k == prefix or k.startswith(prefix + "{")}
def one(key):
    assert key in series, key
    return series[key]
assert len(values("keel_build_info")) == 1 and list(values("keel_build_info").values()) == [1]
routed = values("keel_routed_tokens_total")
# 4 layers x 8 ranks; the synthetic trace routes 8 sources x 4096 tokens x top-2 per layer-step.
assert len(routed) == 32, len(routed)
total = sum(routed.values())
assert abs(total - 200 * 4 * 8 * 4096 * 2) < 1e-6 * total, total
assert not values("keel_expert_tokens_total"), "per-expert series must be off by default"
for layer in range(4):
    for source in ["last_step", "estimate"]:
        r = one('keel_layer_imbalance_ratio{layer="%d",source="%s"}' % (layer, source))
        b = one('keel_layer_balancedness{layer="%d",source="%s"}' % (layer, source))
        assert r >= 1 - 1e-9 and abs(r * b - 1) < 1e-9, (layer, source, r, b)
    assert one('keel_layer_lower_bound_gap_ratio{layer="%d"}' % layer) >= 1
    assert one('keel_expert_load_tokens_count{layer="%d"}' % layer) == 200 * 32
    assert 'keel_layer_replicas{layer="%d"}' % layer in series
    assert 'keel_layer_transient_replicas{layer="%d"}' % layer in series
made = one('keel_plans_total{outcome="made",reason="none"}')
applied = one('keel_plans_total{outcome="applied",reason="none"}')
skipped = sum(v for k, v in values("keel_plans_total").items() if 'outcome="skipped"' in k)
assert made == applied and made + skipped == 199, (made, applied, skipped)
assert one("keel_placement_epoch") == applied
assert one('keel_migrations_total{outcome="ok"}') == applied
assert one('keel_migrations_total{outcome="failed"}') == 0
assert one('keel_migrations_total{outcome="aborted"}') == 0
if applied > 0:
    assert one('keel_migration_bytes_total{transport="local"}') > 0
assert one("keel_planner_duration_seconds_count") == 199
assert one("keel_planner_last_run_timestamp_seconds") > 1.5e9
assert one("keel_monitor_dropped_samples_total") == 0
assert "keel_migrations_in_flight" in series
assert "keel_migration_exposed_seconds_total" in series
PY
grep -q "imbalance mean" "$work/out" || fail "no summary table after the trace"
# SIGTERM ends serving cleanly (exit 0).
kill -TERM "$pid"
wait "$pid" || fail "keel replay exited with $? on SIGTERM"
pid=""

# 2. Paced and looping with per-expert series from an aggregating config: serving ends on
# --serve-seconds while the loop is still replaying.
cat >"$work/config.yaml" <<'YAML'
topology:
  num_nodes: 1
  gpus_per_node: 8
slots:
  persistent_per_rank: 5
policy:
  name: eplb
monitor:
  per_expert: aggregated
  aggregating_rank: 0
YAML
start=$(date +%s)
launched=$(date +%s.%N)
"$keel" replay --trace synthetic --config "$work/config.yaml" --serve-metrics 127.0.0.1:0 \
  --pace 0.01 --loop --serve-seconds 3 --quiet >"$work/out" 2>"$work/err" &
pid=$!
address="$(wait_for_address)" || fail "no 'serving metrics on' line (loop)"
grep -q "policy eplb" "$work/err" || fail "serve-metrics did not use the config's policy"
sleep 1
scrape "$address" >"$work/metrics" || fail "scrape failed (loop)"
scraped=$(date +%s.%N)
promtool check metrics <"$work/metrics" >"$work/promtool" 2>&1 ||
  fail "promtool check metrics (loop): $(cat "$work/promtool")"
experts=$(grep -c '^keel_expert_tokens_total{' "$work/metrics" || true)
[[ "$experts" == 128 ]] || fail "expected 4 x 32 per-expert series, got $experts"
steps=$(grep '^keel_steps_total ' "$work/metrics" | cut -d' ' -f2)
# Paced at 10 ms per step, the replay cannot have run more steps than the time since launch
# allows (one second in on an idle machine: about 100 of the 200-step trace; unpaced it loops
# through thousands).
seconds=$(python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$scraped" "$launched")
python3 -c "import sys; s, t = map(float, sys.argv[1:]); sys.exit(0 if 5 <= s <= t / 0.01 + 1 else 1)" \
  "$steps" "$seconds" || fail "pacing: $steps steps in $seconds s at 0.01 s/step"
wait "$pid" || fail "looping replay exited with $?"
pid=""
elapsed=$(($(date +%s) - start))
((elapsed <= 15)) || fail "--serve-seconds 3 took ${elapsed}s"

# 3. Usage errors.
expect_usage_error() {
  local status=0
  "$keel" replay --trace synthetic --quiet "$@" >"$work/out" 2>"$work/err" || status=$?
  [[ "$status" == 2 ]] || fail "expected exit 2 for '$*', got $status"
  grep -q -- "$EXPECT" "$work/err" || fail "for '$*' stderr lacks '$EXPECT'"
}
EXPECT="one policy" expect_usage_error --serve-metrics 127.0.0.1:0 --policy keel,eplb
EXPECT="--loop" expect_usage_error --loop
EXPECT="not-a-port" expect_usage_error --serve-metrics 127.0.0.1:not-a-port
EXPECT="write an IPv6 host in brackets" expect_usage_error --serve-metrics ::1:9400
EXPECT="--pace" expect_usage_error --pace -1

# 4. A port in use: bad input (exit 2, not a crash); the error names the address and the cause.
"$keel" replay --trace synthetic --policy static --serve-metrics 127.0.0.1:0 --serve-seconds 20 \
  --quiet >"$work/out" 2>"$work/err" &
pid=$!
address="$(wait_for_address)" || fail "no 'serving metrics on' line (port in use)"
status=0
"$keel" replay --trace synthetic --policy static --serve-metrics "$address" --serve-seconds 1 \
  --quiet >"$work/out2" 2>"$work/err2" || status=$?
[[ "$status" == 2 ]] || fail "second exporter on $address: expected exit 2, got $status"
grep -q "$address" "$work/err2" || fail "error does not name $address: $(cat "$work/err2")"
grep -q "the port is in use" "$work/err2" || fail "error does not say why: $(cat "$work/err2")"
kill -INT "$pid"
wait "$pid" || fail "keel replay exited with $? on SIGINT"
pid=""

# 5. IPv6: "[::1]:0" serves and is scraped over IPv6 (skipped without an IPv6 loopback).
if python3 -c 'import socket; socket.socket(socket.AF_INET6).bind(("::1", 0))' 2>/dev/null; then
  "$keel" replay --trace synthetic --policy static --serve-metrics "[::1]:0" --serve-seconds 20 \
    --quiet >"$work/out" 2>"$work/err" &
  pid=$!
  address="$(wait_for_address)" || fail "no 'serving metrics on' line ([::1]:0)"
  [[ "$address" == "[::1]:"* ]] || fail "exporter not on [::1]: $address"
  scrape "$address" >"$work/metrics" || fail "scrape of $address failed"
  grep -q '^keel_steps_total ' "$work/metrics" || fail "no keel_steps_total from $address"
  kill -TERM "$pid"
  wait "$pid" || fail "keel replay on [::1] exited with $? on SIGTERM"
  pid=""
else
  echo "replay_metrics_cli: no IPv6 loopback, skipping the [::1] case"
fi
echo "replay_metrics_cli: ok"
