// Trace replay: every policy, and within it every layer, walks the trace step by step in parallel
// (TBB), replans the layer from its load estimator (or the step's own load in oracle mode),
// routes the step, and prices it with the cost model. Tasks share only read-only inputs and
// their results are summed in step order afterwards, so results never depend on scheduling.
#include "tools/replay.h"

#include "keel/replay.hpp"

#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>

#include "common/parallel.h"
#include "placement/cost_model.h"
#include "placement/load.h"
#include "placement/policy.h"
#include "placement/topology.h"

namespace keel::tools {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Linear interpolation between order statistics of a sorted, non-empty vector.
double Percentile(const std::vector<double>& sorted, double q) {
  const double position = q * static_cast<double>(sorted.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = position - static_cast<double>(below);
  // Clamped so that rounding never breaks p50 <= p90 <= p99 <= max.
  return std::min(sorted[above], sorted[below] + (sorted[above] - sorted[below]) * fraction);
}

// Inputs shared read-only by every policy's worker.
struct ReplayInputs {
  const Trace* trace = nullptr;
  const KeelConfig* config = nullptr;
  const PolicyContext* context = nullptr;  // topology, cost model and slots of every policy
  int num_ranks = 0;
  int num_steps = 0;
  int num_layers = 0;
  int num_experts = 0;
  // [num_steps][num_layers][num_experts] tokens per expert.
  std::vector<double> expert_totals;
  bool oracle = false;

  std::span<const double> totals(int step, int layer) const {
    return {expert_totals.data() +
                (static_cast<size_t>(step) * num_layers + layer) * static_cast<size_t>(num_experts),
            static_cast<size_t>(num_experts)};
  }

  Result<StepLoad> Load(int step, int layer) const {
    return TraceStepLoad(*trace, num_ranks, step, layer);
  }
};

std::string Where(const std::string& policy, int step, int layer) {
  return "policy " + policy + ", step " + std::to_string(step) + ", layer " +
         std::to_string(layer) + ": ";
}

// One layer of one policy as the replay walks it: a Policy of its own (policies keep no state
// across layers, so a policy per layer gives the routing of one shared policy, and lets layers
// replay in parallel), the placement in force, and the load estimators.
struct LayerState {
  std::unique_ptr<Policy> policy;
  std::optional<Placement> placement;
  std::optional<LoadEstimator> expert_estimator;
  std::optional<LoadEstimator> traffic_estimator;
};

// What one (step, layer) adds to its policy's results.
struct LayerStepOutcome {
  double seconds = 0;    // the cost model's step time of the layer
  double imbalance = 0;  // after routing
  double lb_gap = 0;     // max rank load / lower bound
  long transients = 0;
  bool replanned = false;
  MigrationCost migration;
  double planner_seconds = 0;
};

// Fixed for one policy's replay.
struct PolicyRun {
  const ReplayInputs* in = nullptr;
  const std::string* name = nullptr;
  const CostModel* cost = nullptr;
  const ReplayOptions* options = nullptr;
  int policy_index = 0;
  int r_max = 1;  // the largest number of ranks an expert can span: the lower bound's divisor
  int interval = 1;
};

// Replans (on replan steps), routes and prices layer `layer` at `step`, and feeds the estimators;
// reports the layer step to options.on_layer_step when it is set.
Result<LayerStepOutcome> StepLayer(const PolicyRun& run, LayerState& state, int step, int layer) {
  const ReplayInputs& in = *run.in;
  const std::string& name = *run.name;
  const bool replan = step % run.interval == 0 && (in.oracle || step >= 1);
  LayerStepOutcome outcome;
  ReplayLayerEvent event;
  Result<StepLoad> loaded = in.Load(step, layer);
  if (!loaded.ok()) return loaded.status().WithContext(Where(name, step, layer));
  StepLoad& load = *loaded;
  const std::span<const double> totals = in.totals(step, layer);
  Placement& current = *state.placement;
  double migration_seconds = 0;
  if (replan) {
    LayerView view;
    view.layer = layer;
    view.current = &current;
    StepLoad estimated_traffic;
    if (in.oracle) {
      view.expert_load = totals;
      view.traffic = &load;
    } else {
      view.expert_load = state.expert_estimator->Estimate();
      estimated_traffic.num_sources = in.num_ranks;
      estimated_traffic.num_experts = in.num_experts;
      estimated_traffic.traffic = state.traffic_estimator->Estimate();
      view.traffic = &estimated_traffic;
    }
    const auto plan_start = Clock::now();
    Result<Placement> next = state.policy->Replan(view);
    outcome.planner_seconds = Seconds(plan_start);
    outcome.replanned = true;
    if (!next.ok()) return next.status().WithContext(Where(name, step, layer) + "Replan");
    if (next->num_slots() != current.num_slots() || next->num_experts() != current.num_experts()) {
      return Internal(
          Where(name, step, layer) + "Replan returned " + std::to_string(next->num_slots()) +
          " slots for " + std::to_string(next->num_experts()) + " experts, expected " +
          std::to_string(current.num_slots()) + " for " + std::to_string(current.num_experts()));
    }
    outcome.migration = run.cost->Migration(current, *next);
    migration_seconds = outcome.migration.seconds;
    event.placement_changed = !(*next == current);
    current = std::move(next).value();
  }

  Result<StepRouting> routing = state.policy->Route(layer, current, load);
  if (!routing.ok()) return routing.status().WithContext(Where(name, step, layer) + "Route");
  const LayerCost layer_cost = run.cost->Estimate(current, *routing, migration_seconds);
  if (Status finite = run.cost->CheckFinite(layer_cost, replan ? &outcome.migration : nullptr);
      !finite.ok()) {
    return InvalidArgument(Where(name, step, layer) + finite.message());
  }
  outcome.seconds = layer_cost.total_seconds();
  outcome.imbalance = routing->imbalance();
  outcome.transients = static_cast<long>(routing->transients.size());
  const double lower_bound = LoadLowerBound(totals, in.num_ranks, run.r_max);
  outcome.lb_gap = lower_bound > 0 ? routing->max_rank_tokens() / lower_bound : 1.0;

  // Causal: what step t routed informs the plan for step t + 1.
  state.expert_estimator->Observe(totals);
  state.traffic_estimator->Observe(load.traffic);

  if (run.options->on_layer_step) {
    event.policy = run.policy_index;
    event.step = step;
    event.layer = layer;
    event.replanned = outcome.replanned;
    event.planner_seconds = outcome.planner_seconds;
    event.migration = outcome.migration;
    event.placement = &current;
    event.routing = &*routing;
    event.cost = layer_cost;
    event.expert_tokens = totals;
    const std::vector<double> expert_estimate = state.expert_estimator->Estimate();
    event.expert_estimate = expert_estimate;
    // Only live export needs it, so the plain replay does not pay for a second Route.
    StepLoad estimated;
    estimated.num_sources = in.num_ranks;
    estimated.num_experts = in.num_experts;
    estimated.traffic = state.traffic_estimator->Estimate();
    Result<StepRouting> estimated_routing = state.policy->Route(layer, current, estimated);
    if (estimated_routing.ok()) event.estimated_rank_tokens = estimated_routing->rank_tokens;
    event.max_copies_per_expert = run.r_max;
    run.options->on_layer_step(event);
  }
  return outcome;
}

Result<PolicyReplay> ReplayPolicy(const ReplayInputs& in, const std::string& name,
                                  const std::function<void(int, int)>& progress,
                                  const ReplayOptions& options, int policy_index) {
  const auto start = Clock::now();
  const KeelConfig& config = *in.config;
  const int num_layers = in.num_layers;
  const int num_steps = in.num_steps;

  PolicyContext context = *in.context;
  context.config.name = name;
  std::vector<LayerState> layers(num_layers);
  for (int layer = 0; layer < num_layers; ++layer) {
    LayerState& state = layers[layer];
    KEEL_ASSIGN_OR_RETURN(state.policy, MakePolicy(name, context));
    Result<Placement> initial = state.policy->Initial(layer);
    if (!initial.ok()) return initial.status().WithContext(Where(name, 0, layer) + "Initial");
    state.placement = std::move(initial).value();
    state.expert_estimator.emplace(config.estimator, in.num_experts);
    state.traffic_estimator.emplace(config.estimator, in.num_ranks * in.num_experts);
  }

  PolicyRun run;
  run.in = &in;
  run.name = &name;
  run.cost = &context.cost;
  run.options = &options;
  run.policy_index = policy_index;
  const int total_slots = in.num_ranks * config.slots.persistent_per_rank;
  run.r_max = std::max(1, std::min(in.num_ranks, total_slots - in.num_experts + 1));
  run.interval = std::max(1, config.policy.replan_interval_steps);

  // [step * num_layers + layer]
  std::vector<LayerStepOutcome> outcomes(static_cast<size_t>(num_steps) * num_layers);
  if (options.on_layer_step || options.on_step_end) {
    // Live export and pacing see the steps in order, every layer of a step before the next.
    for (int step = 0; step < num_steps; ++step) {
      for (int layer = 0; layer < num_layers; ++layer) {
        KEEL_ASSIGN_OR_RETURN(outcomes[static_cast<size_t>(step) * num_layers + layer],
                              StepLayer(run, layers[layer], step, layer));
      }
      if (options.on_step_end && !options.on_step_end(policy_index, step)) {
        return Status(StatusCode::kAborted,
                      "policy " + name + ": replay stopped after step " + std::to_string(step));
      }
      if (progress) progress(step + 1, num_steps);
    }
  } else {
    // Layers are independent: each walks every step on its own, in parallel. Progress counts
    // the steps every layer has finished.
    std::vector<Status> failed(num_layers);
    std::atomic<long> layer_steps_done{0};
    std::mutex progress_mutex;
    ParallelFor(0, num_layers, [&](int layer) {
      for (int step = 0; step < num_steps; ++step) {
        Result<LayerStepOutcome> outcome = StepLayer(run, layers[layer], step, layer);
        if (!outcome.ok()) {
          failed[layer] = outcome.status();
          return;
        }
        outcomes[static_cast<size_t>(step) * num_layers + layer] = *outcome;
        const long done = ++layer_steps_done;
        if (progress && done % num_layers == 0) {
          std::lock_guard<std::mutex> lock(progress_mutex);
          progress(static_cast<int>(done / num_layers), num_steps);
        }
      }
    });
    for (const Status& status : failed) KEEL_RETURN_IF_ERROR(status);
  }

  // The results, summed in step-major order as the steps happened.
  PolicyReplay result;
  result.name = name;
  std::vector<double> imbalances;
  imbalances.reserve(outcomes.size());
  std::vector<double> planner_seconds;
  double lb_gap_sum = 0;
  long transient_count = 0;
  result.step_imbalance.reserve(num_steps);
  result.step_seconds.reserve(num_steps);
  for (int step = 0; step < num_steps; ++step) {
    double step_seconds = 0;
    double step_imbalance_sum = 0;
    for (int layer = 0; layer < num_layers; ++layer) {
      const LayerStepOutcome& o = outcomes[static_cast<size_t>(step) * num_layers + layer];
      if (o.replanned) {
        planner_seconds.push_back(o.planner_seconds);
        ++result.layer_replans;
        result.moved_slots_total += o.migration.changed_slots;
        result.moved_homes_total += o.migration.moved_homes;
        result.moved_bytes_total += o.migration.bytes;
      }
      step_seconds += o.seconds;
      imbalances.push_back(o.imbalance);
      step_imbalance_sum += o.imbalance;
      transient_count += o.transients;
      lb_gap_sum += o.lb_gap;
    }
    result.step_seconds.push_back(step_seconds);
    result.step_imbalance.push_back(step_imbalance_sum / num_layers);
  }

  const double layer_steps = static_cast<double>(imbalances.size());
  result.imbalance = Summarize(std::move(imbalances));
  result.lb_gap = lb_gap_sum / layer_steps;
  result.moved_slots_per_replan =
      result.layer_replans > 0
          ? static_cast<double>(result.moved_slots_total) / result.layer_replans
          : 0.0;
  result.transient_replicas_per_layer_step = static_cast<double>(transient_count) / layer_steps;
  result.sim_total_seconds =
      std::accumulate(result.step_seconds.begin(), result.step_seconds.end(), 0.0);
  result.sim_step_seconds = Summarize(result.step_seconds);
  result.planner_seconds_per_layer = Summarize(std::move(planner_seconds));
  result.wall_seconds = Seconds(start);
  return result;
}

// Trace::Validate checks shapes and counts; a replay also needs at least one step.
Status CheckTrace(const Trace& trace) {
  KEEL_RETURN_IF_ERROR(trace.Validate());
  if (trace.num_steps() < 1) return InvalidArgument("trace has no steps");
  return Status::Ok();
}

nlohmann::json DistributionToJson(const Distribution& d) {
  return {{"mean", d.mean}, {"p50", d.p50}, {"p90", d.p90},
          {"p99", d.p99},   {"max", d.max}, {"count", d.count}};
}

// Rounds to 4 significant digits so long series stay compact in JSON.
std::vector<double> Compact(const std::vector<double>& values) {
  std::vector<double> out;
  out.reserve(values.size());
  char buffer[32];
  for (double v : values) {
    std::snprintf(buffer, sizeof(buffer), "%.4g", v);
    out.push_back(std::strtod(buffer, nullptr));
  }
  return out;
}

}  // namespace

Result<StepLoad> TraceStepLoad(const Trace& trace, int num_ranks, int step, int layer) {
  const std::span<const double> row = trace.layer_row(step, layer);
  if (trace.num_sources == num_ranks) {
    return StepLoad::FromTraffic(num_ranks, trace.num_experts,
                                 std::vector<double>(row.begin(), row.end()));
  }
  std::vector<double> totals(trace.num_experts, 0.0);
  for (int s = 0; s < std::max(1, trace.num_sources); ++s) {
    for (int e = 0; e < trace.num_experts; ++e) totals[e] += row[s * trace.num_experts + e];
  }
  return StepLoad::FromExpertCounts(num_ranks, totals);
}

Distribution Summarize(std::vector<double> values) {
  Distribution d;
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  d.count = static_cast<int>(values.size());
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / values.size();
  d.p50 = Percentile(values, 0.50);
  d.p90 = Percentile(values, 0.90);
  d.p99 = Percentile(values, 0.99);
  d.max = values.back();
  return d;
}

Result<ReplayReport> ReplayTrace(const Trace& trace, const KeelConfig& config,
                                 const ReplayOptions& options) {
  const auto start = Clock::now();
  KEEL_RETURN_IF_ERROR(CheckTrace(trace));
  // Validates topology and slots against the trace once, before any policy thread starts.
  KEEL_ASSIGN_OR_RETURN(const PolicyContext context,
                        PolicyContext::FromConfig(config, trace.num_layers, trace.num_experts));
  const int num_ranks = context.topology.num_ranks();
  // Each policy estimates every layer's traffic matrix, [ranks x experts], from the steps before.
  KEEL_RETURN_IF_ERROR(CheckEstimatorCounts(config.estimator, trace.num_layers, num_ranks,
                                            trace.num_experts, trace.num_steps()));
  if (options.max_threads < 0 || options.max_threads > kMaxThreads) {
    return InvalidArgument("threads " + std::to_string(options.max_threads) + " is not in [0, " +
                           std::to_string(kMaxThreads) + "] (0: one per hardware thread)");
  }
  if (options.heatmap_layer < -1 || options.heatmap_layer >= trace.num_layers) {
    return InvalidArgument("heatmap layer " + std::to_string(options.heatmap_layer) +
                           " is not -1 or a layer of the trace (0.." +
                           std::to_string(trace.num_layers - 1) + ")");
  }

  std::vector<std::string> names = options.policies;
  if (names.empty()) names = PolicyNames();
  std::set<std::string> seen;
  for (const std::string& name : names) {
    KEEL_RETURN_IF_ERROR(CheckPolicyName(name));
    if (!seen.insert(name).second) return InvalidArgument("policy '" + name + "' listed twice");
  }

  ReplayInputs inputs;
  inputs.trace = &trace;
  inputs.config = &config;
  inputs.context = &context;
  inputs.num_ranks = num_ranks;
  inputs.num_steps = trace.num_steps();
  inputs.num_layers = trace.num_layers;
  inputs.num_experts = trace.num_experts;
  inputs.oracle = options.oracle;
  const size_t experts = static_cast<size_t>(trace.num_experts);
  inputs.expert_totals.assign(static_cast<size_t>(inputs.num_steps) * trace.num_layers * experts,
                              0.0);
  const int sources = std::max(1, trace.num_sources);
  for (int step = 0; step < inputs.num_steps; ++step) {
    for (int layer = 0; layer < trace.num_layers; ++layer) {
      std::span<const double> row = trace.layer_row(step, layer);
      double* totals = inputs.expert_totals.data() +
                       (static_cast<size_t>(step) * trace.num_layers + layer) * experts;
      for (int s = 0; s < sources; ++s) {
        for (size_t e = 0; e < experts; ++e) totals[e] += row[s * experts + e];
      }
    }
  }

  ReplayReport report;
  report.trace_description = trace.description;
  report.num_steps = inputs.num_steps;
  report.num_layers = trace.num_layers;
  report.num_experts = trace.num_experts;
  report.num_sources = trace.num_sources;
  report.config = config;
  report.oracle = options.oracle;
  report.heatmap_layer = options.heatmap_layer;
  report.expert_share.assign(static_cast<size_t>(inputs.num_steps) * experts, 0.0);
  for (int step = 0; step < inputs.num_steps; ++step) {
    double* share = report.expert_share.data() + static_cast<size_t>(step) * experts;
    for (int layer = 0; layer < trace.num_layers; ++layer) {
      if (options.heatmap_layer >= 0 && layer != options.heatmap_layer) continue;
      std::span<const double> totals = inputs.totals(step, layer);
      for (size_t e = 0; e < experts; ++e) share[e] += totals[e];
    }
    const double sum = std::accumulate(share, share + experts, 0.0);
    if (sum > 0) {
      for (size_t e = 0; e < experts; ++e) share[e] /= sum;
    }
  }

  // Policies (and, inside each, layers) in parallel on at most max_threads threads; each task
  // writes only its own result slot.
  std::vector<std::unique_ptr<Result<PolicyReplay>>> results(names.size());
  const int threads =
      options.max_threads > 0 ? options.max_threads : tbb::this_task_arena::max_concurrency();
  tbb::task_arena arena(threads);
  arena.execute([&] {
    ParallelFor(size_t{0}, names.size(), [&](size_t i) {
      auto progress = [&options, i](int done, int total) {
        if (options.progress) options.progress(static_cast<int>(i), done, total);
      };
      try {
        results[i] = std::make_unique<Result<PolicyReplay>>(
            ReplayPolicy(inputs, names[i], progress, options, static_cast<int>(i)));
      } catch (const std::exception& e) {
        results[i] = std::make_unique<Result<PolicyReplay>>(
            Internal("policy " + names[i] + " threw: " + e.what()));
      }
    });
  });

  for (auto& result : results) {
    if (!result->ok()) return result->status();
    report.policies.push_back(std::move(*result).value());
  }
  report.wall_seconds = Seconds(start);
  return report;
}

nlohmann::json ReplayReportToJson(const ReplayReport& report, bool include_series) {
  const KeelConfig& c = report.config;
  nlohmann::json json;
  json["trace"] = {{"description", report.trace_description},
                   {"steps", report.num_steps},
                   {"layers", report.num_layers},
                   {"experts", report.num_experts},
                   {"sources", report.num_sources}};
  json["config"] = {
      {"num_nodes", c.topology.num_nodes},
      {"gpus_per_node", c.topology.gpus_per_node},
      {"num_ranks", c.num_ranks()},
      {"intra_node_gb_per_s", c.topology.intra_node_gb_per_s},
      {"inter_node_gb_per_s", c.topology.inter_node_gb_per_s},
      {"persistent_slots_per_rank", c.slots.persistent_per_rank},
      {"transient_slots_per_rank", c.slots.transient_per_rank},
      {"estimator",
       {{"kind", std::string(EstimatorKindName(c.estimator.kind))},
        {"ema_decay", c.estimator.ema_decay},
        {"window_steps", c.estimator.window_steps}}},
      {"cost_model",
       {{"expert_tflops", c.cost_model.expert_tflops},
        {"hidden_size", c.cost_model.hidden_size},
        {"expert_ffn_size", c.cost_model.expert_ffn_size},
        {"expert_matrices", c.cost_model.expert_matrices},
        {"dtype_bytes", c.cost_model.dtype_bytes},
        {"home_move_bytes_per_parameter", c.cost_model.home_move_bytes_per_parameter},
        {"train_flops_multiplier", c.cost_model.train_flops_multiplier},
        {"all_to_all_passes", c.cost_model.all_to_all_passes},
        {"replica_sync_passes", c.cost_model.replica_sync_passes}}},
      {"policy",
       {{"replan_interval_steps", c.policy.replan_interval_steps},
        {"eplb", {{"num_groups", c.policy.eplb.num_groups}}},
        {"flexmoe",
         {{"balance_ratio_trigger", c.policy.flexmoe.balance_ratio_trigger},
          {"max_actions_per_replan", c.policy.flexmoe.max_actions_per_replan}}},
        {"smartmoe",
         {{"candidate_pool_size", c.policy.smartmoe.candidate_pool_size},
          {"stickiness", c.policy.smartmoe.stickiness}}},
        {"fastermoe", {{"max_shadowed_experts", c.policy.fastermoe.max_shadowed_experts}}},
        {"lplb", {{"solver", c.policy.lplb.solver}}},
        {"trtllm", {{"layer_updates_per_iter", c.policy.trtllm.layer_updates_per_iter}}},
        {"keel",
         {{"transient_replicas", c.policy.keel.transient_replicas},
          {"spare_slots", c.policy.keel.spare_slots},
          {"max_moves_per_replan", c.policy.keel.max_moves_per_replan},
          {"home_payback_horizon_steps", c.policy.keel.home_payback_horizon_steps},
          {"min_gain_fraction", c.policy.keel.min_gain_fraction}}}}}};
  json["mode"] = report.oracle ? "oracle" : "causal";
  nlohmann::json order = nlohmann::json::array();
  nlohmann::json policies = nlohmann::json::object();
  for (const PolicyReplay& p : report.policies) {
    order.push_back(p.name);
    const Distribution& sim = p.sim_step_seconds;
    const Distribution& planner = p.planner_seconds_per_layer;
    nlohmann::json entry = {
        {"imbalance", DistributionToJson(p.imbalance)},
        {"lb_gap", p.lb_gap},
        {"layer_replans", p.layer_replans},
        {"moved_slots_per_replan", p.moved_slots_per_replan},
        {"moved_slots_total", p.moved_slots_total},
        {"moved_homes_total", p.moved_homes_total},
        {"moved_bytes_total", p.moved_bytes_total},
        {"transient_replicas_per_layer_step", p.transient_replicas_per_layer_step},
        {"sim_step_seconds",
         {{"mean", sim.mean}, {"p50", sim.p50}, {"p99", sim.p99}, {"max", sim.max}}},
        {"sim_total_seconds", p.sim_total_seconds},
        {"planner_seconds_per_layer",
         {{"median", planner.p50},
          {"mean", planner.mean},
          {"p99", planner.p99},
          {"max", planner.max},
          {"count", planner.count}}},
        {"wall_seconds", p.wall_seconds}};
    if (include_series) {
      entry["series"] = {{"step_imbalance", Compact(p.step_imbalance)},
                         {"step_seconds", Compact(p.step_seconds)}};
    }
    policies[p.name] = std::move(entry);
  }
  json["policy_order"] = std::move(order);
  json["policies"] = std::move(policies);
  json["wall_seconds"] = report.wall_seconds;
  return json;
}

KeelConfig ConfigFittingTrace(const Trace& trace) {
  KeelConfig config;
  if (trace.num_sources > 0) {
    const int ranks = trace.num_sources;
    const bool whole_nodes = ranks > 8 && ranks % 8 == 0;
    config.topology.num_nodes = whole_nodes ? ranks / 8 : 1;
    config.topology.gpus_per_node = whole_nodes ? 8 : ranks;
  }
  const int ranks = config.num_ranks();
  const int needed = (trace.num_experts + ranks - 1) / ranks + 1;
  config.slots.persistent_per_rank = std::max(config.slots.persistent_per_rank, needed);
  return config;
}

}  // namespace keel::tools

namespace keel {

Result<std::string> ReplayToJson(const ReplayRequest& request) {
  if (request.trace == nullptr) return InvalidArgument("trace is null");
  KEEL_RETURN_IF_ERROR(request.trace->Validate());
  const KeelConfig config = request.config != nullptr ? TypedConfig(*request.config)
                                                      : tools::ConfigFittingTrace(*request.trace);
  tools::ReplayOptions options;
  options.policies = request.policies;
  options.oracle = request.oracle;
  KEEL_ASSIGN_OR_RETURN(tools::ReplayReport report,
                        tools::ReplayTrace(*request.trace, config, options));
  return tools::ReplayReportToJson(report, request.include_series).dump(2) + "\n";
}

}  // namespace keel
