#!/usr/bin/env bash
# Numbers read exactly, by every reader of the keel program, one case per reader and field; each
# bad input exits 2 with a message that names the field and quotes the value as written:
#   - integers range-checked at their full width (2^64 - 1 was read as -1: "step -1 is negative")
#     and named with the bound that applies;
#   - a JSON key given twice (nlohmann kept the last): keel traces, Megatron and OLMoE traces,
#     `keel plan --input`, strategy pools;
#   - types exact: a quoted number is a string (JSON readers, the YAML config), and so is a
#     YAML scalar tagged !!str;
#   - a YAML config of more than one document, or text after its end ('...');
#   - cost-model constants that priced a simulated step at inf or NaN (null in the report);
#   - flags whose integer does not fit their type.
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-numbers-cli-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "exact_numbers_cli: $*" >&2
  exit 1
}

# expect_usage_error NAME TEXT COMMAND...: exit status 2 and TEXT on stderr or stdout.
expect_usage_error() {
  local name="$1" text="$2"
  shift 2
  local got=0
  timeout 60 "$@" >"$work/out" 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$name: exited $got, expected 2: $(cat "$work/err" "$work/out")"
  grep -qF -- "$text" "$work/err" "$work/out" ||
    fail "$name: no '$text' in: $(cat "$work/err" "$work/out")"
}

# --- Keel traces (trace info reads them as replay does) -------------------------------------
header='{"keel_trace":1,"num_layers":1,"num_experts":2,"num_sources":0}'
keel_trace() {  # keel_trace NAME LINES...: a Keel trace file of these lines
  local file="$work/$1.jsonl"
  shift
  printf '%s\n' "$@" >"$file"
}
keel_trace step_u64 "$header" '{"step":18446744073709551615,"layers":[[1,2]]}'
expect_usage_error "keel step 2^64-1" \
  "step_u64.jsonl:2: step 18446744073709551615 is more than 9223372036854775807" \
  "$keel" trace info "$work/step_u64.jsonl"
keel_trace step_big "$header" '{"step":36893488147419103232,"layers":[[1,2]]}'
expect_usage_error "keel step 2^65" \
  "step_big.jsonl:2: step 36893488147419103232 is more than 9223372036854775807" \
  "$keel" trace info "$work/step_big.jsonl"
keel_trace step_quoted "$header" '{"step":"0","layers":[[1,2]]}'
expect_usage_error "keel step quoted" 'step_quoted.jsonl:2: step must be an integer, got "0"' \
  "$keel" trace info "$work/step_quoted.jsonl"
keel_trace step_twice "$header" '{"step":0,"layers":[[1,2]],"step":7}'
expect_usage_error "keel step twice" \
  'step_twice.jsonl:2: key "step" appears twice in one object at line 1, column 28' \
  "$keel" trace info "$work/step_twice.jsonl"
keel_trace layers_u64 '{"keel_trace":1,"num_layers":18446744073709551615,"num_experts":2,"num_sources":0}'
expect_usage_error "keel num_layers 2^64-1" \
  'layers_u64.jsonl:1: header "num_layers" 18446744073709551615 is more than 1073741824' \
  "$keel" trace info "$work/layers_u64.jsonl"
keel_trace experts_big '{"keel_trace":1,"num_layers":1,"num_experts":2000000000,"num_sources":0}'
expect_usage_error "keel num_experts 2e9" \
  'experts_big.jsonl:1: header "num_experts" 2000000000 is more than 1073741824' \
  "$keel" trace info "$work/experts_big.jsonl"
keel_trace sources_quoted '{"keel_trace":1,"num_layers":1,"num_experts":2,"num_sources":"0"}'
expect_usage_error "keel num_sources quoted" \
  'sources_quoted.jsonl:1: header "num_sources" must be an integer, got "0"' \
  "$keel" trace info "$work/sources_quoted.jsonl"
keel_trace header_twice '{"keel_trace":1,"num_layers":1,"num_experts":2,"num_sources":0,"num_experts":9}'
expect_usage_error "keel header key twice" \
  'header_twice.jsonl:1: key "num_experts" appears twice in one object at line 1, column 64' \
  "$keel" trace info "$work/header_twice.jsonl"

# --- Megatron-LM router records ----------------------------------------------------------------
megatron() {  # megatron NAME LINE: a router_trace file of one record
  printf '%s\n' "$2" >"$work/$1.jsonl"
}
megatron m_step '{"step":18446744073709551615,"layer":0,"expert_counts":[1,2]}'
expect_usage_error "megatron step 2^64-1" \
  'm_step.jsonl:1: "step" 18446744073709551615 is more than 9223372036854775807' \
  "$keel" trace info "$work/m_step.jsonl" --format megatron
megatron m_layer '{"step":0,"layer":"2","expert_counts":[1,2]}'
expect_usage_error "megatron layer quoted" 'm_layer.jsonl:1: "layer" must be an integer, got "2"' \
  "$keel" trace info "$work/m_layer.jsonl" --format megatron
megatron m_rank '{"step":0,"layer":0,"rank":18446744073709551615,"expert_counts":[1,2]}'
expect_usage_error "megatron rank 2^64-1" \
  'm_rank.jsonl:1: "rank" 18446744073709551615 is more than 9223372036854775807' \
  "$keel" trace info "$work/m_rank.jsonl" --format megatron
megatron m_expert '{"step":0,"layer":0,"top_indices":[[0,18446744073709551615]]}'
expect_usage_error "megatron expert id 2^64-1" \
  'm_expert.jsonl:1: top_indices[0]: expert id 18446744073709551615 is more than 65535' \
  "$keel" trace info "$work/m_expert.jsonl" --format megatron
megatron m_twice '{"step":0,"layer":0,"layer":1,"expert_counts":[1,2]}'
expect_usage_error "megatron layer twice" \
  'm_twice.jsonl:1: key "layer" appears twice in one object at line 1, column 21' \
  "$keel" trace info "$work/m_twice.jsonl" --format megatron

# --- OLMoE counts, ESFT expert ids, SmartMoE layers --------------------------------------------
mkdir "$work/olmoe"
printf '{"models": {"olmoe": {"top8": {"law": [[1, 2]],\n  "law": [[3, 4]]}}}}\n' \
  >"$work/olmoe/expert_counts_derived.json"
expect_usage_error "olmoe domain twice" \
  'expert_counts_derived.json: key "law" appears twice in one object at line 2, column 3' \
  "$keel" trace info "$work/olmoe" --format olmoe
mkdir "$work/esft"
printf '1\t18446744073709551616\t\t0.5\t0.5\n' >"$work/esft/expert_weights_1.txt"
expect_usage_error "esft expert id 2^64" \
  "expert_weights_1.txt:1: expert id 18446744073709551616 outside 0..63" \
  "$keel" trace info "$work/esft" --format esft
mkdir "$work/smartmoe"
printf '99999999999999999999:[[1.0, 2.0]]\n' >"$work/smartmoe/table_iter1_rank0.log"
expect_usage_error "smartmoe layer 1e20" \
  "table_iter1_rank0.log:1: column 1: integer 99999999999999999999 does not fit in 64 bits" \
  "$keel" trace info "$work/smartmoe" --format smartmoe

# --- keel plan --input -------------------------------------------------------------------------
plan_input() {  # plan_input NAME REST: DeepSeek's arguments with REST after the weights
  printf '{"weight": [[1, 2, 3, 4]], %s}\n' "$2" >"$work/$1.json"
}
plan_input p_gpus '"num_replicas": 4, "num_groups": 1, "num_nodes": 1, "num_gpus": 18446744073709551615'
expect_usage_error "plan num_gpus 2^64-1" \
  "field 'num_gpus' 18446744073709551615 is more than 1000000000" \
  "$keel" plan --policy eplb --input "$work/p_gpus.json"
plan_input p_quoted '"num_replicas": "4", "num_groups": 1, "num_nodes": 1, "num_gpus": 2'
expect_usage_error "plan num_replicas quoted" "field 'num_replicas' must be an integer, got \"4\"" \
  "$keel" plan --policy eplb --input "$work/p_quoted.json"
plan_input p_bool '"num_replicas": 4, "num_groups": true, "num_nodes": 1, "num_gpus": 2'
expect_usage_error "plan num_groups boolean" "field 'num_groups' must be an integer, got true" \
  "$keel" plan --policy eplb --input "$work/p_bool.json"
plan_input p_twice '"num_replicas": 4, "num_groups": 1, "num_nodes": 1, "num_gpus": 2, "num_gpus": 4'
expect_usage_error "plan num_gpus twice" \
  'key "num_gpus" appears twice in one object at line 1, column 95' \
  "$keel" plan --policy eplb --input "$work/p_twice.json"

# --- strategy pools (keel replay --strategy auto --pool) ---------------------------------------
printf '{"format": "keel-strategy-pool", "layers": [["ep"]], "layers": [["esp"]]}\n' \
  >"$work/pool_twice.json"
expect_usage_error "pool layers twice" \
  'pool_twice.json: key "layers" appears twice in one object at line 1, column 54' \
  "$keel" replay --trace synthetic --strategy auto --pool "$work/pool_twice.json" --quiet
printf '{"format": "keel-strategy-pool", "source": 7, "layers": [["ep"]]}\n' \
  >"$work/pool_source.json"
expect_usage_error "pool source not a string" 'strategy pool: "source" must be a string, got 7' \
  "$keel" replay --trace synthetic --strategy auto --pool "$work/pool_source.json" --quiet

# --- the YAML config ---------------------------------------------------------------------------
config_case() {  # config_case NAME TEXT MESSAGE
  printf '%b' "$2" >"$work/$1.yaml"
  expect_usage_error "config $1" "$1.yaml:$3" "$keel" config --check "$work/$1.yaml"
}
config_case int_quoted 'topology:\n  num_nodes: "4"\n' \
  '2: topology.num_nodes: "4" is a quoted string, not an integer (write 4 without quotes)'
config_case float_quoted "cost_model:\n  expert_tflops: '600'\n" \
  '2: cost_model.expert_tflops: "600" is a quoted string, not a number'
config_case bool_quoted 'policy:\n  keel:\n    transient_replicas: "true"\n' \
  '3: policy.keel.transient_replicas: "true" is a quoted string, not true or false'
config_case int_str_tag 'slots:\n  persistent_per_rank: !!str 4\n' \
  '2: slots.persistent_per_rank: 4 is tagged !!str, not an integer'
config_case second_doc 'topology:\n  num_nodes: 2\n---\ntopology:\n  num_nodes: 3\n' \
  '3: a second YAML document starts here'
config_case after_end 'topology:\n  num_nodes: 2\n...\nslots:\n  persistent_per_rank: 9\n' \
  '4: a second YAML document starts here'
config_case int_u64 'topology:\n  gpus_per_node: 18446744073709551615\n' \
  '2: topology.gpus_per_node: 18446744073709551615 is out of range (must be in [1, 4096])'
config_case int_bound 'policy:\n  replan_interval_steps: 3000000000\n' \
  '2: policy.replan_interval_steps: 3000000000 is out of range (must be in [1, 2147483647])'

# --- cost-model constants that priced a step at inf or NaN -------------------------------------
cost_case() {  # cost_case NAME SECTION KEY VALUE RANGE
  printf 'slots:\n  persistent_per_rank: 6\n%s:\n  %s: %s\n' "$2" "$3" "$4" >"$work/$1.yaml"
  expect_usage_error "replay with $2.$3 $4" "$1.yaml:4: $2.$3: $4 is out of range (must be $5)" \
    "$keel" replay --trace synthetic --config "$work/$1.yaml" --quiet --report "$work/$1.json"
  [[ ! -e "$work/$1.json" ]] || fail "$1: a report was written"
}
cost_case tflops cost_model expert_tflops 1e-300 'in [1e-9, 1e9]'
cost_case intra topology intra_node_gb_per_s 1e-320 'in [1e-9, 1e9]'
cost_case inter topology inter_node_gb_per_s 1e-320 'in [1e-9, 1e9]'
cost_case multiplier cost_model train_flops_multiplier 1e308 'in [1, 1000]'
cost_case home_bytes cost_model home_move_bytes_per_parameter 1e308 'in (0, 1024]'
printf 'slots:\n  persistent_per_rank: 6\ncost_model:\n  gemm_efficiency: "1024:1e-300"\n' \
  >"$work/efficiency.yaml"
expect_usage_error "replay with a GEMM efficiency of 1e-300" \
  "cost_model.gemm_efficiency: entry '1024:1e-300': efficiency must be a number in [0.001, 4]" \
  "$keel" replay --trace synthetic --strategy all --config "$work/efficiency.yaml" --quiet

# --- flags -------------------------------------------------------------------------------------
expect_usage_error "--threads 2^32" "flag --threads: '4294967296' is out of range [-2147483648, 2147483647]" \
  "$keel" replay --trace synthetic --threads 4294967296 --quiet

echo "exact_numbers_cli: ok"
