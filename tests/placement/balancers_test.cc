// The policies after the newest balancers (velb, lplb, swiftmoe, trtllm) on cases worked by hand
// from their descriptions, LPLB's linear program against the quota solver, and proportional
// routing. policy_property_test.cc checks the invariants every policy shares.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "placement/lp_balance.h"
#include "placement/policy.h"

namespace keel {
namespace {

KeelConfig SmallConfig(int num_nodes, int gpus_per_node, int persistent, int transient) {
  KeelConfig config;
  config.topology.num_nodes = num_nodes;
  config.topology.gpus_per_node = gpus_per_node;
  config.slots.persistent_per_rank = persistent;
  config.slots.transient_per_rank = transient;
  return config;
}

std::unique_ptr<Policy> Make(const std::string& name, const PolicyContext& context) {
  auto policy = MakePolicy(name, context);
  EXPECT_TRUE(policy.ok()) << policy.status().ToString();
  return policy.ok() ? std::move(policy).value() : nullptr;
}

// Two ranks of two slots: rank 0 holds experts 0 and 2, rank 1 experts 1 and 2.
Placement SharedThirdExpert() { return Placement::Create(3, 2, {0, 2, 1, 2}).value(); }

TEST(LpBalanceTest, SolvesTheThreeExpertExampleWorkedByHand) {
  // Loads 4, 2, 6: ranks 0 and 1 carry 4 and 2 of their own, expert 2's 6 tokens may go either
  // way. The optimum t = 6 needs 2 on rank 0 and 4 on rank 1, and nothing else reaches it.
  auto balance = SolveLpBalance(SharedThirdExpert(), std::vector<double>{4, 2, 6});
  ASSERT_TRUE(balance.ok()) << balance.status().ToString();
  EXPECT_NEAR(balance->max_rank_tokens, 6.0, 1e-9);
  EXPECT_NEAR(balance->slot_tokens[0], 4.0, 1e-9);
  EXPECT_NEAR(balance->slot_tokens[1], 2.0, 1e-9);
  EXPECT_NEAR(balance->slot_tokens[2], 2.0, 1e-9);
  EXPECT_NEAR(balance->slot_tokens[3], 4.0, 1e-9);

  // Loads 10, 2, 6: rank 0's own 10 tokens bound t from below; all of expert 2 goes to rank 1.
  balance = SolveLpBalance(SharedThirdExpert(), std::vector<double>{10, 2, 6});
  ASSERT_TRUE(balance.ok()) << balance.status().ToString();
  EXPECT_NEAR(balance->max_rank_tokens, 10.0, 1e-9);
  EXPECT_NEAR(balance->slot_tokens[1], 0.0, 1e-9);
  EXPECT_NEAR(balance->slot_tokens[3], 6.0, 1e-9);
}

TEST(LpBalanceTest, QuotaSolverGivesTheLpOptimumRoundedUp) {
  std::mt19937_64 draw(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int num_ranks = 2 + static_cast<int>(draw() % 6);
    const int per_rank = 2 + static_cast<int>(draw() % 2);
    const int num_experts = num_ranks + static_cast<int>(draw() % num_ranks);
    // Every expert once, the rest of the slots random copies.
    std::vector<int> phy2log(static_cast<size_t>(num_ranks) * per_rank);
    for (size_t s = 0; s < phy2log.size(); ++s) {
      phy2log[s] = s < static_cast<size_t>(num_experts) ? static_cast<int>(s)
                                                        : static_cast<int>(draw() % num_experts);
    }
    std::shuffle(phy2log.begin(), phy2log.end(), draw);
    auto placement = Placement::Create(num_experts, num_ranks, phy2log);
    ASSERT_TRUE(placement.ok()) << placement.status().ToString();
    std::vector<long long> tokens(num_experts);
    std::vector<double> load(num_experts);
    for (int e = 0; e < num_experts; ++e) {
      tokens[e] = static_cast<long long>(draw() % 1000);
      load[e] = static_cast<double>(tokens[e]);
    }
    auto balance = SolveLpBalance(*placement, load);
    ASSERT_TRUE(balance.ok()) << balance.status().ToString();
    const QuotaSplit split = SplitQuotas(*placement, tokens, {});
    EXPECT_EQ(split.max_rank_tokens,
              static_cast<long long>(std::ceil(balance->max_rank_tokens - 1e-7)))
        << "trial " << trial;
    // The LP's split is a split: every expert's tokens, no rank above t.
    std::vector<double> per_expert(num_experts, 0.0);
    std::vector<double> per_rank_load(num_ranks, 0.0);
    for (int s = 0; s < placement->num_slots(); ++s) {
      if (placement->expert_at(s) == kEmptySlot) continue;
      per_expert[placement->expert_at(s)] += balance->slot_tokens[s];
      per_rank_load[placement->rank_of_slot(s)] += balance->slot_tokens[s];
    }
    for (int e = 0; e < num_experts; ++e) EXPECT_NEAR(per_expert[e], load[e], 1e-6);
    for (double l : per_rank_load) EXPECT_LE(l, balance->max_rank_tokens + 1e-6);
  }
}

TEST(LpBalanceTest, RejectsALoadOfTheWrongSizeOrSign) {
  auto short_load = SolveLpBalance(SharedThirdExpert(), std::vector<double>{1, 2});
  ASSERT_FALSE(short_load.ok());
  EXPECT_NE(short_load.status().message().find("expected num_experts 3"), std::string::npos);
  auto negative = SolveLpBalance(SharedThirdExpert(), std::vector<double>{1, -2, 3});
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("expert_load[1]"), std::string::npos);
}

TEST(RouteInProportionTest, EverySourceSplitsByTheQuotas) {
  const Placement placement = SharedThirdExpert();
  // Source 0 sends 8 tokens to expert 2, source 1 sends 4; quotas 1 : 3 between its copies.
  auto load = StepLoad::FromTraffic(2, 3, {0, 0, 8, 0, 0, 4});
  ASSERT_TRUE(load.ok());
  auto routing = RouteInProportion(placement, *load, std::vector<double>{0, 1, 0, 3});
  ASSERT_TRUE(routing.ok()) << routing.status().ToString();
  EXPECT_EQ(routing->slot_tokens, (std::vector<double>{0, 3, 0, 9}));
  EXPECT_EQ(routing->rank_tokens, (std::vector<double>{3, 9}));
  // Rows by source: 2 and 6 from source 0, 1 and 3 from source 1.
  EXPECT_EQ(routing->sent_tokens, (std::vector<double>{2, 6, 1, 3}));

  auto wrong = RouteInProportion(placement, *load, std::vector<double>{1, 1});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("expected num_slots 4"), std::string::npos);
}

TEST(VelbTest, MovesTheExcessOfTheHotRankOntoAReplicaForOneStep) {
  // One node of two ranks, one persistent slot each (the homes) and one transient slot.
  auto context = PolicyContext::FromConfig(SmallConfig(1, 2, 1, 1), 1, 2).value();
  auto velb = Make("velb", context);
  ASSERT_NE(velb, nullptr);
  auto placement = velb->Initial(0);
  ASSERT_TRUE(placement.ok());
  // Expert 0 (rank 0) gets 30 tokens, expert 1 (rank 1) 10: rank 0 is 10 above the mean of 20
  // and gives those 10 to a replica of expert 0 on rank 1.
  auto load = StepLoad::FromTraffic(2, 2, {15, 5, 15, 5});
  auto routing = velb->Route(0, *placement, *load);
  ASSERT_TRUE(routing.ok()) << routing.status().ToString();
  EXPECT_EQ(routing->rank_tokens, (std::vector<double>{20, 20}));
  ASSERT_EQ(routing->transients.size(), 1u);
  EXPECT_EQ(routing->transients[0].expert, 0);
  EXPECT_EQ(routing->transients[0].rank, 1);
  EXPECT_EQ(routing->transients[0].source_rank, 0);
  EXPECT_EQ(routing->transient_tokens, (std::vector<double>{10}));
  // The homes stay.
  LayerView view{0, &*placement, std::vector<double>{30, 10}, nullptr};
  EXPECT_EQ(*velb->Replan(view), *placement);

  // Without a replica slot nothing moves.
  auto no_slots = PolicyContext::FromConfig(SmallConfig(1, 2, 1, 0), 1, 2).value();
  auto fixed = Make("velb", no_slots)->Route(0, *placement, *load);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->rank_tokens, (std::vector<double>{30, 10}));
  EXPECT_TRUE(fixed->transients.empty());
}

TEST(TrtllmTest, PlansAsTensorRtLlmAndUpdatesLayersInTurn) {
  // Two ranks of two slots, three experts, loads 6, 2, 1: the spare slot goes to expert 0 (3 per
  // copy); copies by load per copy: expert 0 on rank 0 then rank 1 (tie: lower rank), expert 1
  // on rank 0 (3 = 3, tie), expert 2 on rank 1.
  KeelConfig config = SmallConfig(1, 2, 2, 0);
  config.policy.trtllm.layer_updates_per_iter = 1;
  auto context = PolicyContext::FromConfig(config, /*num_layers=*/4, 3).value();
  std::vector<std::unique_ptr<Policy>> layers;
  std::vector<Placement> placements;
  for (int layer = 0; layer < 4; ++layer) {
    layers.push_back(Make("trtllm", context));
    placements.push_back(layers.back()->Initial(layer).value());
  }
  const std::vector<double> load{6, 2, 1};
  const std::vector<int> planned{0, 1, 0, 2};
  // Four buckets of one layer; the first and the last are as full, so an empty bucket follows:
  // layer l updates at replans l, l + 5, ...; replan 4 updates nothing.
  for (int replan = 0; replan < 6; ++replan) {
    for (int layer = 0; layer < 4; ++layer) {
      const Placement before = placements[layer];
      auto next = layers[layer]->Replan({layer, &before, load, nullptr});
      ASSERT_TRUE(next.ok()) << next.status().ToString();
      const bool turn = replan % 5 == layer;
      if (turn) {
        EXPECT_EQ(next->phy2log(), planned) << "replan " << replan << ", layer " << layer;
      } else {
        EXPECT_EQ(*next, before) << "replan " << replan << ", layer " << layer;
      }
      placements[layer] = *next;
      // Back to the initial placement, so every turn shows a change.
      if (turn) placements[layer] = layers[layer]->Initial(layer).value();
    }
  }
}

TEST(SwiftMoeTest, MovesParametersOnlyAndKeepsEveryHome) {
  // Two ranks of three slots, four experts: homes {0, 1} and {2, 3}, one spare slot each.
  auto context = PolicyContext::FromConfig(SmallConfig(1, 2, 3, 0), 1, 4).value();
  auto swift = Make("swiftmoe", context);
  const Placement initial = swift->Initial(0).value();
  // Expert 0 is hot: its second copy goes to rank 1 (rank 0 holds it). The next spare slot goes
  // to expert 1 (most tokens per copy after it, lowest id), but rank 0, the only rank with a free
  // slot, holds expert 1 already, so that slot stays empty.
  auto next = swift->Replan({0, &initial, std::vector<double>{8, 1, 1, 1}, nullptr});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->phy2log(), (std::vector<int>{0, 1, kEmptySlot, 2, 3, 0}));
  EXPECT_EQ(next->home(), initial.home());
  // A second replan on the same load keeps the copy where it is: nothing moves.
  auto again = swift->Replan({0, &*next, std::vector<double>{8, 1, 1, 1}, nullptr});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *next);
}

TEST(LplbTest, RedundantSlotsCopyTheHottestExpertOfTheNextRankInTheNode) {
  // One node of four ranks with three slots each, eight experts: two own experts per rank and one
  // redundant slot, which copies the hottest expert of the next rank round the node.
  auto context = PolicyContext::FromConfig(SmallConfig(1, 4, 3, 0), 1, 8).value();
  auto lplb = Make("lplb", context);
  const Placement initial = lplb->Initial(0).value();
  std::vector<double> load{1, 2, 3, 4, 5, 6, 7, 80};
  auto next = lplb->Replan({0, &initial, load, nullptr});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_LE(next->max_copies(), 2);
  for (int r = 0; r < 4; ++r) {
    const int partner = (r + 1) % 4;
    int hottest = -1;
    for (int s = partner * 3; s < partner * 3 + 2; ++s) {
      const int e = next->expert_at(s);
      if (hottest < 0 || load[e] > load[hottest]) hottest = e;
    }
    EXPECT_EQ(next->expert_at(r * 3 + 2), hottest) << "rank " << r;
  }
  // The step's LP puts the hot expert's tokens where they balance best: in whole tokens by
  // default (the optimum rounded up), exactly with GLPK.
  auto step = StepLoad::FromExpertCounts(4, load);
  auto lp = SolveLpBalance(*next, load);
  ASSERT_TRUE(lp.ok());
  auto routing = lplb->Route(0, *next, *step);
  ASSERT_TRUE(routing.ok()) << routing.status().ToString();
  EXPECT_EQ(routing->max_rank_tokens(), std::ceil(lp->max_rank_tokens - 1e-7));

  KeelConfig glpk_config = SmallConfig(1, 4, 3, 0);
  glpk_config.policy.lplb.solver = "glpk";
  auto glpk = Make("lplb", PolicyContext::FromConfig(glpk_config, 1, 8).value());
  auto exact = glpk->Route(0, *next, *step);
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_NEAR(exact->max_rank_tokens(), lp->max_rank_tokens, 1e-6);
}

}  // namespace
}  // namespace keel
