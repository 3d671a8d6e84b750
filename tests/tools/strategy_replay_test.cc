// Strategy replay on small in-memory traces: auto follows a load that favours one strategy early
// and another late, the pool comes from the profiling replay, and bad names and pools are
// refused with the bad value named.
#include "tools/strategy_replay.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

namespace keel::tools {
namespace {

constexpr int kPhaseSteps = 30;

// 1 node x 4 GPUs, 8 experts, 2 layers. First phase: every rank routes 1000 rows evenly; second:
// half of every rank's rows go to expert 0. ep (static placement, experts whole) is cheapest
// while the load is even; once expert 0's rank computes half of all rows, ppmoe (every expert
// sliced over the node) is.
Trace TwoPhaseTrace() {
  Trace trace;
  trace.description = "two phases";
  trace.num_layers = 2;
  trace.num_experts = 8;
  trace.num_sources = 4;
  for (int t = 0; t < 2 * kPhaseSteps; ++t) {
    trace.step_ids.push_back(t);
    std::vector<double> values;
    for (int l = 0; l < trace.num_layers; ++l) {
      for (int s = 0; s < trace.num_sources; ++s) {
        for (int e = 0; e < trace.num_experts; ++e) {
          if (t < kPhaseSteps) {
            values.push_back(125);
          } else {
            values.push_back(e == 0 ? 500 : 500.0 / 7);
          }
        }
      }
    }
    trace.steps.push_back(std::move(values));
  }
  return trace;
}

KeelConfig TwoPhaseConfig() {
  KeelConfig config;
  config.topology.num_nodes = 1;
  config.topology.gpus_per_node = 4;
  config.slots.persistent_per_rank = 2;
  config.slots.transient_per_rank = 0;
  config.policy.name = "static";
  config.policy.keel.transient_replicas = false;
  config.cost_model.hidden_size = 1024;
  config.cost_model.expert_ffn_size = 8192;
  return config;
}

const StrategyReplayResult& Find(const StrategyReplayReport& report, const std::string& name) {
  for (const StrategyReplayResult& r : report.strategies) {
    if (r.name == name) return r;
  }
  ADD_FAILURE() << "no strategy " << name;
  return report.strategies.front();
}

// Mean step over [begin, end).
double MeanStep(const StrategyReplayResult& r, int begin, int end) {
  return std::accumulate(r.step_seconds.begin() + begin, r.step_seconds.begin() + end, 0.0) /
         (end - begin);
}

TEST(StrategyReplayTest, AutoFollowsTheStrategyThatWinsEachPhase) {
  Result<StrategyReplayReport> report =
      ReplayStrategies(TwoPhaseTrace(), TwoPhaseConfig(), StrategyReplayOptions{});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const StrategyReplayResult& ep = Find(*report, "ep");
  const StrategyReplayResult& ppmoe = Find(*report, "ppmoe");
  const StrategyReplayResult& automatic = Find(*report, "auto");
  // The trace does what it was built for.
  ASSERT_LT(MeanStep(ep, 0, kPhaseSteps), MeanStep(ppmoe, 0, kPhaseSteps));
  ASSERT_LT(MeanStep(ppmoe, kPhaseSteps, 2 * kPhaseSteps),
            MeanStep(ep, kPhaseSteps, 2 * kPhaseSteps));
  // One switch per layer, into ppmoe, and every phase once settled (its estimator has seen ten
  // steps of it) as fast as the better fixed strategy.
  EXPECT_EQ(automatic.switches, 2);
  EXPECT_GT(automatic.layer_steps_in[static_cast<int>(Strategy::kPpmoe)], 0);
  constexpr int kSettle = 10;
  EXPECT_LE(MeanStep(automatic, kSettle, kPhaseSteps), MeanStep(ep, kSettle, kPhaseSteps));
  EXPECT_LE(MeanStep(automatic, kPhaseSteps + kSettle, 2 * kPhaseSteps),
            MeanStep(ppmoe, kPhaseSteps + kSettle, 2 * kPhaseSteps));
  // The switch itself was paid for: the whole second phase costs auto more than ppmoe.
  EXPECT_GT(automatic.migration_seconds, 0);
  EXPECT_GT(MeanStep(automatic, kPhaseSteps, 2 * kPhaseSteps),
            MeanStep(ppmoe, kPhaseSteps, 2 * kPhaseSteps));
}

TEST(StrategyReplayTest, PoolStartsInTheBestAloneAndNeverLeavesAPoolOfOne) {
  const Trace trace = TwoPhaseTrace();
  StrategyReplayOptions profile;
  profile.strategies = {"ep", "esp", "parm", "ppmoe"};
  Result<StrategyReplayReport> profiled = ReplayStrategies(trace, TwoPhaseConfig(), profile);
  ASSERT_TRUE(profiled.ok()) << profiled.status().ToString();
  const StrategyPool pool = BuildStrategyPool(*profiled, 1);
  ASSERT_EQ(pool.layers.size(), 2u);
  // Over both phases ppmoe's total is the lower one.
  EXPECT_EQ(pool.layers[0], std::vector<Strategy>({Strategy::kPpmoe}));

  StrategyReplayOptions options;
  options.strategies = {"ppmoe", "auto"};
  options.pool = pool;
  Result<StrategyReplayReport> report = ReplayStrategies(trace, TwoPhaseConfig(), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(Find(*report, "auto").switches, 0);
  EXPECT_EQ(Find(*report, "auto").step_seconds, Find(*report, "ppmoe").step_seconds);
}

TEST(StrategyReplayTest, PoolJsonRoundTripsAndNamesBadEntries) {
  StrategyPool pool;
  pool.source = "test";
  pool.layers = {{Strategy::kPpmoe, Strategy::kEp}, {Strategy::kEsp}};
  Result<StrategyPool> back = StrategyPoolFromJson(StrategyPoolToJson(pool));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->layers, pool.layers);  // order kept: the first is where a layer starts
  EXPECT_EQ(back->source, "test");

  nlohmann::json bad = StrategyPoolToJson(pool);
  bad["layers"][1] = {"esp", "tp"};
  Result<StrategyPool> refused = StrategyPoolFromJson(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("layers[1]"), std::string::npos);
  EXPECT_NE(refused.status().message().find("'tp'"), std::string::npos);
  bad["layers"][1] = {"esp", "esp"};
  EXPECT_NE(StrategyPoolFromJson(bad).status().message().find("listed twice"), std::string::npos);
  EXPECT_FALSE(StrategyPoolFromJson(nlohmann::json{{"layers", pool.layers.size()}}).ok());
}

TEST(StrategyReplayTest, RefusesUnknownStrategiesAndPoolsOfTheWrongShape) {
  StrategyReplayOptions options;
  options.strategies = {"ep", "tensor"};
  Result<StrategyReplayReport> report =
      ReplayStrategies(TwoPhaseTrace(), TwoPhaseConfig(), options);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("'tensor'"), std::string::npos);

  options.strategies = {};
  options.pool.layers = {{Strategy::kEp}};  // the trace has two layers
  report = ReplayStrategies(TwoPhaseTrace(), TwoPhaseConfig(), options);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("the pool has 1 layers, the trace 2"),
            std::string::npos);
}

TEST(StrategyReplayTest, SameInputsGiveTheSameReport) {
  const Trace trace = TwoPhaseTrace();
  Result<StrategyReplayReport> first = ReplayStrategies(trace, TwoPhaseConfig(), {});
  Result<StrategyReplayReport> second = ReplayStrategies(trace, TwoPhaseConfig(), {});
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(StrategyReplayReportToJson(*first), StrategyReplayReportToJson(*second));
  EXPECT_EQ(first->layer_step_seconds, second->layer_step_seconds);
}

}  // namespace
}  // namespace keel::tools
