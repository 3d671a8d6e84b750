#!/usr/bin/env bash
# Work bounded before it starts, and flags that do nothing refused: small inputs that name a huge
# job (a size, or a product of sizes: ranks x slots x experts x sources x steps x layers), and
# flags the command would accept and ignore. Every case must exit 2 within 20 s and under a 2 GB
# address space (ulimit -v), with a message naming the flag or field, the value and the limit,
# and leave no file behind, neither in the working folder nor in TMPDIR.
#   - `keel plan`: num_replicas 2^20 with a hot expert (log2phy's width), --repeat;
#   - traces: a Keel trace of 16,384 sources, a Megatron trace of sparse ids, a SmartMoE table of
#     blank lines, an ESFT task of blank lines, synthetic ones too big to generate;
#   - a config topology of 256 x 256 ranks (config --check refuses what the run refuses), a
#     window estimator over more counts than a job holds;
#   - --threads, trace info --ranks, demo sizes;
#   - flags given twice, empty list items, and flags the chosen run does not read.
# $1: path of the keel binary.
set -euo pipefail

keel="$(realpath "$1")"
root="$(mktemp -d "${TMPDIR:-/tmp}/keel-bounded-work-cli-XXXXXX")"
trap 'rm -rf "$root"' EXIT
mkdir "$root/work" "$root/tmp"
cd "$root/work"

fail() {
  echo "bounded_work_cli: $*" >&2
  exit 1
}

# --- The inputs -------------------------------------------------------------------------------
python3 - <<'PY'
import json
import os

def write(name, text):
    if os.path.dirname(name):
        os.makedirs(os.path.dirname(name), exist_ok=True)
    with open(name, "w") as out:
        out.write(text)

# keel plan: one hot expert among 1,024, and 2^20 slots: log2phy would be 1,024 x 2^20 wide.
weight = [[1] * 1024]
weight[0][0] = 10**9
write("hot.json", json.dumps({"weight": weight, "num_replicas": 2**20, "num_groups": 1,
                              "num_nodes": 1, "num_gpus": 1}))
# keel plan: an input small enough to plan, too big to plan a thousand times.
write("wide.json", json.dumps({"weight": [[1]], "num_replicas": 65536, "num_groups": 1,
                               "num_nodes": 1, "num_gpus": 1}))
# A Keel trace of one step from 16,384 sources (one GPU each in a replay).
sources = 16384
write("sources.jsonl", json.dumps({"keel_trace": 1, "num_layers": 1, "num_experts": 1,
                                   "num_sources": sources}) + "\n" +
      json.dumps({"step": 0, "layers": [[1] * sources]}) + "\n")
# Megatron: 20 records, each its own step, layer and rank, each the highest expert id.
write("sparse_router.jsonl", "".join(
    json.dumps({"step": 10**12 * i, "layer": 1000 * i, "rank": 100 * i, "top_indices": [[65535]]})
    + "\n" for i in range(20)))
# Megatron: 1,100 records of distinct keys, each a row of 65,536 experts.
write("rows_router.jsonl", "".join(
    json.dumps({"step": i, "layer": 0, "top_indices": [[65535]]}) + "\n" for i in range(1100)))
# SmartMoE: a table whose first layer lists 16,384 experts, then 60,000 blank lines (layers).
experts = 16384
write("smartmoe_table/table_iter0_rank0.log",
      "0:[[" + ",".join(["1"] * experts) + "]]\n" + "\n" * 60000 + "1:[[1]]\n")
# ESFT: 400,000 sequences (blank lines but the last) of 65,536 experts.
write("esft_task/expert_weights_1.txt", "\n" * 400000 + "1\t2\t3\t4\t5\t6\n")
# A job of 256 x 256 ranks.
write("big_topology.yaml", "topology:\n  num_nodes: 256\n  gpus_per_node: 256\n")
# 4,096 ranks whose window estimator keeps 10,000 steps of every layer's traffic matrix.
write("wide_window.yaml", "topology:\n  num_nodes: 512\n  gpus_per_node: 8\n"
      "estimator:\n  kind: window\n  window_steps: 10000\n")
write("keel.yaml", "policy:\n  name: keel\n")
PY
"$keel" trace generate --output small.jsonl --steps 4 --layers 2 --experts 8 --sources 2 \
  2>/dev/null

# The state of every file under the working folder and TMPDIR: names and contents.
snapshot() {
  find . "$root/tmp" -print0 | sort -z | while IFS= read -r -d '' path; do
    if [[ -f "$path" ]]; then
      echo "file $path $(sha256sum <"$path" | cut -d' ' -f1)"
    else
      echo "other $path"
    fi
  done
}
snapshot >"$root/before"

# An AddressSanitizer build reserves terabytes of address space for its shadow memory and cannot
# start under `ulimit -v`: there the cases run without it, and the regular build's run holds the
# memory bound.
limit_memory=true
if ldd "$keel" 2>/dev/null | grep -q libasan; then limit_memory=false; fi

cases=0
# expect_refused NAME TEXT COMMAND...: exit 2 within 20 s under a 2 GB address space, TEXT on
# stderr or stdout, and no file changed, added or removed.
expect_refused() {
  local name="$1" text="$2"
  shift 2
  local got=0
  (
    if $limit_memory; then ulimit -v 2000000; fi
    TMPDIR="$root/tmp" exec timeout 20 "$@"
  ) >"$root/out" 2>"$root/err" </dev/null || got=$?
  [[ "$got" == 2 ]] || fail "$name: exited $got, expected 2: $(head -c 2000 "$root/err")"
  grep -qF -- "$text" "$root/err" "$root/out" ||
    fail "$name: no '$text' in: $(head -c 2000 "$root/err" "$root/out")"
  snapshot >"$root/after"
  diff "$root/before" "$root/after" >/dev/null ||
    fail "$name: files changed: $(diff "$root/before" "$root/after" || true)"
  cases=$((cases + 1))
}

# --- Sizes and products of sizes --------------------------------------------------------------
expect_refused "plan: 2^20 replicas with a hot expert" \
  "(num_replicas - num_experts + 1), the cells of log2phy = 1072694272 is more than the 16777216" \
  "$keel" plan --policy eplb --input hot.json
expect_refused "plan --repeat 1e9" "flag --repeat: '1e9' is not an integer" \
  "$keel" plan --input wide.json --repeat 1e9
expect_refused "plan --repeat 10^9" "--repeat 1000000000 is not in [1, 1000]" \
  "$keel" plan --input wide.json --repeat 1000000000
expect_refused "plan --repeat x slots" \
  "--repeat 1000 x 1 layers x num_replicas 65536 is more than the 2^24 slots" \
  "$keel" plan --input wide.json --repeat 1000
expect_refused "keel trace of 16,384 sources" \
  "sources.jsonl:1: num_sources 16384 is more than 4096" \
  "$keel" replay --trace sources.jsonl --quiet
expect_refused "megatron trace of sparse ids" \
  "20 steps of num_layers x num_sources x num_experts = 20 x 20 x 65536 counts, more than" \
  "$keel" trace info sparse_router.jsonl --format megatron
expect_refused "megatron records of wide rows" "takes the records' counts" \
  "$keel" replay --trace rows_router.jsonl --format megatron --quiet
expect_refused "smartmoe table of blank layers" \
  "60002 x 1 x 16384 counts per step, more than the 67108864 counts (512 MiB) a trace" \
  "$keel" trace info smartmoe_table --format smartmoe
expect_refused "esft task of blank sequences" \
  "400001 sequences of 1 layers x 65536 experts hold more counts than the 67108864 counts (512 MiB) a trace may hold" \
  "$keel" trace convert --input esft_task --format esft --esft-experts 65536 --output out.jsonl
expect_refused "synthetic trace of 2^36 counts" "counts is more than the 67108864 counts (512 MiB) a trace may hold" \
  "$keel" trace generate --output out.jsonl --steps 1000000 --layers 1000 --experts 64
expect_refused "synthetic trace of 10^13 selections" "token selections" \
  "$keel" trace generate --output out.jsonl --tokens 2147483647
expect_refused "synthetic trace of 10^11 swaps" "popularity swaps" \
  "$keel" trace generate --output out.jsonl --steps 100000 --experts 2 --sources 0 --tokens 1 \
  --top-k 1 --drift 1000000
expect_refused "config --check 256 x 256" \
  "topology.num_nodes x topology.gpus_per_node: 65536 ranks, more than the 4096 Keel supports" \
  "$keel" config --check big_topology.yaml
expect_refused "replay with the 256 x 256 config" "65536 ranks, more than the 4096" \
  "$keel" replay --trace synthetic --config big_topology.yaml --quiet
expect_refused "window estimator over 2^26 counts" \
  "ranks x num_experts x (estimator.window_steps + 1) = 4 x 4096 x 32 x 201 load counts, more" \
  "$keel" replay --trace synthetic --config wide_window.yaml --policy static --quiet
expect_refused "--threads 2^31-1" "--threads 2147483647 is not in [0, 1024]" \
  "$keel" replay --trace synthetic --threads 2147483647 --quiet
expect_refused "trace info --ranks 2^31-1" \
  "flag --ranks: 2147483647 must be 0 (default) or in [1, 4096]" \
  "$keel" trace info small.jsonl --ranks 2147483647
expect_refused "demo --ranks 512" "routed rows per run, more than the demo's 2^28" \
  "$keel" demo --ranks 512 --quiet
expect_refused "demo --steps 10^6" "--steps 1000000 x --ranks 8" \
  "$keel" demo --steps 1000000 --quiet

# --- Flags that would do nothing --------------------------------------------------------------
expect_refused "flag given twice" "flag --strategy given twice ('esp', then 'parm')" \
  "$keel" demo --strategy esp --strategy parm --steps 2 --quiet
expect_refused "boolean flag given twice" "flag --quiet given twice" \
  "$keel" replay --trace synthetic --quiet --quiet
expect_refused "--policy with an empty item" "--policy 'keel,': item 2 is empty" \
  "$keel" replay --trace synthetic --policy 'keel,' --quiet
expect_refused "--strategy with an empty item" "--strategy 'ep,,esp': item 2 is empty" \
  "$keel" replay --trace synthetic --strategy 'ep,,esp' --quiet
expect_refused "replay --synthetic with --trace FILE" \
  "--synthetic replays a generated trace, but --trace small.jsonl names a file" \
  "$keel" replay --synthetic --trace small.jsonl --quiet
expect_refused "replay --heatmap-layer without --plot" \
  "--heatmap-layer 0 chooses what --plot draws; there is no --plot" \
  "$keel" replay --trace synthetic --heatmap-layer 0 --quiet
expect_refused "replay --threads with --serve-metrics" \
  "--threads: --serve-metrics replays one policy on one thread" \
  "$keel" replay --trace synthetic --serve-metrics 127.0.0.1:0 --threads 2 --quiet
expect_refused "demo --sequence-objective without --sequence-migration" \
  "--sequence-objective applies only with --sequence-migration" \
  "$keel" demo --sequence-objective traffic --steps 2 --quiet
expect_refused "demo --sequence-objective with --condense" \
  "--sequence-objective applies only with --sequence-migration" \
  "$keel" demo --condense 0.99 --sequence-objective traffic --steps 2 --quiet
expect_refused "demo --sequence-tokens without sequences" \
  "--sequence-tokens applies only with --sequence-migration or --condense" \
  "$keel" demo --sequence-tokens 128 --steps 2 --quiet
expect_refused "demo --token-repeat without sequences" \
  "--token-repeat applies only with --sequence-migration or --condense" \
  "$keel" demo --token-repeat 0.5 --steps 2 --quiet
expect_refused "demo --shard-degree with parm" \
  "--shard-degree applies only with --strategy esp or --shard-hot" \
  "$keel" demo --strategy parm --shard-degree 2 --steps 2 --quiet
expect_refused "demo --shard-degree alone" \
  "--shard-degree applies only with --strategy esp or --shard-hot" \
  "$keel" demo --shard-degree 2 --steps 2 --quiet
expect_refused "demo --zipf with --trace" "--zipf applies only to the synthetic gate" \
  "$keel" demo --trace small.jsonl --zipf 2 --ranks 2 --steps 2 --quiet
expect_refused "plan --policy eplb with --config" \
  "--config keel.yaml: eplb is DeepSeek's algorithm as published and reads no config" \
  "$keel" plan --policy eplb --input wide.json --config keel.yaml
expect_refused "trace convert: a megatron flag for an esft trace" \
  "--megatron-experts is for megatron traces, but esft_task is read as esft" \
  "$keel" trace convert --input esft_task --format esft --megatron-experts 8 --output out.jsonl
expect_refused "trace convert: an esft flag for a guessed keel trace" \
  "--esft-group is for esft traces, but small.jsonl is read as keel (guessed from the path" \
  "$keel" trace convert --input small.jsonl --esft-group 4 --output out.jsonl

# What stays accepted: the bounds are not off by one, and ranks beyond the experts cost nothing.
"$keel" trace info small.jsonl --ranks 4096 >"$root/out" ||
  fail "trace info --ranks 4096 failed"
grep -q "static contiguous placement on 4096 ranks" "$root/out" || fail "$(cat "$root/out")"
"$keel" replay --trace small.jsonl --policy static,keel --quiet --threads 1024 >"$root/out" \
  2>"$root/err" ||
  fail "replay --threads 1024 failed"

echo "bounded_work_cli: ok ($cases cases)"
