// Sharded experts as units (placement/shards.h): the shard map, the first placement of the units
// and a reshard's, the byte pieces a reshard copies, and the shard-or-replicate choice, each on
// cases worked by hand.
#include "placement/shards.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/placement/two_nodes.h"

namespace keel {
namespace {

constexpr int E = kEmptySlot;

TEST(ShardMapTest, NumbersUnitsExpertByExpert) {
  const ShardMap map = ShardMap::Create({1, 3, 1, 2}).value();
  EXPECT_EQ(map.num_experts(), 4);
  EXPECT_EQ(map.num_units(), 7);
  EXPECT_TRUE(map.sharded());
  EXPECT_EQ(map.first_unit(1), 1);
  EXPECT_EQ(map.first_unit(3), 5);
  EXPECT_EQ(map.expert_of(3), 1);
  EXPECT_EQ(map.shard_of(3), 2);
  EXPECT_EQ(map.shard_of(6), 1);
  EXPECT_EQ(map.UnitCounts(std::vector<int32_t>{5, 6, 7, 8}),
            (std::vector<int32_t>{5, 6, 6, 6, 7, 8, 8}));
  // Two sources: every unit sees its expert's rows, and back.
  const std::vector<double> by_expert = {1, 2, 3, 4, 10, 20, 30, 40};
  const std::vector<double> by_unit = map.UnitTraffic(by_expert);
  EXPECT_EQ(by_unit, (std::vector<double>{1, 2, 2, 2, 3, 4, 4, 10, 20, 20, 20, 30, 40, 40}));
  EXPECT_EQ(map.ExpertTraffic(by_unit), by_expert);
  EXPECT_FALSE(ShardMap::Whole(4).sharded());
  const Status bad = ShardMap::Create({1, 1, 0}).status();
  EXPECT_NE(bad.message().find("shards of expert 2 = 0 must be >= 1"), std::string::npos)
      << bad.ToString();
}

TEST(PlaceShardsTest, OtherShardsGoToTheNextRanksOfTheHomesNode) {
  const Topology topology = TwoNodesOfTwo();
  // Rank r holds expert r in slot 2r; slot 2r + 1 is empty.
  const Placement whole = Placement::Contiguous(4, 4, 2).value();
  // Expert 0 (home rank 0) over 2: its shard 1 takes rank 1's empty slot 3.
  Placement p = PlaceShards(whole, ShardMap::Create({2, 1, 1, 1}).value(), topology).value();
  EXPECT_EQ(p.phy2log(), (std::vector<int>{0, E, 2, 1, 3, E, 4, E}));
  EXPECT_EQ(p.home(), (std::vector<int>{0, 1, 1, 2, 3}));
  // Expert 3 (home rank 3, node 1) over 2: the next rank of node 1 wraps around to rank 2.
  p = PlaceShards(whole, ShardMap::Create({1, 1, 1, 2}).value(), topology).value();
  EXPECT_EQ(p.phy2log(), (std::vector<int>{0, E, 1, E, 2, 4, 3, E}));
  EXPECT_EQ(p.home(4), 2);
}

TEST(PlaceShardsTest, TakesAReplicaSlotWhenNoSlotIsEmpty) {
  const Topology topology = TwoNodesOfTwo();
  // Expert 1 has copies on ranks 0 (its home slot 1) and 1 (slot 2, a replica).
  const Placement whole = Placement::Create(4, 4, {0, 1, 1, 2, 2, 3, 3, 0}).value();
  const Placement p = PlaceShards(whole, ShardMap::Create({2, 1, 1, 1}).value(), topology).value();
  EXPECT_EQ(p.phy2log(), (std::vector<int>{0, 2, 1, 3, 3, 4, 4, 0}));
  EXPECT_EQ(p.home(), (std::vector<int>{0, 1, 0, 1, 2}));
}

TEST(PlaceShardsTest, RefusesShardsThatDoNotFitTheNode) {
  const Topology topology = TwoNodesOfTwo();
  const Status wide = PlaceShards(Placement::Contiguous(4, 4, 2).value(),
                                  ShardMap::Create({3, 1, 1, 1}).value(), topology)
                          .status();
  EXPECT_EQ(wide.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wide.message().find("expert 0 has 3 shards, more than the node's "
                                "topology.gpus_per_node = 2"),
            std::string::npos)
      << wide.ToString();
  const Status full = PlaceShards(Placement::Contiguous(4, 4, 1).value(),
                                  ShardMap::Create({1, 2, 1, 1}).value(), topology)
                          .status();
  EXPECT_EQ(full.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(full.message().find("expert 1's shard 1 of 2 finds no empty or replica slot on the "
                                "ranks of node 0"),
            std::string::npos)
      << full.ToString();
}

TEST(ReshardTest, KeepsTheOtherUnitsAndRestartsTheChangedExperts) {
  const Topology topology = TwoNodesOfTwo();
  const ShardMap two_of_first = ShardMap::Create({2, 1, 1, 1}).value();
  const Placement p =
      PlaceShards(Placement::Contiguous(4, 4, 2).value(), two_of_first, topology).value();
  // Expert 0 joins (its shard 1 leaves slot 3) while expert 3 splits into slot 5 of rank 2;
  // experts 1 and 2 keep their slots under their new unit numbers.
  const ShardMap two_of_last = ShardMap::Create({1, 1, 1, 2}).value();
  const Placement next = Reshard(p, two_of_first, two_of_last, topology).value();
  EXPECT_EQ(next.phy2log(), (std::vector<int>{0, E, 1, E, 2, 4, 3, E}));
  EXPECT_EQ(next.home(), (std::vector<int>{0, 1, 2, 3, 2}));
  EXPECT_FALSE(Reshard(p, ShardMap::Whole(4), two_of_last, topology).ok());
}

TEST(ReshardTest, NoShardLandsWhereAnotherChangedExpertRestarts) {
  const Topology topology = TwoNodesOfTwo();
  const ShardMap whole = ShardMap::Whole(4);
  const Placement p = Placement::Contiguous(4, 4, 2).value();
  // Experts 0 and 1 (ranks 0 and 1, node 0) both split. Expert 1 restarts in slot 2, so expert
  // 0's shard 1 takes rank 1's empty slot 3, and expert 1's shard 1 wraps to rank 0's slot 1.
  const ShardMap first_two = ShardMap::Create({2, 2, 1, 1}).value();
  const Placement next = Reshard(p, whole, first_two, topology).value();
  EXPECT_EQ(next.phy2log(), (std::vector<int>{0, 3, 2, 1, 4, E, 5, E}));
  EXPECT_EQ(next.home(), (std::vector<int>{0, 1, 1, 0, 2, 3}));
}

TEST(ReshardTest, PiecesCutAndJoinTheExpertsBytes) {
  TopologyConfig config;
  config.num_nodes = 1;
  config.gpus_per_node = 4;
  const Topology topology = Topology::Create(config).value();
  const Placement whole = Placement::Contiguous(2, 4, 2).value();  // experts on ranks 0 and 1
  const ShardMap two = ShardMap::Create({2, 1}).value();
  const ShardMap three = ShardMap::Create({3, 1}).value();
  const Placement p2 = PlaceShards(whole, two, topology).value();
  const Placement p3 = Reshard(p2, two, three, topology).value();
  // 12 bytes as one tensor (RegionTensors): old shards [0, 6) and [6, 12), new ones [0, 4),
  // [4, 8) and [8, 12).
  const std::vector<ShardedTensor> bytes = RegionTensors({}, 12);
  ASSERT_EQ(bytes.size(), 1u);
  const int old0 = p2.home_slot(0), old1 = p2.home_slot(1);
  const int new0 = p3.home_slot(0), new1 = p3.home_slot(1), new2 = p3.home_slot(2);
  EXPECT_EQ(ReshardPieces(p2, two, p3, three, 0, bytes),
            (std::vector<ShardPiece>{{old0, 0, new0, 0, 4},
                                     {old0, 4, new1, 0, 2},
                                     {old1, 0, new1, 2, 2},
                                     {old1, 2, new2, 0, 4}}));
  // Joined again: the whole expert's bytes from the three shards in order.
  const ShardMap one = ShardMap::Whole(2);
  const Placement p1 = Reshard(p3, three, one, topology).value();
  EXPECT_EQ(p1.home_slot(0), new0);
  EXPECT_EQ(ReshardPieces(p3, three, p1, one, 0, bytes),
            (std::vector<ShardPiece>{
                {new0, 0, new0, 0, 4}, {new1, 0, new0, 4, 4}, {new2, 0, new0, 8, 4}}));

  // An FFN's two matrices in 2-byte elements: W1 [4 rows, 3 columns] split by rows, then W2
  // [3 rows, 4 columns] split by columns. Cut in 2, shard j holds W1's rows [2j, 2j + 2) (12
  // bytes) and then, for each of W2's rows, its columns [2j, 2j + 2) (4 bytes per row).
  const std::vector<ShardedTensor> ffn = {{4, 3, 2, false}, {3, 4, 2, true}};
  EXPECT_TRUE(ShardsDivide(ffn, 2));
  EXPECT_FALSE(ShardsDivide(ffn, 3));
  const ShardMap whole_ffn = ShardMap::Whole(2);
  const Placement w = Reshard(p2, two, whole_ffn, topology).value();
  const int w0 = w.home_slot(0);
  EXPECT_EQ(ReshardPieces(w, whole_ffn, p2, two, 0, ffn),
            (std::vector<ShardPiece>{// shard 0: W1's rows 0-1, then W2's columns 0-1 of rows 0-2
                                     {w0, 0, old0, 0, 12},
                                     {w0, 24, old0, 12, 4},
                                     {w0, 32, old0, 16, 4},
                                     {w0, 40, old0, 20, 4},
                                     // shard 1: W1's rows 2-3, then W2's columns 2-3
                                     {w0, 12, old1, 0, 12},
                                     {w0, 28, old1, 12, 4},
                                     {w0, 36, old1, 16, 4},
                                     {w0, 44, old1, 20, 4}}));
}

// HandModel's experts on 2 nodes of 2 ranks: rows of 2000 bytes, 1.6e7 bytes of weights (1.12e8
// with the optimizer state), 4.8e-5 s of compute per row; 1e11 B/s inside a node, 1e10 between.
CostModel HandCost() { return CostModel(TwoNodesOfTwo(), HandModel()); }

TEST(ShardPricingTest, HandWorkedPrices) {
  const CostModel cost = HandCost();
  // Two copies: 1.6e7 x 2 passes x 1/2 over 1e11 B/s.
  // Two shards of 1000 rows: each shard's rank takes 500 more rows x 2000 B x 4 passes over
  // the slower tier's 1e10 B/s; at half the GEMM efficiency also 500 rows x 4.8e-5 s more.
  ShardPricing price = PriceSharding(cost, 1000, 2, 1.0, 1.12e8);
  EXPECT_DOUBLE_EQ(price.replicate_seconds, 1.6e-4);
  EXPECT_DOUBLE_EQ(price.shard_seconds, 4e-4);
  EXPECT_DOUBLE_EQ(price.switch_seconds, 5.6e-4);
  price = PriceSharding(cost, 1000, 2, 0.5, 1.12e8);
  EXPECT_DOUBLE_EQ(price.shard_seconds, 4e-4 + 0.024);
  price = PriceSharding(cost, 100, 2, 1.0, 1.12e8);
  EXPECT_DOUBLE_EQ(price.shard_seconds, 4e-5);
  EXPECT_EQ(PriceSharding(cost, 100, 1, 1.0, 1.12e8).replicate_seconds, 0);
}

TEST(ShardChoiceTest, ShardsAHotExpertWhoseRowsCostLessThanItsWeights) {
  const CostModel cost = HandCost();
  const auto flat = [](double) { return 1.0; };
  ShardChoiceOptions options;
  options.weights = RegionTensors({}, 8);
  options.optimizer = RegionTensors({}, 16);
  options.state_bytes = 1.12e8;
  options.payback_steps = 100;
  const ShardMap whole = ShardMap::Whole(4);
  // Mean rank 32.5 rows: expert 0 (100) must spread over ceil(3.1) = 4 ranks, 2 in its node.
  // Sharding costs 4e-5 s against 1.6e-4 s; the 1.2e-4 s gained repays the 5.6e-4 s move in
  // 100 steps but not in one.
  const std::vector<double> hot_and_small = {100, 10, 10, 10};
  EXPECT_EQ(ChooseShards(hot_and_small, whole, cost, flat, options),
            (std::vector<int>{2, 1, 1, 1}));
  ShardChoiceOptions impatient = options;
  impatient.payback_steps = 1;
  EXPECT_EQ(ChooseShards(hot_and_small, whole, cost, flat, impatient),
            (std::vector<int>{1, 1, 1, 1}));
  // 1000 rows cost more in traffic (4e-4 s) than two replicas' sync: keep it whole.
  EXPECT_EQ(ChooseShards(std::vector<double>{1000, 100, 100, 100}, whole, cost, flat, options),
            (std::vector<int>{1, 1, 1, 1}));
  // A state that 2 does not divide cannot be cut in 2.
  ShardChoiceOptions odd = options;
  odd.weights = RegionTensors({}, 7);
  EXPECT_EQ(ChooseShards(hot_and_small, whole, cost, flat, odd), (std::vector<int>{1, 1, 1, 1}));
  // Cooled to the mean: the shards' 4e-6 s per step repays the join (5.6e-4 s) in 1000 steps,
  // not in 100.
  const ShardMap sharded = ShardMap::Create({2, 1, 1, 1}).value();
  const std::vector<double> even = {10, 10, 10, 10};
  EXPECT_EQ(ChooseShards(even, sharded, cost, flat, options), (std::vector<int>{2, 1, 1, 1}));
  ShardChoiceOptions patient = options;
  patient.payback_steps = 1000;
  EXPECT_EQ(ChooseShards(even, sharded, cost, flat, patient), (std::vector<int>{1, 1, 1, 1}));
}

}  // namespace
}  // namespace keel
