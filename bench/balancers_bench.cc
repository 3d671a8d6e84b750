// Per-step cost of the policies after the newest balancers at DeepSeek-V3-like scale: 256 experts
// on 64 ranks (8 nodes x 8 GPUs), 5 persistent slots per rank (64 redundant slots), Zipf-skewed
// loads. LPLB's figure is about 100 us per solve on one GPU SM; ours are on one CPU core. Numbers
// go in docs/benchmarks.md.
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "placement/lp_balance.h"
#include "placement/policy.h"

namespace keel {
namespace {

constexpr int kExperts = 256;
constexpr int kRanks = 64;

// Zipf loads over a fixed permutation, shifted by `round` so that each call sees other numbers.
std::vector<double> ZipfLoad(int round) {
  std::vector<double> load(kExperts);
  for (int i = 0; i < kExperts; ++i) {
    load[(i * 97 + round * 13) % kExperts] = std::floor(131072.0 / std::pow(i + 1, 0.9)) + round;
  }
  return load;
}

PolicyContext BenchContext() {
  KeelConfig config;
  config.topology.num_nodes = 8;
  config.topology.gpus_per_node = 8;
  config.slots.persistent_per_rank = 5;
  config.slots.transient_per_rank = 1;
  return PolicyContext::FromConfig(config, 1, kExperts).value();
}

// The linear program alone, on LPLB's placement for the load (64 edges, 129 variables).
void BM_LplbSolve(benchmark::State& state) {
  PolicyContext context = BenchContext();
  auto lplb = MakePolicy("lplb", context).value();
  const Placement initial = lplb->Initial(0).value();
  const Placement placement = lplb->Replan({0, &initial, ZipfLoad(0), nullptr}).value();
  std::vector<std::vector<double>> loads;
  for (int round = 0; round < 16; ++round) loads.push_back(ZipfLoad(round));
  size_t round = 0;
  for (auto _ : state) {
    auto balance = SolveLpBalance(placement, loads[round++ % loads.size()]);
    benchmark::DoNotOptimize(balance);
  }
}
BENCHMARK(BM_LplbSolve)->Unit(benchmark::kMicrosecond);

// The same split by Keel's quota solver, in whole tokens (lplb's default solver).
void BM_LplbQuotaSolve(benchmark::State& state) {
  PolicyContext context = BenchContext();
  auto lplb = MakePolicy("lplb", context).value();
  const Placement initial = lplb->Initial(0).value();
  const Placement placement = lplb->Replan({0, &initial, ZipfLoad(0), nullptr}).value();
  std::vector<std::vector<long long>> loads;
  for (int round = 0; round < 16; ++round) {
    const std::vector<double> load = ZipfLoad(round);
    loads.emplace_back(load.begin(), load.end());
  }
  QuotaSplitter splitter;
  QuotaSplit split;
  size_t round = 0;
  for (auto _ : state) {
    splitter.Split(placement, loads[round++ % loads.size()], split);
    benchmark::DoNotOptimize(split);
  }
}
BENCHMARK(BM_LplbQuotaSolve)->Unit(benchmark::kMicrosecond);

// A whole step of a policy: its Route on the step's traffic (every source sends evenly).
void StepOf(benchmark::State& state, const char* name, const char* lplb_solver = "quota") {
  PolicyContext context = BenchContext();
  context.config.lplb.solver = lplb_solver;
  auto policy = MakePolicy(name, context).value();
  const Placement initial = policy->Initial(0).value();
  const Placement placement = policy->Replan({0, &initial, ZipfLoad(0), nullptr}).value();
  std::vector<StepLoad> loads;
  for (int round = 0; round < 16; ++round) {
    loads.push_back(StepLoad::FromExpertCounts(kRanks, ZipfLoad(round)).value());
  }
  size_t round = 0;
  for (auto _ : state) {
    auto routing = policy->Route(0, placement, loads[round++ % loads.size()]);
    benchmark::DoNotOptimize(routing);
  }
}
void BM_LplbStep(benchmark::State& state) { StepOf(state, "lplb"); }
void BM_LplbStepGlpk(benchmark::State& state) { StepOf(state, "lplb", "glpk"); }
void BM_VelbStep(benchmark::State& state) { StepOf(state, "velb"); }
BENCHMARK(BM_LplbStep)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_LplbStepGlpk)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_VelbStep)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
