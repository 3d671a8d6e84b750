// Tests of the synthetic trace generator: determinism, shapes and totals, option validation,
// and that the default skew makes the static placement visibly imbalanced.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "monitor/trace.h"

namespace keel {
namespace {

double Sum(std::span<const double> values) {
  return std::accumulate(values.begin(), values.end(), 0.0);
}

uint64_t Fingerprint(const Trace& trace) {
  uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the counts
  for (const std::vector<double>& step : trace.steps) {
    for (double value : step) {
      hash ^= static_cast<uint64_t>(value);
      hash *= 1099511628211ULL;
    }
  }
  return hash;
}

TEST(SyntheticTraceTest, SameSeedSameTraceOtherSeedOtherTrace) {
  SyntheticTraceOptions options;
  options.num_steps = 20;
  Result<Trace> a = GenerateSyntheticTrace(options);
  Result<Trace> b = GenerateSyntheticTrace(options);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->steps, b->steps);
  EXPECT_EQ(a->description, b->description);
  options.seed = 2;
  Result<Trace> c = GenerateSyntheticTrace(options);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->steps, c->steps);
}

TEST(SyntheticTraceTest, MoreLayersKeepEarlierLayers) {
  SyntheticTraceOptions options;
  options.num_steps = 10;
  options.num_layers = 2;
  Result<Trace> small = GenerateSyntheticTrace(options);
  options.num_layers = 3;
  Result<Trace> large = GenerateSyntheticTrace(options);
  ASSERT_TRUE(small.ok() && large.ok());
  for (int step = 0; step < 10; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      std::span<const double> a = small->layer_row(step, layer);
      std::span<const double> b = large->layer_row(step, layer);
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
    }
  }
}

// Guards against silent changes of the generator: these numbers must be the same on every
// machine and compiler. Update them only on a deliberate change of the model.
TEST(SyntheticTraceTest, GoldenFingerprint) {
  SyntheticTraceOptions options;
  options.num_steps = 8;
  options.num_layers = 2;
  options.num_sources = 3;
  options.tokens_per_source = 256;
  Result<Trace> trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok());
  EXPECT_EQ(Fingerprint(*trace), 6461499540834815901u) << "fingerprint " << Fingerprint(*trace);
}

TEST(SyntheticTraceTest, ShapesAndTotals) {
  SyntheticTraceOptions options;
  options.num_steps = 30;
  options.num_layers = 3;
  options.num_experts = 16;
  options.num_sources = 4;
  options.tokens_per_source = 500;
  options.top_k = 3;
  options.burst_probability = 0.3;
  options.burst_factor = 50.0;  // very hot experts still get each token at most once
  Result<Trace> trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 30);
  EXPECT_EQ(trace->num_layers, 3);
  EXPECT_EQ(trace->num_experts, 16);
  EXPECT_EQ(trace->num_sources, 4);
  EXPECT_EQ(trace->step_ids.back(), 29);
  for (int step = 0; step < 30; ++step) {
    for (int layer = 0; layer < 3; ++layer) {
      std::span<const double> row = trace->layer_row(step, layer);
      for (int source = 0; source < 4; ++source) {
        std::span<const double> part = row.subspan(source * 16, 16);
        ASSERT_EQ(Sum(part), 500.0 * 3);
        for (double count : part) {
          ASSERT_LE(count, 500.0);  // top-k experts are distinct per token
          ASSERT_EQ(count, static_cast<double>(static_cast<int64_t>(count)));
        }
      }
    }
  }

  options.num_sources = 0;
  trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok());
  EXPECT_EQ(trace->row_size(), 16);
  EXPECT_EQ(Sum(trace->layer_row(7, 2)), 500.0 * 3);
}

TEST(SyntheticTraceTest, TopKEqualsExpertsGivesUniformCounts) {
  SyntheticTraceOptions options;
  options.num_steps = 3;
  options.num_experts = 4;
  options.top_k = 4;
  options.tokens_per_source = 10;
  Result<Trace> trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok());
  for (double count : trace->steps[2]) EXPECT_EQ(count, 10.0);
}

TEST(SyntheticTraceTest, DefaultSkewImbalancesStaticPlacement) {
  SyntheticTraceOptions options;  // 32 experts; place them contiguously on 8 ranks
  Result<Trace> trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok());
  double sum = 0.0;
  int cells = 0;
  for (int step = 0; step < trace->num_steps(); ++step) {
    for (int layer = 0; layer < trace->num_layers; ++layer) {
      std::vector<double> counts = trace->ExpertCounts(step, layer);
      std::vector<double> ranks(8, 0.0);
      for (int e = 0; e < 32; ++e) ranks[e / 4] += counts[e];
      double total = std::accumulate(ranks.begin(), ranks.end(), 0.0);
      sum += *std::max_element(ranks.begin(), ranks.end()) / (total / 8);
      ++cells;
    }
  }
  EXPECT_GT(sum / cells, 1.5);
}

TEST(SyntheticTraceTest, InvalidOptionsNameTheField) {
  struct Case {
    void (*change)(SyntheticTraceOptions&);
    const char* field;
  };
  const Case cases[] = {
      {[](SyntheticTraceOptions& o) { o.num_steps = 0; }, "num_steps 0"},
      {[](SyntheticTraceOptions& o) { o.num_layers = -1; }, "num_layers -1"},
      {[](SyntheticTraceOptions& o) { o.num_experts = 0; }, "num_experts 0"},
      {[](SyntheticTraceOptions& o) { o.num_sources = -2; }, "num_sources -2"},
      {[](SyntheticTraceOptions& o) { o.tokens_per_source = 0; }, "tokens_per_source 0"},
      {[](SyntheticTraceOptions& o) { o.top_k = 33; }, "top_k 33"},
      {[](SyntheticTraceOptions& o) { o.zipf_exponent = -1; }, "zipf_exponent"},
      {[](SyntheticTraceOptions& o) { o.drift_swaps_per_step = -0.5; }, "drift_swaps_per_step"},
      {[](SyntheticTraceOptions& o) { o.burst_probability = 1.5; }, "burst_probability"},
      {[](SyntheticTraceOptions& o) { o.burst_factor = 0; }, "burst_factor"},
      {[](SyntheticTraceOptions& o) { o.burst_steps = 0; }, "burst_steps 0"},
  };
  for (const Case& c : cases) {
    SyntheticTraceOptions options;
    c.change(options);
    Result<Trace> trace = GenerateSyntheticTrace(options);
    ASSERT_FALSE(trace.ok()) << c.field;
    EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(trace.status().message().find(c.field), std::string::npos)
        << trace.status().message();
  }
}

}  // namespace
}  // namespace keel
