#!/usr/bin/python3
"""Lists, checks and substitutes the PromQL expressions of Keel's dashboards.

Every query lives in dashboards/grafana/keel.json (panel targets, annotations, template
variables) or in the console templates (dashboards/prometheus/consoles/*.html and
console_libraries/*.lib). The tests use this to check them all with `promtool check rules` and to
run them against a live Prometheus; an operator can use it to print them.

  dashboard_queries.py check-grafana keel.json       invariants (uid, datasource, $__rate_interval)
  dashboard_queries.py rules OUT.yml --grafana keel.json --consoles DIR [DIR...]
                                                     every expression as a recording rule
  dashboard_queries.py grafana keel.json [--rate-interval 1m]
                                                     JSON list of {where, expr} with the variables
                                                     set to match all
Standard library only (Debian's /usr/bin/python3).
"""

import argparse
import json
import os
import re
import sys

EXPECTED_UID = "keel-moe-balance"
DATASOURCE_REFS = ("${datasource}", "$datasource")
# Variables a query may use; every one must match all values when a test substitutes it.
DASHBOARD_VARIABLES = ("job", "rank", "layer")
RATE_FUNCTIONS = ("rate", "irate", "increase")


# ---- Grafana ------------------------------------------------------------------------------------

def _panels(panels):
    """Every panel, including the ones nested in (collapsed) rows."""
    for panel in panels or []:
        yield panel
        yield from _panels(panel.get("panels"))


def _variable_query(variable):
    query = variable.get("query", "")
    if isinstance(query, dict):
        query = query.get("query", "")
    return query or variable.get("definition", "")


def _variable_promql(query):
    """The PromQL inside a query variable: label_values(SELECTOR, label) -> SELECTOR;
    label_values(label) -> None; query_result(EXPR) -> EXPR; anything else is PromQL."""
    query = query.strip()
    match = re.fullmatch(r"label_values\((.*),\s*\w+\s*\)", query, re.S)
    if match:
        return match.group(1).strip()
    if re.fullmatch(r"label_values\(\s*\w+\s*\)", query) or query.startswith("metrics("):
        return None
    match = re.fullmatch(r"query_result\((.*)\)", query, re.S)
    return match.group(1).strip() if match else query


def grafana_queries(dashboard):
    """[(where, raw expression)] for every PromQL expression of a dashboard."""
    out = []
    for panel in _panels(dashboard.get("panels")):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                out.append((f"panel {panel.get('id')} '{panel.get('title')}' "
                            f"target {target.get('refId')}", target["expr"]))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        expr = annotation.get("expr") or (annotation.get("target") or {}).get("expr")
        if expr:
            out.append((f"annotation '{annotation.get('name')}'", expr))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            expr = _variable_promql(_variable_query(variable))
            if expr:
                out.append((f"variable ${variable.get('name')}", expr))
    return out


def substitute(expr, rate_interval="1m", all_regex=".+"):
    """Sets Grafana's interval variables to `rate_interval` and the dashboard variables to a
    regex matching all values, as Grafana does for "All". Unknown variables are an error."""
    def interval(_):
        return rate_interval

    expr = re.sub(r"\$\{?__(rate_interval|interval|range)\}?", interval, expr)

    def variable(match):
        name = match.group("a") or match.group("b") or match.group("c")
        if name not in DASHBOARD_VARIABLES:
            raise ValueError(f"unknown variable ${name} in: {expr}")
        return all_regex

    expr = re.sub(r"\$\{(?P<a>\w+)(?::\w+)?\}|\$(?P<b>\w+)|\[\[(?P<c>\w+)\]\]", variable, expr)
    return expr


def _call_argument(expr, open_paren):
    """The text between expr[open_paren] == '(' and its matching ')'."""
    depth = 0
    for i in range(open_paren, len(expr)):
        if expr[i] == "(":
            depth += 1
        elif expr[i] == ")":
            depth -= 1
            if depth == 0:
                return expr[open_paren + 1:i]
    raise ValueError(f"unbalanced parentheses in: {expr}")


def rate_windows(expr):
    """[(function, argument)] for every rate()/irate()/increase() call."""
    calls = []
    for match in re.finditer(r"\b(%s)\s*\(" % "|".join(RATE_FUNCTIONS), expr):
        calls.append((match.group(1), _call_argument(expr, match.end() - 1)))
    return calls


def _datasources(node, path="$"):
    """[(json path, value)] of every "datasource" field in the document."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                found.append((f"{path}.{key}", value))
            found.extend(_datasources(value, f"{path}.{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_datasources(value, f"{path}[{i}]"))
    return found


def check_grafana(dashboard):
    """Human-readable problems; empty when the dashboard keeps its invariants."""
    problems = []
    if dashboard.get("uid") != EXPECTED_UID:
        problems.append(f"uid is {dashboard.get('uid')!r}, must stay {EXPECTED_UID!r} "
                        "(links and provisioning rely on it)")
    if dashboard.get("id") is not None:
        problems.append("a numeric dashboard id is set: remove it (Grafana assigns one per "
                        "instance; the uid identifies the dashboard)")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    source = variables.get("datasource")
    if not source or source.get("type") != "datasource" or source.get("query") != "prometheus":
        problems.append("no template variable 'datasource' of type datasource, query prometheus")
    for name in DASHBOARD_VARIABLES:
        v = variables.get(name)
        if not v:
            problems.append(f"no template variable '{name}'")
            continue
        query = _variable_query(v)
        if v.get("type") != "query" or not query.startswith("label_values("):
            problems.append(f"variable ${name} is not a label_values() query: {query!r}")
        if not v.get("multi") or not v.get("includeAll"):
            problems.append(f"variable ${name} must be multi-value and include All")
    for path, value in _datasources(dashboard):
        uid = value.get("uid") if isinstance(value, dict) else value
        if uid not in DATASOURCE_REFS:
            problems.append(f"{path} is {value!r}: reference the datasource variable "
                            "(\"${datasource}\"), never a datasource uid or name")
    ids = [p.get("id") for p in _panels(dashboard.get("panels"))]
    if len(ids) != len(set(ids)):
        problems.append(f"panel ids are not unique: {sorted(ids, key=str)}")
    for panel in _panels(dashboard.get("panels")):
        if panel.get("type") == "row":
            continue
        if not panel.get("targets"):
            problems.append(f"panel {panel.get('id')} '{panel.get('title')}' has no query")
        if panel.get("type") == "heatmap":
            for target in panel.get("targets") or []:
                if target.get("format") != "heatmap" or "_bucket" not in target.get("expr", ""):
                    problems.append(f"heatmap panel '{panel.get('title')}' must query a _bucket "
                                    "series with format heatmap")
    for where, expr in grafana_queries(dashboard):
        for function, argument in rate_windows(expr):
            if not re.search(r"\[\s*\$__rate_interval\s*\]\s*$", argument):
                problems.append(f"{where}: {function}() must use [$__rate_interval]: {expr}")
        try:
            substitute(expr)
        except ValueError as error:
            problems.append(f"{where}: {error}")
    return problems


# ---- Console templates --------------------------------------------------------------------------

_GO_STRING = r'"(?:[^"\\]|\\.)*"'


def _go_unquote(literal):
    return json.loads(literal)


def _fill_printf(fmt):
    # Label values substituted into the format; any value makes a syntactically valid query.
    return re.sub(r"%%|%[-+# 0-9.]*[svdfgq]", lambda m: "%" if m.group(0) == "%%" else "0", fmt)


def console_queries(text, name="console"):
    """[(where, expression)] for the PromQL in a console template: string literals passed to
    query, printf (whose result feeds query or args) and args, and the expr of every
    PromConsole.Graph. Template actions inside an expression are replaced by a label value."""
    out = []
    for action in re.finditer(r"\{\{(.*?)\}\}", text, re.S):
        body = action.group(1)
        for match in re.finditer(r"\b(query|printf|args)\s+(%s)" % _GO_STRING, body):
            expr = _go_unquote(match.group(2))
            if match.group(1) == "printf" and re.fullmatch(r"%[-+# 0-9.]*[a-z]", expr):
                continue  # a number format ({{ value | printf "%.3f" }}), not a query
            if match.group(1) == "printf":
                expr = _fill_printf(expr)
            line = text.count("\n", 0, action.start()) + 1
            out.append((f"{name}:{line} {match.group(1)}", expr))
    graph_expr = r"\bexpr:\s*(\[(?:\s*%s\s*,?)*\s*\]|%s)" % (_GO_STRING, _GO_STRING)
    for match in re.finditer(graph_expr, text, re.S):
        for literal in re.finditer(_GO_STRING, match.group(1)):
            line = text.count("\n", 0, match.start(1) + literal.start()) + 1
            expr = re.sub(r"\{\{.*?\}\}", "0", _go_unquote(literal.group(0)))
            out.append((f"{name}:{line} graph", expr))
    return out


def uncovered_console_lines(text, queries):
    """Lines that hold a metric selector (keel_...{ or up{) but gave no expression: a query
    written in a form console_queries does not read, which the checks would silently miss."""
    covered = {int(where.split(":")[1].split()[0]) for where, _ in queries}
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if re.search(r"\b(keel_[a-z_]+|up)\{(?!\{)", line) and number not in covered:
            lines.append(f"line {number}: {line.strip()}")
    return lines


def console_files(folders):
    for folder in folders:
        for entry in sorted(os.listdir(folder)):
            if entry.endswith((".html", ".lib")):
                yield os.path.join(folder, entry)


# ---- Rules file ---------------------------------------------------------------------------------

def _yaml_string(value):
    return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar


def write_rules(path, queries):
    lines = ["# Generated by dashboards/dashboard_queries.py: every dashboard expression as a",
             "# recording rule, so `promtool check rules` parses them all.", "groups:"]
    for group, entries in queries:
        lines.append(f"  - name: {group}")
        lines.append("    rules:")
        for i, (where, expr) in enumerate(entries):
            lines.append(f"      # {where}")
            lines.append(f"      - record: keel_dashboard_check:{group}:q{i:03d}")
            lines.append(f"        expr: {_yaml_string(expr)}")
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-grafana")
    check.add_argument("dashboard")
    rules = sub.add_parser("rules")
    rules.add_argument("output")
    rules.add_argument("--grafana", required=True)
    rules.add_argument("--consoles", nargs="+", default=[])
    listing = sub.add_parser("grafana")
    listing.add_argument("dashboard")
    listing.add_argument("--rate-interval", default="1m")
    args = parser.parse_args()

    if args.command == "check-grafana":
        with open(args.dashboard) as f:
            problems = check_grafana(json.load(f))
        for problem in problems:
            print(f"{args.dashboard}: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.command == "grafana":
        with open(args.dashboard) as f:
            dashboard = json.load(f)
        print(json.dumps([{"where": where, "expr": substitute(expr, args.rate_interval)}
                          for where, expr in grafana_queries(dashboard)], indent=1))
        return 0
    with open(args.grafana) as f:
        grafana = [(where, substitute(expr)) for where, expr in grafana_queries(json.load(f))]
    console = []
    for path in console_files(args.consoles):
        with open(path) as f:
            text = f.read()
        found = console_queries(text, os.path.basename(path))
        missed = uncovered_console_lines(text, found)
        if missed:
            print(f"{path}: queries the checker cannot read (use query/printf/args string "
                  "literals or a PromConsole.Graph expr):\n  " + "\n  ".join(missed),
                  file=sys.stderr)
            return 1
        console.extend(found)
    write_rules(args.output, [("grafana", grafana), ("console", console)])
    print(f"{len(grafana)} Grafana and {len(console)} console expressions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
