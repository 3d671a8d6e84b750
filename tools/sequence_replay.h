// `keel replay --sequence-migration`: Luffy's sequence migration measured on a trace that records
// routing per sequence (the ESFT trace, or a Keel trace with "sequences"). Each step's sequences
// are dealt to the ranks in turn, as a data loader deals them; the sequence planner
// (placement/sequence_planner.h) then moves them, and the replay reports the (token, k) rows that
// leave their rank and their node, the bytes the moves cost, and the cost model's step, against
// the same steps without migration. docs/luffy.md explains the modes and the numbers.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "monitor/trace.h"

namespace keel::tools {

struct SequenceReplayOptions {
  // > 0: the trace's sequences, in order, regrouped into steps of this many (the last partial
  // step dropped), so that a trace imported one sequence per step replays in batches.
  int batch_sequences = 0;
  double max_token_imbalance = 1.10;  // SequencePlanOptions::max_token_imbalance
  // SequencePlanOptions::objective: "step" (the cost model's step) or "traffic" (summed link
  // time, cross-node bytes weighing most).
  std::string objective = "step";
  // Called after each step, every mode planned: (steps done, steps). May be empty.
  std::function<void(int done, int total)> progress;
};

// One way of placing sequences (and experts), measured on `steps` steps. "Before" is always the
// static expert placement without migration on the same steps; "after" is this mode.
struct SequenceReplayMode {
  std::string name;
  std::string description;
  int first_step = 0;  // index of the first measured step (after the regrouped batches)
  int steps = 0;
  int steps_used = 0;      // steps (step modes) or layers (layer mode) whose plan paid
  int64_t sequences = 0;   // sequences in the measured steps
  int64_t moves = 0;       // times a sequence changed rank
  double moved_bytes = 0;  // one way; the gradient returns as many
  double cross_node_moved_bytes = 0;
  double remote_rows_before = 0;  // (token, k) rows off the sequence's rank, all layers
  double remote_rows_after = 0;
  double cross_node_rows_before = 0;  // ... off its node
  double cross_node_rows_after = 0;
  // Bytes over links between nodes: rows x token row bytes x all-to-all passes, plus the moves
  // that cross nodes, there and back.
  double cross_node_bytes_before = 0;
  double cross_node_bytes_after = 0;
  double seconds_before = 0;  // the cost model's expert compute + all-to-all, summed over steps
  double seconds_after = 0;   // ... with the moves' time
};

struct SequenceReplayReport {
  std::string trace_description;
  int num_steps = 0;  // after regrouping
  int num_layers = 0;
  int num_experts = 0;
  int num_nodes = 0;
  int gpus_per_node = 0;
  double sequences_per_step = 0;
  std::string objective;  // as SequenceReplayOptions::objective
  std::vector<SequenceReplayMode> modes;
  // The one-time cost of the grouped expert placement: bytes to move from the static one.
  double grouping_migration_bytes = 0;
};

// Fails when the trace records no sequences (naming the formats that do), or when the config's
// topology and slots do not fit the trace's experts.
Result<SequenceReplayReport> ReplaySequenceMigration(const Trace& trace, const KeelConfig& config,
                                                     const SequenceReplayOptions& options);

// The steps ReplaySequenceMigration replays: the trace's, or its sequences in batches.
int SequenceReplaySteps(const Trace& trace, int batch_sequences);

nlohmann::json SequenceReplayReportToJson(const SequenceReplayReport& report);
// The report as a table for the terminal, one row per mode, with the cuts against "before".
std::string FormatSequenceReplayTable(const SequenceReplayReport& report);

}  // namespace keel::tools
