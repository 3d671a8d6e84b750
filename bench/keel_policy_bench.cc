// Planner cost of the `keel` policy at DeepSeek-V3-like scale: 256 experts on 64 ranks (8 nodes x
// 8 GPUs) with 5 persistent slots per rank (64 redundant slots). Loads are Zipf-skewed and drift
// between replans, so every replan has real work. Numbers go in docs/benchmarks.md.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

constexpr int kExperts = 256;
constexpr int kNodes = 8;
constexpr int kGpusPerNode = 8;
constexpr int kSlotsPerRank = 5;

// Deterministic Zipf loads over a permutation that drifts by `round` adjacent swaps.
std::vector<double> DriftingLoad(int layer, int round) {
  std::vector<int> order(kExperts);
  for (int i = 0; i < kExperts; ++i) order[i] = (i * 97 + layer * 31) % kExperts;
  uint64_t state = 0x9E3779B97F4A7C15ull * (layer + 1);
  for (int r = 0; r < round * 8; ++r) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const int i = static_cast<int>((state >> 33) % (kExperts - 1));
    std::swap(order[i], order[i + 1]);
  }
  std::vector<double> load(kExperts);
  for (int rank = 0; rank < kExperts; ++rank) {
    load[order[rank]] = std::floor(8192.0 * 8 * 64 / kExperts * 4.0 / std::pow(rank + 1, 0.9));
  }
  return load;
}

PolicyContext BenchContext(int layers) {
  KeelConfig config;
  config.topology.num_nodes = kNodes;
  config.topology.gpus_per_node = kGpusPerNode;
  config.slots.persistent_per_rank = kSlotsPerRank;
  config.slots.transient_per_rank = 1;
  if (getenv("NOHOME")) config.policy.keel.home_payback_horizon_steps = 0;
  return PolicyContext::FromConfig(config, layers, kExperts).value();
}

// One layer replanned repeatedly as its load drifts: the steady-state cost per layer.
void BM_KeelReplanPerLayer(benchmark::State& state) {
  PolicyContext context = BenchContext(1);
  auto policy = MakePolicy("keel", context).value();
  Placement current = policy->Initial(0).value();
  std::vector<std::vector<double>> loads;
  for (int round = 0; round < 64; ++round) loads.push_back(DriftingLoad(0, round));
  // Warm the placement up so replans start from a balanced, replicated state.
  for (int round = 0; round < 32; ++round) {
    current = policy->Replan({0, &current, loads[round % loads.size()], nullptr}).value();
  }
  size_t round = 0;
  for (auto _ : state) {
    Placement next = policy->Replan({0, &current, loads[round++ % loads.size()], nullptr}).value();
    benchmark::DoNotOptimize(next);
    current = std::move(next);
  }
}
BENCHMARK(BM_KeelReplanPerLayer)->Unit(benchmark::kMicrosecond);

// A whole 58-layer model replanned at once on one core.
void BM_KeelReplan58Layers(benchmark::State& state) {
  constexpr int kLayers = 58;
  PolicyContext context = BenchContext(kLayers);
  auto policy = MakePolicy("keel", context).value();
  std::vector<Placement> current;
  for (int l = 0; l < kLayers; ++l) current.push_back(policy->Initial(l).value());
  for (int round = 0; round < 16; ++round) {
    for (int l = 0; l < kLayers; ++l) {
      auto load = DriftingLoad(l, round);
      current[l] = policy->Replan({l, &current[l], load, nullptr}).value();
    }
  }
  std::vector<std::vector<double>> loads;
  for (int l = 0; l < kLayers; ++l) loads.push_back(DriftingLoad(l, 17));
  int round = 17;
  for (auto _ : state) {
    for (int l = 0; l < kLayers; ++l) {
      current[l] = policy->Replan({l, &current[l], loads[l], nullptr}).value();
    }
    state.PauseTiming();
    ++round;
    for (int l = 0; l < kLayers; ++l) loads[l] = DriftingLoad(l, round);
    state.ResumeTiming();
  }
}
BENCHMARK(BM_KeelReplan58Layers)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
