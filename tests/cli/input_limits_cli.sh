#!/usr/bin/env bash
# Every input file of every keel command is read by one bounded reader (docs/config.md, "Input
# limits"). Each entry point (a config file by every command that takes one, `keel plan --input`
# from a file and from stdin, a strategy pool, a trace in every format, a .tar.xz archive) is
# handed what is not a regular file within its limits: a FIFO with no writer, /dev/zero,
# /dev/urandom, a folder, a file beyond the limit, a file that grows while it is read, nesting
# too deep and a line too long. Each case must exit 2 with a message naming the path and what is
# wrong, within a hang guard, and leave no file behind. An output that is a FIFO nobody reads
# fails instead of blocking. An archive interrupted by SIGTERM or SIGINT while it is extracted
# leaves no temporary folder and no xz or tar running.
# $1: path of the keel binary.
set -euo pipefail

keel="$(realpath "$1")"
root="$(mktemp -d "${TMPDIR:-/tmp}/keel-input-limits-cli-XXXXXX")"
writer=""
cleanup() {
  if [[ -n "$writer" ]]; then kill "$writer" 2>/dev/null || true; fi
  rm -rf "$root"
}
trap cleanup EXIT
# The commands run in $root/work with their own TMPDIR; what they print stays outside both.
mkdir "$root/work" "$root/tmp"
export TMPDIR="$root/tmp"
cd "$root/work"

fail() {
  echo "input_limits_cli: $*" >&2
  exit 1
}

# Every file under the work and temporary folders: nothing may appear or vanish.
snapshot() { find "$root/work" "$root/tmp" -print | sort; }

# refused NAME TEXT COMMAND...: exit status 2 within the hang guard, TEXT on stderr or stdout,
# and no file added or removed.
refused() {
  local name="$1" text="$2"
  shift 2
  local before got=0
  before="$(snapshot)"
  timeout 60 "$@" >"$root/out" 2>"$root/err" </dev/null || got=$?
  [[ "$got" != 124 ]] || fail "$name: hangs"
  [[ "$got" == 2 ]] || fail "$name: exited $got, expected 2: $(cat "$root/err" "$root/out")"
  grep -qF -- "$text" "$root/err" "$root/out" ||
    fail "$name: no '$text' in: $(cat "$root/err" "$root/out")"
  [[ "$(snapshot)" == "$before" ]] || fail "$name: left files behind or removed some"
}

# The bad inputs, each under a name of every kind a reader looks for (b/NAME).
mkdir b
bad_kinds=(fifo zero urandom folder large)
make_bad() {  # make_bad KIND PATH
  case "$1" in
    fifo) mkfifo "$2" ;;
    zero) ln -s /dev/zero "$2" ;;
    urandom) ln -s /dev/urandom "$2" ;;
    folder) mkdir "$2" ;;
    large) truncate -s 2G "$2" ;;  # sparse: no disk used
  esac
}
bad_text() {  # what the refusal of KIND says
  case "$1" in
    fifo) echo "is a FIFO (named pipe), not a regular file" ;;
    zero | urandom) echo "is a character device, not a regular file" ;;
    folder) echo "is a folder, expected a file" ;;
    large) echo "2 GiB is more than the limit of" ;;
  esac
}
for kind in "${bad_kinds[@]}"; do
  mkdir "b/$kind" "b/$kind/esft" "b/$kind/smartmoe" "b/$kind/megatron"
  for name in c.yaml in.json pool.json t.jsonl expert_counts_derived.json moe_trace.tar.xz \
    esft/expert_weights_1.txt smartmoe/table_iter1_rank0.log megatron/router_trace_rank0.jsonl; do
    make_bad "$kind" "b/$kind/$name"
  done
done

# A trace for the pool case.
"$keel" trace generate --output "$root/trace.jsonl" --steps 2 --layers 2 --experts 8 \
  --sources 2 2>/dev/null

for kind in "${bad_kinds[@]}"; do
  d="b/$kind"
  text="$(bad_text "$kind")"
  refused "$kind: config --check" "$d/c.yaml: $text" "$keel" config --check "$d/c.yaml"
  refused "$kind: replay --config" "$d/c.yaml: $text" \
    "$keel" replay --trace synthetic --config "$d/c.yaml" --quiet
  refused "$kind: demo --config" "$d/c.yaml: $text" \
    "$keel" demo --config "$d/c.yaml" --steps 1 --quiet
  refused "$kind: plan --input" "--input '$d/in.json': $text" \
    "$keel" plan --policy eplb --input "$d/in.json"
  refused "$kind: plan --config" "$d/c.yaml: $text" \
    "$keel" plan --policy keel --input "$d/in.json" --config "$d/c.yaml"
  refused "$kind: replay --pool" "$d/pool.json: $text" \
    "$keel" replay --trace "$root/trace.jsonl" --strategy auto --pool "$d/pool.json" --quiet
  refused "$kind: trace info --format keel" "$d/t.jsonl: $text" \
    "$keel" trace info "$d/t.jsonl" --format keel
  if [[ "$kind" != folder ]]; then  # these read a folder as a folder of their files
    refused "$kind: trace info --format megatron" "$d/t.jsonl: $text" \
      "$keel" trace info "$d/t.jsonl" --format megatron
    refused "$kind: replay --trace" "$d/t.jsonl: $text" \
      "$keel" replay --trace "$d/t.jsonl" --quiet
    refused "$kind: trace info olmoe" "$d/expert_counts_derived.json: $text" \
      "$keel" trace info "$d/expert_counts_derived.json" --format olmoe
    refused "$kind: .tar.xz archive" "$d/moe_trace.tar.xz: $text" \
      "$keel" trace info "$d/moe_trace.tar.xz"
  fi
  refused "$kind: trace info esft" "$d/esft/expert_weights_1.txt: $text" \
    "$keel" trace info "$d/esft" --format esft
  refused "$kind: trace info smartmoe" "$d/smartmoe/table_iter1_rank0.log: $text" \
    "$keel" trace info "$d/smartmoe" --format smartmoe
  refused "$kind: trace info megatron folder" "$d/megatron/router_trace_rank0.jsonl: $text" \
    "$keel" trace info "$d/megatron" --format megatron
  refused "$kind: trace convert" "$d/t.jsonl: $text" \
    "$keel" trace convert --input "$d/t.jsonl" --format keel --output "$root/converted.jsonl"
done

# Stdin is a stream, bounded by the plan input's limit.
for device in /dev/zero /dev/urandom; do
  before="$(snapshot)"
  got=0
  KEEL_MAX_PLAN_INPUT_BYTES=1M timeout 60 "$keel" plan --policy eplb --input - <"$device" \
    >"$root/out" 2>"$root/err" || got=$?
  [[ "$got" == 2 ]] || fail "plan --input - <$device: exited $got"
  grep -qF -- "--input '-': holds more than the limit of 1 MiB for \`keel plan\` input (set" \
    "$root/err" || fail "plan --input - <$device: $(cat "$root/err")"
  [[ "$(snapshot)" == "$before" ]] || fail "plan --input - <$device left files behind"
done
# The limit is the same for a file, and a bad value of its variable is refused by name.
printf '{"weight": [[1, 2, 3, 4]], "num_replicas": 4, "num_groups": 1, "num_nodes": 1,
  "num_gpus": 2}' >in.json
refused "plan input beyond a lowered limit" \
  "--input 'in.json': 95 bytes is more than the limit of 64 bytes for \`keel plan\` input" \
  env KEEL_MAX_PLAN_INPUT_BYTES=64 "$keel" plan --policy eplb --input in.json
refused "a limit that is not a size" "KEEL_MAX_PLAN_INPUT_BYTES='lots': expected" \
  env KEEL_MAX_PLAN_INPUT_BYTES=lots "$keel" plan --policy eplb --input in.json
"$keel" plan --policy eplb --input in.json >/dev/null || fail "plan of a good input failed"

# Streams when KEEL_ALLOW_STREAMS=1 says so: a pipe reads, /dev/zero stops at the limit.
KEEL_ALLOW_STREAMS=1 "$keel" config --check <(printf 'policy:\n  name: static\n') >/dev/null ||
  fail "a config from a pipe with KEEL_ALLOW_STREAMS=1 failed"
refused "config from /dev/zero as a stream" \
  "/dev/zero: holds more than the limit of 1 MiB for a config file" \
  env KEEL_ALLOW_STREAMS=1 "$keel" config --check /dev/zero

# A file that grows while it is read: refused at the limit, whenever it is seen.
touch growing.yaml
cat /dev/zero >>growing.yaml &
writer=$!
sleep 0.2
refused "a config that grows" "growing.yaml: " "$keel" config --check growing.yaml
grep -qE "(is more than|grew while it was read, past) the limit of 1 MiB for a config file" \
  "$root/err" || fail "a config that grows: $(cat "$root/err")"
kill "$writer"
wait "$writer" 2>/dev/null || true
writer=""
rm growing.yaml

# Nesting and line length, in every parser.
python3 -c "print('policy: ' + '[' * 100000)" >deep.yaml
refused "config nested 100,000 levels" "deep.yaml:1: maps and sequences nest deeper than 64" \
  "$keel" config --check deep.yaml
python3 -c "print('{\"weight\": ' + '[' * 100000)" >deep.json
refused "plan input nested 100,000 levels" "arrays and objects nest deeper than 64 levels" \
  "$keel" plan --policy eplb --input deep.json
refused "pool nested 100,000 levels" "arrays and objects nest deeper than 64 levels" \
  "$keel" replay --trace "$root/trace.jsonl" --strategy auto --pool deep.json --quiet
python3 -c "print('[' * 100000)" >deep.jsonl
for format in keel megatron; do
  refused "$format trace nested 100,000 levels" "deep.jsonl:1: " \
    "$keel" trace info deep.jsonl --format "$format"
  grep -qF "nest deeper than 64 levels" "$root/err" || fail "deep $format: $(cat "$root/err")"
done
cp deep.jsonl expert_counts_derived.json
refused "olmoe counts nested 100,000 levels" "arrays and objects nest deeper than 64 levels" \
  "$keel" trace info expert_counts_derived.json --format olmoe
rm deep.yaml deep.json deep.jsonl expert_counts_derived.json
head -c 200 /dev/zero | tr '\0' '1' >long.jsonl
refused "a trace line beyond the line limit" \
  "long.jsonl:1: a line of 200 bytes is longer than the limit of 128 bytes for a trace line" \
  env KEEL_MAX_LINE_BYTES=128 "$keel" trace info long.jsonl --format megatron
rm long.jsonl

# An output FIFO that no process reads: an error naming it, not a command that never ends.
mkfifo out.fifo
refused "plan --output to a FIFO nobody reads" "out.fifo: a FIFO that no process reads" \
  "$keel" plan --policy eplb --input in.json --output out.fifo
printf 'slots:\n  persistent_per_rank: 5\nmonitor:\n  trace_path: %s\n' "$PWD/out.fifo" \
  >records_fifo.yaml
refused "monitor.trace_path to a FIFO nobody reads" \
  "monitor.trace_path: cannot create trace $PWD/out.fifo: a FIFO that no process reads" \
  "$keel" demo --config records_fifo.yaml --steps 2 --quiet
rm out.fifo records_fifo.yaml

# Archives: one that expands past the limit is refused with its temporary folder gone, whether
# its index says so (xz) or only the count while extracting finds it (the legacy .lzma format).
mkdir -p src/moe_trace
head -c $((8 << 20)) /dev/zero >src/moe_trace/table_iter1_rank0.log
tar -cf - -C src moe_trace | xz >bomb.tar.xz
tar -cf - -C src moe_trace | xz --format=lzma >bomb_lzma.tar.xz
rm -r src
refused "archive beyond the limit by its index" \
  "bomb.tar.xz: expands to 8.0 MiB (8396800 bytes), more than the limit of 1 MiB for an" \
  env KEEL_MAX_ARCHIVE_BYTES=1M "$keel" trace info bomb.tar.xz
refused "archive beyond the limit while extracting" \
  "bomb_lzma.tar.xz: expands to more than the limit of 1 MiB for an extracted archive" \
  env KEEL_MAX_ARCHIVE_BYTES=1M "$keel" trace info bomb_lzma.tar.xz --format smartmoe
rm bomb.tar.xz bomb_lzma.tar.xz

# A signal during the extraction. An xz of our own hands tar the first bytes of an archive, then
# stalls (as a slow disk would): keel is then mid-extraction, with xz and tar running.
mkdir -p fake src/moe_trace
for rank in 0 1; do
  head -c $((1 << 20)) /dev/urandom | od -An -tu1 -v >"src/moe_trace/table_iter1_rank$rank.log"
done
tar -cJf slow.tar.xz -C src moe_trace
rm -r src
cat >fake/xz <<EOF
#!/bin/sh
# Lists nothing (so the extraction finds the size by counting); decompresses 64 KiB, then stalls.
[ "\$1" = --robot ] && exit 1
echo \$\$ >"$root/xz.pid"
$(command -v xz) -dc | head -c 65536
exec sleep 600
EOF
chmod +x fake/xz
mkdir "$root/signal"
default_sigint=(python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])')
for signal in TERM INT; do
  rm -f "$root/xz.pid"
  # Python restores SIGINT's default action, which a shell takes away from a job it starts
  # with &; keel then handles both signals as a process started from a terminal would.
  PATH="$PWD/fake:$PATH" TMPDIR="$root/signal" "${default_sigint[@]}" \
    "$keel" trace info slow.tar.xz >"$root/out" 2>"$root/err" &
  pid=$!
  for _ in $(seq 200); do
    if [[ -s "$root/xz.pid" ]] && compgen -G "$root/signal/keel-trace-*/moe_trace" >/dev/null &&
      pgrep -f -- "-C $root/signal/keel-trace-" >/dev/null; then
      break
    fi
    sleep 0.05
  done
  pgrep -f -- "-C $root/signal/keel-trace-" >/dev/null || fail "SIG$signal: tar never started"
  kill -s "$signal" "$pid"
  got=0
  timeout 60 tail --pid="$pid" -f /dev/null || fail "SIG$signal: keel did not end"
  wait "$pid" || got=$?
  [[ "$got" == $((128 + $(kill -l "$signal"))) ]] || fail "SIG$signal: keel exited $got"
  [[ -z "$(ls -A "$root/signal")" ]] || fail "SIG$signal: left $(ls "$root/signal")"
  # xz and tar are gone (their ids are not reused this soon).
  xz_pid="$(cat "$root/xz.pid")"
  for _ in $(seq 100); do
    kill -0 "$xz_pid" 2>/dev/null || break
    sleep 0.05
  done
  ! kill -0 "$xz_pid" 2>/dev/null || fail "SIG$signal: xz ($xz_pid) still runs"
  ! pgrep -f -- "-C $root/signal/keel-trace-" >/dev/null || fail "SIG$signal: tar still runs"
done

[[ -z "$(ls -A "$root/tmp")" ]] || fail "temporary files were left: $(ls "$root/tmp")"
echo "input_limits_cli: ok"
