// ReplaySequenceMigration: per step, the sequences dealt to ranks, then planned four ways (once
// per step, before every layer, grouped experts alone, grouped experts with once per step).
#include "tools/sequence_replay.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "placement/cost_model.h"
#include "placement/placement.h"
#include "placement/sequence_planner.h"
#include "placement/topology.h"

namespace keel::tools {
namespace {

// The trace's steps as batches of sequences, dealt to ranks in turn.
std::vector<std::vector<SequenceTraffic>> Batches(const Trace& trace, int batch_sequences,
                                                  int ranks) {
  std::vector<std::vector<const TraceSequence*>> steps;
  if (batch_sequences > 0) {
    std::vector<const TraceSequence*> all;
    for (const auto& step : trace.sequences) {
      for (const TraceSequence& sequence : step) all.push_back(&sequence);
    }
    for (size_t first = 0; first + batch_sequences <= all.size(); first += batch_sequences) {
      steps.emplace_back(all.begin() + static_cast<ptrdiff_t>(first),
                         all.begin() + static_cast<ptrdiff_t>(first + batch_sequences));
    }
  } else {
    for (const auto& step : trace.sequences) {
      steps.emplace_back();
      for (const TraceSequence& sequence : step) steps.back().push_back(&sequence);
    }
  }
  std::vector<std::vector<SequenceTraffic>> batches;
  for (const auto& step : steps) {
    std::vector<SequenceTraffic> batch;
    for (size_t i = 0; i < step.size(); ++i) {
      batch.push_back({static_cast<int>(i % ranks), step[i]->tokens, step[i]->counts});
    }
    batches.push_back(std::move(batch));
  }
  return batches;
}

// The layers [layer, layer + 1) of every sequence, for planning before one layer.
std::vector<SequenceTraffic> OneLayer(std::span<const SequenceTraffic> batch,
                                      std::span<const int> rank, int layer, int experts) {
  std::vector<SequenceTraffic> layer_batch;
  layer_batch.reserve(batch.size());
  for (size_t s = 0; s < batch.size(); ++s) {
    const auto first = batch[s].expert_rows.begin() + static_cast<ptrdiff_t>(layer) * experts;
    layer_batch.push_back({rank[s], batch[s].tokens, std::vector<double>(first, first + experts)});
  }
  return layer_batch;
}

class ModeTotals {
 public:
  ModeTotals(std::string name, std::string description, const CostModel& cost)
      : row_bytes_(cost.token_row_bytes() * cost.config().all_to_all_passes) {
    mode_.name = std::move(name);
    mode_.description = std::move(description);
  }

  // The static placement without migration on this step: the "before" of every mode.
  void AddBefore(const SequencePlan& unmoved, int64_t sequences) {
    mode_.steps += 1;
    mode_.sequences += sequences;
    mode_.remote_rows_before += unmoved.remote_rows_before;
    mode_.cross_node_rows_before += unmoved.cross_node_rows_before;
    mode_.cross_node_bytes_before += unmoved.cross_node_rows_before * row_bytes_;
    mode_.seconds_before += unmoved.seconds_before;
  }
  // One plan of this mode (a step's, or a layer's).
  void AddAfter(const SequencePlan& plan) {
    mode_.steps_used += plan.used ? 1 : 0;
    mode_.moves += plan.moved_sequences;
    mode_.moved_bytes += plan.moved_bytes;
    mode_.cross_node_moved_bytes += plan.cross_node_moved_bytes;
    mode_.remote_rows_after += plan.remote_rows_after;
    mode_.cross_node_rows_after += plan.cross_node_rows_after;
    mode_.cross_node_bytes_after +=
        plan.cross_node_rows_after * row_bytes_ + 2.0 * plan.cross_node_moved_bytes;
    mode_.seconds_after += plan.seconds_after;
  }
  SequenceReplayMode Finish(int first_step) {
    mode_.first_step = first_step;
    return mode_;
  }

 private:
  double row_bytes_;
  SequenceReplayMode mode_;
};

}  // namespace

int SequenceReplaySteps(const Trace& trace, int batch_sequences) {
  if (batch_sequences <= 0) return static_cast<int>(trace.sequences.size());
  size_t sequences = 0;
  for (const auto& step : trace.sequences) sequences += step.size();
  return static_cast<int>(sequences / static_cast<size_t>(batch_sequences));
}

Result<SequenceReplayReport> ReplaySequenceMigration(const Trace& trace, const KeelConfig& config,
                                                     const SequenceReplayOptions& options) {
  KEEL_RETURN_IF_ERROR(trace.Validate());
  if (!trace.has_sequences()) {
    return InvalidArgument(
        "--sequence-migration needs a trace that records routing per sequence: an ESFT folder "
        "(one task, or the folder of every task to mix them), or a Keel trace whose steps have "
        "\"sequences\" (docs/traces.md); '" +
        trace.description + "' has none");
  }
  if (options.batch_sequences < 0) {
    return InvalidArgument("--batch-sequences " + std::to_string(options.batch_sequences) +
                           " must be >= 0");
  }
  KEEL_RETURN_IF_ERROR(ValidateConfig(config));
  KEEL_ASSIGN_OR_RETURN(const Topology topology, Topology::Create(config.topology));
  const CostModel cost(topology, config.cost_model);
  const int ranks = topology.num_ranks();
  const int layers = trace.num_layers;
  const int experts = trace.num_experts;
  Result<Placement> static_placement =
      Placement::Contiguous(experts, ranks, config.slots.persistent_per_rank);
  if (!static_placement.ok()) {
    return static_placement.status().WithContext("the config's slots for the trace's " +
                                                 std::to_string(experts) + " experts");
  }
  const Placement& contiguous = *static_placement;
  const std::vector<Placement> fixed(layers, contiguous);

  const std::vector<std::vector<SequenceTraffic>> batches =
      Batches(trace, options.batch_sequences, ranks);
  if (batches.size() < 2) {
    return InvalidArgument("the trace has " + std::to_string(batches.size()) +
                           " step(s) of sequences; the grouped modes fit on the first half and "
                           "measure on the second, so at least 2 are needed (--batch-sequences "
                           "sets the sequences per step)");
  }
  const int held_out = static_cast<int>(batches.size()) / 2;
  std::vector<SequenceTraffic> history;
  for (int step = 0; step < held_out; ++step) {
    history.insert(history.end(), batches[step].begin(), batches[step].end());
  }
  KEEL_ASSIGN_OR_RETURN(const std::vector<Placement> grouped,
                        GroupExpertsBySequences(history, layers, experts, topology,
                                                config.slots.persistent_per_rank));

  SequencePlanOptions plan_options;
  plan_options.max_token_imbalance = options.max_token_imbalance;
  if (options.objective == "traffic") {
    plan_options.objective = SequenceObjective::kLinkTime;
  } else if (options.objective != "step") {
    return InvalidArgument("--sequence-objective '" + options.objective +
                           "' is not step or traffic");
  }
  SequencePlanOptions unmoved_options = plan_options;
  unmoved_options.max_sweeps = 0;

  ModeTotals step_mode("step", "static experts; sequences planned once per step, all layers", cost);
  ModeTotals layer_mode("layer", "static experts; sequences planned before every layer", cost);
  ModeTotals grouped_only("grouped",
                          "experts grouped by co-occurrence (fitted on the first half); no "
                          "sequence moves",
                          cost);
  ModeTotals grouped_step("grouped+step", "grouped experts; sequences planned once per step", cost);
  for (size_t step = 0; step < batches.size(); ++step) {
    const std::vector<SequenceTraffic>& batch = batches[step];
    KEEL_ASSIGN_OR_RETURN(const SequencePlan unmoved,
                          PlanSequences(fixed, batch, cost, unmoved_options));
    KEEL_ASSIGN_OR_RETURN(const SequencePlan per_step,
                          PlanSequences(fixed, batch, cost, plan_options));
    step_mode.AddBefore(unmoved, static_cast<int64_t>(batch.size()));
    step_mode.AddAfter(per_step);

    layer_mode.AddBefore(unmoved, static_cast<int64_t>(batch.size()));
    std::vector<int> rank(batch.size());
    for (size_t s = 0; s < batch.size(); ++s) rank[s] = batch[s].origin_rank;
    for (int l = 0; l < layers; ++l) {
      const std::vector<SequenceTraffic> layer_batch = OneLayer(batch, rank, l, experts);
      KEEL_ASSIGN_OR_RETURN(
          const SequencePlan per_layer,
          PlanSequences(std::span(fixed).subspan(l, 1), layer_batch, cost, plan_options));
      layer_mode.AddAfter(per_layer);
      rank = per_layer.rank;
    }

    if (static_cast<int>(step) >= held_out) {
      KEEL_ASSIGN_OR_RETURN(const SequencePlan grouped_unmoved,
                            PlanSequences(grouped, batch, cost, unmoved_options));
      grouped_only.AddBefore(unmoved, static_cast<int64_t>(batch.size()));
      grouped_only.AddAfter(grouped_unmoved);
      KEEL_ASSIGN_OR_RETURN(const SequencePlan grouped_plan,
                            PlanSequences(grouped, batch, cost, plan_options));
      grouped_step.AddBefore(unmoved, static_cast<int64_t>(batch.size()));
      grouped_step.AddAfter(grouped_plan);
    }
    if (options.progress) {
      options.progress(static_cast<int>(step) + 1, static_cast<int>(batches.size()));
    }
  }

  SequenceReplayReport report;
  report.trace_description = trace.description;
  report.num_steps = static_cast<int>(batches.size());
  report.num_layers = layers;
  report.num_experts = experts;
  report.num_nodes = topology.num_nodes();
  report.gpus_per_node = topology.gpus_per_node();
  int64_t sequences = 0;
  for (const auto& batch : batches) sequences += static_cast<int64_t>(batch.size());
  report.sequences_per_step = static_cast<double>(sequences) / static_cast<double>(batches.size());
  report.objective = options.objective;
  report.modes = {step_mode.Finish(0), layer_mode.Finish(0), grouped_only.Finish(held_out),
                  grouped_step.Finish(held_out)};
  for (int l = 0; l < layers; ++l) {
    report.grouping_migration_bytes += cost.Migration(contiguous, grouped[l]).bytes;
  }
  return report;
}

nlohmann::json SequenceReplayReportToJson(const SequenceReplayReport& report) {
  nlohmann::json json;
  json["trace"] = report.trace_description;
  json["num_steps"] = report.num_steps;
  json["num_layers"] = report.num_layers;
  json["num_experts"] = report.num_experts;
  json["num_nodes"] = report.num_nodes;
  json["gpus_per_node"] = report.gpus_per_node;
  json["sequences_per_step"] = report.sequences_per_step;
  json["objective"] = report.objective;
  json["grouping_migration_bytes"] = report.grouping_migration_bytes;
  nlohmann::json modes = nlohmann::json::object();
  for (const SequenceReplayMode& mode : report.modes) {
    modes[mode.name] = {
        {"description", mode.description},
        {"first_step", mode.first_step},
        {"steps", mode.steps},
        {"plans_used", mode.steps_used},
        {"sequences", mode.sequences},
        {"moves", mode.moves},
        {"moved_bytes", mode.moved_bytes},
        {"cross_node_moved_bytes", mode.cross_node_moved_bytes},
        {"remote_rows_before", mode.remote_rows_before},
        {"remote_rows_after", mode.remote_rows_after},
        {"cross_node_rows_before", mode.cross_node_rows_before},
        {"cross_node_rows_after", mode.cross_node_rows_after},
        {"cross_node_bytes_before", mode.cross_node_bytes_before},
        {"cross_node_bytes_after", mode.cross_node_bytes_after},
        {"sim_step_seconds_before", mode.seconds_before / std::max(1, mode.steps)},
        {"sim_step_seconds_after", mode.seconds_after / std::max(1, mode.steps)},
    };
  }
  json["modes"] = std::move(modes);
  return json;
}

std::string FormatSequenceReplayTable(const SequenceReplayReport& report) {
  auto cut = [](double before, double after) {
    return before > 0 ? 100.0 * (1.0 - after / before) : 0.0;
  };
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line,
                "sequence migration: %d steps of %.1f sequences, %d node(s) x %d GPUs, %d layers x "
                "%d experts; planned for the %s\n",
                report.num_steps, report.sequences_per_step, report.num_nodes, report.gpus_per_node,
                report.num_layers, report.num_experts,
                report.objective == "traffic" ? "traffic" : "step time");
  out += line;
  out +=
      "mode           steps  remote rows  cross-node  cross-node bytes  moves/seq  moved MB  "
      "sim step ms   step\n"
      "                      cut %        rows cut %  cut % (net)                            "
      "before/after  ratio\n";
  out += std::string(110, '-') + "\n";
  for (const SequenceReplayMode& mode : report.modes) {
    const double steps = std::max(1, mode.steps);
    std::snprintf(
        line, sizeof line, "%-14s %5d  %11.2f  %10.2f  %16.2f  %9.2f  %8.1f  %6.3f/%-6.3f  %5.3f\n",
        mode.name.c_str(), mode.steps, cut(mode.remote_rows_before, mode.remote_rows_after),
        cut(mode.cross_node_rows_before, mode.cross_node_rows_after),
        cut(mode.cross_node_bytes_before, mode.cross_node_bytes_after),
        mode.sequences > 0 ? static_cast<double>(mode.moves) / static_cast<double>(mode.sequences)
                           : 0.0,
        mode.moved_bytes / 1e6, 1e3 * mode.seconds_before / steps, 1e3 * mode.seconds_after / steps,
        mode.seconds_before > 0 ? mode.seconds_after / mode.seconds_before : 1.0);
    out += line;
  }
  std::snprintf(line, sizeof line,
                "Before = static experts, no migration, on the same steps. The grouped modes fit "
                "on steps [0, %d) and are measured on the rest; regrouping moves %.1f MB once.\n",
                report.modes.empty() ? 0 : report.modes.back().first_step,
                report.grouping_migration_bytes / 1e6);
  out += line;
  return out;
}

}  // namespace keel::tools
