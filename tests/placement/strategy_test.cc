// Strategies: each one's step parts (bytes per link tier, collectives, compute) against values
// worked by hand on two nodes of two GPUs, the switch price, the GEMM efficiency curve, the pool
// and auto's choice.
#include "placement/strategy.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/placement/two_nodes.h"

namespace keel {
namespace {

// Four experts; rank 0 routes 100 rows to expert 0 and 50 to expert 2, the others nothing.
StepLoad OneBusyRank() {
  std::vector<double> traffic(4 * 4, 0.0);
  traffic[0 * 4 + 0] = 100;
  traffic[0 * 4 + 2] = 50;
  return StepLoad::FromTraffic(4, 4, traffic).value();
}

struct Fixture {
  CostModel cost{TwoNodesOfTwo(), HandModel()};
  StrategyConfig config = [] {
    StrategyConfig c;
    c.shard_degree = 2;
    c.mp_degree = 2;
    c.parm_chunks = 4;
    return c;
  }();
  StrategyModel Model() const { return StrategyModel::Create(cost, config).value(); }
};

TEST(StrategyTest, NamesRoundTrip) {
  for (Strategy strategy : kAllStrategies) {
    EXPECT_EQ(ParseStrategy(StrategyName(strategy)).value(), strategy);
  }
  Result<Strategy> bad = ParseStrategy("tp");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'tp'"), std::string::npos);
}

TEST(StrategyTest, ContiguousOwnerDealsLikeTheStaticPlacement) {
  // 5 experts over 2 owners: 3 + 2.
  EXPECT_EQ(ContiguousOwner(0, 5, 2), 0);
  EXPECT_EQ(ContiguousOwner(2, 5, 2), 0);
  EXPECT_EQ(ContiguousOwner(3, 5, 2), 1);
  EXPECT_EQ(ContiguousOwner(4, 5, 2), 1);
  const Placement contiguous = Placement::Contiguous(7, 3, 3).value();
  for (int e = 0; e < 7; ++e) EXPECT_EQ(ContiguousOwner(e, 7, 3), contiguous.home(e));
}

TEST(StrategyTest, EspShardsOverTheNodeAndGathersInside) {
  Fixture f;
  const StrategyCost cost = f.Model().Estimate(Strategy::kEsp, OneBusyRank()).value();
  // Experts 0, 1 on ranks {0, 1}; 2, 3 on {2, 3}. Expert 0's rows stay on rank 0; expert 2's
  // 50 rows cross to rank 2 (rank 0's position in the other group): 1e5 bytes at 1e10 B/s.
  EXPECT_DOUBLE_EQ(cost.all_to_all_seconds, 4 * 1e5 / 1e10);
  // Group 0 all-gathers 100 rows (rank 0 sends 2e5 bytes), group 1 50 rows: 2e5 at 1e11 B/s.
  EXPECT_DOUBLE_EQ(cost.all_reduce_seconds, 4 * 2e5 / 1e11);
  // Group 0's ranks each run half of expert 0 for 100 rows.
  EXPECT_DOUBLE_EQ(cost.compute_seconds, 100 * 4.8e7 / 1e12 / 2);
  EXPECT_DOUBLE_EQ(cost.compute_imbalance, 100.0 / 75.0);
  EXPECT_DOUBLE_EQ(cost.sync_seconds, 0);
  EXPECT_DOUBLE_EQ(cost.link_bytes, 4 * (1e5 + 2e5 + 1e5));
  // Rank 0 sends its expert-2 rows to rank 2, all-gathers its 100 rows to rank 1 and
  // reduce-scatters nothing (rank 1 collected none): 2 messages. Rank 2 returns the outputs to
  // rank 0, all-gathers to rank 3: 2. Rank 1 reduce-scatters rank 0's block back: 1.
  EXPECT_EQ(cost.messages_per_rank, 2);
}

TEST(StrategyTest, MessagesCountEveryPeerThatGetsBytes) {
  Fixture f;
  // Every rank routes rows to every expert: esp's groups exchange with the other group's member
  // at their position (there and back) and gather and reduce-scatter with their one peer.
  std::vector<double> traffic(4 * 4, 10.0);
  const StepLoad even = StepLoad::FromTraffic(4, 4, traffic).value();
  const StrategyModel model = f.Model();
  EXPECT_EQ(model.Estimate(Strategy::kEsp, even).value().messages_per_rank, 2 + 2);
  // parm adds the MP group's all-gather to its one other member.
  EXPECT_EQ(model.Estimate(Strategy::kParm, even).value().messages_per_rank, 2 + 2 + 1);
  // ppmoe: a ring all-reduce over the node's 2 ranks, P - 1 pieces each way.
  EXPECT_EQ(model.Estimate(Strategy::kPpmoe, even).value().messages_per_rank, 2);
  // ep on the static placement (one expert per rank): each rank sends to the 3 others and gets
  // rows back from them.
  const Placement placement = Placement::Contiguous(4, 4, 1).value();
  const StepRouting routing = RouteEvenly(placement, even);
  const StrategyCost ep = EpStrategyCost(f.cost, f.cost.Estimate(placement, routing), routing);
  EXPECT_EQ(ep.messages_per_rank, 6);
  EXPECT_DOUBLE_EQ(ep.link_bytes, 4 * 12 * 10 * 2000.0);  // 12 off-rank pairs of 10 rows
  EXPECT_DOUBLE_EQ(ep.compute_imbalance, 1.0);
}

TEST(StrategyTest, ParmOverlapsTheGatherAndAllGathersTheMpGroup) {
  Fixture f;
  const StrategyCost cost = f.Model().Estimate(Strategy::kParm, OneBusyRank()).value();
  const double exchange = 1e5 / 1e10;  // as esp: one crossing per row
  const double gather = 2e5 / 1e11;
  EXPECT_DOUBLE_EQ(cost.all_to_all_seconds, 4 * exchange);
  // Overlapped in 4 chunks: a quarter of the shorter part stays exposed, per pass. The MP
  // group {0, 1} all-gathers rank 0's 150 rows, 75 tokens of 2000 bytes, to its other member,
  // forward and backward.
  const double mp_gather = 75 * 2000 / 1e11;
  EXPECT_NEAR(cost.all_reduce_seconds, 4 * gather / 4 + 2 * mp_gather, 1e-15);
  EXPECT_DOUBLE_EQ(cost.compute_seconds, 100 * 4.8e7 / 1e12 / 2);
}

TEST(StrategyTest, PpmoeSlicesEveryExpertAndAllReducesInTheNode) {
  Fixture f;
  const StrategyCost cost = f.Model().Estimate(Strategy::kPpmoe, OneBusyRank()).value();
  EXPECT_DOUBLE_EQ(cost.all_to_all_seconds, 0);
  // Node 0's 150 rows on each of its two ranks at half an expert each.
  EXPECT_DOUBLE_EQ(cost.compute_seconds, 150 * 4.8e7 / 1e12 / 2);
  EXPECT_DOUBLE_EQ(cost.compute_imbalance, 2.0);
  // Ring all-reduce of node 0's 75 tokens x 2000 bytes, 2 (P - 1) / P = 1 of them per rank,
  // forward and backward.
  EXPECT_DOUBLE_EQ(cost.all_reduce_seconds, 2 * 75 * 2000 / 1e11);
  // Each rank's slice of all 4 experts (3.2e7 bytes) has a copy on the other node: gradient and
  // weights, half of it each way per pass, over the network.
  EXPECT_DOUBLE_EQ(cost.sync_seconds, 3.2e7 * 2 * 0.5 / 1e10);
}

TEST(StrategyTest, EpIsPricedByTheCostModelNotHere) {
  Fixture f;
  EXPECT_FALSE(f.Model().Estimate(Strategy::kEp, OneBusyRank()).ok());
  std::vector<double> three_sources(3 * 4, 1.0);
  EXPECT_FALSE(
      f.Model().Estimate(Strategy::kEsp, StepLoad::FromTraffic(3, 4, three_sources).value()).ok());
}

TEST(StrategyTest, GemmEfficiencyCurveSlowsNarrowShards) {
  Fixture f;
  f.cost = CostModel(TwoNodesOfTwo(), [] {
    CostModelConfig c = HandModel();
    c.gemm_efficiency = "1000:0.5, 4000:1";
    return c;
  }());
  const StrategyModel model = f.Model();
  EXPECT_DOUBLE_EQ(model.RelativeGemmEfficiency(4000), 1.0);
  EXPECT_DOUBLE_EQ(model.RelativeGemmEfficiency(2000), 0.75);  // halfway on log2
  EXPECT_DOUBLE_EQ(model.RelativeGemmEfficiency(500), 0.5);    // held beyond the points
  const StrategyCost cost = model.Estimate(Strategy::kEsp, OneBusyRank()).value();
  EXPECT_DOUBLE_EQ(cost.compute_seconds, 100 * 4.8e7 / 1e12 / 2 / 0.75);
}

TEST(StrategyTest, DegreesMustDivideTheNode) {
  Fixture f;
  f.config.shard_degree = 3;
  Result<StrategyModel> bad = StrategyModel::Create(f.cost, f.config);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("strategy.shard_degree: 3"), std::string::npos);
  f.config.shard_degree = 0;  // the whole node
  EXPECT_EQ(f.Model().shard_degree(), 2);
}

TEST(StrategyTest, ZeroDegreesMeanTheNodeAndItsSmallestSplit) {
  StrategyConfig config;  // both 0
  EXPECT_EQ(ShardDegree(config, 8), 8);
  EXPECT_EQ(MpDegree(config, 8), 2);
  EXPECT_EQ(MpDegree(config, 9), 3);
  EXPECT_EQ(MpDegree(config, 7), 7);
  EXPECT_EQ(MpDegree(config, 1), 1);
  config.mp_degree = 4;
  config.shard_degree = 2;
  EXPECT_EQ(MpDegree(config, 8), 4);
  EXPECT_EQ(ShardDegree(config, 8), 2);
}

TEST(StrategyTest, SwitchMovesTheStateEachRankGains) {
  Fixture f;
  const StrategyModel model = f.Model();
  const std::vector<int> homes = {0, 1, 2, 3};
  const StrategyLayout ep{Strategy::kEp, homes};
  // To esp: each rank gains half of its neighbour's expert (5.6e7 bytes) over NVLink.
  EXPECT_DOUBLE_EQ(model.SwitchSeconds(ep, {Strategy::kEsp, {}}, 4), 0.5 * 1.12e8 / 1e11);
  // To ppmoe: rank 0 gains half of expert 1 in its node and half of experts 2 and 3, which its
  // node never held, over the network.
  EXPECT_DOUBLE_EQ(model.SwitchSeconds(ep, {Strategy::kPpmoe, {}}, 4), 1.12e8 / 1e10);
  EXPECT_DOUBLE_EQ(model.SwitchSeconds({Strategy::kEsp, {}}, {Strategy::kEsp, {}}, 4), 0);
  // Back from esp to homes that moved off the node: a whole home crosses the network.
  const std::vector<int> moved = {2, 1, 0, 3};
  EXPECT_DOUBLE_EQ(model.SwitchSeconds({Strategy::kEsp, {}}, {Strategy::kEp, moved}, 4),
                   1.12e8 / 1e10);
}

TEST(StrategyTest, PoolPicksTheBestThenWhatCoversItsWorstSteps) {
  const std::vector<std::vector<double>> costs = {{1, 1, 1, 1}, {2, 2, 0.5, 0.5}, {0.9, 3, 3, 3}};
  EXPECT_EQ(SelectPool(costs, 1), std::vector<int>({0}));
  EXPECT_EQ(SelectPool(costs, 2), std::vector<int>({0, 1}));
  EXPECT_EQ(SelectPool(costs, 5), std::vector<int>({0, 1, 2}));
  // The best alone comes first even when its index is not the lowest.
  const std::vector<std::vector<double>> reversed = {costs[2], costs[1], costs[0]};
  EXPECT_EQ(SelectPool(reversed, 2), std::vector<int>({2, 1}));
}

TEST(StrategyTest, PoolStartsOnTheSteadierOfTwoThatTie) {
  // Candidate 0 has the least total, but candidate 1's excess over it (0.05, -0.04, 0.02 by
  // step) has mean 0.01 and standard error sqrt(0.0021 / 3) = 0.026: a tie. Candidate 1 spreads
  // less (not at all), so the pool starts on it.
  const std::vector<std::vector<double>> tie = {{0.95, 1.04, 0.98}, {1, 1, 1}};
  EXPECT_EQ(SelectPool(tie, 1), std::vector<int>({1}));
  EXPECT_EQ(SelectPool(tie, 2), std::vector<int>({1, 0}));
  // A lead that stands out of its spread keeps the best alone first, though the other is
  // steadier: excess 0.10, 0.08, 0.09, mean 0.09, standard error 0.01 / sqrt(3) = 0.006.
  const std::vector<std::vector<double>> clear = {{0.90, 0.92, 0.91}, {1, 1, 1}};
  EXPECT_EQ(SelectPool(clear, 2), std::vector<int>({0, 1}));
  // A tie with a candidate that spreads more keeps the best alone.
  const std::vector<std::vector<double>> wilder = {{1, 1, 1}, {0.95, 1.04, 1.02}};
  EXPECT_EQ(SelectPool(wilder, 1), std::vector<int>({0}));
  // One profiling step has no spread to judge a tie by.
  const std::vector<std::vector<double>> one = {{0.99}, {1}};
  EXPECT_EQ(SelectPool(one, 1), std::vector<int>({0}));
}

TEST(StrategyTest, AutoSwitchesOnlyWhenTheGainRepaysTheMove) {
  StrategyConfig config;
  config.switch_payback_steps = 50;
  config.min_gain_fraction = 0.02;
  const std::vector<double> estimated = {1.0, 0.5};
  const std::vector<double> steady = {0, 0};
  EXPECT_EQ(ChooseStrategy(0, estimated, steady, std::vector<double>{0, 10}, config), 1);
  EXPECT_EQ(ChooseStrategy(0, estimated, steady, std::vector<double>{0, 30}, config), 0);
  EXPECT_EQ(ChooseStrategy(1, estimated, steady, std::vector<double>{0, 0}, config), 1);
  const std::vector<double> close = {1.0, 0.99};
  EXPECT_EQ(ChooseStrategy(0, close, steady, std::vector<double>{0, 0}, config), 0);
}

TEST(StrategyTest, AutoDiscountsTheGainByTheEstimatesSpread) {
  StrategyConfig config;
  config.switch_payback_steps = 50;
  config.min_gain_fraction = 0.02;
  const std::vector<double> estimated = {1.0, 0.5};
  const std::vector<double> no_switch_cost = {0, 0};
  // A gain of 0.5 against spreads of 0.3 and 0.4 (combined 0.5): nothing stands out.
  EXPECT_EQ(ChooseStrategy(0, estimated, std::vector<double>{0.3, 0.4}, no_switch_cost, config), 0);
  // Spreads of 0.3 and 0 leave 0.2 a step: it pays a switch of 9.9 but not one of 10.1.
  EXPECT_EQ(ChooseStrategy(0, estimated, std::vector<double>{0.3, 0}, std::vector<double>{0, 9.9},
                           config),
            1);
  EXPECT_EQ(ChooseStrategy(0, estimated, std::vector<double>{0.3, 0}, std::vector<double>{0, 10.1},
                           config),
            0);
}

}  // namespace
}  // namespace keel
