#!/usr/bin/env bash
# End to end: `keel replay --serve-metrics` exports a synthetic trace's metrics, Debian's
# Prometheus scrapes it every second, and within ~20 s every Grafana panel query (variables set
# to All) returns data through /api/v1/query, the alert rules evaluate cleanly, and the console
# page /consoles/keel.html renders one row per layer and per rank with values in every cell and
# graph queries that return data. Everything listens on 127.0.0.1 only; every process this
# script starts is stopped on exit.
# $1: path of the keel binary. Exit 77 without prometheus.
set -euo pipefail

name="dashboards_e2e_cli"
keel="$1"
source_dir="${KEEL_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
dashboards="$source_dir/dashboards"
python=/usr/bin/python3

fail() {
  echo "$name: $*" >&2
  exit 1
}
for tool in prometheus "$python"; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$name: skipped: $tool not found" >&2; exit 77; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/keel-dashboards-e2e-XXXXXX")"
keel_pid=""
prometheus_pid=""
prometheus_port=""
checks_pid=""

# Waits for a process this script started and the caller asked to stop; SIGTERM after 2 s,
# SIGKILL after 5 s.
stop_process() {  # $1: pid
  local pid="$1" i
  for i in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break
    if ((i == 20)); then kill -TERM "$pid" 2>/dev/null || true; fi
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  trap '' INT TERM  # finish stopping everything even if interrupted again
  if [[ -n "$checks_pid" ]]; then kill "$checks_pid" 2>/dev/null || true; wait "$checks_pid" 2>/dev/null || true; fi
  if [[ -n "$prometheus_pid" ]]; then
    "$python" -c 'import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="POST"), timeout=2)' \
      "http://127.0.0.1:$prometheus_port/-/quit" >/dev/null 2>&1 || true
    stop_process "$prometheus_pid"
  fi
  if [[ -n "$keel_pid" ]]; then
    kill -TERM "$keel_pid" 2>/dev/null || true
    stop_process "$keel_pid"
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # so that cleanup runs when interrupted too

# The synthetic trace's shape, from the generator's own help (defaults of `keel trace generate`).
generate_help="$("$keel" trace generate --help 2>&1)" ||
  fail "\`$keel trace generate --help\` failed: $generate_help"
default_of() {  # $1: flag
  sed -n "s/^ *--$1 N .*(default: \([0-9]*\)).*/\1/p" <<<"$generate_help"
}
num_layers="$(default_of layers)"
num_ranks="$(default_of sources)"
num_experts="$(default_of experts)"
[[ -n "$num_layers" && -n "$num_ranks" && -n "$num_experts" ]] ||
  fail "cannot read the synthetic trace's shape from \`keel trace generate --help\`"

# A config like the one replay fits to the trace (one GPU per source rank, a spare slot per GPU),
# plus the per-expert series so the "Hottest experts" panel has data: they exist only with
# monitor.per_expert: aggregated, which is off by default.
cat >"$work/keel.yaml" <<EOF
topology:
  num_nodes: 1
  gpus_per_node: $num_ranks
slots:
  persistent_per_rank: $(((num_experts + num_ranks - 1) / num_ranks + 1))
  transient_per_rank: 1
policy:
  name: keel
monitor:
  per_expert: aggregated
EOF

# The log exists before the background replay opens it, so the polling below never reads a
# missing file (under load the loop can run before the replay's redirection does).
: >"$work/keel.err"
"$keel" replay --trace synthetic --config "$work/keel.yaml" --serve-metrics 127.0.0.1:0 \
  --pace 0.05 --loop --serve-seconds 120 --quiet >"$work/keel.out" 2>"$work/keel.err" &
keel_pid=$!
keel_port=""
for _ in $(seq 100); do
  keel_port="$(sed -n 's|.*serving metrics on http://127\.0\.0\.1:\([0-9]*\)/metrics.*|\1|p' \
    "$work/keel.err" | head -n1)"
  [[ -n "$keel_port" ]] && break
  kill -0 "$keel_pid" 2>/dev/null || fail "keel replay exited: $(cat "$work/keel.err")"
  sleep 0.1
done
[[ -n "$keel_port" ]] || fail "keel replay did not say where it serves: $(cat "$work/keel.err")"

prometheus_port="$("$python" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cp "$dashboards/prometheus/alerts.yml" "$work/alerts.yml"
cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - alerts.yml
scrape_configs:
  - job_name: keel
    static_configs:
      - targets: ['127.0.0.1:$keel_port']
EOF
# Keel's console library beside the stock ones (where Debian ships them), as an operator would
# install it: the names must not clash.
mkdir "$work/console_libraries"
cp "$dashboards"/prometheus/console_libraries/*.lib "$work/console_libraries/"
for stock in /etc/prometheus/console_libraries /usr/share/doc/prometheus/examples/console_libraries; do
  if ls "$stock"/*.lib >/dev/null 2>&1; then
    cp "$stock"/*.lib "$work/console_libraries/"
    break
  fi
done

prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prometheus_port" --web.enable-lifecycle \
  --web.console.templates="$dashboards/prometheus/consoles" \
  --web.console.libraries="$work/console_libraries" --log.level=warn \
  >"$work/prometheus.log" 2>&1 &
prometheus_pid=$!

# The checks run in the background so that an interrupt stops the test at once.
"$python" - "$dashboards" "http://127.0.0.1:$prometheus_port" "$num_layers" "$num_ranks" \
  "$prometheus_pid" <<'PY' &
import codecs, html.parser, json, math, os, re, sys, time, urllib.parse, urllib.request

dashboards, base, num_layers, num_ranks, prometheus_pid = sys.argv[1:6]
sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, dashboards)
import dashboard_queries as dq

def get(path, timeout=5):
    with urllib.request.urlopen(base + path, timeout=timeout) as response:
        return response.status, response.read().decode()

def query(expr):
    _, body = get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    reply = json.loads(body)
    assert reply["status"] == "success", (expr, reply)
    data = reply["data"]
    if data["resultType"] == "vector":
        return [float(r["value"][1]) for r in data["result"]]
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    return []

def alive():
    try:
        os.kill(int(prometheus_pid), 0)
        return True
    except OSError:
        return False

start = time.time()
while True:
    try:
        if get("/-/ready", timeout=1)[0] == 200:
            break
    except OSError:
        pass
    if not alive() or time.time() - start > 15:
        sys.exit("prometheus did not become ready")
    time.sleep(0.2)

with open(os.path.join(dashboards, "grafana", "keel.json")) as f:
    dashboard = json.load(f)
# $__rate_interval as Grafana computes it for a 1 s scrape interval and a short range.
queries = [(where, dq.substitute(expr, rate_interval="15s"))
           for where, expr in dq.grafana_queries(dashboard)]
assert len(queries) >= 20, queries

# Poll until every query returns at least one series with a finite value (histogram quantiles
# are NaN until their histogram has observations inside the window).
pending = dict(queries)
deadline = time.time() + 20
while pending and time.time() < deadline:
    for where, expr in list(pending.items()):
        values = query(expr)
        if any(math.isfinite(v) for v in values):
            del pending[where]
    if pending:
        time.sleep(1)
if pending:
    for where, expr in pending.items():
        values = query(expr)
        print(f"no {'finite ' if values else ''}data after 20 s: {where}: {expr} -> {values}",
              file=sys.stderr)
    sys.exit(1)
print(f"{len(queries)} Grafana queries return data after {time.time() - start:.1f} s")

# The alert rules evaluate against the real series without errors.
deadline = time.time() + 10
while True:
    _, body = get("/api/v1/rules?type=alert")
    rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
    health = {r["name"]: r["health"] for r in rules}
    if len(rules) == 5 and all(h == "ok" for h in health.values()):
        break
    if time.time() > deadline or any(h == "err" for h in health.values()):
        sys.exit(f"alert rules do not evaluate cleanly: {[(r['name'], r['health'], r.get('lastError')) for r in rules]}")
    time.sleep(0.5)

# The console page: one row per layer and per rank, a value in every cell, and graph queries
# that return data.
status, page = get("/consoles/keel.html", timeout=10)
assert status == 200, status

class Rows(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows = {"keel_layer_row": [], "keel_rank_row": []}
        self.current = None
    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and attrs.get("class") in self.rows:
            self.current = []
            self.rows[attrs["class"]].append(self.current)
        elif tag == "td" and self.current is not None:
            self.current.append("")
    def handle_endtag(self, tag):
        if tag == "tr":
            self.current = None
    def handle_data(self, data):
        if self.current:
            self.current[-1] += data.strip()

parser = Rows()
parser.feed(page)
layers = [row[0] for row in parser.rows["keel_layer_row"]]
ranks = [row[0] for row in parser.rows["keel_rank_row"]]
if layers != [str(l) for l in range(int(num_layers))]:
    sys.exit(f"console page: layer rows {layers}, expected 0..{int(num_layers) - 1}")
if ranks != [str(r) for r in range(int(num_ranks))]:
    sys.exit(f"console page: rank rows {ranks}, expected 0..{int(num_ranks) - 1}")
number = re.compile(r"^[0-9.]+[kMG]?$")
for row in parser.rows["keel_layer_row"] + parser.rows["keel_rank_row"]:
    if not all(number.match(cell) for cell in row):
        sys.exit(f"console page: a row with a missing or non-numeric value: {row}")

graph_exprs = []
for block in re.findall(r"\bexpr:\s*(\[.*?\]\s*,|\"(?:[^\"\\]|\\.)*\")", page, re.S):
    for literal in re.findall(r"\"((?:[^\"\\]|\\.)*)\"", block):
        graph_exprs.append(codecs.decode(literal, "unicode_escape"))
assert len(graph_exprs) >= 10, graph_exprs
empty = [e for e in graph_exprs if not query(e)]
if empty:
    sys.exit(f"console graph queries without data: {empty}")
print(f"console page: {len(layers)} layer rows, {len(ranks)} rank rows, "
      f"{len(graph_exprs)} graph queries with data")
PY
checks_pid=$!
wait "$checks_pid" || fail "see above; prometheus log: $(tail -n 20 "$work/prometheus.log")"
checks_pid=""

kill -0 "$keel_pid" 2>/dev/null || fail "keel replay stopped early: $(cat "$work/keel.err")"
echo "$name: ok"
