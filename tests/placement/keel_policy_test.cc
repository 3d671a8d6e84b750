// The `keel` policy: incremental replans that spread hot experts, never co-locate two copies of
// one expert, respect the move budget, and leave a balanced layer alone.
#include <gtest/gtest.h>

#include <numeric>

#include "placement/policy.h"

namespace keel {
namespace {

// Default cost model: the 2048 x 8192 bf16 expert of configs/smartmoe-16gpu.yaml.
PolicyContext Context(int nodes, int gpus, int experts, int slots, int transient) {
  KeelConfig config;
  config.topology.num_nodes = nodes;
  config.topology.gpus_per_node = gpus;
  config.slots.persistent_per_rank = slots;
  config.slots.transient_per_rank = transient;
  return PolicyContext::FromConfig(config, /*num_layers=*/1, experts).value();
}

int ChangedSlots(const Placement& a, const Placement& b) {
  return DiffPlacements(a, b).changed_slots;
}

TEST(KeelPolicyTest, LeavesABalancedLayerAlone) {
  PolicyContext context = Context(1, 4, 8, 3, 1);
  auto policy = MakePolicy("keel", context).value();
  Placement initial = policy->Initial(0).value();
  std::vector<double> uniform(8, 1000.0);
  Placement next = policy->Replan({0, &initial, uniform, nullptr}).value();
  EXPECT_EQ(next, initial);
}

// Found by the plan fuzzer (tests/fuzz/plan_fuzz.cc): a load of 6.7e30 tokens overflowed the
// policy's whole-token sums. Loads beyond 1e15 tokens are refused, naming the expert, by every
// policy that reads them (static, fastermoe and velb keep their placement whatever the load).
TEST(KeelPolicyTest, LoadsBeyondTheTokenLimitAreRefused) {
  PolicyContext context = Context(1, 4, 8, 3, 1);
  for (const std::string& name : PolicyNames()) {
    auto policy = MakePolicy(name, context).value();
    Placement initial = policy->Initial(0).value();
    std::vector<double> load(8, 1000.0);
    load[5] = 6.7e30;
    Result<Placement> next = policy->Replan({0, &initial, load, nullptr});
    if (name == "static" || name == "fastermoe" || name == "velb") continue;
    ASSERT_FALSE(next.ok()) << name;
    EXPECT_NE(next.status().message().find("[5]"), std::string::npos)
        << name << ": " << next.status().ToString();
  }
}

TEST(KeelPolicyTest, SpreadsAHotExpertWithinTheMoveBudget) {
  PolicyContext context = Context(2, 4, 16, 3, 0);
  context.config.keel.spare_slots = "replicas";
  context.config.keel.max_moves_per_replan = 3;
  auto policy = MakePolicy("keel", context).value();
  Placement current = policy->Initial(0).value();
  std::vector<double> load(16, 1000.0);
  load[5] = 20000.0;  // one expert takes most tokens
  Placement next = policy->Replan({0, &current, load, nullptr}).value();
  EXPECT_GT(next.logcnt()[5], 1);
  EXPECT_LE(ChangedSlots(current, next), 3);
  for (int g = 0; g < next.num_ranks(); ++g) {
    for (int e = 0; e < next.num_experts(); ++e) {
      int copies_here = 0;
      for (int s : next.copies(e)) copies_here += next.rank_of_slot(s) == g;
      EXPECT_LE(copies_here, 1) << "expert " << e << " twice on rank " << g;
    }
  }
  // Predicted max rank load under quota routing went down.
  auto est = StepLoad::FromExpertCounts(8, load).value();
  auto before = PlanStepQuotas(current, est, context.topology, context.cost, {}).value();
  auto after = PlanStepQuotas(next, est, context.topology, context.cost, {}).value();
  EXPECT_LT(after.max_rank_tokens(), before.max_rank_tokens());
}

TEST(KeelPolicyTest, RepeatedReplansConvergeAndStop) {
  PolicyContext context = Context(1, 8, 16, 3, 0);
  context.config.keel.spare_slots = "replicas";
  auto policy = MakePolicy("keel", context).value();
  Placement current = policy->Initial(0).value();
  std::vector<double> load(16, 500.0);
  load[0] = 8000.0;
  load[9] = 4000.0;
  int changes = 0;
  for (int round = 0; round < 20; ++round) {
    Placement next = policy->Replan({0, &current, load, nullptr}).value();
    if (next == current) break;
    ++changes;
    current = next;
  }
  EXPECT_GT(changes, 0);
  EXPECT_LT(changes, 20) << "replans never settled on a fixed load";
  Placement again = policy->Replan({0, &current, load, nullptr}).value();
  EXPECT_EQ(again, current);
}

// With spare_slots: per_step the spare slots are the step planner's: replans add no copy (an
// expert keeps one, its home), and a burst's transients take the empty slots as well as the
// transient slots.
TEST(KeelPolicyTest, PerStepSpareSlotsGetNoReplicaButTransients) {
  PolicyContext context = Context(2, 4, 16, 3, 0);
  context.config.keel.spare_slots = "per_step";
  auto policy = MakePolicy("keel", context).value();
  Placement current = policy->Initial(0).value();
  std::vector<double> load(16, 1000.0);
  load[5] = 20000.0;
  Placement next = policy->Replan({0, &current, load, nullptr}).value();
  for (int e = 0; e < next.num_experts(); ++e) EXPECT_EQ(next.logcnt()[e], 1) << "expert " << e;
  auto est = StepLoad::FromExpertCounts(8, load).value();
  StepRouting routing = policy->Route(0, next, est).value();
  EXPECT_FALSE(routing.transients.empty());
  std::vector<int> per_rank(8, 0);
  for (const TransientReplica& t : routing.transients) {
    EXPECT_FALSE(next.holds(t.rank, t.expert));
    ++per_rank[t.rank];
  }
  for (int g = 0; g < 8; ++g) {
    int empty = 0;
    for (int s = g * 3; s < (g + 1) * 3; ++s) empty += next.expert_at(s) == kEmptySlot;
    EXPECT_LE(per_rank[g], empty) << "rank " << g;
  }
  EXPECT_LT(
      routing.max_rank_tokens(),
      PlanStepQuotas(next, est, context.topology, context.cost, {}).value().max_rank_tokens());
}

// Every slot holds a home: the only way to balance is to swap experts, which moves homes with
// their optimizer state, so the swap happens only when it pays back within the horizon.
TEST(KeelPolicyTest, SwapsHomesOnlyWhenTheyPayBackWithinTheHorizon) {
  std::vector<double> load = {60000, 60000, 100, 100, 100, 100, 100, 100};  // both hot on rank 0
  PolicyContext patient = Context(1, 4, 8, 2, 0);
  patient.config.keel.home_payback_horizon_steps = 1000;
  auto policy = MakePolicy("keel", patient).value();
  Placement current = policy->Initial(0).value();
  Placement next = policy->Replan({0, &current, load, nullptr}).value();
  ASSERT_NE(next, current);
  EXPECT_GE(DiffPlacements(current, next).moved_homes, 1);
  auto est = StepLoad::FromExpertCounts(4, load).value();
  EXPECT_LT(RouteEvenly(next, est).max_rank_tokens(), RouteEvenly(current, est).max_rank_tokens());
  EXPECT_NE(next.rank_of_slot(next.copies(0)[0]), next.rank_of_slot(next.copies(1)[0]))
      << "the two hot experts should end up on different ranks";

  PolicyContext impatient = Context(1, 4, 8, 2, 0);
  impatient.config.keel.home_payback_horizon_steps = 0;
  auto never = MakePolicy("keel", impatient).value();
  EXPECT_EQ(never->Replan({0, &current, load, nullptr}).value(), current);
}

TEST(KeelPolicyTest, RouteAddsTransientReplicasForABurst) {
  PolicyContext context = Context(1, 8, 8, 1, 1);
  context.config.keel.transient_replicas = true;
  auto policy = MakePolicy("keel", context).value();
  Placement p = policy->Initial(0).value();
  std::vector<double> burst(8, 1000.0);
  burst[3] = 60000.0;
  auto load = StepLoad::FromExpertCounts(8, burst).value();
  StepRouting with = policy->Route(0, p, load).value();
  EXPECT_FALSE(with.transients.empty());
  for (const auto& t : with.transients) EXPECT_FALSE(p.holds(t.rank, t.expert));
  EXPECT_LT(with.imbalance(), RouteEvenly(p, load).imbalance());
  const double total = std::accumulate(with.rank_tokens.begin(), with.rank_tokens.end(), 0.0);
  EXPECT_DOUBLE_EQ(total, load.TotalTokens());

  context.config.keel.transient_replicas = false;
  auto plain = MakePolicy("keel", context).value();
  EXPECT_TRUE(plain->Route(0, p, load).value().transients.empty());
}

}  // namespace
}  // namespace keel
