// PolicyContext::FromConfig: the one place that checks topology and slots before a policy runs.
#include <gtest/gtest.h>

#include "placement/policy.h"

namespace keel {
namespace {

TEST(PolicyContextTest, CarriesTopologySlotsAndPolicyParameters) {
  KeelConfig config;
  config.topology.num_nodes = 2;
  config.topology.gpus_per_node = 4;
  config.slots.persistent_per_rank = 3;
  config.slots.transient_per_rank = 2;
  config.policy.keel.max_moves_per_replan = 7;
  auto context = PolicyContext::FromConfig(config, /*num_layers=*/5, /*num_experts=*/20);
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  EXPECT_EQ(context->topology.num_ranks(), 8);
  EXPECT_EQ(context->num_layers, 5);
  EXPECT_EQ(context->num_experts, 20);
  EXPECT_EQ(context->slots_per_rank, 3);
  EXPECT_EQ(context->transient_per_rank, 2);
  EXPECT_EQ(context->config.keel.max_moves_per_replan, 7);
}

TEST(PolicyContextTest, ErrorsNameTheBadSlotValue) {
  KeelConfig config;  // 1 node x 8 GPUs
  config.slots.persistent_per_rank = 2;
  auto too_few = PolicyContext::FromConfig(config, 1, 17);
  ASSERT_FALSE(too_few.ok());
  EXPECT_NE(too_few.status().message().find("cannot hold 17 experts"), std::string::npos)
      << too_few.status().message();

  config.slots.transient_per_rank = -1;
  auto negative = PolicyContext::FromConfig(config, 1, 8);
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("slots.transient_per_rank must be >= 0, got -1"),
            std::string::npos)
      << negative.status().message();
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// common/ cannot see placement/, so the config checks names against common/policy_names.h: every
// name MakePolicy knows must parse, and an unknown name's error must list them all.
TEST(PolicyContextTest, CheckPolicyNameListsTheKnownNames) {
  for (const std::string& name : PolicyNames()) EXPECT_TRUE(CheckPolicyName(name).ok()) << name;
  Status unknown = CheckPolicyName("roundrobin");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(
      unknown.message(),
      "unknown policy 'roundrobin' (known: static, eplb, flexmoe, smartmoe, fastermoe, velb, lplb, "
      "swiftmoe, trtllm, keel)");
  auto made = MakePolicy("roundrobin", PolicyContext::FromConfig(KeelConfig{}, 1, 8).value());
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().message(), unknown.message());
}

TEST(PolicyContextTest, ConfigAcceptsExactlyThePolicyNames) {
  for (const std::string& name : PolicyNames()) {
    auto config = ParseConfig("policy:\n  name: " + name + "\n");
    EXPECT_TRUE(config.ok()) << name << ": " << config.status().ToString();
  }
  auto unknown = ParseConfig("policy:\n  name: roundrobin\n");
  ASSERT_FALSE(unknown.ok());
  for (const std::string& name : PolicyNames()) {
    EXPECT_NE(unknown.status().message().find(name), std::string::npos)
        << "the error should list '" << name << "': " << unknown.status().message();
  }
}

}  // namespace
}  // namespace keel
