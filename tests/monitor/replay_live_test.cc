// Tests of the replay hooks that `keel replay --serve-metrics` exports from: one event per
// (step, layer) with consistent shapes, replans and placement changes reported as they happen,
// and a stop request that ends the replay with kAborted.
#include <gtest/gtest.h>

#include <numeric>

#include "monitor/trace.h"
#include "tools/replay.h"

namespace keel {
namespace {

Trace SmallTrace() {
  SyntheticTraceOptions options;
  options.num_steps = 12;
  options.num_layers = 2;
  options.num_experts = 16;
  options.num_sources = 4;
  Result<Trace> trace = GenerateSyntheticTrace(options);
  EXPECT_TRUE(trace.ok());
  return std::move(trace).value();
}

KeelConfig SmallConfig() {
  KeelConfig config;
  config.topology.gpus_per_node = 4;
  config.slots.persistent_per_rank = 5;
  return config;
}

TEST(ReplayLiveTest, OneEventPerStepAndLayer) {
  const Trace trace = SmallTrace();
  tools::ReplayOptions options;
  options.policies = {"keel"};
  int events = 0;
  int steps = 0;
  int changes = 0;
  options.on_layer_step = [&](const tools::ReplayLayerEvent& event) {
    ++events;
    ASSERT_NE(event.placement, nullptr);
    ASSERT_NE(event.routing, nullptr);
    EXPECT_EQ(event.expert_tokens.size(), 16u);
    EXPECT_EQ(event.expert_estimate.size(), 16u);
    EXPECT_EQ(event.estimated_rank_tokens.size(), 4u);
    EXPECT_EQ(event.routing->rank_tokens.size(), 4u);
    // The routing computes exactly the step's tokens.
    EXPECT_NEAR(
        std::accumulate(event.routing->rank_tokens.begin(), event.routing->rank_tokens.end(), 0.0),
        std::accumulate(event.expert_tokens.begin(), event.expert_tokens.end(), 0.0), 1e-6);
    EXPECT_EQ(event.replanned, event.step >= 1);  // causal: no plan before any load was seen
    if (!event.placement_changed) {
      EXPECT_EQ(event.migration.bytes, 0);
    }
    changes += event.placement_changed;
  };
  options.on_step_end = [&](int policy, int step) {
    EXPECT_EQ(policy, 0);
    EXPECT_EQ(step, steps++);
    return true;
  };
  Result<tools::ReplayReport> report = tools::ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(events, 12 * 2);
  EXPECT_EQ(steps, 12);
  EXPECT_EQ(report->policies[0].moved_bytes_total > 0, changes > 0);
}

TEST(ReplayLiveTest, StopRequestAbortsTheReplay) {
  tools::ReplayOptions options;
  options.policies = {"static"};
  int steps = 0;
  options.on_step_end = [&](int, int step) {
    ++steps;
    return step < 4;
  };
  Result<tools::ReplayReport> report = tools::ReplayTrace(SmallTrace(), SmallConfig(), options);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kAborted);
  EXPECT_EQ(steps, 5);
}

}  // namespace
}  // namespace keel
