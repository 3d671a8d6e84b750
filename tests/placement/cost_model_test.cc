// Cost model: each term of the predicted layer time and the cost of a placement change, checked
// against hand-computed values on tiny topologies.
#include "placement/cost_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "tests/placement/two_nodes.h"

namespace keel {
namespace {

CostModelConfig SmallModel() {
  CostModelConfig config;
  config.expert_tflops = 1.0;  // 1e12 FLOP/s
  config.hidden_size = 4;
  config.expert_ffn_size = 8;
  config.expert_matrices = 2;
  config.dtype_bytes = 2;
  config.home_move_bytes_per_parameter = 14;
  config.train_flops_multiplier = 3;
  config.all_to_all_passes = 4;
  config.replica_sync_passes = 2;
  return config;
}

StepRouting EmptyRouting(int ranks, int slots) {
  StepRouting routing;
  routing.num_ranks = ranks;
  routing.rank_tokens.assign(ranks, 0);
  routing.sent_tokens.assign(ranks * ranks, 0);
  routing.slot_tokens.assign(slots, 0);
  return routing;
}

// A price that is not finite is refused where it is produced, naming the terms and every
// constant it came from; ValidateConfig's ranges keep configs from files out of this path.
TEST(CostModelTest, CheckFiniteNamesTheTermsAndTheConstants) {
  const Topology topology = TwoNodesOfTwo();
  CostModelConfig config = SmallModel();
  StepRouting routing = EmptyRouting(4, 4);
  routing.rank_tokens = {10, 0, 0, 0};
  routing.sent_tokens[1] = 10;
  const Placement placement = Placement::Contiguous(4, 4, 1).value();
  EXPECT_TRUE(CostModel(topology, config)
                  .CheckFinite(CostModel(topology, config).Estimate(placement, routing))
                  .ok());

  config.expert_tflops = 1e-300;  // 2 * 64 * 1e20 * 10 FLOPs at 1e-288 FLOP/s: inf seconds
  config.train_flops_multiplier = 1e20;
  const CostModel degenerate(topology, config);
  const Status status = degenerate.CheckFinite(degenerate.Estimate(placement, routing));
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  for (const char* part : {"compute_seconds inf", "cost_model.expert_tflops 1e-300",
                           "cost_model.train_flops_multiplier 1e+20", "cost_model.hidden_size 4",
                           "topology.intra_node_gb_per_s 100", "topology.inter_node_gb_per_s 10"}) {
    EXPECT_NE(status.message().find(part), std::string::npos) << part << " in " << status.message();
  }
  MigrationCost migration;
  migration.bytes = std::numeric_limits<double>::infinity();
  const Status moved = CostModel(topology, SmallModel()).CheckFinite(LayerCost{}, &migration);
  EXPECT_NE(moved.message().find("migration bytes inf"), std::string::npos) << moved.message();
}

TEST(CostModelTest, SizesFollowTheConfig) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  EXPECT_DOUBLE_EQ(cost.expert_parameters(), 64);
  EXPECT_DOUBLE_EQ(cost.expert_weight_bytes(), 128);
  EXPECT_DOUBLE_EQ(cost.home_move_bytes(), 64 * 14);
  EXPECT_DOUBLE_EQ(cost.token_row_bytes(), 8);
  // 2 FLOP per parameter per token, forward + backward = 3x.
  EXPECT_DOUBLE_EQ(cost.ComputeSeconds(1000), 1000 * 2 * 64 * 3 / 1e12);
}

TEST(CostModelTest, ComputeIsTheSlowestRank) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto p = Placement::Contiguous(4, 4, 1).value();
  StepRouting routing = EmptyRouting(4, 4);
  routing.rank_tokens = {10, 50, 20, 0};
  routing.sent_tokens[0 * 4 + 0] = 10;  // local rows cross no link
  LayerCost c = cost.Estimate(p, routing);
  EXPECT_DOUBLE_EQ(c.compute_seconds, cost.ComputeSeconds(50));
  EXPECT_DOUBLE_EQ(c.all_to_all_seconds, 0);
  EXPECT_DOUBLE_EQ(c.replica_sync_seconds, 0);  // one copy per expert: nothing to sync
}

TEST(CostModelTest, AllToAllUsesTheLinkOfEachPair) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto p = Placement::Contiguous(4, 4, 1).value();
  StepRouting intra = EmptyRouting(4, 4);
  intra.sent_tokens[0 * 4 + 1] = 1000;  // rank 0 -> 1, same node
  EXPECT_DOUBLE_EQ(cost.Estimate(p, intra).all_to_all_seconds, 1000 * 8 / 100e9 * 4);
  StepRouting inter = EmptyRouting(4, 4);
  inter.sent_tokens[0 * 4 + 2] = 1000;  // rank 0 -> 2, other node
  EXPECT_DOUBLE_EQ(cost.Estimate(p, inter).all_to_all_seconds, 1000 * 8 / 10e9 * 4);
}

// Estimate sums the all-to-all four destinations and up to four sources at a time; its bytes per
// link must still be the sums of a plain pair-by-pair pass, bit for bit, for any routing: sources
// in groups that do not fill four lanes, zero and negative rows (which carry nothing), and
// fractional token counts whose sums depend on the order of the additions.
TEST(CostModelTest, AllToAllIsThePairByPairSumBitForBit) {
  TopologyConfig config;
  config.num_nodes = 3;
  config.gpus_per_node = 6;
  config.intra_node_gb_per_s = 100;
  config.inter_node_gb_per_s = 10;
  const Topology topology = Topology::Create(config).value();
  const int ranks = topology.num_ranks();
  CostModel cost(topology, SmallModel());
  auto p = Placement::Contiguous(ranks, ranks, 1).value();
  StepRouting routing = EmptyRouting(ranks, ranks);
  unsigned state = 12345;
  for (double& rows : routing.sent_tokens) {
    state = state * 1103515245u + 12345u;
    const unsigned pick = (state >> 16) % 8;
    rows = pick == 0 ? 0.0 : pick == 1 ? -3.0 : ((state >> 8) % 100000) / 7.0;
  }

  // send and receive bytes per rank and link class (0 within a node, 1 across), pair by pair.
  std::vector<double> send(ranks * 2, 0.0), receive(ranks * 2, 0.0);
  for (int src = 0; src < ranks; ++src) {
    for (int dst = 0; dst < ranks; ++dst) {
      const double bytes = routing.sent_tokens[src * ranks + dst] * cost.token_row_bytes();
      if (src == dst || bytes <= 0) continue;
      const int link = topology.same_node(src, dst) ? 0 : 1;
      send[src * 2 + link] += bytes;
      receive[dst * 2 + link] += bytes;
    }
  }
  double most[2] = {0, 0};
  for (int i = 0; i < ranks * 2; ++i) {
    most[i % 2] = std::max({most[i % 2], send[i], receive[i]});
  }
  const double expected = std::max(most[0] / topology.intra_node_bytes_per_second(),
                                   most[1] / topology.inter_node_bytes_per_second()) *
                          SmallModel().all_to_all_passes;
  EXPECT_EQ(cost.Estimate(p, routing).all_to_all_seconds, expected);
}

TEST(CostModelTest, EstimateWithSyncIsEstimate) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto p = Placement::Create(2, 4, {0, 1, 0, 1}).value();
  StepRouting routing = EmptyRouting(4, 4);
  routing.rank_tokens = {10, 50, 20, 5};
  routing.sent_tokens = {0, 3, 7, 1, 2, 0, 9, 4, 5, 5, 0, 8, 1, 6, 2, 0};
  routing.transients = {{0, 1, 0}};
  routing.transient_tokens = {4};
  const LayerCost plain = cost.Estimate(p, routing, 1e-3);
  const LayerCost with_sync = cost.EstimateWithSync(p, routing, cost.ReplicaSyncSeconds(p), 1e-3);
  EXPECT_GT(plain.replica_sync_seconds, 0);
  EXPECT_EQ(with_sync.compute_seconds, plain.compute_seconds);
  EXPECT_EQ(with_sync.all_to_all_seconds, plain.all_to_all_seconds);
  EXPECT_EQ(with_sync.replica_sync_seconds, plain.replica_sync_seconds);
  EXPECT_EQ(with_sync.transient_seconds, plain.transient_seconds);
  EXPECT_EQ(with_sync.exposed_migration_seconds, plain.exposed_migration_seconds);
}

TEST(CostModelTest, ReplicaSyncIsARingOverTheCopies) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  // Expert 0 on ranks 0 and 1 (same node): each ring edge carries W * passes * (m-1)/m = W.
  auto pair =
      Placement::Create(3, 4, {0, 1, 0, 2, kEmptySlot, kEmptySlot, kEmptySlot, kEmptySlot}).value();
  StepRouting routing = EmptyRouting(4, 8);
  EXPECT_DOUBLE_EQ(cost.Estimate(pair, routing).replica_sync_seconds, 128 / 100e9);
  // Expert 0 on ranks 0, 1 and 2: the ring crosses nodes; edges carry 2W * 2/3.
  auto three = Placement::Create(3, 4, {0, 1, 0, 2, 0, kEmptySlot, kEmptySlot, kEmptySlot}).value();
  StepRouting routing3 = EmptyRouting(4, 8);
  EXPECT_DOUBLE_EQ(cost.Estimate(three, routing3).replica_sync_seconds, 128 * 2 * 2.0 / 3.0 / 10e9);
}

TEST(CostModelTest, TransientReplicasArePricedAsAChainFromTheSource) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto p = Placement::Contiguous(4, 4, 1).value();
  StepRouting routing = EmptyRouting(4, 4);
  routing.transients = {{/*expert=*/0, /*rank=*/1, /*source_rank=*/0}};
  routing.transient_tokens = {5};
  EXPECT_DOUBLE_EQ(cost.Estimate(p, routing).transient_seconds, 128 / 100e9);
  // A second copy on rank 2 is fed by rank 1 over the inter-node link.
  routing.transients.push_back({0, 2, 0});
  routing.transient_tokens.push_back(5);
  EXPECT_DOUBLE_EQ(cost.Estimate(p, routing).transient_seconds, 128 / 10e9);
}

// Up to 8 transients are priced from a short list, more from a table of every rank: both must
// give the chain's fills. The reference counts fills per (rank, link class, direction); every
// fill carries W = 128 bytes, so the sums are exact.
TEST(CostModelTest, FewAndManyTransientsArePricedAlike) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto p = Placement::Contiguous(4, 4, 1).value();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int count = 1 + trial % 12;
    std::vector<TransientReplica> transients;
    for (int i = 0; i < count; ++i) {
      // Few experts, so that chains grow; a source may be the receiving rank itself.
      transients.push_back(
          {static_cast<int>(rng() % 3), static_cast<int>(rng() % 4), static_cast<int>(rng() % 4)});
    }
    std::vector<int> fills(4 * 4, 0);  // [rank][send intra, send inter, recv intra, recv inter]
    std::vector<int> chain_end(4, -1);
    for (const TransientReplica& t : transients) {
      const int from = chain_end[t.expert] >= 0 ? chain_end[t.expert] : t.source_rank;
      chain_end[t.expert] = t.rank;
      if (from == t.rank) continue;
      const int link = from / 2 == t.rank / 2 ? 0 : 1;  // two ranks per node
      for (const auto& [src, dst] : {std::pair{from, t.rank}, std::pair{t.rank, from}}) {
        ++fills[src * 4 + link];
        ++fills[dst * 4 + 2 + link];
      }
    }
    int most[2] = {0, 0};
    for (int i = 0; i < 16; ++i) most[i % 2] = std::max(most[i % 2], fills[i]);
    const double expected = std::max(most[0] * 128 / 100e9, most[1] * 128 / 10e9);
    EXPECT_EQ(cost.TransientSeconds(p, transients), expected) << "trial " << trial;
  }
}

TEST(CostModelTest, OnlyMigrationBeyondOneForwardBackwardIsExposed) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto p = Placement::Contiguous(4, 4, 1).value();
  StepRouting routing = EmptyRouting(4, 4);
  routing.rank_tokens = {1e6, 0, 0, 0};
  const double window = cost.ComputeSeconds(1e6);
  EXPECT_DOUBLE_EQ(cost.Estimate(p, routing, window / 2).exposed_migration_seconds, 0);
  EXPECT_NEAR(cost.Estimate(p, routing, window * 3).exposed_migration_seconds, window * 2, 1e-15);
}

TEST(CostModelTest, MigrationChargesWeightsForReplicasAndOptimizerForHomes) {
  CostModel cost(TwoNodesOfTwo(), SmallModel());
  auto from = Placement::Create(2, 4, {0, 1, kEmptySlot, kEmptySlot}).value();
  // A replica of expert 0 on rank 3 (other node than its home): weights only, inter-node.
  auto replica = Placement::Create(2, 4, {0, 1, kEmptySlot, 0}, {0, 1}).value();
  MigrationCost m = cost.Migration(from, replica);
  EXPECT_EQ(m.changed_slots, 1);
  EXPECT_EQ(m.moved_homes, 0);
  EXPECT_DOUBLE_EQ(m.bytes, 128);
  EXPECT_DOUBLE_EQ(m.seconds, 128 / 10e9);
  // The next replica on rank 2 is fed from rank 3, its node neighbour.
  auto two = Placement::Create(2, 4, {0, 1, 0, 0}, {0, 1}).value();
  EXPECT_DOUBLE_EQ(cost.Migration(replica, two).seconds, 128 / 100e9);
  // Expert 1's home moves to rank 2 on the other node: weights + optimizer state.
  auto moved = Placement::Create(2, 4, {0, kEmptySlot, 1, kEmptySlot}).value();
  MigrationCost h = cost.Migration(from, moved);
  EXPECT_EQ(h.moved_homes, 1);
  EXPECT_DOUBLE_EQ(h.bytes, 64 * 14);
  EXPECT_DOUBLE_EQ(h.seconds, 64 * 14 / 10e9);
  // Unchanged placement: nothing moves.
  MigrationCost none = cost.Migration(from, from);
  EXPECT_EQ(none.changed_slots, 0);
  EXPECT_DOUBLE_EQ(none.bytes, 0);
}

}  // namespace
}  // namespace keel
