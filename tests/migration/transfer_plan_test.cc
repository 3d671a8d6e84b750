// Transfer planning: targeted cases and properties over random placement changes.
#include "migration/transfer_plan.h"

#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "tests/migration/test_util.h"

namespace keel {
namespace {

using testing::MakeTopology;
using testing::RandomPlacement;
using testing::ValueOrDie;

const ExpertLayout kLayout{.weight_bytes = 100, .optimizer_bytes = 700};

TransferPlan Plan(const Placement& from, const Placement& to, const Topology& topology) {
  std::vector<Placement> a{from};
  std::vector<Placement> b{to};
  return ValueOrDie(PlanTransfers(a, b, topology, kLayout));
}

TEST(TransferPlanTest, UnchangedPlacementMovesNothing) {
  const Topology topology = MakeTopology(2, 2);
  Placement p = ValueOrDie(Placement::Create(4, 4, {0, 1, 1, 2, 3, -1, 0, 2}));
  TransferPlan plan = Plan(p, p, topology);
  EXPECT_TRUE(plan.transfers.empty());
  EXPECT_EQ(plan.total_bytes(), 0u);
}

TEST(TransferPlanTest, CopyOnSameRankIsLocal) {
  const Topology topology = MakeTopology(1, 2);
  // Rank 0 slots {0,1}: expert 0 in slot 0; the new placement also puts expert 0 in slot 1.
  Placement from = ValueOrDie(Placement::Create(2, 2, {0, -1, 1, 0}));
  Placement to = ValueOrDie(Placement::Create(2, 2, {0, 0, 1, 0}, from.home()));
  TransferPlan plan = Plan(from, to, topology);
  ASSERT_EQ(plan.transfers.size(), 1u);
  const Transfer& t = plan.transfers[0];
  EXPECT_EQ(t.src_slot, 0);
  EXPECT_EQ(t.dst_slot, 1);
  EXPECT_EQ(t.route, Route::kLocal);
  EXPECT_EQ(t.payload, Payload::kWeights);
  EXPECT_EQ(plan.local_bytes, 100u);
}

TEST(TransferPlanTest, PrefersSameNodeSource) {
  const Topology topology = MakeTopology(2, 2);  // ranks 0,1 node 0; ranks 2,3 node 1
  // Expert 0 lives on rank 0 (home) and rank 3; rank 2 gets a new copy: rank 3 is on its node.
  Placement from = ValueOrDie(Placement::Create(2, 4, {0, 1, 1, -1, 1, -1, 0, -1}));
  Placement to = ValueOrDie(Placement::Create(2, 4, {0, 1, 1, -1, 0, -1, 0, -1}, {0, 0}));
  TransferPlan plan = Plan(from, to, topology);
  ASSERT_EQ(plan.transfers.size(), 1u);
  EXPECT_EQ(plan.transfers[0].src_rank, 3);
  EXPECT_EQ(plan.transfers[0].route, Route::kIntraNode);
  EXPECT_EQ(plan.inter_node_bytes, 0u);
}

TEST(TransferPlanTest, SpreadsReceiversAcrossHolders) {
  const Topology topology = MakeTopology(1, 4);
  // Expert 0 on ranks 0 and 1; ranks 2 and 3 each get a copy: one from each holder.
  Placement from = ValueOrDie(Placement::Create(2, 4, {0, 1, 0, -1, 1, -1, 1, -1}));
  Placement to = ValueOrDie(Placement::Create(2, 4, {0, 1, 0, -1, 0, 1, 0, 1}, from.home()));
  TransferPlan plan = Plan(from, to, topology);
  std::vector<Transfer> expert0;
  for (const Transfer& t : plan.transfers) {
    if (t.expert == 0) expert0.push_back(t);
  }
  ASSERT_EQ(expert0.size(), 2u);
  EXPECT_NE(expert0[0].src_rank, expert0[1].src_rank);
}

TEST(TransferPlanTest, HomeRelocationCarriesOptimizerState) {
  const Topology topology = MakeTopology(2, 1);
  // Expert 0 moves from rank 0 to rank 1 entirely; rank 1 becomes its home.
  Placement from = ValueOrDie(Placement::Create(2, 2, {0, 1, 1, -1}));
  Placement to = ValueOrDie(Placement::Create(2, 2, {1, -1, 1, 0}, {1, 0}));
  TransferPlan plan = Plan(from, to, topology);
  // Expert 1's home stays on rank 0 but its home slot moves from slot 1 to slot 0: a local
  // copy of weights and optimizer state.
  ASSERT_EQ(plan.transfers.size(), 2u);
  EXPECT_EQ(plan.transfers[0].expert, 0);
  EXPECT_EQ(plan.transfers[1].payload, Payload::kWeightsAndOptimizer);
  EXPECT_EQ(plan.transfers[1].route, Route::kLocal);
  EXPECT_EQ(plan.transfers[1].src_slot, 1);
  EXPECT_EQ(plan.transfers[1].dst_slot, 0);
  const Transfer& t = plan.transfers[0];
  EXPECT_EQ(t.src_slot, 0);
  EXPECT_EQ(t.dst_slot, 3);
  EXPECT_EQ(t.payload, Payload::kWeightsAndOptimizer);
  EXPECT_EQ(t.bytes, 800u);
  EXPECT_EQ(plan.new_home[0][0], 1);
}

TEST(TransferPlanTest, HomeMovingOntoExistingReplicaMovesOnlyOptimizerState) {
  const Topology topology = MakeTopology(1, 2);
  Placement from = ValueOrDie(Placement::Create(1, 2, {0, 0}, {0}));
  Placement to = ValueOrDie(Placement::Create(1, 2, {0, 0}, {1}));
  TransferPlan plan = Plan(from, to, topology);
  ASSERT_EQ(plan.transfers.size(), 1u);
  EXPECT_EQ(plan.transfers[0].payload, Payload::kOptimizer);
  EXPECT_EQ(plan.transfers[0].src_slot, 0);
  EXPECT_EQ(plan.transfers[0].dst_slot, 1);
  EXPECT_EQ(plan.transfers[0].bytes, 700u);
}

TEST(TransferPlanTest, HomeMoveTakesWeightsFromNearerCopy) {
  const Topology topology = MakeTopology(2, 2);
  // Expert 0: home on rank 0 (node 0), replica on rank 3 (node 1). New home on rank 2 (node 1):
  // the weights come over the node from rank 3, only the optimizer state crosses nodes.
  Placement from = ValueOrDie(Placement::Create(2, 4, {0, 1, 1, -1, 1, -1, 0, -1}, {0, 0}));
  Placement to = ValueOrDie(Placement::Create(2, 4, {1, -1, 1, -1, 0, -1, 0, -1}, {2, 1}));
  TransferPlan plan = Plan(from, to, topology);
  std::vector<Transfer> expert0;
  for (const Transfer& t : plan.transfers) {
    if (t.expert == 0) expert0.push_back(t);
  }
  ASSERT_EQ(expert0.size(), 2u);
  EXPECT_EQ(expert0[0].payload, Payload::kWeights);
  EXPECT_EQ(expert0[0].src_rank, 3);
  EXPECT_EQ(expert0[1].payload, Payload::kOptimizer);
  EXPECT_EQ(expert0[1].src_rank, 0);
  EXPECT_EQ(expert0[1].dst_slot, 4);
}

TEST(TransferPlanTest, RejectsMismatchedShapes) {
  const Topology topology = MakeTopology(1, 2);
  Placement a = ValueOrDie(Placement::Create(2, 2, {0, 1, 1, 0}));
  Placement b = ValueOrDie(Placement::Create(2, 2, {0, 1}));
  std::vector<Placement> from{a};
  std::vector<Placement> to{b};
  auto plan = PlanTransfers(from, to, topology, kLayout);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("layer 0"), std::string::npos);
  std::vector<Placement> two{a, a};
  EXPECT_FALSE(PlanTransfers(from, two, topology, kLayout).ok());
  EXPECT_FALSE(PlanTransfers(from, from, MakeTopology(1, 4), kLayout).ok());
}

TEST(TransferPlanTest, DescribesTransfer) {
  Transfer t{.layer = 3, .expert = 12, .src_rank = 1, .src_slot = 4, .dst_rank = 2, .dst_slot = 5};
  EXPECT_EQ(DescribeTransfer(t), "layer 3 expert 12 rank 1 -> rank 2 slot 5");
}

// Properties over random placement changes on several topologies.
struct Shape {
  int num_nodes;
  int gpus_per_node;
  int slots_per_rank;
  int num_experts;
};

class TransferPlanPropertyTest : public ::testing::TestWithParam<Shape> {};

Route ExpectedBestRoute(const Placement& from, const Topology& topology, int expert, int dst) {
  Route best = Route::kInterNode;
  for (int slot : from.copies(expert)) {
    const int r = from.rank_of_slot(slot);
    const Route route = r == dst                     ? Route::kLocal
                        : topology.same_node(r, dst) ? Route::kIntraNode
                                                     : Route::kInterNode;
    best = std::min(best, route);
  }
  return best;
}

TEST_P(TransferPlanPropertyTest, InvariantsHoldOverRandomChanges) {
  const Shape shape = GetParam();
  const Topology topology = MakeTopology(shape.num_nodes, shape.gpus_per_node);
  const int ranks = topology.num_ranks();
  std::mt19937_64 rng(1234 + ranks * 7 + shape.slots_per_rank);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<Placement> from;
    std::vector<Placement> to;
    for (int l = 0; l < 2; ++l) {
      from.push_back(RandomPlacement(rng, shape.num_experts, ranks, shape.slots_per_rank));
      to.push_back(RandomPlacement(rng, shape.num_experts, ranks, shape.slots_per_rank));
    }
    TransferPlan plan = ValueOrDie(PlanTransfers(from, to, topology, kLayout));
    // Deterministic.
    TransferPlan again = ValueOrDie(PlanTransfers(from, to, topology, kLayout));
    ASSERT_EQ(plan.transfers, again.transfers);

    size_t inter = 0;
    std::map<std::pair<int, int>, int> weights_into;  // (layer, slot) -> weight transfers
    std::map<std::pair<int, int>, int> optimizer_into;
    for (const Transfer& t : plan.transfers) {
      const Placement& a = from[t.layer];
      const Placement& b = to[t.layer];
      // The source holds the expert now, the destination holds it after the plan.
      ASSERT_EQ(a.expert_at(t.src_slot), t.expert);
      ASSERT_EQ(b.expert_at(t.dst_slot), t.expert);
      ASSERT_EQ(t.src_rank, a.rank_of_slot(t.src_slot));
      ASSERT_EQ(t.dst_rank, b.rank_of_slot(t.dst_slot));
      if (CarriesWeights(t.payload)) {
        ++weights_into[{t.layer, t.dst_slot}];
        // No transfer where none is needed.
        ASSERT_NE(a.expert_at(t.dst_slot), t.expert);
      }
      if (CarriesOptimizer(t.payload)) {
        ++optimizer_into[{t.layer, t.dst_slot}];
        ASSERT_EQ(t.src_slot, a.home_slot(t.expert)) << "optimizer state comes from the home";
        ASSERT_EQ(t.dst_slot, b.home_slot(t.expert)) << "optimizer state goes to the new home";
      }
      if (t.payload == Payload::kWeights) {
        // Weights come from the nearest class of holder there is.
        ASSERT_EQ(t.route, ExpectedBestRoute(a, topology, t.expert, t.dst_rank))
            << DescribeTransfer(t);
      }
      if (t.route == Route::kInterNode) inter += t.bytes;
    }
    ASSERT_EQ(inter, plan.inter_node_bytes);
    for (size_t l = 0; l < from.size(); ++l) {
      const Placement& a = from[l];
      const Placement& b = to[l];
      const int layer = static_cast<int>(l);
      for (int s = 0; s < b.num_slots(); ++s) {
        const int e = b.expert_at(s);
        const bool changed = e != kEmptySlot && a.expert_at(s) != e;
        // Every new slot is fed exactly once; unchanged slots get no weights.
        const int fed = weights_into.count({layer, s}) ? weights_into[{layer, s}] : 0;
        ASSERT_EQ(fed, changed ? 1 : 0) << "layer " << l << " slot " << s;
      }
      for (int e = 0; e < b.num_experts(); ++e) {
        const int old_home = a.home_slot(e);
        const int new_home = b.home_slot(e);
        const int moved = optimizer_into.count({layer, new_home}) ? 1 : 0;
        ASSERT_EQ(moved, old_home != new_home ? 1 : 0) << "layer " << l << " expert " << e;
      }
      ASSERT_EQ(plan.new_home[l], b.home());
    }
  }
}

TEST_P(TransferPlanPropertyTest, ReceiversOfOneExpertAreSpread) {
  const Shape shape = GetParam();
  const Topology topology = MakeTopology(shape.num_nodes, shape.gpus_per_node);
  const int ranks = topology.num_ranks();
  std::mt19937_64 rng(99 + ranks);
  for (int trial = 0; trial < 100; ++trial) {
    Placement from = RandomPlacement(rng, shape.num_experts, ranks, shape.slots_per_rank);
    Placement to = RandomPlacement(rng, shape.num_experts, ranks, shape.slots_per_rank);
    TransferPlan plan = Plan(from, to, topology);
    // On one node every holder is equally near, so receivers go to the least-fed holder: the
    // counts differ by at most one. Experts with a local copy or a home move are skipped, since
    // those pick their source for another reason.
    if (shape.num_nodes != 1) continue;
    std::map<int, std::map<int, int>> fed;  // expert -> holder rank -> receivers fed
    std::set<int> forced;
    for (const Transfer& t : plan.transfers) {
      if (t.route == Route::kLocal || t.payload != Payload::kWeights) forced.insert(t.expert);
      if (CarriesWeights(t.payload)) ++fed[t.expert][t.src_rank];
    }
    for (auto& [expert, per_rank] : fed) {
      if (forced.count(expert)) continue;
      std::set<int> holders;
      for (int slot : from.copies(expert)) holders.insert(from.rank_of_slot(slot));
      int lo = 1 << 30;
      int hi = 0;
      for (int r : holders) {
        const int n = per_rank.count(r) ? per_rank[r] : 0;
        lo = std::min(lo, n);
        hi = std::max(hi, n);
      }
      ASSERT_LE(hi - lo, 1) << "expert " << expert;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TransferPlanPropertyTest,
                         ::testing::Values(Shape{1, 4, 3, 6}, Shape{2, 2, 3, 8}, Shape{2, 4, 2, 10},
                                           Shape{4, 2, 4, 16}, Shape{1, 8, 2, 4}));

}  // namespace
}  // namespace keel
