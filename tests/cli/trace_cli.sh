#!/usr/bin/env bash
# End-to-end test of `keel trace`: generate -> info -> convert round trip, a SmartMoE-style
# folder converted and summarized, and usage errors and bad traces (exit 2).
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-trace-cli-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "trace_cli: $*" >&2
  exit 1
}

# Expects exit status $1 from the rest of the command line; keeps its stderr in $work/err.
expect_exit() {
  local want="$1"
  shift
  local got=0
  "$@" >"$work/out" 2>"$work/err" || got=$?
  [[ "$got" == "$want" ]] || fail "'$*' exited $got, expected $want: $(cat "$work/err")"
}

# Generate a small synthetic trace and summarize it.
"$keel" trace generate --output "$work/syn.jsonl" --seed 7 --steps 12 --layers 2 --experts 16 \
  --sources 4 --tokens 256 --top-k 2 --zipf 1.2 --drift 1 --burst-prob 0.1 2>/dev/null
[[ -s "$work/syn.jsonl" ]] || fail "generate wrote nothing"
[[ ! -e "$work/syn.jsonl.tmp" ]] || fail "generate left its temporary file"
head -n 1 "$work/syn.jsonl" | grep -q '"keel_trace": 1' || fail "missing Keel header"

"$keel" trace info "$work/syn.jsonl" >"$work/info.txt"
grep -q '^steps: *12' "$work/info.txt" || fail "info steps: $(cat "$work/info.txt")"
grep -q '^layers: *2' "$work/info.txt" || fail "info layers"
grep -q '^experts: *16' "$work/info.txt" || fail "info experts"
grep -q '^sources: *4' "$work/info.txt" || fail "info sources"
grep -q 'mean 2048.0' "$work/info.txt" || fail "info tokens: $(cat "$work/info.txt")"
grep -q '^imbalance: .*4 ranks' "$work/info.txt" || fail "info imbalance"

# Same seed, same bytes; keel -> keel conversion is lossless.
"$keel" trace generate --output "$work/syn2.jsonl" --seed 7 --steps 12 --layers 2 --experts 16 \
  --sources 4 --tokens 256 --top-k 2 --zipf 1.2 --drift 1 --burst-prob 0.1 2>/dev/null
cmp -s "$work/syn.jsonl" "$work/syn2.jsonl" || fail "same seed gave different traces"
"$keel" trace convert --input "$work/syn.jsonl" --output "$work/copy.jsonl" --quiet
cmp -s "$work/syn.jsonl" "$work/copy.jsonl" || fail "keel round trip changed the trace"

# A SmartMoE-style folder: 2 iterations x 2 ranks, 2 layers, 2 experts, 2 microbatches.
mkdir -p "$work/moe_trace"
for it in 1 11; do
  for rank in 0 1; do
    printf '0:[[1.0, 3.0], [2.0, 2.0]]\n1:[[4.0, 0.0], [0.0, 4.0]]\n' \
      >"$work/moe_trace/table_iter${it}_rank${rank}.log"
  done
done
"$keel" trace convert --input "$work/moe_trace" --output "$work/smart.jsonl" 2>"$work/err"
grep -q 'smartmoe' "$work/err" || fail "convert did not report the detected format"
sed -n 2p "$work/smart.jsonl" | grep -q '"step": 1, "layers": \[\[3, 5, 3, 5\], \[4, 4, 4, 4\]\]' \
  || fail "smartmoe conversion: $(sed -n 2p "$work/smart.jsonl")"
"$keel" trace info "$work/moe_trace" --format smartmoe | grep -q '^sources: *2' \
  || fail "info on the smartmoe folder"

# Help texts exit 0 and document every flag.
"$keel" trace --help >"$work/help.txt" && grep -q convert "$work/help.txt" ||
  fail "trace --help"
"$keel" trace convert --help >"$work/help.txt" && grep -q -- '--esft-group' "$work/help.txt" ||
  fail "convert --help"
"$keel" trace generate --help >"$work/help.txt" && grep -q -- '--burst-prob' "$work/help.txt" ||
  fail "generate --help"
"$keel" trace info --help >"$work/help.txt" && grep -q -- '--ranks' "$work/help.txt" ||
  fail "info --help"

# Usage errors exit 2 and name the flag.
expect_exit 2 "$keel" trace generate --output "$work/x.jsonl" --bogus 1
grep -q -- '--bogus' "$work/err" || fail "bad flag not named: $(cat "$work/err")"
expect_exit 2 "$keel" trace generate --output "$work/x.jsonl" --steps many
grep -q -- '--steps' "$work/err" || fail "bad value not named"
expect_exit 2 "$keel" trace generate --output "$work/x.jsonl" --top-k 99
grep -q 'top_k 99' "$work/err" || fail "invalid option not named"
expect_exit 2 "$keel" trace convert --input "$work/syn.jsonl"
expect_exit 2 "$keel" trace convert --input "$work/syn.jsonl" --output "$work/x" --format csv
expect_exit 2 "$keel" trace frobnicate
[[ ! -e "$work/x.jsonl" ]] || fail "a failed generate wrote output"

# Bad traces exit 2 with the error and leave an existing output untouched.
printf 'precious\n' >"$work/keep.jsonl"
printf '{"keel_trace": 1, "num_layers": 1, "num_experts": 2, "num_sources": 0}\n' >"$work/bad.jsonl"
printf '{"step": 0, "layers": [[1, -1]]}\n' >>"$work/bad.jsonl"
expect_exit 2 "$keel" trace convert --input "$work/bad.jsonl" --output "$work/keep.jsonl"
grep -q 'bad.jsonl:2' "$work/err" || fail "failure does not name the line: $(cat "$work/err")"
[[ "$(cat "$work/keep.jsonl")" == "precious" ]] || fail "failed convert clobbered the output"
expect_exit 2 "$keel" trace info "$work/does-not-exist.jsonl"
# Sizes beyond what a trace may hold are refused before anything is allocated.
printf '{"keel_trace": 1, "num_layers": 1, "num_experts": 1000000000, "num_sources": 0}\n' \
  >"$work/huge.jsonl"
expect_exit 2 "$keel" trace info "$work/huge.jsonl"
grep -q 'num_experts 1000000000 is more than 65536' "$work/err" ||
  fail "huge header: $(cat "$work/err")"
expect_exit 2 "$keel" trace convert --input "$work/syn.jsonl" --output "$work/x.jsonl" \
  --format esft --esft-experts 1000000000
grep -q 'esft-experts: 1000000000 must be in \[1, 65536\]' "$work/err" || fail "$(cat "$work/err")"
expect_exit 2 "$keel" trace convert --input "$work/syn.jsonl" --output "$work/x.jsonl" \
  --format megatron --megatron-experts 2147483647
grep -q 'megatron-experts: 2147483647 must be 0' "$work/err" || fail "$(cat "$work/err")"

echo "trace_cli: ok"
