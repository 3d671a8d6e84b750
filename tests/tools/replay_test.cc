// Trace replay on small in-memory traces: metric definitions, causal versus oracle planning,
// determinism across runs and threads, the JSON report and the SVG plot.
#include "tools/replay.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "placement/policy.h"
#include "tools/svg_plot.h"

namespace keel::tools {
namespace {

using CountFn = std::function<double(int step, int layer, int source, int expert)>;

Trace MakeTrace(int steps, int layers, int experts, int sources, const CountFn& count) {
  Trace trace;
  trace.description = "test trace";
  trace.num_layers = layers;
  trace.num_experts = experts;
  trace.num_sources = sources;
  const int rows = std::max(1, sources);
  for (int t = 0; t < steps; ++t) {
    trace.step_ids.push_back(t);
    std::vector<double> values;
    for (int l = 0; l < layers; ++l) {
      for (int s = 0; s < rows; ++s) {
        for (int e = 0; e < experts; ++e) values.push_back(count(t, l, s, e));
      }
    }
    trace.steps.push_back(std::move(values));
  }
  return trace;
}

// 1 node x 4 GPUs, 3 slots each: 12 slots for 8 experts.
KeelConfig SmallConfig() {
  KeelConfig config;
  config.topology.num_nodes = 1;
  config.topology.gpus_per_node = 4;
  config.slots.persistent_per_rank = 3;
  config.slots.transient_per_rank = 1;
  return config;
}

// A skewed, drifting, deterministic load: a few hot experts whose identity moves slowly.
Trace SkewedTrace(int steps = 30, int layers = 2) {
  return MakeTrace(steps, layers, 8, 4, [](int t, int l, int s, int e) {
    const uint32_t mix = static_cast<uint32_t>(t * 131 + l * 31 + s * 7 + e * 17) * 2654435761u;
    const int hot = (t / 5 + l) % 8;
    return static_cast<double>((e == hot ? 400 : 40) + (mix >> 24) % 30);
  });
}

const PolicyReplay& Find(const ReplayReport& report, const std::string& name) {
  for (const PolicyReplay& p : report.policies) {
    if (p.name == name) return p;
  }
  ADD_FAILURE() << "policy " << name << " missing from the report";
  return report.policies.front();
}

// The report without anything that depends on wall-clock time.
nlohmann::json WithoutTimes(nlohmann::json json) {
  json.erase("wall_seconds");
  for (auto& [name, entry] : json["policies"].items()) {
    entry.erase("wall_seconds");
    entry.erase("planner_seconds_per_layer");
  }
  return json;
}

TEST(SummarizeTest, PercentilesInterpolateLinearly) {
  const Distribution d = Summarize({5, 1, 4, 2, 3});
  EXPECT_EQ(d.count, 5);
  EXPECT_DOUBLE_EQ(d.mean, 3);
  EXPECT_DOUBLE_EQ(d.p50, 3);
  EXPECT_DOUBLE_EQ(d.p90, 4.6);
  EXPECT_DOUBLE_EQ(d.max, 5);
  EXPECT_EQ(Summarize({}).count, 0);
}

TEST(ReplayTest, StaticOnUniformTraceIsPerfectlyBalanced) {
  const Trace trace = MakeTrace(10, 3, 8, 4, [](int, int, int, int) { return 100.0; });
  ReplayOptions options;
  options.policies = {"static"};
  auto report = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const PolicyReplay& p = report->policies.at(0);
  EXPECT_DOUBLE_EQ(p.imbalance.mean, 1.0);
  EXPECT_DOUBLE_EQ(p.imbalance.max, 1.0);
  EXPECT_DOUBLE_EQ(p.lb_gap, 1.0);
  EXPECT_EQ(p.moved_slots_total, 0);
  EXPECT_EQ(p.moved_bytes_total, 0.0);
  EXPECT_EQ(p.imbalance.count, 30);
  EXPECT_EQ(p.layer_replans, 3 * 9);  // causal: every step but the first, every layer
}

TEST(ReplayTest, OraclePlansNoWorseThanCausalWhenTheHotExpertMovesEveryStep) {
  // Expert t % 8 takes 20x the tokens at step t: yesterday's load misleads a causal planner.
  const Trace trace =
      MakeTrace(24, 2, 8, 4, [](int t, int, int, int e) { return e == t % 8 ? 2000.0 : 100.0; });
  ReplayOptions options;
  options.policies = {"eplb", "keel"};
  auto causal = ReplayTrace(trace, SmallConfig(), options);
  options.oracle = true;
  auto oracle = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(causal.ok()) << causal.status().ToString();
  ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
  EXPECT_TRUE(oracle->oracle);
  for (const std::string name : {"eplb", "keel"}) {
    EXPECT_LE(Find(*oracle, name).imbalance.mean, Find(*causal, name).imbalance.mean + 1e-9)
        << name;
  }
  EXPECT_LT(Find(*oracle, "eplb").imbalance.mean, Find(*causal, "eplb").imbalance.mean);
  EXPECT_EQ(Find(*oracle, "eplb").layer_replans, 24 * 2);  // oracle also plans step 0
}

TEST(ReplayTest, MetricsArePresentAndConsistent) {
  const Trace trace = SkewedTrace();
  ReplayOptions options;  // all policies
  auto report = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  ASSERT_EQ(report->policies.size(), PolicyNames().size());
  for (const PolicyReplay& p : report->policies) {
    SCOPED_TRACE(p.name);
    const Distribution& i = p.imbalance;
    EXPECT_EQ(i.count, 30 * 2);
    EXPECT_GE(i.p50, 1.0 - 1e-9);
    EXPECT_LE(i.p50, i.p90);
    EXPECT_LE(i.p90, i.p99);
    EXPECT_LE(i.p99, i.max);
    EXPECT_LE(i.mean, i.max);
    EXPECT_GT(p.lb_gap, 0);
    EXPECT_EQ(p.layer_replans, 29 * 2);
    EXPECT_NEAR(p.moved_slots_per_replan * p.layer_replans, p.moved_slots_total, 1e-9);
    EXPECT_GE(p.moved_bytes_total, 0);
    EXPECT_EQ(p.moved_bytes_total == 0, p.moved_slots_total == 0 && p.moved_homes_total == 0);
    const Distribution& sim = p.sim_step_seconds;
    EXPECT_EQ(sim.count, 30);
    EXPECT_GT(sim.mean, 0);
    EXPECT_LE(sim.p50, sim.p99);
    EXPECT_LE(sim.p99, sim.max);
    EXPECT_NEAR(sim.mean * 30, p.sim_total_seconds, 1e-9 * p.sim_total_seconds);
    EXPECT_EQ(p.planner_seconds_per_layer.count, 29 * 2);
    EXPECT_EQ(p.step_imbalance.size(), 30u);
    EXPECT_EQ(p.step_seconds.size(), 30u);
  }
  const PolicyReplay& fixed = Find(*report, "static");
  EXPECT_EQ(fixed.moved_bytes_total, 0.0);
  EXPECT_EQ(fixed.moved_slots_total, 0);
  // A skewed load leaves the static placement imbalanced and something else does better.
  EXPECT_GT(fixed.imbalance.mean, 1.5);
  EXPECT_LT(Find(*report, "eplb").imbalance.mean, fixed.imbalance.mean);

  // The heatmap series: shares of each step sum to one.
  ASSERT_EQ(report->expert_share.size(), 30u * 8);
  double sum = 0;
  for (int e = 0; e < 8; ++e) sum += report->expert_share[e];
  EXPECT_NEAR(sum, 1.0, 1e-12);
}

TEST(ReplayTest, SameReportTwice) {
  const Trace trace = SkewedTrace();
  auto first = ReplayTrace(trace, SmallConfig(), ReplayOptions{});
  auto second = ReplayTrace(trace, SmallConfig(), ReplayOptions{});
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(WithoutTimes(ReplayReportToJson(*first)), WithoutTimes(ReplayReportToJson(*second)));
}

TEST(ReplayTest, MultiPolicyRunEqualsSinglePolicyRuns) {
  const Trace trace = SkewedTrace(20, 3);
  ReplayOptions all;
  all.max_threads = 3;
  auto together = ReplayTrace(trace, SmallConfig(), all);
  ASSERT_TRUE(together.ok()) << together.status().ToString();
  const nlohmann::json together_json = WithoutTimes(ReplayReportToJson(*together));
  for (const std::string& name : PolicyNames()) {
    ReplayOptions one;
    one.policies = {name};
    one.max_threads = 1;
    auto alone = ReplayTrace(trace, SmallConfig(), one);
    ASSERT_TRUE(alone.ok()) << name << ": " << alone.status().ToString();
    EXPECT_EQ(WithoutTimes(ReplayReportToJson(*alone))["policies"][name],
              together_json["policies"][name])
        << name;
  }
}

TEST(ReplayTest, ExpertCountsOnlyTraceIsSpreadOverTheRanks) {
  const Trace trace =
      MakeTrace(6, 1, 8, 0, [](int t, int, int, int e) { return e == t % 8 ? 50.0 : 10.0; });
  ReplayOptions options;
  options.policies = {"static", "keel"};
  auto report = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_GT(Find(*report, "static").imbalance.max, 1.0);
}

TEST(ReplayTest, ProgressReachesEveryPolicysLastStep) {
  const Trace trace = SkewedTrace(12, 1);
  ReplayOptions options;
  options.policies = {"static", "eplb", "keel"};
  std::mutex mutex;
  std::vector<int> last(3, 0);
  options.progress = [&](int policy, int done, int total) {
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_EQ(total, 12);
    EXPECT_EQ(done, last[policy] + 1);
    last[policy] = done;
  };
  ASSERT_TRUE(ReplayTrace(trace, SmallConfig(), options).ok());
  EXPECT_EQ(last, (std::vector<int>{12, 12, 12}));
}

TEST(ReplayTest, RejectsBadPoliciesConfigsAndTraces) {
  const Trace trace = SkewedTrace(4, 1);
  ReplayOptions options;
  options.policies = {"static", "fancy"};
  auto unknown = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("unknown policy 'fancy' (known: static, eplb"),
            std::string::npos)
      << unknown.status().message();

  KeelConfig tight = SmallConfig();
  tight.slots.persistent_per_rank = 1;  // 4 slots for 8 experts
  auto too_few = ReplayTrace(trace, tight, ReplayOptions{});
  ASSERT_FALSE(too_few.ok());
  EXPECT_NE(too_few.status().message().find("slots.persistent_per_rank 1"), std::string::npos)
      << too_few.status().message();

  Trace ragged = trace;
  ragged.steps[2].pop_back();
  auto bad = ReplayTrace(ragged, SmallConfig(), ReplayOptions{});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("step 2"), std::string::npos) << bad.status().message();

  ReplayOptions heat;
  heat.heatmap_layer = 5;
  auto bad_layer = ReplayTrace(trace, SmallConfig(), heat);
  ASSERT_FALSE(bad_layer.ok());
  EXPECT_NE(bad_layer.status().message().find("heatmap layer 5"), std::string::npos);
}

TEST(ReplayTest, JsonReportHasTheDocumentedFields) {
  const Trace trace = SkewedTrace(10, 2);
  ReplayOptions options;
  options.policies = {"static", "keel"};
  auto report = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(report.ok());
  const nlohmann::json json = ReplayReportToJson(*report);
  EXPECT_EQ(json["mode"], "causal");
  EXPECT_EQ(json["trace"]["steps"], 10);
  EXPECT_EQ(json["trace"]["experts"], 8);
  EXPECT_EQ(json["config"]["num_ranks"], 4);
  EXPECT_EQ(json["config"]["persistent_slots_per_rank"], 3);
  EXPECT_EQ(json["policy_order"], (nlohmann::json{"static", "keel"}));
  EXPECT_TRUE(json.contains("wall_seconds"));
  for (const char* name : {"static", "keel"}) {
    const nlohmann::json& p = json["policies"][name];
    for (const char* key : {"mean", "p50", "p90", "p99", "max"}) {
      EXPECT_TRUE(p["imbalance"].contains(key)) << name << " " << key;
    }
    for (const char* key : {"lb_gap", "moved_slots_per_replan", "moved_slots_total",
                            "moved_bytes_total", "wall_seconds"}) {
      EXPECT_TRUE(p.contains(key)) << name << " " << key;
    }
    for (const char* key : {"mean", "p50", "p99"}) {
      EXPECT_TRUE(p["sim_step_seconds"].contains(key)) << name << " " << key;
    }
    EXPECT_TRUE(p["planner_seconds_per_layer"].contains("median"));
    EXPECT_EQ(p["series"]["step_imbalance"].size(), 10u);
  }
  EXPECT_FALSE(ReplayReportToJson(*report, false)["policies"]["keel"].contains("series"));
}

TEST(ReplayPlotTest, SvgHasBothPanelsAndEveryPolicy) {
  const Trace trace = SkewedTrace(700, 1);  // more steps than columns: averaged
  ReplayOptions options;
  options.policies = {"static", "eplb"};
  auto report = ReplayTrace(trace, SmallConfig(), options);
  ASSERT_TRUE(report.ok());
  const std::string svg = RenderReplaySvg(*report);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("Imbalance per step"), std::string::npos);
  EXPECT_NE(svg.find("700 steps averaged into columns"), std::string::npos);
  EXPECT_NE(svg.find("Expert load"), std::string::npos);
  EXPECT_NE(svg.find(">static<"), std::string::npos);
  EXPECT_NE(svg.find(">eplb<"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
}

// A config built in code skips ValidateConfig's ranges; a degenerate constant then gives a price
// that is not finite, which the replay refuses where it is produced (it reported inf, and null in
// its JSON report), naming the policy, step, layer, term and constants.
TEST(ReplayTest, NonFinitePricesAreRefusedNamingTheConstants) {
  const Trace trace = SkewedTrace(4, 2);
  struct Case {
    std::function<void(KeelConfig&)> set;
    const char* term;
    const char* constant;
  };
  const Case cases[] = {
      {[](KeelConfig& c) { c.cost_model.expert_tflops = 1e-310; }, "compute_seconds inf",
       "cost_model.expert_tflops 1e-310"},
      {[](KeelConfig& c) { c.cost_model.train_flops_multiplier = 1e308; }, "compute_seconds",
       "cost_model.train_flops_multiplier 1e+308"},
      {[](KeelConfig& c) { c.topology.intra_node_gb_per_s = 1e-320; }, "all_to_all_seconds inf",
       "topology.intra_node_gb_per_s 1e-320"},
  };
  for (const Case& c : cases) {
    KeelConfig config = SmallConfig();
    c.set(config);
    ReplayOptions options;
    options.policies = {"static"};
    Result<ReplayReport> report = ReplayTrace(trace, config, options);
    ASSERT_FALSE(report.ok()) << c.constant;
    EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
    for (const char* part : {"policy static, step 0, layer 0: ", c.term, c.constant}) {
      EXPECT_NE(report.status().message().find(part), std::string::npos)
          << part << " in " << report.status().message();
    }
  }
}

}  // namespace
}  // namespace keel::tools
