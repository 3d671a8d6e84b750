// Strategy replay: the policy replay gives ep's step and placement per (step, layer); each layer
// then walks the trace pricing esp, parm and ppmoe on the step's traffic, and lets `auto` choose
// among its pool from each member's estimated step. Layers run in parallel and results are
// summed in step order, so they do not depend on threading.
#include "tools/strategy_replay.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <mutex>

#include "common/number_text.h"
#include "common/parallel.h"
#include "placement/load.h"
#include "placement/topology.h"

namespace keel::tools {
namespace {

constexpr int kFixed = static_cast<int>(kAllStrategies.size());
constexpr int kAuto = kFixed;  // index of auto beside the fixed strategies

// What the policy replay tells about ep at one (step, layer).
struct EpStep {
  StrategyCost cost;
  std::vector<int> homes;  // [num_experts] of the placement in force
};

// Index of a name in kAllStrategies, or kAuto.
Result<int> StrategyIndex(const std::string& name) {
  if (name == "auto") return kAuto;
  Result<Strategy> strategy = ParseStrategy(name);
  if (!strategy.ok()) {
    return InvalidArgument("strategy '" + name + "' is not one of ep, esp, parm, ppmoe, auto");
  }
  return static_cast<int>(*strategy);
}

// One layer walked through the trace: every fixed strategy's cost, and auto's.
struct LayerWalk {
  // [num_steps][kFixed + 1]
  std::vector<StrategyCost> costs;
  long switches = 0;
  std::array<long, kFixed> steps_in = {};
};

Result<LayerWalk> WalkLayer(const Trace& trace, const KeelConfig& config,
                            const StrategyModel& model, std::span<const EpStep> ep, int layer,
                            std::span<const Strategy> pool, bool oracle) {
  const int num_steps = trace.num_steps();
  const int num_layers = trace.num_layers;
  const int num_ranks = config.num_ranks();
  const int num_experts = trace.num_experts;
  const int interval = std::max(1, config.policy.replan_interval_steps);
  LayerWalk walk;
  walk.costs.resize(static_cast<size_t>(num_steps) * (kFixed + 1));
  LoadEstimator cost_estimator(config.estimator, kFixed);
  LoadEstimator square_estimator(config.estimator, kFixed);  // of the squared prices

  // auto starts as the pool's first: the layout the layer is built with costs no switch.
  int current = 0;
  std::vector<double> estimated(pool.size());
  std::vector<double> switch_seconds(pool.size());
  std::vector<double> spread(pool.size());

  for (int step = 0; step < num_steps; ++step) {
    const EpStep& ep_step = ep[static_cast<size_t>(step) * num_layers + layer];
    KEEL_ASSIGN_OR_RETURN(StepLoad load, TraceStepLoad(trace, num_ranks, step, layer));
    StrategyCost* costs = walk.costs.data() + static_cast<size_t>(step) * (kFixed + 1);
    for (Strategy strategy : kAllStrategies) {
      if (strategy == Strategy::kEp) {
        costs[0] = ep_step.cost;
      } else {
        KEEL_ASSIGN_OR_RETURN(costs[static_cast<int>(strategy)], model.Estimate(strategy, load));
      }
    }

    // auto: at a replan, each pool member's estimated step and the price of moving to it.
    double switched_seconds = 0;
    // A spread needs two observed steps; until then auto keeps its strategy.
    if (step % interval == 0 && (oracle || cost_estimator.observed_steps() >= 2)) {
      const StrategyLayout from{pool[current], ep_step.homes};
      for (size_t i = 0; i < pool.size(); ++i) {
        const int fixed = static_cast<int>(pool[i]);
        estimated[i] = oracle ? costs[fixed].total_seconds() : cost_estimator.Estimate()[fixed];
        const double mean = cost_estimator.Estimate()[fixed];
        spread[i] =
            oracle ? 0.0
                   : std::sqrt(std::max(0.0, square_estimator.Estimate()[fixed] - mean * mean));
        switch_seconds[i] = model.SwitchSeconds(from, {pool[i], ep_step.homes}, num_experts);
      }
      const int chosen =
          ChooseStrategy(current, estimated, spread, switch_seconds, config.strategy);
      if (chosen != current) {
        switched_seconds = switch_seconds[chosen];
        current = chosen;
        ++walk.switches;
      }
    }
    const int fixed_index = static_cast<int>(pool[current]);
    StrategyCost chosen = costs[fixed_index];
    // The switch moves state in the background like a migration: only what outlasts the
    // layer's compute and exchanges is exposed.
    chosen.migration_seconds +=
        std::max(0.0, switched_seconds - (chosen.compute_seconds + chosen.all_to_all_seconds));
    costs[kAuto] = chosen;
    ++walk.steps_in[fixed_index];
    // Every step's load is priced under every strategy, so the estimate of each one's next
    // step comes from the same estimator that predicts the load, fed with those prices. A
    // migration is paid once, so the prices leave it out.
    std::array<double, kFixed> priced;
    for (int s = 0; s < kFixed; ++s)
      priced[s] = costs[s].total_seconds() - costs[s].migration_seconds;
    cost_estimator.Observe(priced);
    for (double& price : priced) price *= price;
    square_estimator.Observe(priced);
  }
  return walk;
}

StrategyReplayResult SummarizeStrategy(const std::string& name, int index, int num_steps,
                                       int num_layers, const std::vector<LayerWalk>& walks) {
  StrategyReplayResult result;
  result.name = name;
  std::vector<double> imbalances;
  double link_bytes = 0;
  for (int step = 0; step < num_steps; ++step) {
    double seconds = 0;
    double imbalance_sum = 0;
    for (int layer = 0; layer < num_layers; ++layer) {
      const StrategyCost& cost =
          walks[layer].costs[static_cast<size_t>(step) * (kFixed + 1) + index];
      seconds += cost.total_seconds();
      result.compute_seconds += cost.compute_seconds;
      result.all_to_all_seconds += cost.all_to_all_seconds;
      result.all_reduce_seconds += cost.all_reduce_seconds;
      result.sync_seconds += cost.sync_seconds;
      result.migration_seconds += cost.migration_seconds;
      link_bytes += cost.link_bytes;
      result.messages_per_rank += cost.messages_per_rank;
      imbalances.push_back(cost.compute_imbalance);
      imbalance_sum += cost.compute_imbalance;
    }
    result.step_seconds.push_back(seconds);
    result.step_imbalance.push_back(imbalance_sum / num_layers);
  }
  const double steps = std::max(1, num_steps);
  for (double* part :
       {&result.compute_seconds, &result.all_to_all_seconds, &result.all_reduce_seconds,
        &result.sync_seconds, &result.migration_seconds}) {
    *part /= steps;
  }
  result.link_gb_per_step = link_bytes / steps / 1e9;
  result.messages_per_rank /= std::max(1.0, steps * num_layers);
  result.imbalance = Summarize(std::move(imbalances));
  result.sim_step_seconds = Summarize(result.step_seconds);
  if (index == kAuto) {
    result.layer_steps_in.assign(kFixed, 0);
    for (const LayerWalk& walk : walks) {
      result.switches += walk.switches;
      for (int s = 0; s < kFixed; ++s) result.layer_steps_in[s] += walk.steps_in[s];
    }
  }
  return result;
}

}  // namespace

Result<StrategyReplayReport> ReplayStrategies(const Trace& trace, const KeelConfig& config,
                                              const StrategyReplayOptions& options) {
  std::vector<std::string> names = options.strategies;
  if (names.empty()) names = {"ep", "esp", "parm", "ppmoe", "auto"};
  std::vector<int> indices;
  for (const std::string& name : names) {
    KEEL_ASSIGN_OR_RETURN(int index, StrategyIndex(name));
    indices.push_back(index);
  }
  if (!options.pool.layers.empty() &&
      static_cast<int>(options.pool.layers.size()) != trace.num_layers) {
    return InvalidArgument("the pool has " + std::to_string(options.pool.layers.size()) +
                           " layers, the trace " + std::to_string(trace.num_layers));
  }
  for (const std::vector<Strategy>& layer : options.pool.layers) {
    if (layer.empty()) return InvalidArgument("the pool has a layer with no strategy");
  }
  KEEL_ASSIGN_OR_RETURN(Topology topology, Topology::Create(config.topology));
  const CostModel cost(topology, config.cost_model);
  KEEL_ASSIGN_OR_RETURN(StrategyModel model, StrategyModel::Create(cost, config.strategy));

  // ep: the policy replay, recording every (step, layer) as it goes.
  const int num_layers = trace.num_layers;
  const int num_steps = trace.num_steps();
  std::vector<EpStep> ep(static_cast<size_t>(std::max(0, num_steps)) * num_layers);
  ReplayOptions ep_options;
  ep_options.policies = {config.policy.name};
  ep_options.oracle = options.oracle;
  ep_options.heatmap_layer = options.heatmap_layer;
  ep_options.on_layer_step = [&](const ReplayLayerEvent& event) {
    EpStep& step = ep[static_cast<size_t>(event.step) * num_layers + event.layer];
    step.cost = EpStrategyCost(cost, event.cost, *event.routing);
    step.homes = event.placement->home();
  };
  if (options.progress) {
    ep_options.progress = [&](int, int done, int total) {
      options.progress("ep (" + config.policy.name + ")", done, total);
    };
  }
  KEEL_ASSIGN_OR_RETURN(ReplayReport ep_report, ReplayTrace(trace, config, ep_options));

  StrategyReplayReport report;
  report.trace_description = trace.description;
  report.num_steps = num_steps;
  report.num_layers = num_layers;
  report.num_experts = trace.num_experts;
  report.config = config;
  report.ep_policy = config.policy.name;
  report.oracle = options.oracle;
  report.pool = options.pool;
  if (report.pool.layers.empty()) {
    report.pool.layers.assign(num_layers,
                              std::vector<Strategy>(kAllStrategies.begin(), kAllStrategies.end()));
    report.pool.source = "every strategy";
  }

  std::vector<LayerWalk> walks(num_layers);
  std::vector<Status> failed(num_layers);
  std::mutex progress_mutex;
  int layers_done = 0;
  ParallelFor(0, num_layers, [&](int layer) {
    Result<LayerWalk> walk =
        WalkLayer(trace, config, model, ep, layer, report.pool.layers[layer], options.oracle);
    if (!walk.ok()) {
      failed[layer] = walk.status().WithContext("layer " + std::to_string(layer));
      return;
    }
    walks[layer] = std::move(walk).value();
    if (options.progress) {
      std::lock_guard<std::mutex> lock(progress_mutex);
      options.progress("strategies", ++layers_done, num_layers);
    }
  });
  for (const Status& status : failed) KEEL_RETURN_IF_ERROR(status);

  for (size_t i = 0; i < names.size(); ++i) {
    report.strategies.push_back(
        SummarizeStrategy(names[i], indices[i], num_steps, num_layers, walks));
  }
  report.layer_step_seconds.resize(static_cast<size_t>(num_steps) * num_layers * kFixed);
  for (int step = 0; step < num_steps; ++step) {
    for (int layer = 0; layer < num_layers; ++layer) {
      for (int s = 0; s < kFixed; ++s) {
        const double seconds =
            walks[layer].costs[static_cast<size_t>(step) * (kFixed + 1) + s].total_seconds();
        // The ep replay checked its prices (CostModel::CheckFinite); the strategies' come from
        // the same constants, and a report holds no inf or NaN either.
        if (!std::isfinite(seconds)) {
          return InvalidArgument("strategy " + std::string(StrategyName(kAllStrategies[s])) +
                                 ", step " + std::to_string(step) + ", layer " +
                                 std::to_string(layer) + ": priced at " + NumberText(seconds) +
                                 " seconds; the cost_model and topology constants are out of "
                                 "scale (ValidateConfig names the one out of range)");
        }
        report.layer_step_seconds[(static_cast<size_t>(step) * num_layers + layer) * kFixed + s] =
            seconds;
      }
    }
  }
  report.ep_report = std::move(ep_report);
  return report;
}

StrategyPool BuildStrategyPool(const StrategyReplayReport& report, int size) {
  StrategyPool pool;
  pool.source = "keel pool build: " + std::to_string(size) + " of 4 strategies per layer on " +
                (report.trace_description.empty() ? "a trace" : report.trace_description) + " (" +
                std::to_string(report.num_steps) + " steps)";
  for (int layer = 0; layer < report.num_layers; ++layer) {
    std::vector<std::vector<double>> costs(kFixed, std::vector<double>(report.num_steps));
    for (int step = 0; step < report.num_steps; ++step) {
      for (int s = 0; s < kFixed; ++s) {
        costs[s][step] =
            report.layer_step_seconds[(static_cast<size_t>(step) * report.num_layers + layer) *
                                          kFixed +
                                      s];
      }
    }
    std::vector<Strategy> chosen;
    for (int index : SelectPool(costs, size)) chosen.push_back(kAllStrategies[index]);
    pool.layers.push_back(std::move(chosen));
  }
  return pool;
}

nlohmann::json StrategyPoolToJson(const StrategyPool& pool) {
  nlohmann::json layers = nlohmann::json::array();
  for (const std::vector<Strategy>& layer : pool.layers) {
    nlohmann::json names = nlohmann::json::array();
    for (Strategy strategy : layer) names.push_back(std::string(StrategyName(strategy)));
    layers.push_back(names);
  }
  return {{"format", "keel-strategy-pool"}, {"source", pool.source}, {"layers", layers}};
}

Result<StrategyPool> StrategyPoolFromJson(const nlohmann::json& json) {
  if (!json.is_object() || !json.contains("format") ||
      json["format"] != nlohmann::json("keel-strategy-pool")) {
    return InvalidArgument(
        "not a strategy pool: expected an object with \"format\": "
        "\"keel-strategy-pool\" (written by keel pool build)");
  }
  StrategyPool pool;
  if (json.contains("source")) {
    if (!json["source"].is_string()) {
      return InvalidArgument("strategy pool: \"source\" must be a string, got " +
                             json["source"].dump());
    }
    pool.source = json["source"];
  }
  if (!json.contains("layers") || !json["layers"].is_array() || json["layers"].empty()) {
    return InvalidArgument("strategy pool: \"layers\" must be a non-empty array");
  }
  for (size_t layer = 0; layer < json["layers"].size(); ++layer) {
    const nlohmann::json& entry = json["layers"][layer];
    const std::string where = "strategy pool: layers[" + std::to_string(layer) + "]";
    if (!entry.is_array() || entry.empty()) {
      return InvalidArgument(where + " must be a non-empty array of strategy names");
    }
    std::vector<Strategy> strategies;
    for (const nlohmann::json& name : entry) {
      if (!name.is_string()) return InvalidArgument(where + ": " + name.dump() + " is not a name");
      Result<Strategy> strategy = ParseStrategy(name.get<std::string>());
      if (!strategy.ok()) return strategy.status().WithContext(where);
      if (std::find(strategies.begin(), strategies.end(), *strategy) != strategies.end()) {
        return InvalidArgument(where + ": " + name.get<std::string>() + " is listed twice");
      }
      strategies.push_back(*strategy);
    }
    pool.layers.push_back(std::move(strategies));
  }
  return pool;
}

nlohmann::json StrategyReplayReportToJson(const StrategyReplayReport& report) {
  auto distribution = [](const Distribution& d) {
    return nlohmann::json{{"mean", d.mean}, {"p50", d.p50}, {"p90", d.p90},
                          {"p99", d.p99},   {"max", d.max}, {"count", d.count}};
  };
  nlohmann::json strategies = nlohmann::json::object();
  for (const StrategyReplayResult& r : report.strategies) {
    nlohmann::json entry = {
        {"sim_step_seconds", distribution(r.sim_step_seconds)},
        {"compute_seconds", r.compute_seconds},
        {"all_to_all_seconds", r.all_to_all_seconds},
        {"all_reduce_seconds", r.all_reduce_seconds},
        {"sync_seconds", r.sync_seconds},
        {"migration_seconds", r.migration_seconds},
        {"imbalance", distribution(r.imbalance)},
        {"link_gb_per_step", r.link_gb_per_step},
        {"messages_per_rank", r.messages_per_rank},
    };
    if (!r.layer_steps_in.empty()) {
      entry["switches"] = r.switches;
      nlohmann::json steps_in = nlohmann::json::object();
      for (int s = 0; s < kFixed; ++s) {
        steps_in[std::string(StrategyName(kAllStrategies[s]))] = r.layer_steps_in[s];
      }
      entry["layer_steps_in"] = steps_in;
    }
    strategies[r.name] = entry;
  }
  const KeelConfig& c = report.config;
  return {{"trace", report.trace_description},
          {"steps", report.num_steps},
          {"layers", report.num_layers},
          {"experts", report.num_experts},
          {"topology",
           {{"num_nodes", c.topology.num_nodes}, {"gpus_per_node", c.topology.gpus_per_node}}},
          {"ep_policy", report.ep_policy},
          {"mode", report.oracle ? "oracle" : "causal"},
          {"shard_degree", ShardDegree(c.strategy, c.topology.gpus_per_node)},
          {"mp_degree", MpDegree(c.strategy, c.topology.gpus_per_node)},
          {"pool", StrategyPoolToJson(report.pool)},
          {"strategies", strategies}};
}

std::string FormatStrategyTable(const StrategyReplayReport& report) {
  std::string out;
  char line[320];
  const KeelConfig& c = report.config;
  std::snprintf(line, sizeof line,
                "%s: %d steps x %d layers x %d experts on %d x %d GPUs; ep runs policy %s, %s\n\n",
                report.trace_description.empty() ? "trace" : report.trace_description.c_str(),
                report.num_steps, report.num_layers, report.num_experts, c.topology.num_nodes,
                c.topology.gpus_per_node, report.ep_policy.c_str(),
                report.oracle ? "oracle" : "causal");
  out += line;
  out +=
      "strategy  sim step ms  compute  all-to-all  all-reduce     sync  migration  imbalance"
      "    p99  GB/step    msgs  switches\n";
  out += std::string(121, '-') + "\n";
  for (const StrategyReplayResult& r : report.strategies) {
    std::snprintf(line, sizeof line,
                  "%-8s  %11.3f  %7.3f  %10.3f  %10.3f  %7.3f  %9.3f  %9.3f  %5.3f  %7.2f  %6.1f  "
                  "%8s\n",
                  r.name.c_str(), r.sim_step_seconds.mean * 1e3, r.compute_seconds * 1e3,
                  r.all_to_all_seconds * 1e3, r.all_reduce_seconds * 1e3, r.sync_seconds * 1e3,
                  r.migration_seconds * 1e3, r.imbalance.mean, r.imbalance.p99, r.link_gb_per_step,
                  r.messages_per_rank,
                  r.layer_steps_in.empty() ? "-" : std::to_string(r.switches).c_str());
    out += line;
  }
  for (const StrategyReplayResult& r : report.strategies) {
    if (r.layer_steps_in.empty()) continue;
    long total = 0;
    for (long n : r.layer_steps_in) total += n;
    out += "\n" + r.name + " ran";
    for (int s = 0; s < kFixed; ++s) {
      std::snprintf(line, sizeof line, " %s %.1f%%",
                    std::string(StrategyName(kAllStrategies[s])).c_str(),
                    total > 0 ? 100.0 * r.layer_steps_in[s] / total : 0.0);
      out += line;
    }
    out += " of its (step, layer)s\n";
  }
  return out;
}

ReplayReport StrategyPlotReport(const StrategyReplayReport& report) {
  ReplayReport plot = report.ep_report;
  plot.policies.clear();
  for (const StrategyReplayResult& r : report.strategies) {
    PolicyReplay line;
    line.name = r.name;
    line.sim_step_seconds = r.sim_step_seconds;
    line.step_seconds = r.step_seconds;
    line.imbalance = r.imbalance;
    line.step_imbalance = r.step_imbalance;
    plot.policies.push_back(std::move(line));
  }
  return plot;
}

}  // namespace keel::tools
