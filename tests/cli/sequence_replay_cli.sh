#!/usr/bin/env bash
# End-to-end test of `keel replay --sequence-migration` on an ESFT-format folder this test writes:
# four tasks whose sequences each prefer two experts that the static placement puts on different
# nodes. The table and the JSON report give every mode; grouping the experts and moving the
# sequences must cut the cross-node bytes, net of the moves; bad flag combinations and a trace
# without sequences exit 2 and say why. With the shared ESFT trace present, it replays that too.
# $1: path of the keel binary.
set -euo pipefail

keel="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/keel-sequence-replay-XXXXXX")"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "sequence_replay_cli: $*" >&2
  exit 1
}

# 2 layers, 8 experts, top-2; task t's tokens pick experts t and t + 4 (nodes 0 and 1 under the
# static placement of 2 nodes x 2 GPUs) 7 times in 8, another expert otherwise.
python3 - "$work/esft" <<'PY'
import os, random, sys
root = sys.argv[1]
rng = random.Random(5)
for task, name in enumerate(["alpha", "beta", "gamma", "delta"]):
    os.makedirs(os.path.join(root, name))
    sequences = []
    for _ in range(12):
        tokens = rng.randint(20, 40)
        sequences.append([[(task, task + 4) if rng.random() < 7 / 8 else
                           tuple(rng.sample(range(8), 2)) for _ in range(tokens)]
                          for _ in range(2)])
    for layer in range(2):
        with open(os.path.join(root, name, f"expert_weights_{layer + 1}.txt"), "w") as f:
            for sequence in sequences:
                ids = [str(e) for pair in sequence[layer] for e in pair]
                f.write("\t".join(ids) + "\t\t" + "\t".join(["0.5"] * len(ids)) + "\n")
PY
cat >"$work/config.yaml" <<'YAML'
topology: {num_nodes: 2, gpus_per_node: 2, intra_node_gb_per_s: 400, inter_node_gb_per_s: 50}
slots: {persistent_per_rank: 3, transient_per_rank: 1}
cost_model: {hidden_size: 1024, expert_ffn_size: 1024, dtype_bytes: 2}
YAML

"$keel" trace convert --input "$work/esft" --output "$work/esft.jsonl" --esft-experts 8 \
  --esft-top-k 2 --quiet >/dev/null 2>"$work/err" || fail "convert: $(cat "$work/err")"
"$keel" replay --trace "$work/esft.jsonl" --sequence-migration --batch-sequences 8 \
  --config "$work/config.yaml" --report "$work/report.json" >"$work/out" 2>"$work/err" ||
  fail "replay failed: $(cat "$work/err")"
for mode in step layer grouped grouped+step; do
  grep -q "^$mode " "$work/out" || fail "no row for mode $mode: $(cat "$work/out")"
done
python3 - "$work/report.json" <<'PY' || fail "report: $(cat "$work/report.json")"
import json, sys
r = json.load(open(sys.argv[1]))["sequence_migration"]
assert r["num_steps"] == 6 and r["sequences_per_step"] == 8.0, r
assert r["num_nodes"] == 2 and r["gpus_per_node"] == 2, r
modes = r["modes"]
assert set(modes) == {"step", "layer", "grouped", "grouped+step"}, modes.keys()
for name, m in modes.items():
    assert m["sequences"] == 8 * m["steps"], (name, m)
    # Plans are used only when the cost model's step gets faster.
    assert m["sim_step_seconds_after"] <= m["sim_step_seconds_before"] * (1 + 1e-12) or \
        name == "grouped", (name, m)
    assert m["cross_node_bytes_before"] > 0, (name, m)
assert modes["step"]["steps"] == 6 and modes["grouped"]["first_step"] == 3, modes
assert modes["grouped"]["moves"] == 0 and modes["grouped"]["moved_bytes"] == 0
g = modes["grouped+step"]
# Each task's two experts share a node once grouped, and its sequences move there: most
# cross-node bytes go, net of the moves.
assert g["cross_node_bytes_after"] < 0.5 * g["cross_node_bytes_before"], g
assert g["moves"] > 0 and g["moved_bytes"] > 0, g
assert r["grouping_migration_bytes"] > 0
PY

# Errors: flags of the other replay, a trace without sequences, a bad bound.
expect_usage_error() {
  local words="$1"
  shift
  local got=0
  "$keel" replay "$@" >/dev/null 2>"$work/err" || got=$?
  [[ "$got" == 2 ]] || fail "$* exited $got, expected 2"
  grep -q -- "$words" "$work/err" || fail "$*: $(cat "$work/err")"
}
expect_usage_error "needs a trace that records routing per sequence" \
  --trace synthetic --sequence-migration
expect_usage_error "belongs to the policy replay" \
  --trace "$work/esft.jsonl" --sequence-migration --policy keel
expect_usage_error "only meaningful with --sequence-migration" \
  --trace "$work/esft.jsonl" --batch-sequences 4
expect_usage_error "must be in \[1, 1e6\]" \
  --trace "$work/esft.jsonl" --sequence-migration --max-token-imbalance 0.5
expect_usage_error "is not a multiple of top_k 6" --trace "$work/esft" --sequence-migration
"$keel" trace generate --output "$work/plain.jsonl" --steps 4 >/dev/null 2>&1 ||
  fail "could not write a trace without sequences"
expect_usage_error "has none" --trace "$work/plain.jsonl" --sequence-migration

# Steps of 8 sequences made by the importer replay as batches of 8 made by the replay.
"$keel" trace convert --input "$work/esft" --output "$work/by8.jsonl" --esft-experts 8 \
  --esft-top-k 2 --esft-group 8 --quiet >/dev/null 2>"$work/err" || fail "$(cat "$work/err")"
"$keel" replay --trace "$work/by8.jsonl" --sequence-migration --config "$work/config.yaml" \
  --quiet >"$work/out2" 2>&1 || fail "$(cat "$work/out2")"
diff <(grep -E "^(step|layer|grouped)" "$work/out") \
  <(grep -E "^(step|layer|grouped)" "$work/out2") >/dev/null ||
  fail "batches differ: $(diff "$work/out" "$work/out2")"

shared="${KEEL_SHARED_TRACES:-}/esft-dsv2lite"
if [[ -n "${KEEL_SHARED_TRACES:-}" && -d "$shared/law" ]]; then
  "$keel" replay --trace "$shared" --sequence-migration --batch-sequences 16 --quiet \
    --config "${KEEL_SOURCE_DIR:-.}/configs/esft-dsv2lite-2x4.yaml" >"$work/shared" 2>&1 ||
    fail "shared ESFT replay: $(cat "$work/shared")"
  grep -q "213 sequences of intent 127, law 33, summary 13, translation 40" "$work/shared" ||
    fail "shared ESFT trace not mixed: $(cat "$work/shared")"
fi
echo "sequence_replay_cli: ok"
