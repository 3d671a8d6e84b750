// Speed of the per-step quota planner at production size: 256 experts on 64 ranks (8 nodes of 8),
// 5 persistent slots per rank (64 redundant copies), skewed (Zipf) loads with a burst, and one
// transient slot per rank. The planner runs once per MoE layer per step, on every rank.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "placement/cost_model.h"
#include "placement/routing.h"
#include "placement/step_planner.h"

namespace keel {
namespace {

constexpr int kNodes = 8;
constexpr int kGpusPerNode = 8;
constexpr int kRanks = kNodes * kGpusPerNode;
constexpr int kExperts = 256;
constexpr int kSlotsPerRank = 5;
constexpr double kRowsPerSource = 4096.0 * 8;  // tokens per rank x top-k

struct Scenario {
  Topology topology;
  Placement placement;
  StepLoad load;
};

// Zipf(1.0) expert weights in a shuffled order.
std::vector<double> ZipfWeights(std::mt19937& rng) {
  std::vector<double> weights(kExperts);
  for (int e = 0; e < kExperts; ++e) weights[e] = 1.0 / (e + 1);
  std::shuffle(weights.begin(), weights.end(), rng);
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double& w : weights) w /= sum;
  return weights;
}

// Replicas to the heaviest experts per copy, copies placed heaviest first on the least-loaded
// rank with a free slot and no copy of the expert yet: the kind of placement a policy plans.
Placement PlanPlacement(const std::vector<double>& weights) {
  std::vector<int> copies(kExperts, 1);
  for (int extra = 0; extra < kRanks * kSlotsPerRank - kExperts; ++extra) {
    int best = 0;
    for (int e = 1; e < kExperts; ++e) {
      if (weights[e] / copies[e] > weights[best] / copies[best]) best = e;
    }
    ++copies[best];
  }
  std::vector<std::pair<double, int>> items;
  for (int e = 0; e < kExperts; ++e) {
    for (int c = 0; c < copies[e]; ++c) items.push_back({weights[e] / copies[e], e});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> rank_load(kRanks, 0.0);
  std::vector<int> used(kRanks, 0);
  std::vector<int> phy2log(kRanks * kSlotsPerRank, kEmptySlot);
  for (const auto& [w, e] : items) {
    int target = -1;
    for (int g = 0; g < kRanks; ++g) {
      if (used[g] == kSlotsPerRank) continue;
      bool holds = false;
      for (int s = 0; s < used[g]; ++s) holds |= phy2log[g * kSlotsPerRank + s] == e;
      if (holds) continue;
      if (target < 0 || rank_load[g] < rank_load[target]) target = g;
    }
    phy2log[target * kSlotsPerRank + used[target]++] = e;
    rank_load[target] += w;
  }
  return Placement::Create(kExperts, kRanks, phy2log).value();
}

// The placement is planned for `weights`; the step's load drifts from it (noise per source and
// expert) and bursts on a few experts the plan did not replicate.
Scenario MakeScenario() {
  std::mt19937 rng(2024);
  const std::vector<double> weights = ZipfWeights(rng);
  TopologyConfig topology_config;
  topology_config.num_nodes = kNodes;
  topology_config.gpus_per_node = kGpusPerNode;
  Scenario scenario{Topology::Create(topology_config).value(), PlanPlacement(weights), {}};
  std::vector<double> step = weights;
  std::lognormal_distribution<double> drift(0.0, 0.3);
  for (double& w : step) w *= drift(rng);
  for (int burst = 0; burst < 2; ++burst) step[rng() % kExperts] *= 4.0;
  const double sum = std::accumulate(step.begin(), step.end(), 0.0);
  std::vector<double> traffic(static_cast<size_t>(kRanks) * kExperts);
  for (int s = 0; s < kRanks; ++s) {
    for (int e = 0; e < kExperts; ++e) {
      traffic[s * kExperts + e] = std::round(kRowsPerSource * step[e] / sum * drift(rng));
    }
  }
  scenario.load = StepLoad::FromTraffic(kRanks, kExperts, std::move(traffic)).value();
  return scenario;
}

const Scenario& GetScenario() {
  static const Scenario scenario = MakeScenario();
  return scenario;
}

// Defaults (7B-class experts: 67 MB of weights each) rarely pay for a transient fill; small
// experts at the same token counts do.
CostModelConfig CostConfig(bool small_experts) {
  CostModelConfig config;
  if (small_experts) {
    config.hidden_size = 1024;
    config.expert_ffn_size = 512;
    config.expert_tflops = 20.0;
  }
  return config;
}

void BM_SplitQuotas(benchmark::State& state) {
  const Scenario& s = GetScenario();
  std::vector<long long> tokens(kExperts);
  const std::vector<double> totals = s.load.ExpertTotals();
  for (int e = 0; e < kExperts; ++e) tokens[e] = std::llround(totals[e]);
  QuotaSplit split;
  for (auto _ : state) {
    split = SplitQuotas(s.placement, tokens, {});
    benchmark::DoNotOptimize(split);
  }
  const double mean = std::accumulate(tokens.begin(), tokens.end(), 0.0) / kRanks;
  state.counters["imbalance"] = split.max_rank_tokens / mean;
}
BENCHMARK(BM_SplitQuotas)->Unit(benchmark::kMicrosecond);

void BM_RouteEvenly(benchmark::State& state) {
  const Scenario& s = GetScenario();
  StepRouting routing;
  for (auto _ : state) {
    routing = RouteEvenly(s.placement, s.load);
    benchmark::DoNotOptimize(routing);
  }
  state.counters["imbalance"] = routing.imbalance();
}
BENCHMARK(BM_RouteEvenly)->Unit(benchmark::kMicrosecond);

// Args: transient slots per rank, small experts (0/1).
void BM_PlanStepQuotas(benchmark::State& state) {
  const Scenario& s = GetScenario();
  const CostModel cost(s.topology, CostConfig(state.range(1) != 0));
  const QuotaPlanOptions options{.transient_per_rank = static_cast<int>(state.range(0))};
  StepRouting routing;
  for (auto _ : state) {
    routing = PlanStepQuotas(s.placement, s.load, s.topology, cost, options).value();
    benchmark::DoNotOptimize(routing);
  }
  state.counters["imbalance"] = routing.imbalance();
  state.counters["transients"] = static_cast<double>(routing.transients.size());
  state.counters["predicted_ms"] = cost.Estimate(s.placement, routing).total_seconds() * 1e3;
  state.counters["even_predicted_ms"] =
      cost.Estimate(s.placement, RouteEvenly(s.placement, s.load)).total_seconds() * 1e3;
}
BENCHMARK(BM_PlanStepQuotas)
    ->ArgNames({"transient_per_rank", "small_experts"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({1, 1})
    ->Unit(benchmark::kMicrosecond);

// The planner a trainer keeps per layer (StepPlanner): the same routing as PlanStepQuotas, from
// traffic by expert (what the engine all-reduces), with its buffers kept between steps.
// Args: transient slots per rank, small experts (0/1), shares recorded (0: none, 1: all, 2: those
// of rank 0), the all-to-all matrix filled (1) or not (0), and the traffic as doubles (0) or as
// 32-bit counts (1). The engine on rank 0 asks for shares 2, no matrix, and gives counts.
void BM_StepPlanner(benchmark::State& state) {
  const Scenario& s = GetScenario();
  const CostModel cost(s.topology, CostConfig(state.range(1) != 0));
  const QuotaPlanOptions options{.transient_per_rank = static_cast<int>(state.range(0)),
                                 .record_shares = state.range(2) != 0,
                                 .shares_of_rank = state.range(2) == 2 ? 0 : -1,
                                 .sent_tokens = state.range(3) != 0};
  std::vector<double> by_expert;
  TrafficByExpert(s.load.traffic, kRanks, kExperts, by_expert);
  const std::vector<std::int32_t> counts(by_expert.begin(), by_expert.end());
  StepPlanner planner(s.topology, cost);
  StepRouting routing;
  const bool as_counts = state.range(4) != 0;
  for (auto _ : state) {
    const Status status = as_counts
                              ? planner.Plan(s.placement, kRanks, counts, options, routing)
                              : planner.Plan(s.placement, kRanks, by_expert, options, routing);
    benchmark::DoNotOptimize(status);
    benchmark::DoNotOptimize(routing);
  }
  state.counters["imbalance"] = routing.imbalance();
  state.counters["transients"] = static_cast<double>(routing.transients.size());
}
BENCHMARK(BM_StepPlanner)
    ->ArgNames({"transient_per_rank", "small_experts", "shares", "matrix", "counts"})
    ->Args({0, 0, 0, 1, 0})
    ->Args({1, 0, 0, 1, 0})
    ->Args({1, 1, 0, 1, 0})
    ->Args({1, 0, 1, 1, 0})
    ->Args({0, 0, 0, 0, 0})
    ->Args({1, 0, 0, 0, 0})
    ->Args({0, 0, 2, 0, 0})
    ->Args({1, 0, 2, 0, 0})
    ->Args({0, 0, 2, 0, 1})
    ->Args({1, 0, 2, 0, 1})
    ->Unit(benchmark::kMicrosecond);

// One cost-model estimate, for scale: the planner calls it once per transient that lowers the
// max rank load, plus once for the baseline.
void BM_CostEstimate(benchmark::State& state) {
  const Scenario& s = GetScenario();
  const CostModel cost(s.topology, CostConfig(false));
  const StepRouting routing = RouteEvenly(s.placement, s.load);
  for (auto _ : state) benchmark::DoNotOptimize(cost.Estimate(s.placement, routing));
}
BENCHMARK(BM_CostEstimate)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
