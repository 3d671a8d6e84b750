// Offline replay of a routing trace under placement policies: the engine behind `keel replay`.
// Every policy sees the same trace, topology and cost model, plans causally from estimated loads
// (or, in oracle mode, from the step's own load), and is scored on balance, moved state and the
// cost model's simulated step time. Metrics are defined in docs/replay.md.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/config.h"
#include "common/file.h"
#include "keel/status.hpp"
#include "monitor/trace.h"
#include "placement/cost_model.h"
#include "placement/placement.h"
#include "placement/routing.h"

namespace keel::tools {

// One replayed (step, layer) as a live exporter sees it (`keel replay --serve-metrics`).
// Pointers and spans are valid only during the callback.
struct ReplayLayerEvent {
  int policy = 0;  // index into ReplayOptions::policies
  int step = 0;    // index of the step in the trace
  int layer = 0;
  bool replanned = false;                   // the policy was asked for a new placement this step
  bool placement_changed = false;           // ... and returned a different one
  double planner_seconds = 0;               // wall time of that Replan call
  MigrationCost migration;                  // to reach the new placement (zero when unchanged)
  const Placement* placement = nullptr;     // in force for this step
  const StepRouting* routing = nullptr;     // how this step's tokens were split
  LayerCost cost;                           // the cost model's step time of this layer
  std::span<const double> expert_tokens;    // [num_experts] this step's tokens per expert
  std::span<const double> expert_estimate;  // [num_experts] estimate for the next step
  // [num_ranks] rank loads of that estimate, routed by the policy on this placement.
  std::span<const double> estimated_rank_tokens;
  int max_copies_per_expert = 1;  // r_max of the lower bound
};

struct ReplayOptions {
  // Policies to replay, by name (see keel::PolicyNames()); empty means all of them.
  std::vector<std::string> policies;
  // Plan for step t from step t's own load (an upper bound) instead of the estimate from steps
  // before t.
  bool oracle = false;
  // Called from worker threads whenever every layer of a policy finished one more step: (index
  // into `policies`, steps done, total steps); one call at a time per policy. May be empty.
  std::function<void(int policy, int steps_done, int total_steps)> progress;
  // Threads the replay runs on: policies, and the layers of each, in parallel (TBB); 0 = TBB's
  // default, one per hardware thread. With on_layer_step or on_step_end a policy's layers run
  // in step order on one thread.
  int max_threads = 0;
  // Layer whose per-expert load the heatmap series shows; -1 = summed over all layers.
  int heatmap_layer = -1;
  // Called on the policy's worker thread after each (step, layer) is routed. May be empty.
  std::function<void(const ReplayLayerEvent& event)> on_layer_step;
  // Called on the policy's worker thread after each step; returning false stops the replay,
  // and ReplayTrace then fails with StatusCode::kAborted. May be empty.
  std::function<bool(int policy, int step)> on_step_end;
};

// Summary statistics of one metric. Percentiles interpolate linearly between order statistics
// (numpy's default), so p50 <= p90 <= p99 <= max always holds.
struct Distribution {
  int count = 0;
  double mean = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};
Distribution Summarize(std::vector<double> values);

// One policy's results. Everything except the two wall-clock fields is deterministic.
struct PolicyReplay {
  std::string name;
  Distribution imbalance;  // max/mean rank load over every (step, layer), after routing
  double lb_gap = 0;       // mean over (step, layer) of max rank load / lower bound
  long layer_replans = 0;  // Replan calls (one per layer per replan step)
  long moved_slots_total = 0;
  double moved_slots_per_replan = 0;  // moved_slots_total / layer_replans
  long moved_homes_total = 0;
  double moved_bytes_total = 0;
  double transient_replicas_per_layer_step = 0;  // mean transient replicas per (step, layer)
  Distribution sim_step_seconds;                 // per step: sum over layers of the cost model
  double sim_total_seconds = 0;
  Distribution planner_seconds_per_layer;  // wall time of each Replan call (not deterministic)
  double wall_seconds = 0;                 // this policy's whole replay (not deterministic)
  // Per-step series for plots: [num_steps] mean imbalance over layers, and simulated seconds.
  std::vector<double> step_imbalance;
  std::vector<double> step_seconds;
};

struct ReplayReport {
  // The trace's shape.
  std::string trace_description;
  int num_steps = 0;
  int num_layers = 0;
  int num_experts = 0;
  int num_sources = 0;
  KeelConfig config;  // as replayed (topology, slots, cost model, estimator, policy parameters)
  bool oracle = false;
  std::vector<PolicyReplay> policies;  // in the order of ReplayOptions::policies
  // [num_steps * num_experts] share of the layer's tokens per expert (of heatmap_layer, or of all
  // layers together when heatmap_layer is -1), step-major.
  int heatmap_layer = -1;
  std::vector<double> expert_share;
  double wall_seconds = 0;
};

// Replays `trace` under every policy in `options`, every layer with a Policy and estimators of its
// own, policies and layers in parallel; results are summed in step order, so they do not depend
// on threading. Fails on an invalid trace, a
// config the trace does not fit (e.g. fewer slots than experts), an unknown policy name, or a
// policy error (naming the policy, step and layer), or kAborted when on_step_end stopped it.
Result<ReplayReport> ReplayTrace(const Trace& trace, const KeelConfig& config,
                                 const ReplayOptions& options);

// The traffic of one (step, layer) of `trace` as `num_ranks` ranks see it, as every replay reads
// a trace: the recorded traffic matrix when the trace has as many sources, else each expert's
// total spread evenly over the ranks.
Result<StepLoad> TraceStepLoad(const Trace& trace, int num_ranks, int step, int layer);

// Without a config the topology follows the trace: one rank per recorded source (nodes of 8
// GPUs when the count allows), and at least one spare persistent slot per rank beyond what the
// experts need, so that replicating policies have room to act.
KeelConfig ConfigFittingTrace(const Trace& trace);

// The report as JSON: trace shape, config summary, mode, "policies": {name: metrics}, and
// "wall_seconds". `include_series` adds each policy's per-step series (compact: 4 significant
// digits); the per-expert heatmap series is never included, it only feeds the plot.
nlohmann::json ReplayReportToJson(const ReplayReport& report, bool include_series = true);

}  // namespace keel::tools
