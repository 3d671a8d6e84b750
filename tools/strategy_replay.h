// `keel replay --strategy` and `keel pool build`: a routing trace replayed under each way of
// parallelising the MoE layers (placement/strategy.h), side by side. `ep` is the policy replay
// of tools/replay.h (the config's policy, replicas and all); `esp`, `parm` and `ppmoe` price each
// step on their fixed layouts; `auto` picks per layer, at every replan, the pool member whose
// estimated step is lowest, paying for the switch. docs/strategies.md defines every number.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/config.h"
#include "keel/status.hpp"
#include "monitor/trace.h"
#include "placement/strategy.h"
#include "tools/replay.h"

namespace keel::tools {

// Per layer, the strategies `auto` chooses among.
struct StrategyPool {
  // [num_layers] never empty; a layer starts in its first strategy (the best alone on the
  // profiling trace, or the steadiest of those that tie with it: SelectPool), which costs no
  // switch.
  std::vector<std::vector<Strategy>> layers;
  std::string source;  // what it was built from (trace, size)
};

struct StrategyReplayOptions {
  // Strategies to report, by name: ep, esp, parm, ppmoe, auto; empty means all five.
  std::vector<std::string> strategies;
  // The pool `auto` chooses from; empty layers means every strategy for every layer.
  StrategyPool pool;
  // Plan ep (and auto's choice) from the step's own load instead of the estimate.
  bool oracle = false;
  int heatmap_layer = -1;  // as ReplayOptions::heatmap_layer
  // Called as the replay advances: (steps done, total steps), ep's policy replay first, then the
  // strategies. May be empty.
  std::function<void(const std::string& phase, int done, int total)> progress;
};

// One strategy's results over the trace.
struct StrategyReplayResult {
  std::string name;
  Distribution sim_step_seconds;  // per step: the layers' StrategyCost totals summed
  // Means per step of the parts of sim_step_seconds (StrategyCost), summed over layers.
  double compute_seconds = 0;
  double all_to_all_seconds = 0;
  double all_reduce_seconds = 0;
  double sync_seconds = 0;
  double migration_seconds = 0;
  Distribution imbalance;        // per (step, layer): slowest rank's rows / mean rank's rows
  double link_gb_per_step = 0;   // token bytes over links per step, all layers and passes
  double messages_per_rank = 0;  // mean over (step, layer) of StrategyCost::messages_per_rank
  // auto only: layer switches, and (step, layer)s spent in each strategy [kAllStrategies order].
  long switches = 0;
  std::vector<long> layer_steps_in;
  std::vector<double> step_seconds;    // [num_steps] sim step
  std::vector<double> step_imbalance;  // [num_steps] mean over layers
};

struct StrategyReplayReport {
  std::string trace_description;
  int num_steps = 0;
  int num_layers = 0;
  int num_experts = 0;
  KeelConfig config;
  std::string ep_policy;  // the policy ep ran
  bool oracle = false;
  std::vector<StrategyReplayResult> strategies;  // in the order asked for
  StrategyPool pool;                             // the pool auto used
  ReplayReport ep_report;                        // the policy replay behind ep (heatmap, series)
  // [num_steps][num_layers][kAllStrategies] each fixed strategy's layer step (auto's pool input).
  std::vector<double> layer_step_seconds;
};

// Replays `trace` under the strategies; fails on an unknown strategy name, a pool whose layer
// count differs from the trace's, or what ReplayTrace or StrategyModel::Create fail on.
Result<StrategyReplayReport> ReplayStrategies(const Trace& trace, const KeelConfig& config,
                                              const StrategyReplayOptions& options);

// SmartMoE's offline pool from a profiling replay: per layer, `size` strategies by SelectPool on
// the fixed strategies' layer steps in `report`.
StrategyPool BuildStrategyPool(const StrategyReplayReport& report, int size);

nlohmann::json StrategyPoolToJson(const StrategyPool& pool);
// Reads what StrategyPoolToJson wrote; errors name the bad entry.
Result<StrategyPool> StrategyPoolFromJson(const nlohmann::json& json);

nlohmann::json StrategyReplayReportToJson(const StrategyReplayReport& report);
// One row per strategy: sim step and its parts (ms), imbalance, GB per step, auto's switches.
std::string FormatStrategyTable(const StrategyReplayReport& report);
// The replay plot (tools/svg_plot.h) with the strategies as its lines: sim step per step.
ReplayReport StrategyPlotReport(const StrategyReplayReport& report);

}  // namespace keel::tools
