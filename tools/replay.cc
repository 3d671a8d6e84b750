// Trace replay: one worker thread per policy walks the trace step by step, replans every layer
// from its load estimator (or the step's own load in oracle mode), routes the step, and prices
// it with the cost model. Workers share only read-only inputs, so results never depend on
// scheduling.
#include "tools/replay.h"

#include "keel/replay.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <numeric>
#include <set>
#include <thread>

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

  // The traffic of one (step, layer) as the topology's ranks see it: the trace's traffic matrix
  // when it was recorded on as many ranks, else expert totals spread evenly over the ranks.
  Result<StepLoad> Load(int step, int layer) const {
    if (trace->num_sources == num_ranks) {
      std::span<const double> row = trace->layer_row(step, layer);
      return StepLoad::FromTraffic(num_ranks, num_experts,
                                   std::vector<double>(row.begin(), row.end()));
    }
    return StepLoad::FromExpertCounts(num_ranks, totals(step, layer));
  }
};

std::string Where(const std::string& policy, int step, int layer) {
  return "policy " + policy + ", step " + std::to_string(step) + ", layer " +
         std::to_string(layer) + ": ";
}

Result<PolicyReplay> ReplayPolicy(const ReplayInputs& in, const std::string& name,
                                  const std::function<void(int, int)>& progress,
                                  const ReplayOptions& options, int policy_index) {
  const auto start = Clock::now();
  const KeelConfig& config = *in.config;
  const int num_ranks = in.num_ranks;
  const int num_experts = in.num_experts;

  PolicyContext context = *in.context;
  context.config.name = name;
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, MakePolicy(name, context));
  const CostModel& cost = context.cost;

  std::vector<Placement> placements;
  std::vector<LoadEstimator> expert_estimators;
  std::vector<LoadEstimator> traffic_estimators;
  placements.reserve(in.num_layers);
  for (int layer = 0; layer < in.num_layers; ++layer) {
    Result<Placement> initial = policy->Initial(layer);
    if (!initial.ok()) return initial.status().WithContext(Where(name, 0, layer) + "Initial");
    placements.push_back(std::move(initial).value());
    expert_estimators.emplace_back(config.estimator, num_experts);
    traffic_estimators.emplace_back(config.estimator, num_ranks * num_experts);
  }

  // The largest number of ranks an expert can span, and so the lower bound's divisor.
  const int total_slots = num_ranks * config.slots.persistent_per_rank;
  const int r_max = std::max(1, std::min(num_ranks, total_slots - num_experts + 1));
  const int interval = std::max(1, config.policy.replan_interval_steps);

  PolicyReplay result;
  result.name = name;
  std::vector<double> imbalances;
  imbalances.reserve(static_cast<size_t>(in.num_steps) * in.num_layers);
  std::vector<double> planner_seconds;
  double lb_gap_sum = 0;
  long transient_count = 0;
  result.step_imbalance.reserve(in.num_steps);
  result.step_seconds.reserve(in.num_steps);

  for (int step = 0; step < in.num_steps; ++step) {
    const bool replan = step % interval == 0 && (in.oracle || step >= 1);
    double step_seconds = 0;
    double step_imbalance_sum = 0;
    for (int layer = 0; layer < in.num_layers; ++layer) {
      ReplayLayerEvent event;
      Result<StepLoad> load = in.Load(step, layer);
      if (!load.ok()) return load.status().WithContext(Where(name, step, layer));
      const std::span<const double> totals = in.totals(step, layer);

      double migration_seconds = 0;
      if (replan) {
        Placement& current = placements[layer];
        LayerView view;
        view.layer = layer;
        view.current = &current;
        StepLoad estimated_traffic;
        if (in.oracle) {
          view.expert_load = totals;
          view.traffic = &*load;
        } else {
          view.expert_load = expert_estimators[layer].Estimate();
          estimated_traffic.num_sources = num_ranks;
          estimated_traffic.num_experts = num_experts;
          estimated_traffic.traffic = traffic_estimators[layer].Estimate();
          view.traffic = &estimated_traffic;
        }
        const auto plan_start = Clock::now();
        Result<Placement> next = policy->Replan(view);
        planner_seconds.push_back(Seconds(plan_start));
        event.replanned = true;
        event.planner_seconds = planner_seconds.back();
        if (!next.ok()) return next.status().WithContext(Where(name, step, layer) + "Replan");
        if (next->num_slots() != current.num_slots() ||
            next->num_experts() != current.num_experts()) {
          return Internal(Where(name, step, layer) + "Replan returned " +
                          std::to_string(next->num_slots()) + " slots for " +
                          std::to_string(next->num_experts()) + " experts, expected " +
                          std::to_string(current.num_slots()) + " for " +
                          std::to_string(current.num_experts()));
        }
        const MigrationCost migration = cost.Migration(current, *next);
        ++result.layer_replans;
        result.moved_slots_total += migration.changed_slots;
        result.moved_homes_total += migration.moved_homes;
        result.moved_bytes_total += migration.bytes;
        migration_seconds = migration.seconds;
        event.placement_changed = !(*next == current);
        event.migration = migration;
        current = std::move(next).value();
      }

      Result<StepRouting> routing = policy->Route(layer, placements[layer], *load);
      if (!routing.ok()) return routing.status().WithContext(Where(name, step, layer) + "Route");
      const LayerCost layer_cost = cost.Estimate(placements[layer], *routing, migration_seconds);
      step_seconds += layer_cost.total_seconds();
      const double imbalance = routing->imbalance();
      imbalances.push_back(imbalance);
      step_imbalance_sum += imbalance;
      transient_count += static_cast<long>(routing->transients.size());

      const double lower_bound = LoadLowerBound(totals, num_ranks, r_max);
      lb_gap_sum += lower_bound > 0 ? routing->max_rank_tokens() / lower_bound : 1.0;

      // Causal: what step t routed informs the plan for step t + 1.
      expert_estimators[layer].Observe(totals);
      traffic_estimators[layer].Observe(load->traffic);

      if (options.on_layer_step) {
        event.policy = policy_index;
        event.step = step;
        event.layer = layer;
        event.placement = &placements[layer];
        event.routing = &*routing;
        event.cost = layer_cost;
        event.expert_tokens = totals;
        event.expert_estimate = expert_estimators[layer].Estimate();
        // Only live export needs it, so the plain replay does not pay for a second Route.
        StepLoad estimated;
        estimated.num_sources = num_ranks;
        estimated.num_experts = num_experts;
        estimated.traffic = traffic_estimators[layer].Estimate();
        Result<StepRouting> estimated_routing = policy->Route(layer, placements[layer], estimated);
        if (estimated_routing.ok()) event.estimated_rank_tokens = estimated_routing->rank_tokens;
        event.max_copies_per_expert = r_max;
        options.on_layer_step(event);
      }
    }
    if (options.on_step_end && !options.on_step_end(policy_index, step)) {
      return Status(StatusCode::kAborted,
                    "policy " + name + ": replay stopped after step " + std::to_string(step));
    }
    result.step_seconds.push_back(step_seconds);
    result.step_imbalance.push_back(step_imbalance_sum / in.num_layers);
    if (progress) progress(step + 1, in.num_steps);
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

  // Workers pull policies from a shared counter; each writes only its own result slot.
  std::vector<std::unique_ptr<Result<PolicyReplay>>> results(names.size());
  std::atomic<size_t> next{0};
  auto worker = [&]() {
    for (size_t i = next++; i < names.size(); i = next++) {
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
    }
  };
  size_t threads = options.max_threads > 0 ? static_cast<size_t>(options.max_threads)
                                           : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, names.size());
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();

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
        {"keel",
         {{"transient_replicas", c.policy.keel.transient_replicas},
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
