// keel::RegisterPolicy (keel/policy.hpp): a policy added by name at run time is built by
// MakePolicy, accepted by the config, listed by PolicyNames, and its answers become placements.
// The registry lives for the process, so every test registers names of its own.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "keel/plan.hpp"
#include "keel/policy.hpp"
#include "placement/policy.h"

namespace keel {
namespace {

// Moves expert 0 into every rank's last slot; remembers what its last replan saw.
class CopyExpertZero final : public PlacementPolicy {
 public:
  CopyExpertZero(const PolicyShape& shape, ReplanInput* seen) : shape_(shape), seen_(seen) {}

  Result<std::vector<int>> Replan(const ReplanInput& input) override {
    *seen_ = input;
    std::vector<int> phy2log(input.phy2log.begin(), input.phy2log.end());
    for (int r = 0; r < shape_.num_ranks(); ++r) {
      int& last = phy2log[(r + 1) * shape_.slots_per_rank - 1];
      if (last == kEmptySlot) last = 0;
    }
    return phy2log;
  }

 private:
  PolicyShape shape_;
  ReplanInput* seen_;
};

PolicyContext Context() {
  KeelConfig config;  // 1 node x 8 GPUs
  config.slots.persistent_per_rank = 3;
  return PolicyContext::FromConfig(config, /*num_layers=*/2, /*num_experts=*/16).value();
}

TEST(RegisteredPolicyTest, RegisteredPolicyPlansThroughMakePolicyAndTheConfig) {
  ReplanInput seen;
  PolicyShape shape_seen;
  PolicyRegistration registration;
  registration.name = "copy-zero";
  registration.create = [&](const PolicyShape& shape) {
    shape_seen = shape;
    return std::make_unique<CopyExpertZero>(shape, &seen);
  };
  registration.routing = PolicyRouting::kQuotas;
  ASSERT_TRUE(RegisterPolicy(registration).ok());

  EXPECT_EQ(PolicyNames().back(), "copy-zero");
  EXPECT_TRUE(CheckPolicyName("copy-zero").ok());
  auto config = ParseConfig("policy:\n  name: copy-zero\n");
  EXPECT_TRUE(config.ok()) << config.status().ToString();

  const PolicyContext context = Context();
  auto policy = MakePolicy("copy-zero", context);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  EXPECT_EQ((*policy)->name(), "copy-zero");
  EXPECT_EQ(shape_seen.num_experts, 16);
  EXPECT_EQ(shape_seen.num_ranks(), 8);
  EXPECT_EQ(shape_seen.slots_per_rank, 3);

  // No Initial of its own: the static placement.
  auto initial = (*policy)->Initial(1);
  ASSERT_TRUE(initial.ok());
  EXPECT_EQ(*initial, Placement::Contiguous(16, 8, 3).value());

  std::vector<double> load(16, 1.0);
  load[0] = 50;
  auto next = (*policy)->Replan({1, &*initial, load, nullptr});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(seen.layer, 1);
  EXPECT_EQ(seen.expert_load[0], 50);
  EXPECT_TRUE(seen.traffic.empty());
  EXPECT_EQ(next->logcnt()[0], 9);  // its home slot and every rank's last slot
  EXPECT_EQ(next->home(0), initial->home(0));

  // Quota routing spreads expert 0 over its eight ranks: 65 tokens, no rank above 9.
  auto step = StepLoad::FromExpertCounts(8, load);
  auto routing = (*policy)->Route(1, *next, *step);
  ASSERT_TRUE(routing.ok()) << routing.status().ToString();
  EXPECT_LE(routing->max_rank_tokens(), 9.0);
}

TEST(RegisteredPolicyTest, RegistrationErrorsNameTheField) {
  auto create = [](const PolicyShape&) -> std::unique_ptr<PlacementPolicy> { return nullptr; };
  auto message = [&](std::string name, bool with_create) {
    PolicyRegistration registration;
    registration.name = std::move(name);
    if (with_create) registration.create = create;
    return RegisterPolicy(registration).message();
  };
  EXPECT_EQ(message("", true), "PolicyRegistration.name is empty");
  EXPECT_EQ(message("two words", true),
            "PolicyRegistration.name 'two words' may hold only letters, digits, '_' and '-'");
  EXPECT_EQ(message("no-create", false),
            "PolicyRegistration.create of policy 'no-create' is empty");
  EXPECT_EQ(message("keel", true), "PolicyRegistration.name 'keel' is already a policy's name");
  EXPECT_TRUE(RegisterPolicy({"returns-null", create, PolicyRouting::kEven}).ok());
  EXPECT_EQ(message("returns-null", true),
            "PolicyRegistration.name 'returns-null' is already a policy's name");

  // A factory that gives no policy fails MakePolicy, naming the policy.
  auto made = MakePolicy("returns-null", Context());
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().message(), "policy 'returns-null': create returned no policy");
}

// A plug-in's bad answer fails the replan with the policy's name, never a bad placement.
class WrongSize final : public PlacementPolicy {
 public:
  Result<std::vector<int>> Replan(const ReplanInput&) override { return std::vector<int>{0, 1}; }
};

TEST(RegisteredPolicyTest, ABadAnswerFailsTheReplanNamingThePolicy) {
  ASSERT_TRUE(RegisterPolicy({"wrong-size",
                              [](const PolicyShape&) { return std::make_unique<WrongSize>(); },
                              PolicyRouting::kEven})
                  .ok());
  auto policy = MakePolicy("wrong-size", Context());
  ASSERT_TRUE(policy.ok());
  const Placement initial = (*policy)->Initial(0).value();
  auto next = (*policy)->Replan({0, &initial, std::vector<double>(16, 1.0), nullptr});
  ASSERT_FALSE(next.ok());
  EXPECT_EQ(next.status().message(), "policy wrong-size: Replan returned 2 slots, expected 24");
}

}  // namespace
}  // namespace keel
