// Tests of the load monitor: counts arrive intact through the lock-free queue from many
// producers, a full queue drops and counts instead of blocking, steps feed the estimators and
// the metrics, and the trace it records reads back.
#include "monitor/load_monitor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "tests/monitor/metrics_test_util.h"

namespace keel {
namespace {

LoadMonitorOptions Options(int layers, int experts, int ranks, int capacity) {
  LoadMonitorOptions options;
  options.num_layers = layers;
  options.num_experts = experts;
  options.num_ranks = ranks;
  options.monitor.queue_capacity = capacity;
  options.estimator.kind = EstimatorKind::kLastStep;
  return options;
}

std::unique_ptr<LoadMonitor> Make(const LoadMonitorOptions& options, Metrics* metrics = nullptr) {
  Result<std::unique_ptr<LoadMonitor>> monitor = LoadMonitor::Create(options, metrics);
  EXPECT_TRUE(monitor.ok()) << monitor.status().ToString();
  return std::move(monitor).value();
}

TEST(LoadMonitorTest, CountsTopKIdsAndEndsSteps) {
  auto monitor = Make(Options(2, 4, 2, 16));
  const std::vector<int32_t> ids = {0, 1, 1, 3, 3, 3, -1, 4, 2};  // -1 and 4 are skipped
  EXPECT_EQ(monitor->RecordTopK(1, ids), RecordOutcome::kQueued);
  EXPECT_EQ(monitor->RecordTopK(1, ids), RecordOutcome::kQueued);
  EXPECT_EQ(monitor->RecordTopK(2, ids), RecordOutcome::kInvalid);
  monitor->StepEnd(10);
  ASSERT_TRUE(monitor->Flush());
  EXPECT_EQ(monitor->steps_seen(), 1);
  EXPECT_EQ(monitor->ExpertTotals(1), (std::vector<int64_t>{2, 4, 2, 6}));
  EXPECT_EQ(monitor->ExpertTotals(0), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(monitor->ExpertLoadEstimate(1), (std::vector<double>{2, 4, 2, 6}));
  EXPECT_EQ(monitor->dropped_samples(), 0u);
}

TEST(LoadMonitorTest, RejectsWrongShapesOnTheHotPathAndNegativeCountsLater) {
  auto monitor = Make(Options(1, 4, 2, 8));
  const std::vector<int32_t> three = {1, 2, 3};
  EXPECT_EQ(monitor->RecordCounts(0, three), RecordOutcome::kInvalid);
  EXPECT_EQ(monitor->RecordCounts(-1, std::vector<int32_t>{1, 2, 3, 4}), RecordOutcome::kInvalid);
  // A traffic matrix needs monitor.per_source_rank.
  EXPECT_EQ(monitor->RecordCounts(0, std::vector<int32_t>(8, 1)), RecordOutcome::kInvalid);
  EXPECT_EQ(monitor->RecordCounts(0, std::vector<int32_t>{1, -2, 3, 4}), RecordOutcome::kQueued);
  EXPECT_EQ(monitor->RecordCounts(0, std::vector<int32_t>{1, 2, 3, 4}), RecordOutcome::kQueued);
  monitor->StepEnd(0);
  ASSERT_TRUE(monitor->Flush());
  EXPECT_EQ(monitor->invalid_samples(), 1u);
  EXPECT_EQ(monitor->ExpertTotals(0), (std::vector<int64_t>{1, 2, 3, 4}));
}

TEST(LoadMonitorTest, FullQueueDropsAndCountsWithoutBlocking) {
  Result<std::unique_ptr<Metrics>> metrics = Metrics::Create({1, 2, 4, false});
  ASSERT_TRUE(metrics.ok());
  auto monitor = Make(Options(1, 4, 2, 8), metrics->get());
  monitor->Pause();
  const std::vector<int32_t> counts = {1, 1, 1, 1};
  const auto start = std::chrono::steady_clock::now();
  int queued = 0;
  int dropped = 0;
  for (int i = 0; i < 1000; ++i) {
    const RecordOutcome outcome = monitor->RecordCounts(0, counts);
    queued += outcome == RecordOutcome::kQueued;
    dropped += outcome == RecordOutcome::kDropped;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(queued, 8);
  EXPECT_EQ(dropped, 992);
  EXPECT_EQ(monitor->dropped_samples(), 992u);
  // 1000 calls against a stalled consumer: far below one poll interval if nothing waited.
  EXPECT_LT(seconds, 0.5);
  EXPECT_FALSE(monitor->Flush());  // paused: refuses instead of hanging

  monitor->StepEnd(0);
  monitor->Resume();
  ASSERT_TRUE(monitor->Flush());
  EXPECT_EQ(monitor->ExpertTotals(0), (std::vector<int64_t>{8, 8, 8, 8}));
  const auto series = testing::ParseExposition((*metrics)->Serialize());
  EXPECT_EQ(series.at("keel_monitor_dropped_samples_total"), 992);
  EXPECT_EQ(series.at("keel_steps_total"), 1);
  // After draining, the queue takes batches again.
  EXPECT_EQ(monitor->RecordCounts(0, counts), RecordOutcome::kQueued);
}

TEST(LoadMonitorTest, ConcurrentProducersLoseNothingWhenNothingDrops) {
  constexpr int kProducers = 4;
  constexpr int kBatches = 2000;
  constexpr int kExperts = 16;
  auto monitor = Make(Options(2, kExperts, 4, 1 << 16));  // room for every batch
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      std::vector<int32_t> ids(64);
      for (int b = 0; b < kBatches; ++b) {
        for (size_t i = 0; i < ids.size(); ++i)
          ids[i] = static_cast<int32_t>((p + b + i) % kExperts);
        monitor->RecordTopK(b % 2, ids);
      }
    });
  }
  for (std::thread& producer : producers) producer.join();
  monitor->StepEnd(0);
  ASSERT_TRUE(monitor->Flush());
  ASSERT_EQ(monitor->dropped_samples(), 0u);
  int64_t total = 0;
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<int64_t> totals = monitor->ExpertTotals(layer);
    total += std::accumulate(totals.begin(), totals.end(), int64_t{0});
    // Every id pattern covers the experts evenly: 64 ids = 4 per expert per batch.
    for (int64_t count : totals) EXPECT_EQ(count, int64_t{kProducers} * kBatches / 2 * 4);
  }
  EXPECT_EQ(total, int64_t{kProducers} * kBatches * 64);
}

TEST(LoadMonitorTest, ConcurrentProducersAgainstALiveDrainAccountForEveryBatch) {
  constexpr int kProducers = 3;
  constexpr int kBatches = 5000;
  auto monitor = Make(Options(1, 8, 2, 32));  // small: some batches drop
  std::atomic<int64_t> queued{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&] {
      const std::vector<int32_t> counts(8, 1);
      for (int b = 0; b < kBatches; ++b) {
        if (monitor->RecordCounts(0, counts) == RecordOutcome::kQueued) ++queued;
      }
    });
  }
  for (std::thread& producer : producers) producer.join();
  monitor->StepEnd(0);
  ASSERT_TRUE(monitor->Flush());
  EXPECT_EQ(queued.load() + static_cast<int64_t>(monitor->dropped_samples()),
            int64_t{kProducers} * kBatches);
  for (int64_t count : monitor->ExpertTotals(0)) EXPECT_EQ(count, queued.load());
}

TEST(LoadMonitorTest, StepsFeedTheMetricsThroughThePlacement) {
  Result<std::unique_ptr<Metrics>> metrics = Metrics::Create({1, 2, 4, true});
  ASSERT_TRUE(metrics.ok());
  LoadMonitorOptions options = Options(1, 4, 2, 16);
  options.max_copies_per_expert = 1;
  auto monitor = Make(options, metrics->get());
  // Contiguous by default: experts 0,1 on rank 0 and 2,3 on rank 1.
  monitor->RecordCounts(0, std::vector<int32_t>{30, 10, 5, 5});
  monitor->StepEnd(0);
  ASSERT_TRUE(monitor->Flush());
  auto series = testing::ParseExposition((*metrics)->Serialize());
  EXPECT_EQ(series.at("keel_routed_tokens_total{layer=\"0\",rank=\"0\"}"), 40);
  EXPECT_EQ(series.at("keel_routed_tokens_total{layer=\"0\",rank=\"1\"}"), 10);
  EXPECT_DOUBLE_EQ(series.at("keel_layer_imbalance_ratio{layer=\"0\",source=\"last_step\"}"), 1.6);
  // LB = max(50 / 2, 30 / 1) = 30.
  EXPECT_DOUBLE_EQ(series.at("keel_layer_lower_bound_gap_ratio{layer=\"0\"}"), 40.0 / 30.0);
  EXPECT_EQ(series.at("keel_expert_tokens_total{expert=\"0\",layer=\"0\"}"), 30);

  // Swapping experts 1 and 2 balances the ranks: 35 and 15 -> still uneven, but different.
  Result<Placement> swapped = Placement::Create(4, 2, {0, 2, 1, 3});
  ASSERT_TRUE(swapped.ok());
  ASSERT_TRUE(monitor->SetPlacement(0, *swapped).ok());
  EXPECT_FALSE(monitor->SetPlacement(1, *swapped).ok());
  monitor->RecordCounts(0, std::vector<int32_t>{30, 10, 5, 5});
  monitor->StepEnd(1);
  ASSERT_TRUE(monitor->Flush());
  series = testing::ParseExposition((*metrics)->Serialize());
  EXPECT_DOUBLE_EQ(series.at("keel_layer_imbalance_ratio{layer=\"0\",source=\"last_step\"}"), 1.4);
  EXPECT_EQ(series.at("keel_steps_total"), 2);
}

TEST(LoadMonitorTest, TrafficRowsPerSourceRank) {
  LoadMonitorOptions options = Options(1, 2, 2, 16);
  options.monitor.per_source_rank = true;
  options.rank = 1;
  auto monitor = Make(options);
  monitor->RecordTopK(0, std::vector<int32_t>{0, 0, 1});       // source row 1
  monitor->RecordCounts(0, std::vector<int32_t>{1, 2, 3, 4});  // whole matrix
  monitor->StepEnd(0);
  ASSERT_TRUE(monitor->Flush());
  EXPECT_EQ(monitor->TrafficEstimate(0), (std::vector<double>{1, 2, 5, 5}));
  EXPECT_EQ(monitor->ExpertTotals(0), (std::vector<int64_t>{6, 7}));
}

TEST(LoadMonitorTest, RecordsATraceReplayCanRead) {
  testing::ScratchFolder folder;
  LoadMonitorOptions options = Options(2, 3, 1, 16);
  options.monitor.trace_path = folder.File("live.jsonl");
  options.monitor.trace_sample_interval_steps = 2;
  {
    auto monitor = Make(options);
    for (int step = 0; step < 5; ++step) {
      monitor->RecordCounts(0, std::vector<int32_t>{step, 1, 2});
      monitor->RecordCounts(1, std::vector<int32_t>{3, step, 0});
      monitor->StepEnd(100 + step);
    }
  }  // the destructor finishes the steps and closes the trace
  Result<Trace> trace = ReadKeelTrace(options.monitor.trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->step_ids, (std::vector<int64_t>{100, 102, 104}));
  EXPECT_EQ(trace->ExpertCounts(2, 0), (std::vector<double>{4, 1, 2}));
  EXPECT_EQ(trace->ExpertCounts(2, 1), (std::vector<double>{3, 4, 0}));
}

TEST(LoadMonitorTest, CreateRejectsBadOptions) {
  LoadMonitorOptions options = Options(1, 4, 2, 0);
  EXPECT_EQ(LoadMonitor::Create(options).status().code(), StatusCode::kInvalidArgument);
  options = Options(1, 4, 2, 4);
  options.rank = 2;
  EXPECT_EQ(LoadMonitor::Create(options).status().code(), StatusCode::kInvalidArgument);
  options = Options(1, 4, 2, 4);
  options.monitor.trace_path = "/nonexistent-dir/x.jsonl";
  Result<std::unique_ptr<LoadMonitor>> monitor = LoadMonitor::Create(options);
  ASSERT_FALSE(monitor.ok());
  EXPECT_NE(monitor.status().message().find("/nonexistent-dir/x.jsonl"), std::string::npos);
}

// What it would preallocate, beyond the counts a job holds: refused before any of it.
TEST(LoadMonitorTest, CreateRefusesTablesBeyondTheLimits) {
  LoadMonitorOptions queue = Options(1, 65536, 64, 65536);
  queue.monitor.per_source_rank = true;
  LoadMonitorOptions window = Options(64, 4096, 1, 16);
  window.estimator.kind = EstimatorKind::kSlidingWindow;
  window.estimator.window_steps = 1000;
  const std::pair<LoadMonitorOptions, std::string> cases[] = {
      {queue, "monitor.queue_capacity 65536 x 4194304 counts per batch is more than the 2^26"},
      {window, "= 64 x 1 x 4096 x 1001 load counts, more than the 2^26"},
  };
  for (const auto& [options, expected] : cases) {
    Result<std::unique_ptr<LoadMonitor>> monitor = LoadMonitor::Create(options);
    ASSERT_FALSE(monitor.ok()) << expected;
    EXPECT_EQ(monitor.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(monitor.status().message().find(expected), std::string::npos)
        << monitor.status().message();
  }
}

}  // namespace
}  // namespace keel
