// Load inputs and estimators: StepLoad validation and the last-step, window and EMA estimators.
#include "placement/load.h"

#include <gtest/gtest.h>

namespace keel {
namespace {

TEST(StepLoadTest, ExpertCountsSpreadEvenlyOverSources) {
  std::vector<double> counts = {8, 4};
  auto load = StepLoad::FromExpertCounts(4, counts);
  ASSERT_TRUE(load.ok());
  EXPECT_DOUBLE_EQ(load->at(3, 0), 2);
  EXPECT_DOUBLE_EQ(load->at(0, 1), 1);
  EXPECT_EQ(load->ExpertTotals(), counts);
  EXPECT_DOUBLE_EQ(load->TotalTokens(), 12);
}

TEST(StepLoadTest, RejectsBadTraffic) {
  auto wrong_size = StepLoad::FromTraffic(2, 2, {1, 2, 3});
  ASSERT_FALSE(wrong_size.ok());
  EXPECT_NE(wrong_size.status().message().find("3 entries"), std::string::npos);
  auto negative = StepLoad::FromTraffic(2, 2, {1, 2, -3, 4});
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("traffic[source 1][expert 0]"), std::string::npos);
}

TEST(LoadEstimatorTest, LastStepForgetsThePast) {
  EstimatorConfig config;
  config.kind = EstimatorKind::kLastStep;
  LoadEstimator est(config, 2);
  EXPECT_EQ(est.Estimate(), (std::vector<double>{0, 0}));
  est.Observe(std::vector<double>{1, 2});
  est.Observe(std::vector<double>{5, 7});
  EXPECT_EQ(est.Estimate(), (std::vector<double>{5, 7}));
  EXPECT_EQ(est.observed_steps(), 2);
}

TEST(LoadEstimatorTest, EmaStartsAtTheFirstObservation) {
  EstimatorConfig config;
  config.kind = EstimatorKind::kEma;
  config.ema_decay = 0.75;
  LoadEstimator est(config, 1);
  est.Observe(std::vector<double>{8});
  EXPECT_DOUBLE_EQ(est.Estimate()[0], 8);
  est.Observe(std::vector<double>{0});
  EXPECT_DOUBLE_EQ(est.Estimate()[0], 6);
}

TEST(LoadEstimatorTest, WindowAveragesTheLastSteps) {
  EstimatorConfig config;
  config.kind = EstimatorKind::kSlidingWindow;
  config.window_steps = 2;
  LoadEstimator est(config, 1);
  est.Observe(std::vector<double>{2});
  EXPECT_DOUBLE_EQ(est.Estimate()[0], 2);
  est.Observe(std::vector<double>{4});
  EXPECT_DOUBLE_EQ(est.Estimate()[0], 3);
  est.Observe(std::vector<double>{10});
  EXPECT_DOUBLE_EQ(est.Estimate()[0], 7);
}

}  // namespace
}  // namespace keel
