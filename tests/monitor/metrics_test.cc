// Tests of the Prometheus metrics: exact names and labels, values of the derived gauges, the
// per-expert switch, promtool's verdict, and the exporter over real HTTP: its addresses, and
// scrapes answered while idle and dripping clients hold connections.
#include "monitor/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "placement/placement.h"
#include "placement/routing.h"
#include "tests/monitor/http_test_util.h"
#include "tests/monitor/metrics_test_util.h"

namespace keel {
namespace {

using testing::HasFamily;
using testing::HttpGet;
using testing::HttpReply;
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
  const HttpReply reply = HttpGet("127.0.0.1", port);
  ASSERT_EQ(reply.status, 200) << reply.head;
  EXPECT_EQ(ParseExposition(reply.body).at("keel_placement_epoch"), 42);

  auto second = MakeMetrics(1, 2, 2, false);
  const std::string taken = "127.0.0.1:" + std::to_string(port);
  Status conflict = second->Serve(taken);
  ASSERT_FALSE(conflict.ok());
  EXPECT_EQ(conflict.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(conflict.message().find("the port is in use"), std::string::npos) << conflict.message();
  EXPECT_NE(conflict.message().find(taken), std::string::npos) << conflict.message();

  // Malformed addresses are refused by name before anything is bound; a well-formed address
  // that is not this host's (TEST-NET-1) is refused when binding, with the reason.
  for (const char* malformed : {"256.1.1.1:0", "no-port-here", "::1:0", "[::1]", "a,b:0"}) {
    Status refused = second->Serve(malformed);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << malformed;
    EXPECT_NE(refused.message().find("address '" + std::string(malformed) + "'"), std::string::npos)
        << refused.message();
  }
  Status foreign = second->Serve("192.0.2.1:0");
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.message().find("'192.0.2.1:0': the address is not one of this host's"),
            std::string::npos)
      << foreign.message();
  EXPECT_EQ(second->bound_address(), "");
}

// A scrape of a real exporter on loopback while hostile clients hold connections: the answer
// must be a whole page. The bound is generous so a busy machine cannot fail the test; the
// measured times are in docs/monitor.md (bench/scrape_under_abuse.py).
constexpr double kScrapeBoundSeconds = 5;

void ExpectKeelPage(const HttpReply& reply, double epoch) {
  ASSERT_EQ(reply.status, 200) << "head: " << reply.head;
  EXPECT_NE(reply.head.find("Content-Type: text/plain; version=0.0.4"), std::string::npos)
      << reply.head;
  const auto scraped = ParseExposition(reply.body);
  ASSERT_EQ(scraped.count("keel_placement_epoch"), 1u) << reply.body.substr(0, 400);
  EXPECT_EQ(scraped.at("keel_placement_epoch"), epoch);
  EXPECT_TRUE(HasFamily(reply.body, "keel_steps_total"));
  EXPECT_TRUE(HasFamily(reply.body, "keel_layer_imbalance_ratio"));
}

// 200 clients connect and send nothing (a civetweb exposer with 8 workers answered after 125 s).
TEST(MetricsTest, ScrapeIsAnsweredWhileTwoHundredIdleConnectionsAreOpen) {
  auto metrics = MakeMetrics(1, 2, 2, false);
  ASSERT_TRUE(metrics->Serve("127.0.0.1:0").ok());
  metrics->SetEpoch(7);
  std::vector<testing::TestConnection> idle;
  for (int i = 0; i < 200; ++i) {
    idle.emplace_back("127.0.0.1", metrics->bound_port());
    ASSERT_TRUE(idle.back().ok()) << "connection " << i;
  }
  const HttpReply reply = HttpGet("127.0.0.1", metrics->bound_port());
  std::printf("scrape with 200 idle connections open: %.4f s\n", reply.seconds);
  ExpectKeelPage(reply, 7);
  EXPECT_LT(reply.seconds, kScrapeBoundSeconds);
}

// 40 clients send a request head one byte every 200 ms and never finish it, coming back as soon
// as they are dropped (a civetweb exposer with 8 workers answered after 20 s).
TEST(MetricsTest, ScrapeIsAnsweredWhileFortyClientsDripTheirRequests) {
  auto metrics = MakeMetrics(1, 2, 2, false);
  ASSERT_TRUE(metrics->Serve("127.0.0.1:0").ok());
  metrics->SetEpoch(9);
  const int port = metrics->bound_port();
  const std::string head = "GET /metrics HTTP/1.1\r\nX-Drip: " + std::string(4096, 'a');
  std::atomic<bool> stop{false};
  std::atomic<int> drips{0};
  std::thread dripper([&] {
    std::vector<testing::TestConnection> clients;
    std::vector<size_t> sent(40, 0);
    for (int i = 0; i < 40; ++i) clients.emplace_back("127.0.0.1", port);
    while (!stop.load()) {
      for (int i = 0; i < 40; ++i) {
        if (!clients[i].Send(std::string_view(head).substr(sent[i] % head.size(), 1))) {
          clients[i] = testing::TestConnection("127.0.0.1", port);
          sent[i] = 0;
          continue;
        }
        ++sent[i];
        drips.fetch_add(1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  // Every client has dripped a few bytes (about 1 s) before the scrapes.
  while (drips.load() < 40 * 5) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (int scrape = 0; scrape < 3; ++scrape) {
    const HttpReply reply = HttpGet("127.0.0.1", port);
    std::printf("scrape %d with 40 dripping clients: %.4f s\n", scrape, reply.seconds);
    ExpectKeelPage(reply, 9);
    EXPECT_LT(reply.seconds, kScrapeBoundSeconds);
  }
  stop = true;
  dripper.join();
}

// `[::1]:PORT`, the form the address errors recommend for IPv6, serves (Debian's civetweb is
// built without IPv6, so the exposer refused it).
TEST(MetricsTest, ServesOnIpv6Loopback) {
  if (!testing::HaveIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback on this machine";
  auto metrics = MakeMetrics(1, 2, 2, false);
  Status served = metrics->Serve("[::1]:0");
  ASSERT_TRUE(served.ok()) << served.ToString();
  const int port = metrics->bound_port();
  ASSERT_GT(port, 0);
  EXPECT_EQ(metrics->bound_address(), "[::1]:" + std::to_string(port));
  metrics->SetEpoch(3);
  ExpectKeelPage(HttpGet("::1", port), 3);
  // A second exporter on the same address is refused with the reason.
  auto second = MakeMetrics(1, 2, 2, false);
  Status again = second->Serve("[::1]:" + std::to_string(port));
  EXPECT_NE(again.message().find("the port is in use"), std::string::npos) << again.message();
}

TEST(MetricsTest, RejectsEmptyLayouts) {
  MetricsLayout layout;
  layout.num_experts = 0;
  EXPECT_EQ(Metrics::Create(layout).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace keel
