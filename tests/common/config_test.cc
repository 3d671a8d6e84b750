// Tests of the configuration table and its YAML reader: good files, every kind of error (each must
// name the key, the value and the line), cross-field checks, the shipped configs, and that
// docs/config.md and `keel config --defaults` stay in step with the table.
#include "common/config.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace keel {
namespace {

// Fails the test unless parsing `yaml` fails with a message that contains every one of `parts`.
void ExpectError(const std::string& yaml, std::initializer_list<std::string> parts) {
  Result<KeelConfig> config = ParseConfig(yaml, "configs/x.yaml");
  ASSERT_FALSE(config.ok()) << "expected an error for:\n" << yaml;
  EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
  for (const std::string& part : parts) {
    EXPECT_NE(config.status().message().find(part), std::string::npos)
        << "message: " << config.status().message() << "\nlacks: " << part;
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

TEST(ConfigTest, EmptyTextIsTheDefaults) {
  const std::string defaults = ConfigToYaml(KeelConfig{});
  for (const char* text : {"", "\n", "# nothing set\n", "---\n"}) {
    Result<KeelConfig> config = ParseConfig(text);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    EXPECT_EQ(ConfigToYaml(*config), defaults) << "for text: " << text;
  }
  EXPECT_TRUE(ValidateConfig(KeelConfig{}).ok());
}

TEST(ConfigTest, ParsesNestedKeysOfEveryType) {
  Result<KeelConfig> config = ParseConfig(R"(
topology:
  num_nodes: 2
  gpus_per_node: 4
  inter_node_gb_per_s: 25
slots:
  transient_per_rank: 0
estimator:
  kind: window
  window_steps: 5
policy:
  name: flexmoe
  replan_interval_steps: 10
  flexmoe:
    balance_ratio_trigger: 1.2
  keel:
    transient_replicas: false
)");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->topology.num_nodes, 2);
  EXPECT_EQ(config->topology.gpus_per_node, 4);
  EXPECT_EQ(config->num_ranks(), 8);
  EXPECT_DOUBLE_EQ(config->topology.inter_node_gb_per_s, 25.0);
  EXPECT_EQ(config->slots.transient_per_rank, 0);
  EXPECT_EQ(config->estimator.kind, EstimatorKind::kSlidingWindow);
  EXPECT_EQ(config->estimator.window_steps, 5);
  EXPECT_EQ(config->policy.name, "flexmoe");
  EXPECT_EQ(config->policy.replan_interval_steps, 10);
  EXPECT_DOUBLE_EQ(config->policy.flexmoe.balance_ratio_trigger, 1.2);
  EXPECT_FALSE(config->policy.keel.transient_replicas);
  // Keys left out keep their defaults.
  const KeelConfig defaults;
  EXPECT_DOUBLE_EQ(config->topology.intra_node_gb_per_s, defaults.topology.intra_node_gb_per_s);
  EXPECT_EQ(config->cost_model.hidden_size, defaults.cost_model.hidden_size);
  EXPECT_EQ(config->policy.flexmoe.max_actions_per_replan,
            defaults.policy.flexmoe.max_actions_per_replan);
}

TEST(ConfigTest, EmptySectionKeepsDefaults) {
  Result<KeelConfig> config = ParseConfig("topology:\npolicy:\n  eplb:\n");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->topology.num_nodes, KeelConfig{}.topology.num_nodes);
}

TEST(ConfigTest, OutOfRangeNamesKeyValueLineAndBound) {
  ExpectError("cost_model:\n  expert_ffn_size: 8192\n  hidden_size: -3\n",
              {"configs/x.yaml:3: cost_model.hidden_size: -3 is out of range (must be in [1, "
               "1048576])"});
  ExpectError("topology:\n  intra_node_gb_per_s: 0\n",
              {"configs/x.yaml:2: topology.intra_node_gb_per_s: 0 is out of range (must be in "
               "[1e-9, 1e9])"});
  ExpectError("estimator:\n  ema_decay: 1.0\n",
              {"configs/x.yaml:2: estimator.ema_decay: 1.0 is out of range (must be in [0, 1))"});
  ExpectError("cost_model:\n  dtype_bytes: 16\n",
              {":2:", "cost_model.dtype_bytes", "16", "[1, 8]"});
  ExpectError("topology:\n  num_nodes: 99999999999\n",
              {":2:", "topology.num_nodes", "99999999999"});
}

TEST(ConfigTest, WrongTypeNamesKeyValueAndLine) {
  ExpectError("slots:\n  persistent_per_rank: three\n",
              {"configs/x.yaml:2:", "slots.persistent_per_rank", "three", "not an integer"});
  ExpectError("slots:\n  persistent_per_rank: 2.5\n",
              {"configs/x.yaml:2:", "slots.persistent_per_rank", "2.5", "not an integer"});
  ExpectError("cost_model:\n  expert_tflops: fast\n",
              {"configs/x.yaml:2:", "cost_model.expert_tflops", "fast", "not a finite number"});
  ExpectError("cost_model:\n  expert_tflops: .inf\n", {":2:", "cost_model.expert_tflops", ".inf"});
  ExpectError("policy:\n  keel:\n    transient_replicas: maybe\n",
              {"configs/x.yaml:3:", "policy.keel.transient_replicas", "maybe", "true or false"});
  ExpectError("topology:\n  num_nodes: [1, 2]\n",
              {"configs/x.yaml:2:", "topology.num_nodes", "expected an integer", "a list"});
  ExpectError("topology:\n  num_nodes:\n", {"configs/x.yaml:2:", "topology.num_nodes", "no value"});
}

// Types are exact: YAML reads a quoted scalar, or one tagged !!str, as a string, and a key of
// another type refuses it; a plain or rightly tagged scalar of the key's type reads as before.
TEST(ConfigTest, QuotedOrTaggedScalarsAreOfTheirOwnType) {
  struct Case {
    const char* yaml;
    const char* message;
  };
  const Case refused[] = {
      {"topology:\n  num_nodes: \"4\"\n",
       "x.yaml:2: topology.num_nodes: \"4\" is a quoted string, not an integer (write 4 without "
       "quotes)"},
      {"slots:\n  transient_per_rank: '2'\n",
       "x.yaml:2: slots.transient_per_rank: \"2\" is a quoted string, not an integer"},
      {"cost_model:\n  expert_tflops: \"600\"\n",
       "x.yaml:2: cost_model.expert_tflops: \"600\" is a quoted string, not a number"},
      {"policy:\n  keel:\n    transient_replicas: \"true\"\n",
       "x.yaml:3: policy.keel.transient_replicas: \"true\" is a quoted string, not true or false"},
      {"monitor:\n  per_source_rank: 'false'\n",
       "x.yaml:2: monitor.per_source_rank: \"false\" is a quoted string, not true or false"},
      {"topology:\n  num_nodes: !!str 4\n",
       "x.yaml:2: topology.num_nodes: 4 is tagged !!str, not an integer"},
      {"estimator:\n  ema_decay: !!bool 0.5\n",
       "x.yaml:2: estimator.ema_decay: 0.5 is tagged !!bool, not a number"},
      {"policy:\n  keel:\n    shard_experts: !!int 1\n",
       "x.yaml:3: policy.keel.shard_experts: 1 is tagged !!int, not true or false"},
      {"policy:\n  name: !!int 4\n", "x.yaml:2: policy.name: 4 is tagged !!int, not a string"},
      {"topology:\n  num_nodes: !mine 4\n",
       "x.yaml:2: topology.num_nodes: 4 has the tag !mine, which Keel does not read"},
  };
  for (const Case& c : refused) ExpectError(c.yaml, {c.message});
  Result<KeelConfig> accepted = ParseConfig(
      "topology:\n  num_nodes: !!int \"4\"\n  intra_node_gb_per_s: !!int 300\n"
      "cost_model:\n  expert_tflops: !!float 500\npolicy:\n  name: \"keel\"\n  keel:\n"
      "    transient_replicas: !!bool false\n    spare_slots: 'replicas'\n"
      "monitor:\n  metrics_address: 9400\n  trace_path: !!str t.jsonl\n",
      "x.yaml");
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  EXPECT_EQ(accepted->topology.num_nodes, 4);
  EXPECT_EQ(accepted->topology.intra_node_gb_per_s, 300.0);
  EXPECT_EQ(accepted->cost_model.expert_tflops, 500.0);
  EXPECT_EQ(accepted->policy.name, "keel");
  EXPECT_FALSE(accepted->policy.keel.transient_replicas);
  EXPECT_EQ(accepted->monitor.metrics_address, "9400");  // a bare port, as documented
  EXPECT_EQ(accepted->monitor.trace_path, "t.jsonl");
}

// A config file is one YAML document: a second one, or text after its end, was dropped unread.
TEST(ConfigTest, OneDocumentOnly) {
  struct Case {
    const char* yaml;
    const char* line;
  };
  const Case refused[] = {
      {"topology:\n  num_nodes: 2\n...\ntopology:\n  num_nodes: 3\n", "x.yaml:4: "},
      {"topology:\n  num_nodes: 2\n...\ngarbage\n", "x.yaml:4: "},
      {"topology:\n  num_nodes: 2\n---\npolicy:\n  name: keel\n", "x.yaml:3: "},
      {"topology:\n  num_nodes: 2\n---\n", "x.yaml:3: "},
      {"---\ntopology:\n  num_nodes: 2\n...\n\n---\n", "x.yaml:6: "},
  };
  for (const Case& c : refused) {
    ExpectError(c.yaml, {std::string(c.line) + "a second YAML document starts here"});
  }
  // Text yaml-cpp cannot get past: it starts empty documents there forever (found by the config
  // fuzzer once the reader looked for a second document; YAML::Load read it as an empty file).
  ExpectError(std::string(",!\x0e", 3),
              {"x.yaml:1: YAML syntax error: the parser cannot read past"});
  for (const char* yaml : {"---\ntopology:\n  num_nodes: 2\n...\n# a comment after the end\n",
                           "topology:\n  num_nodes: 2\n...\n"}) {
    Result<KeelConfig> config = ParseConfig(yaml, "x.yaml");
    ASSERT_TRUE(config.ok()) << yaml << ": " << config.status().ToString();
    EXPECT_EQ(config->topology.num_nodes, 2);
  }
}

// Integers are read at their full width: one beyond 64 bits is out of range, not "not an
// integer", and an int key's range names the int's bound where the table has none.
TEST(ConfigTest, IntegersOutOfRangeNameTheBoundThatApplies) {
  ExpectError("topology:\n  num_nodes: 18446744073709551615\n",
              {"x.yaml:2: topology.num_nodes: 18446744073709551615 is out of range (must be in "
               "[1, 4096])"});
  ExpectError("policy:\n  replan_interval_steps: 3000000000\n",
              {"x.yaml:2: policy.replan_interval_steps: 3000000000 is out of range (must be in "
               "[1, 2147483647])"});
  ExpectError("policy:\n  replan_interval_steps: -99999999999999999999\n",
              {"x.yaml:2: policy.replan_interval_steps: -99999999999999999999 is out of range "
               "(must be in [1, 2147483647])"});
  ExpectError("monitor:\n  aggregating_rank: 2147483648\n",
              {"monitor.aggregating_rank: 2147483648 is out of range (must be in [0, "
               "2147483647])"});
}

// Constants the cost model divides by or multiplies with have bounds that keep every price of a
// trace finite; a degenerate one is refused by name, where before a replay reported inf or NaN
// (null in its JSON report). One case per key.
TEST(ConfigTest, CostModelConstantsThatWouldGiveNonFinitePricesAreRefused) {
  struct Case {
    const char* yaml;
    const char* message;
  };
  const Case refused[] = {
      {"topology:\n  intra_node_gb_per_s: 1e-320\n",
       "topology.intra_node_gb_per_s: 1e-320 is out of range (must be in [1e-9, 1e9])"},
      {"topology:\n  inter_node_gb_per_s: 1e308\n",
       "topology.inter_node_gb_per_s: 1e308 is out of range (must be in [1e-9, 1e9])"},
      {"cost_model:\n  expert_tflops: 1e-300\n",
       "cost_model.expert_tflops: 1e-300 is out of range (must be in [1e-9, 1e9])"},
      {"cost_model:\n  train_flops_multiplier: 1e308\n",
       "cost_model.train_flops_multiplier: 1e308 is out of range (must be in [1, 1000])"},
      {"cost_model:\n  home_move_bytes_per_parameter: 1e308\n",
       "cost_model.home_move_bytes_per_parameter: 1e308 is out of range (must be in (0, 1024])"},
      {"cost_model:\n  gemm_efficiency: \"1024:1e-300\"\n",
       "entry '1024:1e-300': efficiency must be a number in [0.001, 4]"},
      {"migration:\n  bandwidth_cap_gb_per_s: 1e300\n",
       "migration.bandwidth_cap_gb_per_s: 1e300 is out of range (must be in [0, 1e9])"},
      {"migration:\n  deadline_seconds: 1e300\n",
       "migration.deadline_seconds: 1e300 is out of range (must be in (0, 1e9])"},
      {"policy:\n  planner_watchdog_seconds: 1e20\n",
       "policy.planner_watchdog_seconds: 1e20 is out of range (must be in (0, 1e9])"},
      {"engine:\n  collective_timeout_seconds: 1e20\n",
       "engine.collective_timeout_seconds: 1e20 is out of range (must be in (0, 1e9])"},
  };
  for (const Case& c : refused) ExpectError(c.yaml, {":2: ", c.message});
  // The bounds themselves are accepted.
  Result<KeelConfig> edges = ParseConfig(
      "topology:\n  intra_node_gb_per_s: 1e-9\n  inter_node_gb_per_s: 1e9\n"
      "cost_model:\n  expert_tflops: 1e-9\n  train_flops_multiplier: 1000\n"
      "  home_move_bytes_per_parameter: 1024\n  gemm_efficiency: \"1024:0.001\"\n");
  EXPECT_TRUE(edges.ok()) << edges.status().ToString();
}

TEST(ConfigTest, BadEnumValueListsAllowedValues) {
  ExpectError("estimator:\n  kind: emma\n",
              {"configs/x.yaml:2: estimator.kind: emma is not allowed",
               "must be one of last, window, ema"});
  ExpectError("\npolicy:\n  name: deepspeed\n",
              {"configs/x.yaml:3: policy.name: deepspeed",
               "static, eplb, flexmoe, smartmoe, fastermoe, velb, lplb, swiftmoe, trtllm, keel"});
  ExpectError("policy:\n  keel:\n    spare_slots: transient\n",
              {"configs/x.yaml:3: policy.keel.spare_slots: transient is not allowed",
               "must be one of replicas, per_step"});
}

TEST(ConfigTest, UnknownKeysNameTheFullPathAndTheValidKeys) {
  ExpectError("topology:\n  num_node: 2\n",
              {"configs/x.yaml:2: unknown key 'topology.num_node'", "did you mean 'num_nodes'",
               "valid keys in 'topology': num_nodes, gpus_per_node, intra_node_gb_per_s, "
               "inter_node_gb_per_s"});
  ExpectError("policy:\n  name: keel\n  flexmoe:\n    trigger: 1.1\n",
              {"configs/x.yaml:4: unknown key 'policy.flexmoe.trigger'",
               "did you mean 'balance_ratio_trigger'",
               "valid keys in 'policy.flexmoe': balance_ratio_trigger, max_actions_per_replan"});
  ExpectError(
      "policy:\n  keel:\n    transient_replicas: true\n  deepep: {}\n",
      {"configs/x.yaml:4: unknown key 'policy.deepep'",
       "name, replan_interval_steps, planner_watchdog_seconds, plan_adoption, eplb, flexmoe, "
       "smartmoe, fastermoe, lplb, trtllm, keel"});
  ExpectError("topologies:\n  num_nodes: 2\n",
              {"configs/x.yaml:1: unknown key 'topologies'", "did you mean 'topology'",
               "valid top-level keys: topology, slots, cost_model, estimator, policy"});
}

TEST(ConfigTest, StructuralErrorsNameTheLine) {
  ExpectError("topology: 3\n", {"configs/x.yaml:1: topology: expected a map", "num_nodes", "3"});
  ExpectError("- 1\n- 2\n", {"configs/x.yaml:1:", "top level", "a list"});
  ExpectError("topology:\n  num_nodes: 2\n  num_nodes: 3\n",
              {"configs/x.yaml:3: topology.num_nodes: key appears twice (first on line 2)"});
}

TEST(ConfigTest, SyntaxErrorNamesTheLine) {
  ExpectError("topology:\n  num_nodes: 2\n  gpus_per_node: [8\nslots:\n",
              {"configs/x.yaml:", "YAML"});
  ExpectError("topology:\n  num_nodes: 2\n bad_indent: 1\n",
              {"configs/x.yaml:3: YAML syntax error"});
}

TEST(ConfigTest, CrossFieldChecksNameBothKeys) {
  // EPLB itself falls back to global balancing for groups that do not divide among nodes.
  EXPECT_TRUE(ParseConfig("topology:\n  num_nodes: 2\npolicy:\n  eplb:\n    num_groups: 3\n").ok());
  ExpectError("cost_model:\n  dtype_bytes: 4\n  home_move_bytes_per_parameter: 2\n",
              {"configs/x.yaml:3: cost_model.home_move_bytes_per_parameter: 2.0",
               "cost_model.dtype_bytes (4)"});
  ExpectError(
      "slots:\n  transient_per_rank: 0\n",
      {"configs/x.yaml:2:", "policy.keel.transient_replicas", "slots.transient_per_rank >= 1"});
  // Other policies do not use transient replicas.
  EXPECT_TRUE(ParseConfig("slots:\n  transient_per_rank: 0\npolicy:\n  name: eplb\n").ok());
  // With spare_slots: per_step the spare slots are room for transients: no transient slot needed.
  EXPECT_TRUE(
      ParseConfig("slots:\n  transient_per_rank: 0\npolicy:\n  keel:\n    spare_slots: per_step\n")
          .ok());
  ExpectError("policy:\n  keel:\n    spare_slots: per_step\n    transient_replicas: false\n",
              {"policy.keel.spare_slots: per_step needs policy.keel.transient_replicas: true",
               "policy.keel.transient_replicas"});
}

TEST(ConfigTest, ValidateConfigChecksBuiltConfigs) {
  auto expect_invalid = [](const KeelConfig& config, const std::string& part) {
    Status status = ValidateConfig(config);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << part;
    EXPECT_NE(status.message().find(part), std::string::npos) << status.message();
  };
  KeelConfig config;
  config.estimator.ema_decay = 1.0;
  expect_invalid(config, "estimator.ema_decay: 1.0 is out of range (must be in [0, 1))");
  config = KeelConfig{};
  config.slots.persistent_per_rank = 0;
  expect_invalid(config, "slots.persistent_per_rank: 0 is out of range (must be in [1, 1048576])");
  config = KeelConfig{};
  config.slots.transient_per_rank = -1;
  expect_invalid(config, "slots.transient_per_rank: -1");
  config = KeelConfig{};
  config.policy.replan_interval_steps = 0;
  expect_invalid(config, "policy.replan_interval_steps: 0");
  config = KeelConfig{};
  config.policy.name = "random";
  expect_invalid(config, "policy.name: random is not allowed");
  config = KeelConfig{};
  config.topology.num_nodes = 256;
  config.topology.gpus_per_node = 256;
  expect_invalid(config, "65536 ranks, more than the 4096 Keel supports");
  config = KeelConfig{};
  config.topology.gpus_per_node = 1024;
  config.slots.persistent_per_rank = 1024;
  config.slots.transient_per_rank = 1;
  expect_invalid(config, "1049600 slots per layer on 1024 ranks, more than 2^20");
  config = KeelConfig{};
  config.monitor.aggregating_rank = 8;  // the default topology has 8 ranks
  expect_invalid(config, "monitor.aggregating_rank: 8 is not a rank of the job (it has 8 ranks)");
  // The same reader as --serve-metrics (ParseListenAddress), so the same words.
  config = KeelConfig{};
  config.monitor.metrics_address = "::1:9400";
  expect_invalid(config,
                 "monitor.metrics_address: address '::1:9400': write an IPv6 host in "
                 "brackets, e.g. [::1]:9400");
  config.monitor.metrics_address = "[::1]:9400";
  EXPECT_TRUE(ValidateConfig(config).ok()) << ValidateConfig(config).ToString();
}

TEST(ConfigTest, MetricsAddressIsCheckedWhereTheFileSetsIt) {
  ExpectError("monitor:\n  metrics_address: \"localhost:80s\"\n",
              {"configs/x.yaml:2", "monitor.metrics_address", "address 'localhost:80s'",
               "port '80s' is not a number in 0..65535"});
  Result<KeelConfig> config = ParseConfig("monitor:\n  metrics_address: \"[::1]:0\"\n");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->monitor.metrics_address, "[::1]:0");
}

TEST(ConfigTest, EstimatorKindNames) {
  EXPECT_EQ(EstimatorKindName(EstimatorKind::kLastStep), "last");
  EXPECT_EQ(EstimatorKindName(EstimatorKind::kSlidingWindow), "window");
  EXPECT_EQ(EstimatorKindName(EstimatorKind::kEma), "ema");
  for (EstimatorKind kind :
       {EstimatorKind::kLastStep, EstimatorKind::kSlidingWindow, EstimatorKind::kEma}) {
    Result<KeelConfig> config =
        ParseConfig("estimator:\n  kind: " + std::string(EstimatorKindName(kind)) + "\n");
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    EXPECT_EQ(config->estimator.kind, kind);
  }
}

TEST(ConfigTest, ShippedSmartMoeConfigLoads) {
  Result<KeelConfig> config = LoadConfigFile(KEEL_SOURCE_DIR "/configs/smartmoe-16gpu.yaml");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->num_ranks(), 16);
  EXPECT_EQ(config->topology.num_nodes, 2);
  EXPECT_EQ(config->slots.persistent_per_rank, 3);
  EXPECT_EQ(config->slots.transient_per_rank, 1);
  EXPECT_DOUBLE_EQ(config->topology.intra_node_gb_per_s, 400.0);
  EXPECT_DOUBLE_EQ(config->topology.inter_node_gb_per_s, 50.0);
  EXPECT_DOUBLE_EQ(config->cost_model.expert_tflops, 600.0);
  EXPECT_EQ(config->cost_model.hidden_size, 2048);
  EXPECT_EQ(config->cost_model.expert_ffn_size, 8192);
  EXPECT_EQ(config->cost_model.expert_matrices, 2);
  EXPECT_EQ(config->cost_model.dtype_bytes, 2);
  EXPECT_DOUBLE_EQ(config->cost_model.home_move_bytes_per_parameter, 14.0);
  EXPECT_EQ(config->policy.name, "keel");
  EXPECT_EQ(config->policy.keel.spare_slots, "per_step");
}

// Found by the config fuzzer (tests/fuzz/config_fuzz.cc): a trace_path holding control bytes
// loaded, but did not survive ConfigToYaml and back. Free-form values must be text.
TEST(ConfigTest, FreeFormValuesAreText) {
  Result<KeelConfig> control = ParseConfig("monitor:\n  trace_path: \"a\\x0f\\x1cb\"\n", "x.yaml");
  ASSERT_FALSE(control.ok());
  EXPECT_NE(control.status().message().find(
                "monitor.trace_path: \"a\\x0f\\x1cb\" has a control character (byte 15) at "
                "position 1"),
            std::string::npos)
      << control.status().message();
  KeelConfig config;
  config.monitor.metrics_address = "127.0.0.1:\xff";
  const Status not_utf8 = ValidateConfig(config);
  EXPECT_NE(not_utf8.message().find("monitor.metrics_address"), std::string::npos)
      << not_utf8.ToString();
  EXPECT_NE(not_utf8.message().find("is not valid UTF-8 at position 10"), std::string::npos)
      << not_utf8.ToString();
  config.monitor.metrics_address = "127.0.0.1:\xc0\x80";  // an overlong NUL
  EXPECT_NE(ValidateConfig(config).message().find("is not valid UTF-8"), std::string::npos);
  // Text outside ASCII is fine, and round-trips.
  config.monitor.metrics_address = "";
  config.monitor.trace_path = "/tmp/d\xc3\xa9j\xc3\xa0/\xe2\x82\xac/t.jsonl";
  ASSERT_TRUE(ValidateConfig(config).ok()) << ValidateConfig(config).ToString();
  Result<KeelConfig> again = ParseConfig(ConfigToYaml(config), "again.yaml");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->monitor.trace_path, config.monitor.trace_path);
}

// Maps and sequences nest at most 64 levels, in flow and block style alike: deeper text is
// refused, naming its line, before it is built (a megabyte of '[' included).
TEST(ConfigTest, NestingIsBounded) {
  std::string block;
  for (int level = 0; level < 70; ++level) block += std::string(2 * level, ' ') + "k:\n";
  ExpectError(block, {"configs/x.yaml:65: maps and sequences nest deeper than 64 levels"});
  ExpectError("policy: " + std::string(100, '['),
              {"configs/x.yaml:1: maps and sequences nest deeper than 64 levels"});
  ExpectError("policy:\n  name: " + std::string(1 << 20, '['),
              {"configs/x.yaml:2: maps and sequences nest deeper than 64 levels"});
  // Within the limit, the text parses and is refused for what it says.
  ExpectError("policy: " + std::string(10, '[') + std::string(10, ']'),
              {"configs/x.yaml:1: policy"});
}

// A config file is read as every input is (common/file.h): a FIFO, a device or a file beyond
// KEEL_MAX_CONFIG_BYTES is refused by name, without blocking.
TEST(ConfigTest, FileThatIsNotARegularFileWithinTheLimitIsRefused) {
  char pattern[] = "/tmp/keel-config-test-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string dir = pattern;
  const std::string fifo = dir + "/fifo.yaml";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string large = dir + "/large.yaml";
  { std::ofstream(large) << "policy:\n  name: static\n" << std::string(2 << 20, '#') << "\n"; }
  for (const auto& [path, text] : std::vector<std::pair<std::string, std::string>>{
           {fifo, "is a FIFO (named pipe), not a regular file"},
           {"/dev/zero", "is a character device, not a regular file"},
           {large,
            "is more than the limit of 1 MiB for a config file (set KEEL_MAX_CONFIG_BYTES "
            "to raise it)"}}) {
    const Result<KeelConfig> config = LoadConfigFile(path);
    ASSERT_FALSE(config.ok()) << path;
    EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(config.status().message().rfind("config file: " + path + ": ", 0), 0u)
        << config.status().message();
    EXPECT_NE(config.status().message().find(text), std::string::npos) << config.status().message();
  }
  std::filesystem::remove_all(dir);
}

TEST(ConfigTest, MissingFileIsNotFound) {
  Result<KeelConfig> config = LoadConfigFile("/nonexistent/keel.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), StatusCode::kNotFound);
  EXPECT_NE(config.status().message().find("/nonexistent/keel.yaml"), std::string::npos);
}

TEST(ConfigTest, DocsConfigMdIsUpToDate) {
  const std::string path = KEEL_SOURCE_DIR "/docs/config.md";
  EXPECT_TRUE(ReadFile(path) == ConfigReferenceMarkdown())
      << path << " is stale or missing; regenerate it with `keel config --markdown > "
      << "docs/config.md`";
}

TEST(ConfigTest, MarkdownExampleParses) {
  const std::string markdown = ConfigReferenceMarkdown();
  size_t start = markdown.find("```yaml\n");
  ASSERT_NE(start, std::string::npos);
  start += 8;
  size_t end = markdown.find("```", start);
  ASSERT_NE(end, std::string::npos);
  Result<KeelConfig> config = ParseConfig(markdown.substr(start, end - start));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->policy.name, "flexmoe");
}

TEST(ConfigTest, YamlOfAnyConfigRoundTrips) {
  KeelConfig config;
  config.topology.num_nodes = 4;
  config.topology.inter_node_gb_per_s = 12.5;
  config.estimator.kind = EstimatorKind::kLastStep;
  config.estimator.ema_decay = 0.1 + 0.2;  // not exactly representable in short decimal
  config.policy.name = "smartmoe";
  config.policy.smartmoe.stickiness = 1e-7;
  config.policy.keel.transient_replicas = false;
  config.monitor.trace_path = "runs/a \"quoted\" \\ name.jsonl";  // free strings are quoted
  config.migration.transport = "ucx";
  const std::string yaml = ConfigToYaml(config);
  Result<KeelConfig> parsed = ParseConfig(yaml, "<defaults>");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString() << "\n" << yaml;
  EXPECT_EQ(ConfigToYaml(*parsed), yaml);
  EXPECT_EQ(parsed->estimator.ema_decay, 0.1 + 0.2);
  EXPECT_EQ(parsed->policy.smartmoe.stickiness, 1e-7);
  EXPECT_EQ(parsed->estimator.kind, EstimatorKind::kLastStep);
  EXPECT_EQ(parsed->monitor.trace_path, config.monitor.trace_path);
  EXPECT_EQ(parsed->monitor.metrics_address, "");
  EXPECT_EQ(parsed->migration.transport, "ucx");
}

TEST(ConfigTest, HelpTextNamesEveryKey) {
  const std::string help = ConfigHelpText();
  YAML::Node root = YAML::Load(ConfigToYaml(KeelConfig{}));
  // Walks the defaults YAML and looks for each dotted path in the help.
  std::function<void(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& map,
                                                                        const std::string& at) {
    for (auto entry = map.begin(); entry != map.end(); ++entry) {
      std::string path = at.empty() ? entry->first.Scalar() : at + "." + entry->first.Scalar();
      YAML::Node value = entry->second;
      if (value.IsMap()) {
        walk(value, path);
      } else {
        EXPECT_NE(help.find("  " + path + " = "), std::string::npos) << path;
      }
    }
  };
  walk(root, "");
}

// Counts the members of an aggregate: the largest N for which T{f1, ..., fN} compiles, where
// each fi converts to any member type.
struct AnyMember {
  template <typename T>
  operator T() const;  // NOLINT(google-explicit-constructor): only used unevaluated
};

template <typename T, typename... Members>
constexpr size_t CountMembers() {
  if constexpr (requires { T{Members{}..., AnyMember{}}; }) {
    return CountMembers<T, Members..., AnyMember>();
  } else {
    return sizeof...(Members);
  }
}

size_t EntriesAt(const YAML::Node& root, const std::string& dotted) {
  YAML::Node node = root;
  std::stringstream parts(dotted);
  std::string part;
  while (std::getline(parts, part, '.')) node.reset(node[part]);  // `=` would write into root
  return node.IsMap() ? node.size() : 0;
}

// A member added to a config struct without a row in the key table fails here.
TEST(ConfigTest, EveryStructMemberHasAKey) {
  YAML::Node root = YAML::Load(ConfigToYaml(KeelConfig{}));
  EXPECT_EQ(root.size(), CountMembers<KeelConfig>());
  EXPECT_EQ(EntriesAt(root, "topology"), CountMembers<TopologyConfig>());
  EXPECT_EQ(EntriesAt(root, "slots"), CountMembers<SlotsConfig>());
  EXPECT_EQ(EntriesAt(root, "cost_model"), CountMembers<CostModelConfig>());
  EXPECT_EQ(EntriesAt(root, "estimator"), CountMembers<EstimatorConfig>());
  EXPECT_EQ(EntriesAt(root, "policy"), CountMembers<PolicyConfig>());
  EXPECT_EQ(EntriesAt(root, "policy.eplb"), CountMembers<EplbConfig>());
  EXPECT_EQ(EntriesAt(root, "policy.flexmoe"), CountMembers<FlexMoeConfig>());
  EXPECT_EQ(EntriesAt(root, "policy.smartmoe"), CountMembers<SmartMoeConfig>());
  EXPECT_EQ(EntriesAt(root, "policy.fastermoe"), CountMembers<FasterMoeConfig>());
  EXPECT_EQ(EntriesAt(root, "policy.keel"), CountMembers<KeelPolicyConfig>());
  EXPECT_EQ(EntriesAt(root, "strategy"), CountMembers<StrategyConfig>());
}

TEST(ConfigTest, GemmEfficiencyCurveParsesOrNamesTheBadEntry) {
  Result<std::vector<GemmEfficiencyPoint>> curve =
      ParseGemmEfficiencyCurve(" 1024:0.7,  8192 : 1 ");
  ASSERT_TRUE(curve.ok()) << curve.status().ToString();
  ASSERT_EQ(curve->size(), 2u);
  EXPECT_EQ((*curve)[0].columns, 1024);
  EXPECT_DOUBLE_EQ((*curve)[0].efficiency, 0.7);
  EXPECT_EQ((*curve)[1].columns, 8192);
  EXPECT_TRUE(ParseGemmEfficiencyCurve("").value().empty());
  ExpectError("cost_model:\n  gemm_efficiency: \"1024:0.7, 512:0.5\"\n",
              {"x.yaml:2: cost_model.gemm_efficiency", "entry '512:0.5'", "ascend"});
  ExpectError("cost_model:\n  gemm_efficiency: \"1024\"\n", {"entry '1024'", "columns:efficiency"});
  ExpectError("cost_model:\n  gemm_efficiency: \"1024:zero\"\n",
              {"entry '1024:zero'", "efficiency must be a number"});
  ExpectError("cost_model:\n  gemm_efficiency: \"1024:0.5,\"\n", {"entry ''"});
}

TEST(ConfigTest, StrategyGroupsMustBeRanksOfOneNode) {
  ExpectError("topology:\n  gpus_per_node: 8\nstrategy:\n  mp_degree: 3\n",
              {"x.yaml:4: strategy.mp_degree: 3 does not divide topology.gpus_per_node (8)"});
  ExpectError("strategy:\n  shard_degree: 16\n", {"strategy.shard_degree: 16"});
  ExpectError("strategy:\n  name: tp\n", {"strategy.name", "tp"});
  Result<KeelConfig> fine = ParseConfig("strategy:\n  name: auto\n  shard_degree: 4\n");
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->strategy.shard_degree, 4);
}

}  // namespace
}  // namespace keel
