// The demo's CPU expert by inner width: one token row forward and backward through an FFN
// `hidden` wide and `width` deep (tools/demo_model.h), the GEMMs an expert sharded ffn / width
// ways runs on every row. Its throughput relative to the whole width is the curve
// cost_model.gemm_efficiency describes (docs/strategies.md), measured on this CPU for the demo.
//   bench/demo_expert_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "tools/demo_model.h"

namespace keel::tools {
namespace {

constexpr int kRows = 256;  // rows per iteration, so the timer's overhead is negligible

// Args: hidden, width.
void BM_DemoExpertRow(benchmark::State& state) {
  FfnShape shape;
  shape.hidden = static_cast<int>(state.range(0));
  shape.ffn = static_cast<int>(state.range(1));
  std::vector<float> weights(shape.weight_floats());
  for (size_t i = 0; i < weights.size(); ++i) {
    weights[i] = 0.01f * static_cast<float>(static_cast<int>(i % 17) - 8);
  }
  std::vector<float> x(static_cast<size_t>(kRows) * shape.hidden);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = 0.1f * static_cast<float>(static_cast<int>(i % 7) - 3);
  std::vector<float> y(shape.hidden);
  std::vector<float> dx(shape.hidden);
  std::vector<float> activation(static_cast<size_t>(kRows) * shape.ffn);
  std::vector<float> scratch(shape.ffn);
  std::vector<int64_t> gradient(shape.weight_floats(), 0);
  for (auto _ : state) {
    for (int r = 0; r < kRows; ++r) {
      const float* row = x.data() + static_cast<size_t>(r) * shape.hidden;
      float* act = activation.data() + static_cast<size_t>(r) * shape.ffn;
      ExpertForward(shape, weights.data(), row, y.data(), act);
      ExpertBackward(shape, weights.data(), row, act, y.data(), gradient.data(), dx.data(),
                     scratch.data());
    }
    benchmark::DoNotOptimize(gradient.data());
    benchmark::ClobberMemory();
  }
  const double rows = static_cast<double>(state.iterations()) * kRows;
  // Forward 2 GEMVs, backward 4 (the input gradient and the weight gradient of each matrix).
  const double flops_per_row = 6.0 * 2.0 * shape.hidden * shape.ffn;
  state.counters["rows_per_s"] = benchmark::Counter(rows, benchmark::Counter::kIsRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(rows * flops_per_row / 1e9, benchmark::Counter::kIsRate);
}
// The demo's default expert (16 x 32), and the 64 x 1024 expert of configs/demo-shards.yaml,
// each whole and cut 2, 4 and 8 ways.
BENCHMARK(BM_DemoExpertRow)
    ->Args({16, 32})
    ->Args({16, 16})
    ->Args({16, 8})
    ->Args({16, 4})
    ->Args({64, 1024})
    ->Args({64, 512})
    ->Args({64, 256})
    ->Args({64, 128})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace keel::tools

BENCHMARK_MAIN();
