#!/usr/bin/env bash
# End-to-end test of `keel config`: --check on good and bad files (exit codes, and the message
# names the key and line), --defaults round-trips through --check, bad flags are usage errors.
# Usage: config_cli.sh KEEL_BINARY
set -u

keel=${1:?usage: config_cli.sh KEEL_BINARY}
source_dir=${KEEL_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# expect CODE NAME COMMAND...: runs COMMAND, keeps stdout/stderr in $work/NAME.{out,err}.
expect() {
  local code=$1 name=$2
  shift 2
  "$@" >"$work/$name.out" 2>"$work/$name.err"
  local actual=$?
  if [[ $actual -ne $code ]]; then
    fail "$name: exit $actual, expected $code (stderr: $(cat "$work/$name.err"))"
  fi
}

# The shipped config is valid.
expect 0 shipped "$keel" config --check "$source_dir/configs/smartmoe-16gpu.yaml"
[[ $(cat "$work/shipped.out") == ok ]] ||
  fail "shipped: stdout is '$(cat "$work/shipped.out")', not ok"

# A value out of range: exit 2, and the message names the file, line, key and value.
cat >"$work/bad_range.yaml" <<'YAML'
topology:
  num_nodes: 2
cost_model:
  hidden_size: -3
YAML
expect 2 bad_range "$keel" config --check "$work/bad_range.yaml"
grep -qF "bad_range.yaml:4: cost_model.hidden_size: -3 is out of range" "$work/bad_range.err" ||
  fail "bad_range: message lacks file:line, key or value: $(cat "$work/bad_range.err")"

# An unknown nested key: exit 2, the message names the full dotted key and the valid ones.
cat >"$work/bad_key.yaml" <<'YAML'
policy:
  flexmoe:
    balance_ratio: 1.1
YAML
expect 2 bad_key "$keel" config --check "$work/bad_key.yaml"
grep -qF "bad_key.yaml:3: unknown key 'policy.flexmoe.balance_ratio'" "$work/bad_key.err" ||
  fail "bad_key: message lacks the key or line: $(cat "$work/bad_key.err")"
grep -qF "balance_ratio_trigger" "$work/bad_key.err" ||
  fail "bad_key: message does not list the valid keys: $(cat "$work/bad_key.err")"

# A missing file is an error too.
expect 2 missing "$keel" config --check "$work/does-not-exist.yaml"
grep -qF "does-not-exist.yaml" "$work/missing.err" || fail "missing: message lacks the path"

# --defaults prints a complete, valid config that names every section.
expect 0 defaults "$keel" config --defaults
cp "$work/defaults.out" "$work/defaults.yaml"
expect 0 defaults_check "$keel" config --check "$work/defaults.yaml"
[[ $(cat "$work/defaults_check.out") == ok ]] || fail "defaults do not pass --check"
for section in topology slots cost_model estimator policy eplb flexmoe smartmoe fastermoe lplb \
               trtllm keel; do
  grep -qE "^ *$section:$" "$work/defaults.yaml" || fail "defaults lack the section $section"
done

# --markdown and --help print their text; usage errors exit 2.
expect 0 markdown "$keel" config --markdown
grep -qF "# Keel configuration reference" "$work/markdown.out" || fail "markdown lacks its title"
expect 0 help "$keel" config --help
grep -qF -- "--check FILE" "$work/help.out" || fail "help does not explain --check"
grep -qF "cost_model.hidden_size" "$work/help.out" || fail "help does not list the keys"
expect 2 unknown_flag "$keel" config --frobnicate
grep -qF -- "--frobnicate" "$work/unknown_flag.err" || fail "unknown flag is not named"
expect 2 no_flag "$keel" config
expect 2 check_without_file "$keel" config --check

if [[ $failures -ne 0 ]]; then
  echo "config_cli: $failures failure(s)" >&2
  exit 1
fi
echo "config_cli: all checks passed"
