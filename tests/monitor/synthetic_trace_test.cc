// Tests of the synthetic trace generator: determinism, shapes and totals, option validation,
// that the default skew makes the static placement visibly imbalanced, and that drift and bursts
// change expert popularity as docs/traces.md describes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

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

// Options whose per-step counts measure the expected shares closely: one layer, 8 experts, one
// stream of top-1 tokens (so an expert's expected share is exactly its weight over the sum), and
// enough tokens that a share is known to about 0.001.
SyntheticTraceOptions ShareOptions() {
  SyntheticTraceOptions options;
  options.num_steps = 30;
  options.num_layers = 1;
  options.num_experts = 8;
  options.num_sources = 0;
  options.tokens_per_source = 200000;
  options.top_k = 1;
  options.zipf_exponent = 1.0;
  options.drift_swaps_per_step = 0.0;
  options.burst_probability = 0.0;
  return options;
}

std::vector<double> Shares(const Trace& trace, int step) {
  std::vector<double> counts = trace.ExpertCounts(step, 0);
  const double total = Sum(counts);
  for (double& count : counts) count /= total;
  return counts;
}

// Experts from most to least popular. With 8 experts under Zipf 1, neighbouring ranks differ by at
// least 1/7 - 1/8 of the weight (0.0066 of the tokens), several times the sampling noise.
std::vector<int> PopularityOrder(const std::vector<double>& shares) {
  std::vector<int> order(shares.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return shares[a] > shares[b]; });
  return order;
}

TEST(SyntheticTraceTest, WithoutDriftOrBurstsSharesStayZipfOverOneOrder) {
  const SyntheticTraceOptions options = ShareOptions();
  Result<Trace> trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  double harmonic = 0.0;
  for (int rank = 1; rank <= 8; ++rank) harmonic += 1.0 / rank;

  const std::vector<double> first = Shares(*trace, 0);
  const std::vector<int> order = PopularityOrder(first);
  for (int step = 0; step < options.num_steps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const std::vector<double> shares = Shares(*trace, step);
    EXPECT_EQ(PopularityOrder(shares), order);
    for (int rank = 0; rank < 8; ++rank) {
      // The expert at popularity rank i has weight 1 / (i + 1).
      EXPECT_NEAR(shares[order[rank]], 1.0 / (rank + 1) / harmonic, 0.005) << "rank " << rank;
    }
  }
}

TEST(SyntheticTraceTest, DriftSwapsNeighboursInPopularity) {
  // A whole swap per step: each step's order is the previous one with one adjacent pair exchanged.
  SyntheticTraceOptions options = ShareOptions();
  options.drift_swaps_per_step = 1.0;
  Result<Trace> trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  std::vector<int> previous = PopularityOrder(Shares(*trace, 0));
  const std::vector<int> first = previous;
  for (int step = 1; step < options.num_steps; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const std::vector<int> order = PopularityOrder(Shares(*trace, step));
    std::vector<int> moved;
    for (int rank = 0; rank < 8; ++rank) {
      if (order[rank] != previous[rank]) moved.push_back(rank);
    }
    ASSERT_EQ(moved.size(), 2u);
    EXPECT_EQ(moved[1], moved[0] + 1);
    EXPECT_EQ(order[moved[0]], previous[moved[1]]);
    previous = order;
  }
  EXPECT_NE(previous, first);

  // Half a swap per step: about half of the steps change the order.
  options.drift_swaps_per_step = 0.5;
  options.num_steps = 200;
  options.tokens_per_source = 100000;
  trace = GenerateSyntheticTrace(options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  int changed = 0;
  previous = PopularityOrder(Shares(*trace, 0));
  for (int step = 1; step < options.num_steps; ++step) {
    const std::vector<int> order = PopularityOrder(Shares(*trace, step));
    if (order != previous) ++changed;
    previous = order;
  }
  EXPECT_GT(changed, 60);  // binomial(199, 0.5): mean 99.5, sd 7
  EXPECT_LT(changed, 140);
}

TEST(SyntheticTraceTest, BurstMultipliesOneExpertForBurstSteps) {
  // Equal weights (Zipf 0) and a burst starting every step: at step s the bursts started in the
  // last burst_steps steps are active, each multiplying one expert's weight by the factor, so
  // every expert's count over an unburst expert's is factor^(bursts on it), and the bursts add up
  // to min(s + 1, burst_steps).
  for (int burst_steps : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "burst_steps " << burst_steps);
    SyntheticTraceOptions options = ShareOptions();
    options.num_steps = 12;
    options.tokens_per_source = 400000;
    options.zipf_exponent = 0.0;
    options.burst_probability = 1.0;
    options.burst_factor = 8.0;
    options.burst_steps = burst_steps;
    Result<Trace> trace = GenerateSyntheticTrace(options);
    ASSERT_TRUE(trace.ok()) << trace.status().ToString();
    for (int step = 0; step < options.num_steps; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      std::vector<double> counts = trace->ExpertCounts(step, 0);
      // At most 3 experts burst, so the 5 smallest counts are unburst ones.
      std::vector<double> sorted = counts;
      std::sort(sorted.begin(), sorted.end());
      const double unburst = Sum(std::span<const double>(sorted).first(5)) / 5;
      int bursts = 0;
      for (int e = 0; e < 8; ++e) {
        const double power = std::log(counts[e] / unburst) / std::log(options.burst_factor);
        EXPECT_NEAR(power, std::round(power), 0.15) << "expert " << e << ": " << counts[e];
        bursts += static_cast<int>(std::round(power));
      }
      EXPECT_EQ(bursts, std::min(step + 1, burst_steps));
    }
  }
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
      // Sizes and the work they multiply into, bounded before anything is allocated or drawn.
      {[](SyntheticTraceOptions& o) { o.num_sources = 4097; },
       "num_sources 4097 must be in 0..4096"},
      {[](SyntheticTraceOptions& o) { o.num_layers = 65537; }, "num_layers 65537"},
      {[](SyntheticTraceOptions& o) { o.num_steps = 1000000; },
       "counts is more than the 67108864 counts (512 MiB) a trace may hold"},
      {[](SyntheticTraceOptions& o) { o.tokens_per_source = 1 << 30; }, "token selections"},
      {[](SyntheticTraceOptions& o) {
         o.num_steps = 100000;
         o.num_sources = 0;
         o.tokens_per_source = 1;
         o.drift_swaps_per_step = 1e6;
       },
       "popularity swaps"},
      {[](SyntheticTraceOptions& o) {
         o.num_steps = 100000;
         o.num_experts = 2;
         o.num_sources = 0;
         o.tokens_per_source = 1;
         o.burst_probability = 1;
         o.burst_steps = 1 << 30;
       },
       "burst updates"},
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
