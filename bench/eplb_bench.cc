// RebalanceExperts at DeepSeek-V3 scale: 58 MoE layers x 256 experts, 288 replicas on 32 GPUs in
// 8 nodes, hierarchical (8 groups) and global (1 group), random loads from a fixed seed.
#include <benchmark/benchmark.h>

#include <random>

#include "placement/eplb.h"

namespace keel {
namespace {

EplbInput DeepSeekV3Input(int num_groups) {
  EplbInput in;
  in.num_layers = 58;
  in.num_experts = 256;
  in.num_replicas = 288;
  in.num_groups = num_groups;
  in.num_nodes = 8;
  in.num_gpus = 32;
  std::mt19937 rng(12345);
  std::uniform_real_distribution<float> load(0.0f, 10000.0f);
  in.weight.resize(static_cast<size_t>(in.num_layers) * in.num_experts);
  for (float& w : in.weight) w = load(rng);
  return in;
}

void RunRebalance(benchmark::State& state, int num_groups) {
  const EplbInput in = DeepSeekV3Input(num_groups);
  for (auto _ : state) {
    auto out = RebalanceExperts(in);
    if (!out.ok()) {
      state.SkipWithError(out.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(out->phy2log.data());
  }
  state.SetItemsProcessed(state.iterations() * in.num_layers);  // items: layers balanced
}

// num_groups 8 % num_nodes 8 == 0: groups packed to nodes, replicas kept within each node.
void BM_EplbHierarchical(benchmark::State& state) { RunRebalance(state, 8); }
// num_groups 1 % num_nodes 8 != 0: one pool of 256 experts over all 32 GPUs.
void BM_EplbGlobal(benchmark::State& state) { RunRebalance(state, 1); }

BENCHMARK(BM_EplbHierarchical)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EplbGlobal)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
