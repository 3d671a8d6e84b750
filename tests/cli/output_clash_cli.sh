#!/usr/bin/env bash
# No output of a keel command may replace one of its inputs or another of its outputs: every
# pair below (each command, each input/output and output/output pair of flags, the same file
# spelled another way: a link, a hard link, `..`) must exit 2 before any work, with a message
# naming both flags and the path, and leave every file as it was and no new file behind.
# $1: path of the keel binary.
set -euo pipefail

keel="$(realpath "$1")"
# The commands run in $root/work; what they print and the snapshots stay outside it.
root="$(mktemp -d "${TMPDIR:-/tmp}/keel-output-clash-cli-XXXXXX")"
trap 'rm -rf "$root"' EXIT
mkdir "$root/work"
cd "$root/work"

fail() {
  echo "output_clash_cli: $*" >&2
  exit 1
}

# The inputs: a trace, configs, a plan input, a pool, an ESFT folder, and other names for them.
"$keel" trace generate --output t.jsonl --steps 4 --layers 1 --experts 8 --sources 2 \
  2>/dev/null
printf 'topology:\n  num_nodes: 1\n  gpus_per_node: 2\n' >c.yaml
printf 'monitor:\n  trace_path: t.jsonl\n' >records_t.yaml
printf 'monitor:\n  trace_path: records_self.yaml\n' >records_self.yaml
printf 'monitor:\n  trace_path: r.json\n' >records_r.yaml
printf '{"weight": [[1, 2, 3, 4]], "num_replicas": 4, "num_groups": 1, "num_nodes": 1,
  "num_gpus": 2}' >in.json
printf '{"keel_strategy_pool": 1}\n' >pool.json
mkdir esft
printf '1\t2\t\t0.5\t0.5\n' >esft/expert_weights_1.txt
ln -s t.jsonl link.jsonl
ln t.jsonl hard.jsonl
mkdir sub

# The state of every file under the work folder: names, kinds and contents.
snapshot() {
  find . -print0 | sort -z | while IFS= read -r -d '' path; do
    if [[ -L "$path" ]]; then
      echo "link $path -> $(readlink "$path")"
    elif [[ -f "$path" ]]; then
      echo "file $path $(sha256sum <"$path" | cut -d' ' -f1)"
    else
      echo "other $path"
    fi
  done
}
before="$root/before"
snapshot >"$before"

cases=0
# expect_clash NAME FLAG1 FLAG2 PATH COMMAND...: exit 2, FLAG1, FLAG2 and PATH on stderr, and
# no file changed, added or removed.
expect_clash() {
  local name="$1" first="$2" second="$3" path="$4"
  shift 4
  local got=0
  timeout 60 "$@" >"$root/out" 2>"$root/err" || got=$?
  local err
  err="$(cat "$root/err" "$root/out")"
  [[ "$got" == 2 ]] || fail "$name: exited $got, expected 2: $err"
  for text in "$first" "$second" "'$path'"; do
    grep -qF -- "$text" <<<"$err" || fail "$name: no $text in: $err"
  done
  snapshot | diff "$before" - >/dev/null || fail "$name: files changed: $(snapshot | diff "$before" -)"
  cases=$((cases + 1))
}

# keel replay: the policy replay, the strategy replay, the sequence replay, serving metrics.
expect_clash "replay --report over --trace" --report --trace t.jsonl \
  "$keel" replay --trace t.jsonl --report t.jsonl --quiet
expect_clash "replay --plot over --trace" --plot --trace t.jsonl \
  "$keel" replay --trace t.jsonl --plot t.jsonl --quiet
expect_clash "replay --report over --config" --report --config c.yaml \
  "$keel" replay --trace t.jsonl --config c.yaml --report c.yaml --quiet
expect_clash "replay --plot over --config" --plot --config c.yaml \
  "$keel" replay --trace synthetic --config c.yaml --plot c.yaml --quiet
expect_clash "replay --report and --plot" --plot --report r.json \
  "$keel" replay --trace t.jsonl --report r.json --plot r.json --quiet
expect_clash "replay --report through a link to --trace" --report --trace link.jsonl \
  "$keel" replay --trace t.jsonl --report link.jsonl --quiet
expect_clash "replay --report as a hard link of --trace" --report --trace hard.jsonl \
  "$keel" replay --trace t.jsonl --report hard.jsonl --quiet
expect_clash "replay --report spelled with .." --report --trace sub/../t.jsonl \
  "$keel" replay --trace "$root/work/t.jsonl" --report sub/../t.jsonl --quiet
expect_clash "replay --report inside the --trace folder" --report --trace \
  esft/expert_weights_1.txt \
  "$keel" replay --trace esft --format esft --report esft/expert_weights_1.txt --quiet
expect_clash "replay --strategy --report over --pool" --report --pool pool.json \
  "$keel" replay --trace t.jsonl --strategy all --pool pool.json --report pool.json --quiet
expect_clash "replay --strategy --plot over --trace" --plot --trace t.jsonl \
  "$keel" replay --trace t.jsonl --strategy all --plot t.jsonl --quiet
expect_clash "replay --strategy --report and --plot" --plot --report r.json \
  "$keel" replay --trace t.jsonl --strategy all --report r.json --plot r.json --quiet
expect_clash "replay --sequence-migration --report over --trace" --report --trace t.jsonl \
  "$keel" replay --trace t.jsonl --sequence-migration --report t.jsonl --quiet
expect_clash "replay --serve-metrics --report over --trace" --report --trace t.jsonl \
  "$keel" replay --trace t.jsonl --serve-metrics 127.0.0.1:0 --serve-seconds 1 \
  --report t.jsonl --quiet

# keel plan
expect_clash "plan --output over --input" --output --input in.json \
  "$keel" plan --input in.json --output in.json
expect_clash "plan --output over --config" --output --config c.yaml \
  "$keel" plan --policy keel --input in.json --config c.yaml --output c.yaml

# keel pool build
expect_clash "pool build --out over --trace" --out --trace t.jsonl \
  "$keel" pool build --trace t.jsonl --out t.jsonl --quiet
expect_clash "pool build --report over --trace" --report --trace t.jsonl \
  "$keel" pool build --trace t.jsonl --out p.json --report t.jsonl --quiet
expect_clash "pool build --out over --config" --out --config c.yaml \
  "$keel" pool build --trace t.jsonl --config c.yaml --out c.yaml --quiet
expect_clash "pool build --report over --config" --report --config c.yaml \
  "$keel" pool build --trace t.jsonl --config c.yaml --out p.json --report c.yaml --quiet
expect_clash "pool build --out and --report" --report --out x.json \
  "$keel" pool build --trace t.jsonl --out x.json --report x.json --quiet

# keel trace convert
expect_clash "trace convert --output over --input" --output --input t.jsonl \
  "$keel" trace convert --input t.jsonl --output t.jsonl --quiet
expect_clash "trace convert --output through a link to --input" --output --input link.jsonl \
  "$keel" trace convert --input t.jsonl --output link.jsonl --quiet
expect_clash "trace convert --output inside the --input folder" --output --input \
  esft/expert_weights_1.txt \
  "$keel" trace convert --input esft --format esft --output esft/expert_weights_1.txt --quiet

# keel demo: --report, and the trace the engine records (monitor.trace_path of --config).
expect_clash "demo --report over --trace" --report --trace t.jsonl \
  "$keel" demo --trace t.jsonl --report t.jsonl --quiet
expect_clash "demo --report over --config" --report --config c.yaml \
  "$keel" demo --config c.yaml --report c.yaml --quiet
expect_clash "demo monitor.trace_path over --trace" monitor.trace_path --trace t.jsonl \
  "$keel" demo --trace t.jsonl --config records_t.yaml --quiet
expect_clash "demo monitor.trace_path over its own --config" monitor.trace_path --config \
  records_self.yaml \
  "$keel" demo --config records_self.yaml --quiet
expect_clash "demo --report and monitor.trace_path" monitor.trace_path --report r.json \
  "$keel" demo --config records_r.yaml --report r.json --quiet

# Outputs that are written through, never replaced, are not a clash.
"$keel" replay --trace t.jsonl --report /dev/null --plot /dev/null --quiet >/dev/null ||
  fail "--report /dev/null --plot /dev/null was refused"
echo "output_clash_cli: ok ($cases cases)"
