#!/usr/bin/env bash
# End-to-end test of `keel plan`: DeepSeek EPLB's README example through --policy eplb, every
# policy answering the same input with EPLB-shaped output, and invalid inputs exiting 2 with
# {"error": ...} naming the problem. $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-plan-cli-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "plan_cli: $*" >&2
  exit 1
}

# The example of DeepSeek EPLB's README: 2 layers x 12 experts, 16 replicas, 4 groups,
# 2 nodes, 8 GPUs.
cat >"$work/in.json" <<'JSON'
{"weight": [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]],
 "num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}
JSON

"$keel" plan --policy eplb --input "$work/in.json" --output "$work/eplb.json" --repeat 3 \
  || fail "eplb plan failed"
python3 - "$work/eplb.json" <<'PY' || fail "eplb output differs from DeepSeek's README"
import json, sys
out = json.load(open(sys.argv[1]))
assert out["phy2log"] == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                          [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]], out["phy2log"]
assert out["logcnt"] == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                         [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]], out["logcnt"]
assert out["timing"]["median_seconds"] >= 0
PY

# Planning from scratch moves for free and replans until converged: at realistic token counts
# `keel` replicates the hottest expert of the layer and never puts two copies on one GPU.
python3 - "$work/in.json" "$work/in1000.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d["weight"] = [[w * 1000 for w in row] for row in d["weight"]]
json.dump(d, open(sys.argv[2], "w"))
PY
"$keel" plan --policy keel --input "$work/in1000.json" >"$work/keel1000.json" \
  || fail "keel plan at 1000x failed"
python3 - "$work/keel1000.json" <<'PY' || fail "keel did not replicate hot experts from scratch"
import json, sys
out = json.load(open(sys.argv[1]))
for layer, hottest in ((0, 10), (1, 5)):
    assert out["logcnt"][layer][hottest] >= 2, (layer, out["logcnt"][layer])
    gpus = [slot // 2 for slot, e in enumerate(out["phy2log"][layer]) if e == hottest]
    assert len(gpus) == len(set(gpus)), (layer, gpus)
PY

# Every policy accepts the same input and answers with consistent EPLB shapes.
for policy in static eplb flexmoe smartmoe fastermoe velb lplb swiftmoe trtllm keel; do
  "$keel" plan --policy "$policy" --input "$work/in.json" >"$work/$policy.json" \
    || fail "policy $policy failed: $(cat "$work/$policy.json")"
  python3 - "$work/$policy.json" "$policy" <<'PY' || fail "policy $policy: bad output shape"
import json, sys
out, policy = json.load(open(sys.argv[1])), sys.argv[2]
L, E, R = 2, 12, 16
assert len(out["phy2log"]) == L and all(len(r) == R for r in out["phy2log"]), policy
assert len(out["logcnt"]) == L and all(len(r) == E for r in out["logcnt"]), policy
width = len(out["log2phy"][0][0])
assert width == max(max(r) for r in out["logcnt"]), policy
for l in range(L):
    assert len(out["log2phy"][l]) == E
    for e in range(E):
        copies = [s for s in out["log2phy"][l][e] if s != -1]
        assert len(out["log2phy"][l][e]) == width
        assert len(copies) == out["logcnt"][l][e] >= 1, (policy, l, e)
        assert all(out["phy2log"][l][s] == e for s in copies), (policy, l, e)
    used = [s for s in range(R) if out["phy2log"][l][s] != -1]
    assert sorted(s for row in out["log2phy"][l] for s in row if s != -1) == used, policy
assert "median_seconds" in out["timing"]
PY
done

# Invalid inputs exit 2 with {"error": "..."} naming the problem.
expect_error() {
  local name="$1" text="$2" input="$3"
  printf '%s' "$input" >"$work/bad.json"
  local got=0
  "$keel" plan --policy eplb --input "$work/bad.json" >"$work/out" 2>/dev/null || got=$?
  [[ "$got" == 2 ]] || fail "$name: exited $got, expected 2"
  python3 - "$work/out" "$text" <<'PY' || fail "$name: error does not mention '$text': $(cat "$work/out")"
import json, sys
error = json.load(open(sys.argv[1]))["error"]
assert sys.argv[2] in error, error
PY
}
ok='"num_groups": 1, "num_nodes": 1, "num_gpus": 4'
expect_error "indivisible replicas" "num_replicas 10 is not divisible by num_gpus 4" \
  "{\"weight\": [[1, 2, 3, 4]], \"num_replicas\": 10, $ok}"
expect_error "negative weight" "weight[0][2] = -3 is negative" \
  "{\"weight\": [[1, 2, -3, 4]], \"num_replicas\": 8, $ok}"
expect_error "ragged rows" "ragged rows: weight[1] has 3 entries" \
  "{\"weight\": [[1, 2, 3, 4], [1, 2, 3]], \"num_replicas\": 8, $ok}"
expect_error "missing field" "missing field 'num_replicas'" \
  "{\"weight\": [[1, 2, 3, 4]], $ok}"
expect_error "non-numeric weight" "weight[0][1] is not a number" \
  "{\"weight\": [[1, \"x\", 3, 4]], \"num_replicas\": 8, $ok}"
expect_error "non-numeric count" "field 'num_replicas' must be an integer" \
  "{\"weight\": [[1, 2, 3, 4]], \"num_replicas\": \"eight\", $ok}"
expect_error "not JSON" "is not valid JSON" "{\"weight\": [["
expect_error "unknown field" "unknown field 'num_gpu' (known: weight, num_replicas" \
  "{\"weight\": [[1, 2, 3, 4]], \"num_replicas\": 8, \"num_gpu\": 4, $ok}"
# DeepSeek's fallback rule: hierarchical only when num_groups % num_nodes == 0, and then GPUs must
# split among nodes; otherwise global, where neither groups nor nodes need divide anything.
expect_error "hierarchical, GPUs not split among nodes" \
  "num_gpus 3 is not divisible by num_nodes 2 (hierarchical" \
  '{"weight": [[10, 6, 4, 2]], "num_replicas": 6, "num_groups": 2, "num_nodes": 2, "num_gpus": 3}'
printf '%s' '{"weight": [[10, 6, 4, 2]], "num_replicas": 6, "num_groups": 3, "num_nodes": 2,
  "num_gpus": 3}' >"$work/global.json"
"$keel" plan --policy eplb --input "$work/global.json" >"$work/global.out" ||
  fail "global fallback (3 groups, 2 nodes, 3 GPUs) was refused: $(cat "$work/global.out")"
python3 - "$work/global.out" <<'PY' || fail "global fallback: wrong plan: $(cat "$work/global.out")"
import json, sys
out = json.load(open(sys.argv[1]))
assert out["phy2log"] == [[0, 1, 0, 3, 2, 1]], out["phy2log"]  # worked by hand in eplb_test.cc
assert out["logcnt"] == [[2, 2, 1, 1]], out["logcnt"]
PY

# Usage errors exit 2 as well.
got=0
"$keel" plan --policy nope --input "$work/in.json" >"$work/out" 2>/dev/null || got=$?
[[ "$got" == 2 ]] && grep -q "known: static" "$work/out" || fail "unknown policy: exit $got"
got=0
"$keel" plan >/dev/null 2>&1 || got=$?
[[ "$got" == 2 ]] || fail "missing --input: exit $got"
"$keel" plan --help >"$work/help.txt" && grep -q -- "--repeat N" "$work/help.txt" ||
  fail "help lacks --repeat"
echo "plan_cli: ok"
