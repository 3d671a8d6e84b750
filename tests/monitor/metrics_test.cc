// Tests of the Prometheus metrics: exact names and labels, values of the derived gauges, the
// per-expert switch, promtool's verdict, and the exposer's address handling over real HTTP.
#include "monitor/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "placement/placement.h"
#include "placement/routing.h"
#include "tests/monitor/metrics_test_util.h"

namespace keel {
namespace {

using testing::HasFamily;
using testing::ParseExposition;

std::unique_ptr<Metrics> MakeMetrics(int layers, int ranks, int experts, bool per_expert) {
  MetricsLayout layout;
  layout.num_layers = layers;
  layout.num_ranks = ranks;
  layout.num_experts = experts;
  layout.per_expert_series = per_expert;
  Result<std::unique_ptr<Metrics>> metrics = Metrics::Create(layout);
  EXPECT_TRUE(metrics.ok()) << metrics.status().ToString();
  return std::move(metrics).value();
}

// The page a scrape of 127.0.0.1:`port`/metrics returns, fetched by python3's urllib.
std::string Scrape(int port) {
  const std::string command =
      "python3 -c \"import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("
      "'http://127.0.0.1:" +
      std::to_string(port) + "/metrics', timeout=10).read().decode())\"";
  std::FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) text.append(buffer, n);
  pclose(pipe);
  return text;
}

TEST(MetricsTest, EveryDocumentedFamilyExistsFromTheStart) {
  auto metrics = MakeMetrics(2, 4, 8, false);
  const std::string text = metrics->Serialize();
  for (const char* name :
       {"keel_build_info", "keel_steps_total", "keel_routed_tokens_total",
        "keel_layer_imbalance_ratio", "keel_layer_balancedness", "keel_layer_lower_bound_gap_ratio",
        "keel_expert_load_tokens", "keel_placement_epoch", "keel_plans_total",
        "keel_planner_duration_seconds", "keel_planner_last_run_timestamp_seconds",
        "keel_migrations_total", "keel_migration_bytes_total", "keel_migration_duration_seconds",
        "keel_migrations_in_flight", "keel_migration_exposed_seconds_total", "keel_layer_replicas",
        "keel_layer_transient_replicas", "keel_monitor_dropped_samples_total"}) {
    EXPECT_TRUE(HasFamily(text, name)) << name;
  }
  EXPECT_FALSE(HasFamily(text, "keel_expert_tokens_total"));
  const auto series = ParseExposition(text);
  // Pre-created so rate() and increase() work before the first event.
  EXPECT_EQ(series.count("keel_plans_total{outcome=\"made\",reason=\"none\"}"), 1u);
  EXPECT_EQ(series.count("keel_plans_total{outcome=\"applied\",reason=\"none\"}"), 1u);
  for (const char* outcome : {"ok", "failed", "aborted"}) {
    EXPECT_EQ(series.at(std::string("keel_migrations_total{outcome=\"") + outcome + "\"}"), 0);
  }
  EXPECT_EQ(series.at("keel_routed_tokens_total{layer=\"1\",rank=\"3\"}"), 0);
  EXPECT_EQ(series.at("keel_layer_imbalance_ratio{layer=\"1\",source=\"estimate\"}"), 1);
  int build_info = 0;
  for (const auto& [key, value] : series) {
    if (key.rfind("keel_build_info{", 0) == 0) {
      ++build_info;
      EXPECT_EQ(value, 1);
      EXPECT_NE(key.find("version=\""), std::string::npos);
      EXPECT_NE(key.find("cuda=\""), std::string::npos);
      EXPECT_NE(key.find("nccl=\""), std::string::npos);
      EXPECT_NE(key.find("ucx=\""), std::string::npos);
    }
  }
  EXPECT_EQ(build_info, 1);
}

TEST(MetricsTest, LayerStepGauges) {
  auto metrics = MakeMetrics(2, 2, 3, true);
  const std::vector<double> rank_tokens = {30, 10};
  const std::vector<double> expert_tokens = {20, 15, 5};
  const std::vector<double> estimate = {25, 25};
  LayerStepObservation observation;
  observation.layer = 1;
  observation.rank_tokens = rank_tokens;
  observation.expert_tokens = expert_tokens;
  observation.estimated_rank_tokens = estimate;
  observation.max_copies_per_expert = 1;
  ASSERT_TRUE(metrics->ObserveLayerStep(observation));
  ASSERT_TRUE(metrics->ObserveLayerStep(observation));
  metrics->EndStep();
  const auto series = ParseExposition(metrics->Serialize());
  EXPECT_DOUBLE_EQ(series.at("keel_layer_imbalance_ratio{layer=\"1\",source=\"last_step\"}"), 1.5);
  EXPECT_DOUBLE_EQ(series.at("keel_layer_balancedness{layer=\"1\",source=\"last_step\"}"), 1 / 1.5);
  EXPECT_DOUBLE_EQ(series.at("keel_layer_imbalance_ratio{layer=\"1\",source=\"estimate\"}"), 1);
  // LB = max(40 / 2, 20 / min(2, 1)) = 20; the busiest rank has 30.
  EXPECT_DOUBLE_EQ(series.at("keel_layer_lower_bound_gap_ratio{layer=\"1\"}"), 1.5);
  EXPECT_DOUBLE_EQ(series.at("keel_routed_tokens_total{layer=\"1\",rank=\"0\"}"), 60);
  EXPECT_DOUBLE_EQ(series.at("keel_routed_tokens_total{layer=\"0\",rank=\"0\"}"), 0);
  EXPECT_DOUBLE_EQ(series.at("keel_expert_tokens_total{expert=\"2\",layer=\"1\"}"), 10);
  EXPECT_DOUBLE_EQ(series.at("keel_expert_load_tokens_count{layer=\"1\"}"), 6);
  EXPECT_DOUBLE_EQ(series.at("keel_expert_load_tokens_sum{layer=\"1\"}"), 80);
  EXPECT_DOUBLE_EQ(series.at("keel_expert_load_tokens_bucket{layer=\"1\",le=\"8\"}"), 2);
  EXPECT_DOUBLE_EQ(series.at("keel_expert_load_tokens_bucket{layer=\"1\",le=\"16\"}"), 4);
  EXPECT_DOUBLE_EQ(series.at("keel_steps_total"), 1);

  // Wrong sizes and layers are refused, not half-applied.
  observation.layer = 2;
  EXPECT_FALSE(metrics->ObserveLayerStep(observation));
  observation.layer = 0;
  observation.rank_tokens = std::span<const double>(rank_tokens).first(1);
  EXPECT_FALSE(metrics->ObserveLayerStep(observation));
}

// What the engine, the replay and the load monitor report per layer: the routing's rank loads and
// the placement's replicas plus the routing's transients.
TEST(MetricsTest, LayerRoutingGivesLoadsAndReplicas) {
  auto metrics = MakeMetrics(2, 2, 3, true);
  // Expert 0 on both ranks (one replica), 1 and 2 on rank 1; home of 0 is rank 0.
  const Placement placement = Placement::Create(3, 2, {0, -1, 0, 1, -1, 2}).value();
  StepRouting routing;
  routing.num_ranks = 2;
  routing.rank_tokens = {30, 10};
  routing.transients = {TransientReplica{.expert = 2, .rank = 0, .source_rank = 1}};
  const std::vector<double> expert_tokens = {20, 15, 5};
  metrics->ObserveLayerRouting(1, placement, routing, expert_tokens, {}, 2);
  const auto series = ParseExposition(metrics->Serialize());
  EXPECT_DOUBLE_EQ(series.at("keel_layer_imbalance_ratio{layer=\"1\",source=\"last_step\"}"), 1.5);
  EXPECT_DOUBLE_EQ(series.at("keel_routed_tokens_total{layer=\"1\",rank=\"0\"}"), 30);
  EXPECT_DOUBLE_EQ(series.at("keel_layer_replicas{layer=\"1\"}"), 1);
  EXPECT_DOUBLE_EQ(series.at("keel_layer_transient_replicas{layer=\"1\"}"), 1);
}

TEST(MetricsTest, PlansMigrationsAndCounters) {
  auto metrics = MakeMetrics(1, 2, 2, false);
  metrics->SetEpoch(7);
  metrics->RecordPlan(PlanOutcome::kMade);
  metrics->RecordPlan(PlanOutcome::kSkipped, "no_gain");
  metrics->RecordPlan(PlanOutcome::kRejected, "deadline");
  metrics->RecordPlannerRun(0.002);
  metrics->RecordMigration(MigrationOutcome::kOk, "ucx", 1e9, 1.5, 0.25);
  metrics->RecordMigration(MigrationOutcome::kAborted, "ucx", 0, 30, 0);
  metrics->SetMigrationsInFlight(3);
  metrics->SetReplicas(0, 5, 2);
  metrics->AddDroppedSamples(4);
  const auto series = ParseExposition(metrics->Serialize());
  EXPECT_EQ(series.at("keel_placement_epoch"), 7);
  EXPECT_EQ(series.at("keel_plans_total{outcome=\"made\",reason=\"none\"}"), 1);
  EXPECT_EQ(series.at("keel_plans_total{outcome=\"skipped\",reason=\"no_gain\"}"), 1);
  EXPECT_EQ(series.at("keel_plans_total{outcome=\"rejected\",reason=\"deadline\"}"), 1);
  EXPECT_EQ(series.at("keel_planner_duration_seconds_count"), 1);
  EXPECT_GT(series.at("keel_planner_last_run_timestamp_seconds"), 1.5e9);
  EXPECT_EQ(series.at("keel_migrations_total{outcome=\"ok\"}"), 1);
  EXPECT_EQ(series.at("keel_migrations_total{outcome=\"aborted\"}"), 1);
  EXPECT_EQ(series.at("keel_migration_bytes_total{transport=\"ucx\"}"), 1e9);
  EXPECT_EQ(series.at("keel_migration_duration_seconds_count"), 2);
  EXPECT_EQ(series.at("keel_migration_exposed_seconds_total"), 0.25);
  EXPECT_EQ(series.at("keel_migrations_in_flight"), 3);
  EXPECT_EQ(series.at("keel_layer_replicas{layer=\"0\"}"), 5);
  EXPECT_EQ(series.at("keel_layer_transient_replicas{layer=\"0\"}"), 2);
  EXPECT_EQ(series.at("keel_monitor_dropped_samples_total"), 4);
}

TEST(MetricsTest, PerExpertSeriesOnlyOnTheAggregatingRank) {
  KeelConfig config;
  EXPECT_FALSE(MetricsLayout::FromConfig(config, 2, 8, 0).per_expert_series);  // off
  config.monitor.per_expert = "aggregated";
  config.monitor.aggregating_rank = 3;
  EXPECT_TRUE(MetricsLayout::FromConfig(config, 2, 8, 3).per_expert_series);
  EXPECT_FALSE(MetricsLayout::FromConfig(config, 2, 8, 0).per_expert_series);

  Result<std::unique_ptr<Metrics>> aggregating =
      Metrics::Create(MetricsLayout::FromConfig(config, 2, 8, 3));
  Result<std::unique_ptr<Metrics>> other =
      Metrics::Create(MetricsLayout::FromConfig(config, 2, 8, 0));
  ASSERT_TRUE(aggregating.ok() && other.ok());
  const auto with = ParseExposition((*aggregating)->Serialize());
  const auto without = (*other)->Serialize();
  int series = 0;
  for (const auto& [key, value] : with) series += key.rfind("keel_expert_tokens_total{", 0) == 0;
  EXPECT_EQ(series, 2 * 8);
  EXPECT_EQ(without.find("keel_expert_tokens_total"), std::string::npos);
}

TEST(MetricsTest, ExpositionPassesPromtool) {
  if (!testing::HavePromtool()) GTEST_SKIP() << "promtool not installed";
  auto metrics = MakeMetrics(3, 4, 16, true);
  const std::vector<double> ranks = {100, 50, 25, 25};
  std::vector<double> experts(16, 12.5);
  LayerStepObservation observation;
  observation.rank_tokens = ranks;
  observation.expert_tokens = experts;
  metrics->ObserveLayerStep(observation);
  metrics->RecordPlan(PlanOutcome::kSkipped, "no_gain");
  metrics->RecordMigration(MigrationOutcome::kFailed, "local", 10, 0.1, 0);
  EXPECT_EQ(testing::PromtoolProblems(metrics->Serialize()), "");
}

TEST(MetricsTest, ResolveMetricsAddress) {
  EXPECT_EQ(*ResolveMetricsAddress(""), "");
  EXPECT_EQ(*ResolveMetricsAddress("9400"), "127.0.0.1:9400");
  EXPECT_EQ(*ResolveMetricsAddress("0.0.0.0:80"), "0.0.0.0:80");
  EXPECT_EQ(*ResolveMetricsAddress("[::1]:0"), "[::1]:0");
  for (const char* bad : {"abc", "host:", ":9400", "1.2.3.4:70000", "::1:9400", "9400x"}) {
    Result<std::string> resolved = ResolveMetricsAddress(bad);
    ASSERT_FALSE(resolved.ok()) << bad;
    EXPECT_EQ(resolved.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(resolved.status().message().find(bad), std::string::npos)
        << resolved.status().message();
  }
}

TEST(MetricsTest, ServesOnAFreeLocalPortAndReportsConflictsByAddress) {
  auto metrics = MakeMetrics(1, 2, 2, false);
  ASSERT_TRUE(metrics->Serve("").ok());
  EXPECT_EQ(metrics->bound_address(), "");
  Status served = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(served.ok()) << served.ToString();
  const int port = metrics->bound_port();
  ASSERT_GT(port, 0);
  EXPECT_EQ(metrics->bound_address(), "127.0.0.1:" + std::to_string(port));
  EXPECT_EQ(metrics->Serve("127.0.0.1:0").code(), StatusCode::kFailedPrecondition);

  metrics->SetEpoch(42);
  if (std::system("command -v python3 >/dev/null 2>&1") == 0) {
    const auto scraped = ParseExposition(Scrape(port));
    EXPECT_EQ(scraped.at("keel_placement_epoch"), 42);
  }

  auto second = MakeMetrics(1, 2, 2, false);
  const std::string taken = "127.0.0.1:" + std::to_string(port);
  Status conflict = second->Serve(taken);
  ASSERT_FALSE(conflict.ok());
  EXPECT_EQ(conflict.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(conflict.message().find("the port is in use"), std::string::npos) << conflict.message();
  EXPECT_NE(conflict.message().find(taken), std::string::npos) << conflict.message();

  Status bad = second->Serve("256.1.1.1:0");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("256.1.1.1:0"), std::string::npos) << bad.message();
  EXPECT_EQ(second->Serve("no-port-here").code(), StatusCode::kInvalidArgument);
}

// Clients that send a request line and then nothing (slow or hostile) must not keep a scrape from
// being answered.
TEST(MetricsTest, IdleConnectionsDoNotBlockScrapes) {
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  auto metrics = MakeMetrics(1, 2, 2, false);
  ASSERT_TRUE(metrics->Serve("127.0.0.1:0").ok());
  metrics->SetEpoch(7);
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(metrics->bound_port()));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    const char request_line[] = "GET /metrics HTTP/1.1\r\n";
    ASSERT_GT(send(fd, request_line, sizeof request_line - 1, 0), 0);
    idle.push_back(fd);
  }
  // Scrape times out after 10 s.
  const auto scraped = ParseExposition(Scrape(metrics->bound_port()));
  EXPECT_EQ(scraped.count("keel_placement_epoch"), 1u);
  if (scraped.count("keel_placement_epoch") == 1) {
    EXPECT_EQ(scraped.at("keel_placement_epoch"), 7);
  }
  for (int fd : idle) close(fd);
}

TEST(MetricsTest, RejectsEmptyLayouts) {
  MetricsLayout layout;
  layout.num_experts = 0;
  EXPECT_EQ(Metrics::Create(layout).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace keel
