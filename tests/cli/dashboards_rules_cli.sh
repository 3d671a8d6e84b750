#!/usr/bin/env bash
# Static checks of dashboards/: every PromQL expression of the Grafana dashboard and of the
# Prometheus console templates, collected into a generated rules file, passes
# `promtool check rules`; the alert rules and the example prometheus.yml pass promtool; the
# Grafana JSON keeps its invariants (stable uid, templated datasource, $__rate_interval). Each
# check is also shown to fail on a bad copy, so a broken edit cannot pass unnoticed.
# $1: path of the keel binary (unused: these checks need no keel process). Exit 77 without
# promtool.
set -euo pipefail

name="dashboards_rules_cli"
source_dir="${KEEL_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
dashboards="$source_dir/dashboards"
python=/usr/bin/python3
queries="$dashboards/dashboard_queries.py"

fail() {
  echo "$name: $*" >&2
  exit 1
}
for tool in promtool "$python"; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$name: skipped: $tool not found" >&2; exit 77; }
done
"$python" -c 'import yaml' 2>/dev/null || { echo "$name: skipped: python3-yaml not installed" >&2; exit 77; }

work="$(mktemp -d "${TMPDIR:-/tmp}/keel-dashboards-rules-XXXXXX")"
trap 'rm -rf "$work"' EXIT

grafana="$dashboards/grafana/keel.json"
consoles="$dashboards/prometheus/consoles"
libraries="$dashboards/prometheus/console_libraries"

# 1. Grafana invariants.
"$python" "$queries" check-grafana "$grafana" 2>"$work/err" || fail "$(cat "$work/err")"

# 2. Every dashboard expression parses.
"$python" "$queries" rules "$work/dashboard-rules.yml" --grafana "$grafana" \
  --consoles "$consoles" "$libraries" >"$work/out" 2>"$work/err" ||
  fail "cannot collect the expressions: $(cat "$work/err")"
read -r n_grafana _ _ n_console _ <"$work/out"
# A collector that silently finds nothing would pass promtool; the dashboards have dozens.
((n_grafana >= 20)) || fail "only $n_grafana Grafana expressions found: $(cat "$work/out")"
((n_console >= 20)) || fail "only $n_console console expressions found: $(cat "$work/out")"
promtool check rules "$work/dashboard-rules.yml" >"$work/out" 2>&1 ||
  fail "a dashboard expression does not parse:
$(cat "$work/out")
(rules file: $(cat "$work/dashboard-rules.yml"))"

# 3. Alert rules: parse, and the five alerts exist with a severity, a summary and a description.
promtool check rules "$dashboards/prometheus/alerts.yml" >"$work/out" 2>&1 ||
  fail "alerts.yml: $(cat "$work/out")"
"$python" - "$dashboards/prometheus/alerts.yml" <<'PY' || fail "alerts.yml lacks an alert or a field"
import sys, yaml
rules = [r for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"]]
alerts = {r["alert"]: r for r in rules if "alert" in r}
for name in ["KeelImbalanceHigh", "KeelMigrationsFailing", "KeelPlannerStalled",
             "KeelWatchdogTripped", "KeelMonitorDroppingSamples"]:
    rule = alerts[name]
    assert rule["labels"]["severity"] in ("critical", "warning", "info"), (name, rule["labels"])
    assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    assert "for" in rule, name
assert "keel_planner_last_run_timestamp_seconds" in alerts["KeelPlannerStalled"]["expr"]
assert "keel_steps_total" in alerts["KeelPlannerStalled"]["expr"]
PY

# 3b. The watchdog's alert fires on one trip of the engine's counter, and only then
# (promtool test rules, with the shipped rule file).
cp "$dashboards/prometheus/alerts.yml" "$work/alerts.yml"
cat >"$work/watchdog_test.yml" <<'YAML'
rule_files: [alerts.yml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'keel_watchdog_trips_total{job="train", instance="a", what="planner"}'
        values: '0 0 0 1 1 1 1 1'
      - series: 'keel_watchdog_trips_total{job="quiet", instance="b", what="planner"}'
        values: '0 0 0 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 2m
        alertname: KeelWatchdogTripped
        exp_alerts: []
      - eval_time: 5m
        alertname: KeelWatchdogTripped
        exp_alerts:
          - exp_labels: {severity: critical, job: train, what: planner}
            exp_annotations:
              summary: "Keel planner of train ran past its watchdog limit"
              description: >-
                A planner run of train made no progress within its configured
                limit (policy.planner_watchdog_seconds), so StepEnd returned an error on every rank and
                the placement in force stays; the late plan is dropped when it ends. A planner that
                takes this long is stuck or starved of CPU (a custom policy, a huge layer, an
                oversubscribed host): check the trainer log for "planner watchdog".
YAML
(cd "$work" && promtool test rules watchdog_test.yml) >"$work/out" 2>&1 ||
  fail "KeelWatchdogTripped does not fire as expected: $(cat "$work/out")"

# 4. The example prometheus.yml, with its rule file beside it as in the repository.
mkdir "$work/config"
cp "$dashboards/prometheus/prometheus.yml" "$dashboards/prometheus/alerts.yml" "$work/config/"
promtool check config "$work/config/prometheus.yml" >"$work/out" 2>&1 ||
  fail "prometheus.yml: $(cat "$work/out")"
grep -q "SUCCESS: 5 rules found" "$work/out" || fail "prometheus.yml does not load alerts.yml: $(cat "$work/out")"
"$python" - "$work/config/prometheus.yml" <<'PY' || fail "prometheus.yml sets a target label 'rank'"
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
for job in config["scrape_configs"]:
    for group in job.get("static_configs", []):
        assert "rank" not in group.get("labels", {}), group
    for relabel in job.get("relabel_configs", []):
        assert relabel.get("target_label") != "rank", relabel
PY

# 5. The checks bite: bad copies must fail.
expect_grafana_failure() {  # $1: what, $2: python statement editing `d`
  "$python" - "$grafana" "$work/bad.json" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
exec(sys.argv[3])
json.dump(d, open(sys.argv[2], "w"))
PY
  if "$python" "$queries" check-grafana "$work/bad.json" 2>/dev/null; then
    fail "check-grafana accepts a dashboard with $1"
  fi
}
expect_grafana_failure "another uid" 'd["uid"] = "renamed"'
expect_grafana_failure "a hard-coded datasource uid" \
  'd["panels"][1]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}'
# shellcheck disable=SC2016  # $__rate_interval is Grafana's, not a shell variable
expect_grafana_failure "a fixed rate window" '
p = [p for p in d["panels"] if "rate(" in str(p.get("targets"))][0]
p["targets"][0]["expr"] = p["targets"][0]["expr"].replace("$__rate_interval", "5m")'
expect_grafana_failure "no layer variable" \
  'd["templating"]["list"] = [v for v in d["templating"]["list"] if v["name"] != "layer"]'

cp -r "$consoles" "$work/bad-consoles"
sed -i '0,/max(keel_layer_replicas{/s//max(keel_layer_replicas{{/' "$work/bad-consoles/keel.html"
"$python" "$queries" rules "$work/bad-rules.yml" --grafana "$grafana" \
  --consoles "$work/bad-consoles" "$libraries" >/dev/null 2>&1 || true
if promtool check rules "$work/bad-rules.yml" >/dev/null 2>&1; then
  fail "promtool accepts a console template with a broken expression"
fi

echo "$name: ok ($n_grafana Grafana and $n_console console expressions)"
