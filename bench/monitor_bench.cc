// Hot-path cost of the load monitor: nanoseconds per recorded batch at 8k tokens x top-8 per
// rank (RecordTopK over 65,536 expert ids, and RecordCounts of 256 per-expert counts), next to
// the cost model's step time of one MoE layer for the same shape, which the monitor must stay
// within 0.5% of. The monitor thread drains concurrently, as in a run.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "monitor/load_monitor.h"
#include "placement/cost_model.h"
#include "placement/placement.h"
#include "placement/routing.h"
#include "placement/topology.h"

namespace keel {
namespace {

constexpr int kExperts = 256;
constexpr int kTokensPerRank = 8192;
constexpr int kTopK = 8;

// The default config (1 node x 8 GPUs, default cost model constants) with slots for 256 experts:
// one layer's step time when 8 ranks each route 8k tokens x top-8 uniformly over the experts.
double LayerStepSeconds() {
  KeelConfig config;
  config.slots.persistent_per_rank = kExperts / config.num_ranks() + 1;
  Result<Topology> topology = Topology::Create(config.topology);
  Result<Placement> placement =
      Placement::Contiguous(kExperts, config.num_ranks(), config.slots.persistent_per_rank);
  if (!topology.ok() || !placement.ok()) return 0;
  const CostModel cost(*topology, config.cost_model);
  const std::vector<double> counts(
      kExperts, static_cast<double>(kTokensPerRank) * kTopK * config.num_ranks() / kExperts);
  Result<StepLoad> load = StepLoad::FromExpertCounts(config.num_ranks(), counts);
  if (!load.ok()) return 0;
  return cost.Estimate(*placement, RouteEvenly(*placement, *load)).total_seconds();
}

std::unique_ptr<LoadMonitor> MakeMonitor() {
  LoadMonitorOptions options;
  options.num_layers = 1;
  options.num_experts = kExperts;
  options.num_ranks = 8;
  options.monitor.queue_capacity = 1024;
  Result<std::unique_ptr<LoadMonitor>> monitor = LoadMonitor::Create(options);
  return monitor.ok() ? std::move(monitor).value() : nullptr;
}

void ReportContext(benchmark::State& state, const LoadMonitor& monitor) {
  state.counters["layer_step_us"] = LayerStepSeconds() * 1e6;
  state.counters["dropped"] = static_cast<double>(monitor.dropped_samples());
}

void BM_RecordTopK(benchmark::State& state) {
  auto monitor = MakeMonitor();
  std::mt19937 random(1);
  std::uniform_int_distribution<int32_t> expert(0, kExperts - 1);
  std::vector<int32_t> ids(static_cast<size_t>(kTokensPerRank) * kTopK);
  for (int32_t& id : ids) id = expert(random);
  int64_t step = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(monitor->RecordTopK(0, ids));
    monitor->StepEnd(step++);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(ids.size()));
  ReportContext(state, *monitor);
}
BENCHMARK(BM_RecordTopK);

void BM_RecordCounts(benchmark::State& state) {
  auto monitor = MakeMonitor();
  const std::vector<int32_t> counts(kExperts, kTokensPerRank * kTopK / kExperts);
  int64_t step = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(monitor->RecordCounts(0, counts));
    monitor->StepEnd(step++);
  }
  ReportContext(state, *monitor);
}
BENCHMARK(BM_RecordCounts);

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
