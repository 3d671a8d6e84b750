// The engine with ranks as threads (local communicator and transport): physical routing that
// agrees across ranks, epochs switched at the same step everywhere, aborted epochs that lose no
// update, gradient reduction that is deterministic, and slot exchanges that send no sizes (and go
// device to device over a communicator that moves device memory). The training tests run with
// slot buffers in host memory, in guarded device memory (CreateGuardedHostMemory, one per rank
// like one GPU per rank), where any host access to a slot buffer by the engine crashes the test,
// and in CUDA memory where a GPU is present.
#include "keel/engine.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "comm/communicator.h"
#include "common/file.h"
#include "engine/engine_internal.h"
#include "keel/policy.hpp"
#include "kernels/add.h"
#include "kernels/device.h"
#include "kernels/host_device.h"
#include "kernels/remap.h"
#include "monitor/metrics.h"
#include "monitor/trace.h"
#include "tests/common/test_util.h"
#include "tests/engine/toy_trainer.h"

namespace keel::toy {
namespace {

struct TrainingRun {
  std::vector<RankBuffers> buffers;
  std::vector<RankRecord> records;
};

enum class Memory { kHost, kGuardedDevice, kCuda };

std::string MemoryName(const ::testing::TestParamInfo<Memory>& info) {
  switch (info.param) {
    case Memory::kHost:
      return "Host";
    case Memory::kGuardedDevice:
      return "GuardedDevice";
    case Memory::kCuda:
      break;
  }
  return "Cuda";
}

// This rank's device memory for `memory`: null for host buffers.
std::shared_ptr<DeviceMemory> RankMemory(Memory memory) {
  switch (memory) {
    case Memory::kHost:
      return nullptr;
    case Memory::kGuardedDevice:
      return testing::ValueOrDie(CreateGuardedHostMemory());
    case Memory::kCuda:
      break;
  }
  return testing::ValueOrDie(CreateCudaDeviceMemory());
}

// What the engine asked of the all-to-alls of CountingCommunicators, over all their ranks.
struct AllToAllCounts {
  std::atomic<int> size_exchanging{0};  // AllToAllV: the sizes travel first
  std::atomic<int> known_sizes{0};      // AllToAllVKnownSizes
  std::atomic<int> device{0};           // AllToAllVDevice
};

// A rank's local communicator that counts the all-to-alls the engine calls. With `device` (the
// rank's device memory) it moves device memory too, as NCCL does, but through that object's own
// copies staged through host memory: the bytes never meet the CPU outside DeviceMemory, so
// guarded device memory still traps any stray access, and each call checks that the engine
// handed it device buffers.
class CountingCommunicator final : public ForwardingCommunicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> local, AllToAllCounts& counts,
                       std::shared_ptr<DeviceMemory> device)
      : ForwardingCommunicator(std::move(local)), counts_(counts), device_(std::move(device)) {}

  std::string_view name() const override { return "counting"; }
  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    ++counts_.size_exchanging;
    return ForwardingCommunicator::AllToAllV(send, send_bytes, recv, recv_bytes);
  }
  Status AllToAllVKnownSizes(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                             std::span<std::byte> recv,
                             std::span<const size_t> recv_bytes) override {
    ++counts_.known_sizes;
    return ForwardingCommunicator::AllToAllVKnownSizes(send, send_bytes, recv, recv_bytes);
  }

  bool MovesDeviceMemory() const override { return device_ != nullptr; }
  Status AllToAllVDevice(const std::byte* send, std::span<const size_t> send_bytes, std::byte* recv,
                         std::span<const size_t> recv_bytes) override {
    ++counts_.device;
    if (device_ == nullptr)
      return Communicator::AllToAllVDevice(send, send_bytes, recv, recv_bytes);
    if (!device_->IsDeviceMemory(send) || !device_->IsDeviceMemory(recv)) {
      return InvalidArgument("AllToAllVDevice was handed host memory");
    }
    std::vector<std::byte> send_host(
        std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0}));
    std::vector<std::byte> recv_host(
        std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0}));
    KEEL_RETURN_IF_ERROR(device_->Copy(send_host.data(), send, send_host.size()));
    KEEL_RETURN_IF_ERROR(Inner().AllToAllVKnownSizes(send_host, send_bytes, recv_host, recv_bytes));
    return device_->Copy(recv, recv_host.data(), recv_host.size());
  }

 private:
  AllToAllCounts& counts_;
  std::shared_ptr<DeviceMemory> device_;
};

// Puts a rank's communicator inside another one; gets the rank's device memory (null for host
// buffers).
using WrapCommunicator = std::function<std::unique_ptr<Communicator>(
    std::unique_ptr<Communicator>, std::shared_ptr<DeviceMemory>)>;

// CountingCommunicators that add to `counts`, moving device memory where the rank has some when
// `moves_device_memory`.
WrapCommunicator Counting(AllToAllCounts& counts, bool moves_device_memory) {
  return [&counts, moves_device_memory](std::unique_ptr<Communicator> local,
                                        std::shared_ptr<DeviceMemory> device) {
    return std::make_unique<CountingCommunicator>(std::move(local), counts,
                                                  moves_device_memory ? device : nullptr);
  };
}

TrainingRun RunAll(const KeelConfig& config, int steps, Memory memory,
                   const std::function<void(LocalFabric&)>& before = nullptr,
                   Metrics* metrics = nullptr, const RunHooks& hooks = {},
                   const WrapCommunicator& wrap = nullptr) {
  LocalCommunicatorGroup group(kRanks);
  LocalFabric fabric(kRanks);
  if (before) before(fabric);
  TrainingRun run;
  run.buffers.resize(kRanks);
  run.records.resize(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::shared_ptr<DeviceMemory> device = RankMemory(memory);
      std::unique_ptr<Communicator> communicator = group.Join(r);
      if (wrap) communicator = wrap(std::move(communicator), device);
      run.records[r].status = RunRank(config, steps, *communicator, &fabric, run.buffers[r],
                                      run.records[r], metrics, device, hooks);
    });
  }
  for (auto& t : threads) t.join();
  return run;
}

void ExpectMatchesReference(const TrainingRun& run, const Reference& ref) {
  for (int r = 0; r < kRanks; ++r) {
    const Status status = CheckAgainstReference(r, run.buffers[r], run.records[r], ref);
    EXPECT_TRUE(status.ok()) << status.ToString();
  }
}

void ExpectRoutingAgrees(const TrainingRun& run, int /*steps*/) {
  for (int src = 0; src < kRanks; ++src) {
    const std::vector<int64_t> sent = FlattenSent(run.records[src]);
    EXPECT_FALSE(sent.empty());
    for (int owner = 0; owner < kRanks; ++owner) {
      const Status status = CheckRoutingAgrees(src, sent, owner, run.records[owner]);
      EXPECT_TRUE(status.ok()) << status.ToString();
    }
  }
}

// One rank's options for the small tests below: the toy sizes, 8-byte slot regions.
EngineOptions SmallOptions(const KeelConfig& config, int num_layers, Communicator* communicator,
                           LocalGroup* group) {
  EngineOptions options;
  options.config = MakeConfig(config);
  options.num_layers = num_layers;
  options.num_experts = kExperts;
  options.top_k = kTopK;
  options.shape.weight_bytes = 8;
  options.shape.gradient_bytes = 8;
  options.shape.optimizer_bytes = 8;
  options.communicator = communicator;
  options.local_group = group;
  return options;
}

// One rank holding every expert, no transient slots, static placement.
KeelConfig OneRankStaticConfig() {
  KeelConfig config = TestConfig("static");
  config.topology.gpus_per_node = 1;
  config.slots.persistent_per_rank = kExperts;
  config.slots.transient_per_rank = 0;
  return config;
}

// A group of `ranks` thread-ranks; the tests cannot go on without it.
std::unique_ptr<LocalGroup> MakeGroup(int ranks) {
  return testing::ValueOrDie(LocalGroup::Create(ranks));
}

// Every training test with host buffers, guarded device buffers, and CUDA buffers where a GPU
// is present (bench/gpu/run.sh runs them there).
class EngineMemoryTest : public ::testing::TestWithParam<Memory> {
 protected:
  void SetUp() override {
    if (GetParam() == Memory::kCuda && !kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  }
};
INSTANTIATE_TEST_SUITE_P(Memory, EngineMemoryTest,
                         ::testing::Values(Memory::kHost, Memory::kGuardedDevice, Memory::kCuda),
                         MemoryName);

TEST_P(EngineMemoryTest, StaticPolicyTrainsExactlyAndNeverMigrates) {
  constexpr int kSteps = 6;
  TrainingRun run = RunAll(TestConfig("static"), kSteps, GetParam());
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
    EXPECT_EQ(record.stats.epoch, 0);
    EXPECT_EQ(record.stats.bytes_moved, 0u);
  }
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

// With the default plan adoption (when_ready), epochs land where the planner's speed puts them,
// but at the same step on every rank, and no update is lost.
TEST_P(EngineMemoryTest, KeelPolicySwitchesEpochsTogetherAndLosesNoUpdate) {
  constexpr int kSteps = 24;
  KeelConfig config = TestConfig("keel");
  config.policy.plan_adoption = "when_ready";
  TrainingRun run = RunAll(config, kSteps, GetParam());
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  // Every rank is in the same epoch after every step.
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(run.records[r].epoch_after_step, run.records[0].epoch_after_step) << "rank " << r;
    EXPECT_EQ(run.records[r].final_placements, run.records[0].final_placements);
  }
  EXPECT_GE(run.records[0].stats.epochs_committed, 1) << "the skewed load should move experts";
  EXPECT_GT(run.records[0].stats.bytes_moved, 0u);
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

// policy.keel.spare_slots: per_step without transient slots: replans move homes only, so the
// persistent slots beyond the homes stay empty, and every transient the step planner adds fills
// an empty slot's buffers for the step. Training stays exact and the routing agrees.
TEST_P(EngineMemoryTest, PerStepSpareSlotsHoldTransientsAndTrainExactly) {
  constexpr int kSteps = 24;
  KeelConfig config = TestConfig("keel");
  config.slots.transient_per_rank = 0;
  config.policy.keel.spare_slots = "per_step";
  TrainingRun run = RunAll(config, kSteps, GetParam());
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  // Rows sent, in the first epoch, to persistent slots the initial placement leaves empty: only
  // transients go there.
  int64_t spare_rows = 0;
  for (int r = 0; r < kRanks; ++r) {
    const RankRecord& record = run.records[r];
    for (int step = 0; step < kSteps && record.epoch_after_step[step] == 0; ++step) {
      for (int l = 0; l < kLayers; ++l) {
        const LayerPlacement& initial = record.initial_layouts[l];
        for (const auto& [slot, rows] : record.sent[step][l]) {
          ASSERT_LT(slot, static_cast<int>(initial.phy2log.size())) << "no transient slots here";
          if (initial.phy2log[slot] < 0) spare_rows += rows;
        }
      }
    }
    for (const LayerPlacement& layout : record.final_layouts) {
      std::vector<int> copies(layout.num_experts, 0);
      for (int e : layout.phy2log) {
        if (e >= 0) ++copies[e];
      }
      for (int e = 0; e < layout.num_experts; ++e) EXPECT_EQ(copies[e], 1) << "expert " << e;
    }
  }
  EXPECT_GT(spare_rows, 0) << "the skewed load should fill spare slots";
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

// Layer 0 shards its expert 0 over 2 ranks, layer 1 its expert 3 over all 4: every entry reaches
// each shard once, each shard trains its words of the expert exactly as the whole expert would,
// and the keel policy places, replicates and moves shards as experts of their own.
TEST_P(EngineMemoryTest, ShardedExpertsTrainTheirSlicesExactlyWhileShardsMove) {
  constexpr int kSteps = 24;
  RunHooks hooks;
  hooks.sharded_experts = ToyShardedExperts();
  TrainingRun run = RunAll(TestConfig("keel"), kSteps, GetParam(), nullptr, nullptr, hooks);
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(run.records[r].epoch_after_step, run.records[0].epoch_after_step) << "rank " << r;
    EXPECT_EQ(run.records[r].final_placements, run.records[0].final_placements);
  }
  const std::vector<LayerPlacement>& layouts = run.records[0].final_layouts;
  ASSERT_EQ(layouts.size(), 2u);
  EXPECT_EQ(layouts[0].num_experts, kExperts + 1);
  EXPECT_EQ(layouts[1].num_experts, kExperts + 3);
  EXPECT_EQ(layouts[1].unit_expert[3], 3);
  EXPECT_EQ(layouts[1].unit_shard[5], 2);
  EXPECT_EQ(layouts[1].unit_shards[6], 4);
  EXPECT_EQ(layouts[1].unit_expert[7], 4);
  EXPECT_GE(run.records[0].stats.epochs_committed, 1) << "the skewed load should move units";
  // Some shard now lives (or has copies) in other slots than it started in.
  int moved_shards = 0;
  for (int l = 0; l < kLayers; ++l) {
    const LayerPlacement& first = run.records[0].initial_layouts[l];
    for (int unit = 0; unit < layouts[l].num_experts; ++unit) {
      if (layouts[l].unit_shards[unit] == 1) continue;
      const auto slots_of = [unit](const LayerPlacement& p) {
        std::vector<int> slots;
        for (size_t s = 0; s < p.phy2log.size(); ++s) {
          if (p.phy2log[s] == unit) slots.push_back(static_cast<int>(s));
        }
        return slots;
      };
      if (slots_of(first) != slots_of(layouts[l])) ++moved_shards;
    }
  }
  EXPECT_GT(moved_shards, 0);
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

// policy.keel.shard_experts: the keel policy shards the hot experts (the toy's rows are few
// against the cost model's 4 MiB experts, so sharding is cheaper than replicating) and joins
// them again as the load drifts; every shard's words of its expert, and every home's optimizer
// state, stay exact through the cuts and joins.
TEST_P(EngineMemoryTest, KeelPolicyReshardsHotExpertsAndLosesNoUpdate) {
  constexpr int kSteps = 24;
  KeelConfig config = TestConfig("keel");
  config.policy.keel.shard_experts = true;
  config.cost_model.expert_ffn_size = 8192;  // the cost model's expert: 4 MiB of weights
  TrainingRun run = RunAll(config, kSteps, GetParam());
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(run.records[r].epoch_after_step, run.records[0].epoch_after_step) << "rank " << r;
    EXPECT_EQ(run.records[r].final_placements, run.records[0].final_placements);
    EXPECT_EQ(run.records[r].stats.reshards, run.records[0].stats.reshards);
  }
  // Each layer's hot expert is sharded at the first replan and joined again once the drift has
  // cooled it below the mean rank's rows.
  EXPECT_GE(run.records[0].stats.reshards, 4);
  EXPECT_GE(run.records[0].stats.epochs_committed, 1);
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

// Parm's de-duplicated dispatch: pairs of ranks pass the pair's tokens and each routes its half,
// so every (token, k) is routed once, exactly the rows of the run with `alone`'s hooks and no MP
// groups (static placement: the routing depends on the counts alone), and training under the
// keel policy loses no update.
void ExpectPairsRouteAndTrainAsWithoutThem(const RunHooks& alone, Memory memory) {
  constexpr int kSteps = 6;
  RunHooks pairs = alone;
  pairs.mp_group_size = 2;
  TrainingRun plain = RunAll(TestConfig("static"), kSteps, memory, nullptr, nullptr, alone);
  TrainingRun shared = RunAll(TestConfig("static"), kSteps, memory, nullptr, nullptr, pairs);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(plain.records[r].status.ok()) << plain.records[r].status.ToString();
    ASSERT_TRUE(shared.records[r].status.ok()) << shared.records[r].status.ToString();
    EXPECT_EQ(FlattenSent(shared.records[r]), FlattenSent(plain.records[r])) << "rank " << r;
  }
  constexpr int kKeelSteps = 24;
  TrainingRun keel = RunAll(TestConfig("keel"), kKeelSteps, memory, nullptr, nullptr, pairs);
  for (const RankRecord& record : keel.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  EXPECT_GE(keel.records[0].stats.epochs_committed, 1);
  ExpectRoutingAgrees(keel, kKeelSteps);
  ExpectMatchesReference(keel, ComputeReference(kKeelSteps));
}

TEST_P(EngineMemoryTest, MpGroupsRouteEachTokenOnceAsWithoutThem) {
  ExpectPairsRouteAndTrainAsWithoutThem({}, GetParam());
}

// Parm's MP+EP+ESP in the engine: MP groups whose layers hold sharded experts. Each member routes
// its share of the pair's tokens to every shard of a sharded expert, and the keel policy moves
// the shards.
TEST_P(EngineMemoryTest, MpGroupsWithShardedExpertsRouteAndTrainAsWithoutThem) {
  RunHooks sharded;
  sharded.sharded_experts = ToyShardedExperts();
  ExpectPairsRouteAndTrainAsWithoutThem(sharded, GetParam());
}

TEST_P(EngineMemoryTest, AbortedEpochKeepsOldPlacementAndLosesNoUpdate) {
  constexpr int kSteps = 24;
  // The first data chunk between every pair of ranks arrives corrupted: the first epoch that
  // moves anything fails its checksums and aborts.
  TrainingRun run = RunAll(TestConfig("keel"), kSteps, GetParam(), [](LocalFabric& fabric) {
    for (int src = 0; src < kRanks; ++src) {
      for (int dst = 0; dst < kRanks; ++dst) {
        if (src != dst) fabric.CorruptChunk(src, dst, 0);
      }
    }
  });
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
    EXPECT_GE(record.stats.epochs_aborted, 1);
    EXPECT_FALSE(record.stats.last_abort.ok());
  }
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(run.records[r].epoch_after_step, run.records[0].epoch_after_step);
    EXPECT_EQ(run.records[r].stats.epochs_aborted, run.records[0].stats.epochs_aborted);
  }
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

// The aggregating rank records the exact traffic matrix of every step as a Keel trace and feeds
// the Prometheus metrics the dashboards query.
TEST_P(EngineMemoryTest, RecordsTraceAndMetrics) {
  constexpr int kSteps = 12;
  KeelConfig config = TestConfig("keel");
  const std::string trace_path =
      ::testing::TempDir() + "/engine_trace_" + MemoryName({GetParam(), 0}) + ".jsonl";
  config.monitor.trace_path = trace_path;
  config.monitor.aggregating_rank = 2;
  auto metrics = Metrics::Create(MetricsLayout::FromConfig(config, kLayers, kExperts, 2));
  ASSERT_TRUE(metrics.ok());
  TrainingRun run = RunAll(config, kSteps, GetParam(), nullptr, metrics->get());
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  auto trace = ReadTrace(trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_EQ(trace->num_steps(), kSteps);
  EXPECT_EQ(trace->num_sources, kRanks);
  for (int step = 0; step < kSteps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      for (int r = 0; r < kRanks; ++r) {
        std::vector<double> expected(kExperts, 0.0);
        for (int32_t id : RouterIds(step, r, l)) {
          if (id >= 0) ++expected[id];
        }
        const auto row = trace->layer_row(step, l).subspan(r * kExperts, kExperts);
        EXPECT_EQ(std::vector<double>(row.begin(), row.end()), expected)
            << "step " << step << " layer " << l << " source " << r;
      }
    }
  }
  const std::string text = (*metrics)->Serialize();
  EXPECT_NE(text.find("keel_steps_total " + std::to_string(kSteps)), std::string::npos) << text;
  EXPECT_NE(text.find("keel_placement_epoch " + std::to_string(run.records[0].stats.epoch)),
            std::string::npos);
  EXPECT_NE(text.find("keel_migrations_total{outcome=\"ok\"} " +
                      std::to_string(run.records[0].stats.epochs_committed)),
            std::string::npos);
}

// Expert 0's home gradient after one step of float32 gradients whose sum depends on its order
// (every rank sends everything to expert 0, whose transient replicas split it), each rank's
// communicator inside `wrap`'s if given.
std::vector<float> FloatHomeGradient(Memory memory, const WrapCommunicator& wrap = nullptr) {
  std::unique_ptr<LocalGroup> group = MakeGroup(kRanks);
  std::vector<std::vector<float>> homes(kRanks);
  std::vector<Status> status(kRanks);
  std::atomic<int> transient_copies{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        KEEL_ASSIGN_OR_RETURN(auto communicator, group->Join(r));
        EngineOptions options =
            SmallOptions(TestConfig("keel"), 1, communicator.get(), group.get());
        const size_t gradient_bytes = kWeightWords * sizeof(float);
        options.shape.weight_bytes = 16;
        options.shape.gradient_bytes = gradient_bytes;
        options.shape.optimizer_bytes = 16;
        options.shape.gradient_type = GradientType::kFloat32;
        options.device_memory = RankMemory(memory);
        if (options.device_memory != nullptr) options.shape.memory = MemoryKind::kDevice;
        if (wrap) {
          communicator = wrap(std::move(communicator), options.device_memory);
          options.communicator = communicator.get();
        }
        // Host buffers, or device buffers that only copies reach.
        std::shared_ptr<DeviceMemory> device =
            options.device_memory != nullptr ? options.device_memory : CreateHostMemory();
        KEEL_ASSIGN_OR_RETURN(auto engine, Engine::Create(options));
        const int slots = engine->local_slots();
        std::vector<std::byte*> w(slots), g(slots), o(slots);
        for (int i = 0; i < slots; ++i) {
          KEEL_ASSIGN_OR_RETURN(w[i], device->AllocateDevice(16));
          KEEL_ASSIGN_OR_RETURN(g[i], device->AllocateDevice(gradient_bytes));
          KEEL_ASSIGN_OR_RETURN(o[i], device->AllocateDevice(16));
          KEEL_RETURN_IF_ERROR(engine->RegisterSlot(0, i, {w[i], g[i], o[i]}));
        }
        // Everything to expert 0: the transient replica splits it, and both copies hold
        // gradients whose float sum depends on the order.
        std::vector<int32_t> ids(kTokens * kTopK, 0);
        for (int t = 0; t < kTokens; ++t) ids[t * kTopK + 1] = 1 + t % (kExperts - 1);
        KEEL_ASSIGN_OR_RETURN(LayerRoute route, engine->Route(0, ids));
        for (int i = engine->slots_per_rank(); i < slots; ++i) {
          if (route.local_experts[i] == 0) ++transient_copies;
        }
        std::vector<float> gradient(kWeightWords);
        for (int i = 0; i < slots; ++i) {
          for (int j = 0; j < kWeightWords; ++j) {
            gradient[j] = 1.0f / static_cast<float>(3 + r * 7 + i * 11 + j);
          }
          KEEL_RETURN_IF_ERROR(device->Copy(
              g[i], reinterpret_cast<const std::byte*>(gradient.data()), gradient_bytes));
        }
        KEEL_RETURN_IF_ERROR(engine->ReduceGradients());
        for (const auto& home : engine->HomeSlots(0)) {
          if (home.expert != 0) continue;
          homes[r].resize(kWeightWords);
          KEEL_RETURN_IF_ERROR(device->Copy(reinterpret_cast<std::byte*>(homes[r].data()),
                                            g[home.local_slot], gradient_bytes));
        }
        KEEL_RETURN_IF_ERROR(engine->StepEnd());
        engine.reset();
        for (int i = 0; i < slots; ++i) {
          for (std::byte* buffer : {w[i], g[i], o[i]}) device->FreeDevice(buffer);
        }
        return Status::Ok();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : status) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(transient_copies.load(), 1) << "expert 0 should get transient replicas";
  std::vector<float> home;
  for (auto& h : homes) {
    if (!h.empty()) home = h;
  }
  return home;
}

// kFloat32 sums depend on their order; the engine's fixed order gives the same bits every run.
// Each step's tokens in 4 micro-batches, every layer routed once per micro-batch and the
// gradients added up before one ReduceGradients: the homes end exactly where one batch per step
// takes them (the same reference), while the keel policy migrates and the step planner adds
// transient replicas per micro-batch, each kept in its slot for the rest of the step.
TEST_P(EngineMemoryTest, MicroBatchesTrainExactlyAsOneBatchPerStep) {
  constexpr int kSteps = 24;
  RunHooks hooks;
  hooks.micro_batches = 4;
  TrainingRun run = RunAll(TestConfig("keel"), kSteps, GetParam(), nullptr, nullptr, hooks);
  int64_t rows_in_earlier_transients = 0;
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
    rows_in_earlier_transients += record.rows_in_earlier_transients;
  }
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(run.records[r].epoch_after_step, run.records[0].epoch_after_step) << "rank " << r;
  }
  EXPECT_GE(run.records[0].stats.epochs_committed, 1) << "the skewed load should move experts";
  EXPECT_GT(rows_in_earlier_transients, 0)
      << "no micro-batch used a transient replica an earlier one filled: the test proves little";
  ExpectRoutingAgrees(run, kSteps);
  ExpectMatchesReference(run, ComputeReference(kSteps));
}

TEST_P(EngineMemoryTest, FloatGradientReductionIsDeterministic) {
  const std::vector<float> first = FloatHomeGradient(GetParam());
  ASSERT_EQ(first.size(), static_cast<size_t>(kWeightWords));
  for (int i = 0; i < 3; ++i) {
    const std::vector<float> again = FloatHomeGradient(GetParam());
    ASSERT_EQ(again.size(), first.size());
    EXPECT_EQ(std::memcmp(again.data(), first.data(), first.size() * sizeof(float)), 0);
  }
}

// Device buffers are summed by the kernels' CPU reference in the same order: the same bits as
// host buffers, even for order-dependent float sums. (Whole training runs of both kinds equal the
// exact reference above; their epochs may switch at other steps, since the planner thread's
// timing decides when a plan is adopted.)
TEST(EngineTest, GuardedDeviceMemoryGivesTheBitsOfHostMemory) {
  const std::vector<float> host = FloatHomeGradient(Memory::kHost);
  const std::vector<float> device = FloatHomeGradient(Memory::kGuardedDevice);
  ASSERT_EQ(host.size(), static_cast<size_t>(kWeightWords));
  ASSERT_EQ(device.size(), host.size());
  EXPECT_EQ(std::memcmp(host.data(), device.data(), host.size() * sizeof(float)), 0);
}

// ---- bf16 gradients: ReduceGradients against the CPU reference in the documented order.

// One layer on 4 ranks x 3 slots, no transient slots. Expert 0 has a copy on every rank (slots 0,
// 3, 6, 9) and its home on rank 2 (slot 6); expert 1 has slots 1 and 11, its home on rank 3
// (slot 11). Every other expert has one copy, so nothing is added into it.
EngineState ReplicatedState() {
  EngineState state;
  state.phy2log = {{0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 1}};
  state.home = {{2, 3, 0, 1, 1, 2, 2, 3}};
  return state;
}

constexpr int kBf16Words = 64;

// The bf16 gradient of persistent slot `slot`, word `word`. Word 0 makes the order visible: the
// home of expert 0 holds 1 and its replicas 2^-8 each, so home first gives 1 (every 1 + 2^-8 ties
// to even, down to 1), and any order that adds two replicas first gives more.
uint16_t Bf16Gradient(int slot, int word) {
  if (word == 0) return slot == 6 ? 0x3f80 : 0x3b80;
  std::mt19937 rng(static_cast<uint32_t>(slot * 1000 + word));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return kernels::FloatToBf16(normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 16) - 8));
}

std::vector<uint16_t> Bf16Gradients(int slot) {
  std::vector<uint16_t> gradient(kBf16Words);
  for (int j = 0; j < kBf16Words; ++j) gradient[j] = Bf16Gradient(slot, j);
  return gradient;
}

// kernels::cpu::AddInto of the slots' gradients into zeros, in the order given.
std::vector<uint16_t> Bf16Sum(const std::vector<int>& slots) {
  std::vector<uint16_t> sum(kBf16Words, 0);
  for (int slot : slots) {
    const std::vector<uint16_t> gradient = Bf16Gradients(slot);
    EXPECT_TRUE(kernels::cpu::AddInto(GradientType::kBFloat16, sum.data(), gradient.data(),
                                      kBf16Words * sizeof(uint16_t))
                    .ok());
  }
  return sum;
}

// [rank][expert]: the gradient of each home slot after one ReduceGradients of bf16 gradients
// under ReplicatedState.
std::vector<std::map<int, std::vector<uint16_t>>> Bf16HomeGradients(Memory memory) {
  std::unique_ptr<LocalGroup> group = MakeGroup(kRanks);
  std::vector<std::map<int, std::vector<uint16_t>>> homes(kRanks);
  std::vector<Status> status(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        KEEL_ASSIGN_OR_RETURN(auto communicator, group->Join(r));
        KeelConfig config = TestConfig("static");
        config.slots.transient_per_rank = 0;
        EngineOptions options = SmallOptions(config, 1, communicator.get(), group.get());
        const size_t gradient_bytes = kBf16Words * sizeof(uint16_t);
        options.shape.gradient_bytes = gradient_bytes;
        options.shape.gradient_type = GradientType::kBFloat16;
        options.device_memory = RankMemory(memory);
        if (options.device_memory != nullptr) options.shape.memory = MemoryKind::kDevice;
        std::shared_ptr<DeviceMemory> device =
            options.device_memory != nullptr ? options.device_memory : CreateHostMemory();
        KEEL_ASSIGN_OR_RETURN(auto engine, Engine::Create(options));
        KEEL_RETURN_IF_ERROR(engine->RestoreState(ReplicatedState()));
        const int slots = engine->local_slots();
        std::vector<std::byte*> w(slots), g(slots), o(slots);
        for (int i = 0; i < slots; ++i) {
          KEEL_ASSIGN_OR_RETURN(w[i], device->AllocateDevice(8));
          KEEL_ASSIGN_OR_RETURN(g[i], device->AllocateDevice(gradient_bytes));
          KEEL_ASSIGN_OR_RETURN(o[i], device->AllocateDevice(8));
          KEEL_RETURN_IF_ERROR(engine->RegisterSlot(0, i, {w[i], g[i], o[i]}));
          const std::vector<uint16_t> gradient = Bf16Gradients(r * slots + i);
          KEEL_RETURN_IF_ERROR(device->Copy(
              g[i], reinterpret_cast<const std::byte*>(gradient.data()), gradient_bytes));
        }
        KEEL_RETURN_IF_ERROR(engine->Route(0, RouterIds(0, r, 0)).status());
        KEEL_RETURN_IF_ERROR(engine->ReduceGradients());
        for (const HomeSlot& home : engine->HomeSlots(0)) {
          std::vector<uint16_t>& got = homes[r][home.expert];
          got.resize(kBf16Words);
          KEEL_RETURN_IF_ERROR(device->Copy(reinterpret_cast<std::byte*>(got.data()),
                                            g[home.local_slot], gradient_bytes));
        }
        KEEL_RETURN_IF_ERROR(engine->StepEnd());
        engine.reset();
        for (int i = 0; i < slots; ++i) {
          for (std::byte* buffer : {w[i], g[i], o[i]}) device->FreeDevice(buffer);
        }
        return Status::Ok();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(status[r].ok()) << r << ": " << status[r].ToString();
  return homes;
}

// Each replicated expert's home holds its copies' bf16 gradients added by kernels::cpu::AddInto
// in the documented order (home, then the other copies by ascending slot), rounded at every add;
// an expert with one copy keeps its own gradient.
TEST_P(EngineMemoryTest, Bf16GradientsSumIntoTheHomeInTheDocumentedOrder) {
  const std::vector<uint16_t> expert0 = Bf16Sum({6, 0, 3, 9});
  ASSERT_EQ(expert0[0], 0x3f80) << "1, then three ties to even";
  ASSERT_NE(Bf16Sum({0, 3, 6, 9}), expert0) << "the order must show in the bits";
  std::vector<std::map<int, std::vector<uint16_t>>> homes = Bf16HomeGradients(GetParam());
  ASSERT_EQ(homes.size(), static_cast<size_t>(kRanks));
  EXPECT_EQ(homes[2][0], expert0);
  EXPECT_EQ(homes[3][1], Bf16Sum({11, 1}));
  EXPECT_EQ(homes[0][2], Bf16Gradients(2));
  EXPECT_EQ(homes[3][7], Bf16Gradients(10));
}

// FloatHomeGradient's float32 bits, as the fixed order of sums (home, other copies by ascending
// slot, transients) gives them, pinned so that a change of the exchange under the sums shows.
std::vector<uint32_t> PinnedFloatHomeGradientBits() {
  return {
      0x3ec9cbce, 0x3e9e80d0, 0x3e844d49, 0x3e6550a1, 0x3e4bd2a3, 0x3e3877b7, 0x3e293727,
      0x3e1cd84c, 0x3e129410, 0x3e09e590, 0x3e0270b4, 0x3df7e730, 0x3dec7bae, 0x3de25625,
      0x3dd93ed8, 0x3dd10a4f, 0x3dc99621, 0x3dc2c6b4, 0x3dbc859a, 0x3db6c070, 0x3db167ed,
      0x3dac6f50, 0x3da7cbd3, 0x3da3744f, 0x3d9f60ef, 0x3d9b8af4, 0x3d97ec86, 0x3d94808e,
      0x3d914296, 0x3d8e2eb5, 0x3d8b4171, 0x3d8877b8, 0x3d85cecc, 0x3d83443a, 0x3d80d5d0,
      0x3d7d0324, 0x3d788b6f, 0x3d744143, 0x3d7021af, 0x3d6c2a07, 0x3d6857d7, 0x3d64a8e3,
      0x3d611b1f, 0x3d5daca6, 0x3d5a5bba, 0x3d5726c5, 0x3d540c48, 0x3d510ae3, 0x3d4e2152,
      0x3d4b4e65, 0x3d489100, 0x3d45e81d, 0x3d4352c8, 0x3d40d019, 0x3d3e5f3a, 0x3d3bff60,
      0x3d39afcf, 0x3d376fd6, 0x3d353ecd, 0x3d331c16, 0x3d31071c, 0x3d2eff54, 0x3d2d043a,
      0x3d2b154f,
  };
}

std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits(values.size());
  if (!values.empty()) std::memcpy(bits.data(), values.data(), values.size() * sizeof(float));
  return bits;
}

// Bitwise equality of two runs' slot buffers (all regions, transient slots included).
void ExpectSameBuffers(const TrainingRun& a, const TrainingRun& b) {
  for (int r = 0; r < kRanks; ++r) {
    const RankBuffers& x = a.buffers[r];
    const RankBuffers& y = b.buffers[r];
    ASSERT_EQ(x.weights.size(), y.weights.size());
    for (size_t i = 0; i < x.weights.size(); ++i) {
      EXPECT_EQ(Bits(x.weights[i]), Bits(y.weights[i])) << "rank " << r << " region " << i;
      EXPECT_EQ(std::memcmp(x.optimizer[i].data(), y.optimizer[i].data(),
                            x.optimizer[i].size() * sizeof(double)),
                0)
          << "rank " << r << " region " << i;
      EXPECT_EQ(x.gradients[i], y.gradients[i]) << "rank " << r << " region " << i;
    }
  }
}

// Every transient slot holds what its last fill sent it: the weights of the expert it held in
// the last step it held one, as they were when that step began (the reference after the steps
// before), or zeros if it never held one. A fill that read another piece of the exchange shows
// here, which the reference of the homes cannot see. Returns how many transient slots were
// filled at least once.
int ExpectTransientsHoldTheirLastFill(const TrainingRun& run, int steps) {
  std::vector<Reference> at_start;
  for (int step = 0; step < steps; ++step) at_start.push_back(ComputeReference(step));
  int filled = 0;
  for (int r = 0; r < kRanks; ++r) {
    const RankRecord& record = run.records[r];
    for (int l = 0; l < kLayers; ++l) {
      for (int i = record.slots_per_rank; i < record.local_slots; ++i) {
        int last_step = -1;
        int expert = -1;
        for (int step = 0; step < steps; ++step) {
          const int held = record.local_experts[step][l][i];
          if (held >= 0) std::tie(last_step, expert) = std::make_pair(step, held);
        }
        const std::vector<float>& weights =
            run.buffers[r].weights[static_cast<size_t>(l) * record.local_slots + i];
        const std::vector<float> expected =
            last_step < 0 ? std::vector<float>(kWeightWords, 0.0f)
                          : at_start[last_step].weights[l * kExperts + expert];
        filled += last_step >= 0;
        EXPECT_EQ(Bits(weights), Bits(expected))
            << "rank " << r << " layer " << l << " transient slot " << i << " (expert " << expert
            << " at step " << last_step << ")";
      }
    }
  }
  return filled;
}

// Some layer has an expert with more than one persistent copy at the end of `run`, so weight
// pushes and gradient sums crossed ranks.
bool HasReplicas(const TrainingRun& run) {
  for (const LayerPlacement& layout : run.records[0].final_layouts) {
    for (int32_t copies : layout.logcnt) {
      if (copies > 1) return true;
    }
  }
  return false;
}

// Every slot exchange (transient fills, gradient sums, weight pushes, reshards) derives its
// sizes from the plan on both sides, so no AllToAllV and its size exchange runs any more. The
// training still equals the exact reference, every transient holds what its fill sent, and the
// order-dependent float sums keep their pinned bits.
TEST(EngineTest, SlotExchangesSendNoSizesAndKeepTheBits) {
  constexpr int kSteps = 24;
  AllToAllCounts counts;
  const WrapCommunicator counting = Counting(counts, /*moves_device_memory=*/false);
  TrainingRun run =
      RunAll(TestConfig("keel"), kSteps, Memory::kHost, nullptr, nullptr, {}, counting);
  for (const RankRecord& record : run.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  EXPECT_GE(run.records[0].stats.epochs_committed, 1);
  EXPECT_TRUE(HasReplicas(run));
  ExpectMatchesReference(run, ComputeReference(kSteps));
  EXPECT_GT(ExpectTransientsHoldTheirLastFill(run, kSteps), 0);

  KeelConfig resharding = TestConfig("keel");
  resharding.policy.keel.shard_experts = true;
  resharding.cost_model.expert_ffn_size = 8192;
  TrainingRun reshards = RunAll(resharding, kSteps, Memory::kHost, nullptr, nullptr, {}, counting);
  for (const RankRecord& record : reshards.records) {
    ASSERT_TRUE(record.status.ok()) << record.status.ToString();
  }
  EXPECT_GE(reshards.records[0].stats.reshards, 1);
  ExpectMatchesReference(reshards, ComputeReference(kSteps));

  EXPECT_EQ(Bits(FloatHomeGradient(Memory::kHost, counting)), PinnedFloatHomeGradientBits());
  EXPECT_EQ(counts.size_exchanging.load(), 0);
  EXPECT_GT(counts.known_sizes.load(), 0);
  EXPECT_EQ(counts.device.load(), 0);
}

// Guarded device slot buffers over a communicator that moves device memory: every slot exchange
// goes device to device (AllToAllVDevice), the engine never touches a slot buffer from the CPU
// (guarded memory would fault), and training gives the bits of host memory, transient slots and
// gradients included.
TEST(EngineTest, DeviceToDeviceExchangesGiveTheBitsOfHostMemory) {
  constexpr int kSteps = 24;
  AllToAllCounts counts;
  const WrapCommunicator device_moving = Counting(counts, /*moves_device_memory=*/true);
  TrainingRun host = RunAll(TestConfig("keel"), kSteps, Memory::kHost);
  TrainingRun device = RunAll(TestConfig("keel"), kSteps, Memory::kGuardedDevice, nullptr, nullptr,
                              {}, device_moving);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(host.records[r].status.ok()) << host.records[r].status.ToString();
    ASSERT_TRUE(device.records[r].status.ok()) << device.records[r].status.ToString();
    EXPECT_EQ(device.records[r].epoch_after_step, host.records[r].epoch_after_step);
    EXPECT_EQ(device.records[r].final_placements, host.records[r].final_placements);
  }
  EXPECT_TRUE(HasReplicas(device));
  ExpectSameBuffers(device, host);
  ExpectMatchesReference(device, ComputeReference(kSteps));
  EXPECT_GT(ExpectTransientsHoldTheirLastFill(device, kSteps), 0);

  EXPECT_EQ(Bits(FloatHomeGradient(Memory::kGuardedDevice, device_moving)),
            PinnedFloatHomeGradientBits());
  EXPECT_GT(counts.device.load(), 0);
  EXPECT_EQ(counts.size_exchanging.load(), 0);
  EXPECT_EQ(counts.known_sizes.load(), 0);
}

// Host buffers registered as device memory, and the reverse, are refused naming the buffer.
TEST(EngineTest, RegisterSlotChecksWhereBuffersLive) {
  std::unique_ptr<LocalGroup> group = MakeGroup(1);
  auto communicator = testing::ValueOrDie(group->Join(0));
  EngineOptions options = SmallOptions(OneRankStaticConfig(), 1, communicator.get(), group.get());
  options.shape.memory = MemoryKind::kDevice;
  options.device_memory = testing::ValueOrDie(CreateGuardedHostMemory());
  auto engine = testing::ValueOrDie(Engine::Create(options));
  std::vector<std::byte> host(8);
  std::byte* device = testing::ValueOrDie(options.device_memory->AllocateDevice(8));
  const Status status = engine->RegisterSlot(0, 2, {device, host.data(), device});
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("buffers.gradients of layer 0 local_slot 2 is not device memory"),
            std::string::npos)
      << status.ToString();
  EXPECT_TRUE(engine->RegisterSlot(0, 2, {device, device, device}).ok());
  engine.reset();
  options.device_memory->FreeDevice(device);
}

// A trainer that counts and remaps on its GPU calls RouteCounts and the remap kernel; it must
// get exactly what Route gives. Layers 0 and 1 start with the same placement, so routing the same
// ids through each path must agree field by field.
TEST(EngineTest, RouteCountsPlusTheRemapKernelEqualsRoute) {
  std::unique_ptr<LocalGroup> group = MakeGroup(kRanks);
  std::vector<Status> status(kRanks);
  std::atomic<int> split_experts{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        KEEL_ASSIGN_OR_RETURN(auto communicator, group->Join(r));
        KEEL_ASSIGN_OR_RETURN(
            auto engine,
            Engine::Create(SmallOptions(TestConfig("keel"), 2, communicator.get(), group.get())));
        std::vector<std::byte> buffer(8);
        for (int l = 0; l < 2; ++l) {
          for (int i = 0; i < engine->local_slots(); ++i) {
            KEEL_RETURN_IF_ERROR(
                engine->RegisterSlot(l, i, {buffer.data(), buffer.data(), buffer.data()}));
          }
        }
        // Skewed towards expert 0 so that its tokens are split among several copies.
        std::vector<int32_t> ids(kTokens * kTopK);
        for (int t = 0; t < kTokens; ++t) {
          ids[t * kTopK] = t % 3 == 0 ? (t + r) % kExperts : 0;
          ids[t * kTopK + 1] = t % 5 == 0 ? -1 : 1 + (t * 7 + r) % (kExperts - 1);
        }
        std::vector<int32_t> counts(kExperts, 0);
        for (int32_t id : ids) {
          if (id >= 0) ++counts[id];
        }
        KEEL_ASSIGN_OR_RETURN(LayerRoute full, engine->Route(0, ids));
        KEEL_ASSIGN_OR_RETURN(LayerRoute by_counts, engine->RouteCounts(1, counts));
        if (!by_counts.slot.empty()) return Internal("RouteCounts filled slot");
        if (by_counts.copy_begin != full.copy_begin || by_counts.copy_slot != full.copy_slot ||
            by_counts.copy_quota != full.copy_quota || by_counts.slot_rank != full.slot_rank ||
            by_counts.send_counts != full.send_counts ||
            by_counts.recv_counts != full.recv_counts ||
            by_counts.local_experts != full.local_experts) {
          return Internal("rank " + std::to_string(r) + ": RouteCounts differs from Route");
        }
        for (int e = 0; e < kExperts; ++e) {
          if (full.copy_begin[e + 1] - full.copy_begin[e] > 1) ++split_experts;
        }
        const kernels::QuotaTable table =
            kernels::MakeQuotaTable(by_counts.copy_begin, by_counts.copy_slot, by_counts.copy_quota,
                                    by_counts.slot_rank, kRanks);
        std::vector<int32_t> slot(ids.size()), send(kRanks);
        int32_t invalid = 0;
        KEEL_RETURN_IF_ERROR(kernels::cpu::RemapWithQuotas(ids.data(),
                                                           static_cast<int64_t>(ids.size()), table,
                                                           slot.data(), send.data(), &invalid));
        if (slot != full.slot || invalid != 0) {
          return Internal("rank " + std::to_string(r) + ": remapped slots differ from Route's");
        }
        // A layer may be routed again (a micro-batch), but not once its gradients are folded.
        KEEL_RETURN_IF_ERROR(engine->ReduceGradients());
        if (engine->RouteCounts(1, counts).status().message().find("after ReduceGradients") ==
            std::string::npos) {
          return Internal("a RouteCounts after ReduceGradients was not refused");
        }
        return Status::Ok();
      }();
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : status) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_GT(split_experts.load(), 0) << "no expert was split: the test would prove little";
}

// Only the aggregating rank opens the trace recorder; when it cannot, every other rank must hear
// of it at creation, not at its first collective's deadline (30 s here, as the message would say).
TEST(EngineTest, AnAggregatingRanksFailureFailsEveryRanksCreation) {
  std::unique_ptr<LocalGroup> group = MakeGroup(kRanks);
  KeelConfig config = TestConfig("keel");
  config.monitor.aggregating_rank = 1;
  config.monitor.trace_path = ::testing::TempDir() + "/no/such/folder/trace.jsonl";
  std::vector<Status> status(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      Result<std::unique_ptr<Communicator>> communicator = group->Join(r);
      if (!communicator.ok()) {
        status[r] = communicator.status();
        return;
      }
      status[r] =
          Engine::Create(SmallOptions(config, 2, communicator->get(), group.get())).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_FALSE(status[r].ok()) << "rank " << r;
    EXPECT_NE(status[r].message().find("monitor.trace_path: cannot create trace"),
              std::string::npos)
        << "rank " << r << ": " << status[r].ToString();
    if (r != 1) {
      EXPECT_EQ(status[r].code(), StatusCode::kFailedPrecondition) << status[r].ToString();
      EXPECT_NE(status[r].message().find("rank 1 could not create its engine"), std::string::npos)
          << status[r].ToString();
    } else {
      EXPECT_EQ(status[r].code(), StatusCode::kInvalidArgument) << status[r].ToString();
    }
  }
}

// A config file that names itself as monitor.trace_path would be replaced by the recorded trace
// as the engine starts: refused by both names, the file untouched.
TEST(EngineTest, ATraceThatWouldReplaceItsConfigFileIsRefused) {
  std::unique_ptr<LocalGroup> group = MakeGroup(1);
  auto communicator = testing::ValueOrDie(group->Join(0));
  const std::string path =
      ::testing::TempDir() + "/keel_self_trace_" + std::to_string(::getpid()) + ".yaml";
  KeelConfig config = TestConfig("static");
  config.topology.gpus_per_node = 1;
  config.slots.persistent_per_rank = kExperts;
  config.monitor.trace_path = path;
  const std::string yaml = ConfigToYaml(config);
  ASSERT_TRUE(WriteFileAtomically(path, yaml).ok());
  EngineOptions options = SmallOptions(config, 2, communicator.get(), group.get());
  options.config.reset();
  options.config_path = path;
  const auto engine = Engine::Create(options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("monitor.trace_path '" + path + "' and config_path '" +
                                           path + "' name the same file"),
            std::string::npos)
      << engine.status().ToString();
  EXPECT_EQ(testing::ValueOrDie(ReadFile(path, {})), yaml);
  std::remove(path.c_str());
}

// A policy whose replans wait until the test lets them go, so the engine's planner thread makes
// no progress for as long as the test likes. Its plans change nothing.
struct HeldPlanner {
  std::mutex mutex;
  std::condition_variable released_cv;
  bool released = false;
  std::atomic<int> replans{0};

  void Release() {
    std::lock_guard<std::mutex> lock(mutex);
    released = true;
    released_cv.notify_all();
  }
};

HeldPlanner& Held() {
  static HeldPlanner held;
  return held;
}

class HeldPolicy : public PlacementPolicy {
 public:
  Result<std::vector<int>> Replan(const ReplanInput& input) override {
    ++Held().replans;
    std::unique_lock<std::mutex> lock(Held().mutex);
    Held().released_cv.wait(lock, [] { return Held().released; });
    return std::vector<int>(input.phy2log.begin(), input.phy2log.end());
  }
};

// HeldPolicy's name; RegisterHeldPolicy registers it once per process and says whether it could.
constexpr char kHeldPolicy[] = "held-planner";
bool RegisterHeldPolicy() {
  static const bool registered =
      RegisterPolicy(
          {kHeldPolicy, [](const PolicyShape&) { return std::make_unique<HeldPolicy>(); }})
          .ok();
  return registered;
}

// What each rank saw in RunHeldPlanner.
struct HeldRun {
  std::vector<std::vector<int>> failed_steps;  // [rank] steps whose StepEnd the watchdog failed
  std::vector<double> seconds_to_trip;  // [rank] from StepEnd 0's call to the failed one's end
  std::vector<std::string> messages;    // [rank] the failed StepEnd's message
  std::vector<EngineStats> stats;
  std::vector<Status> status;
};

// Trains `steps` steps of one layer on kRanks thread ranks under `config`, whose policy is
// kHeldPolicy, each step taking at least `step_time`. Rank 0 lets the plan go
// before step `release_step`; past the last step every rank does (an engine waits for its
// planner when it is destroyed).
HeldRun RunHeldPlanner(const KeelConfig& config, int steps, int release_step,
                       std::chrono::milliseconds step_time, Metrics* metrics = nullptr) {
  Held().released = false;
  Held().replans = 0;
  std::unique_ptr<LocalGroup> group = MakeGroup(kRanks);
  HeldRun run;
  run.failed_steps.resize(kRanks);
  run.seconds_to_trip.resize(kRanks);
  run.messages.resize(kRanks);
  run.stats.resize(kRanks);
  run.status.resize(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      run.status[r] = [&]() -> Status {
        KEEL_ASSIGN_OR_RETURN(auto communicator, group->Join(r));
        EngineOptions options = SmallOptions(config, 1, communicator.get(), group.get());
        KEEL_ASSIGN_OR_RETURN(auto engine, EngineFactory::Create(options, metrics));
        std::vector<std::byte> buffer(8);
        for (int i = 0; i < engine->local_slots(); ++i) {
          KEEL_RETURN_IF_ERROR(
              engine->RegisterSlot(0, i, {buffer.data(), buffer.data(), buffer.data()}));
        }
        std::chrono::steady_clock::time_point replan_started;
        for (int step = 0; step < steps; ++step) {
          if (r == 0 && step == release_step) Held().Release();
          std::vector<int32_t> ids(kTokens * kTopK);
          for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i + r) % kExperts);
          KEEL_RETURN_IF_ERROR(engine->Route(0, ids).status());
          KEEL_RETURN_IF_ERROR(engine->ReduceGradients());
          std::this_thread::sleep_for(step_time);
          // Before StepEnd 0, which starts the replan.
          if (step == 0) replan_started = std::chrono::steady_clock::now();
          Status ended = engine->StepEnd();
          if (!ended.ok()) {
            if (ended.code() != StatusCode::kDeadlineExceeded) return ended;
            run.failed_steps[r].push_back(step);
            run.messages[r] = ended.message();
            run.seconds_to_trip[r] =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - replan_started)
                    .count();
          }
        }
        run.stats[r] = engine->stats();
        Held().Release();
        return Status::Ok();
      }();
    });
  }
  for (auto& t : threads) t.join();
  Held().Release();
  return run;
}

// The planner's watchdog: a replan still running after policy.planner_watchdog_seconds is an
// error from StepEnd on every rank, at the same step, once, with a log line and the counter the
// KeelWatchdogTripped alert fires on; training goes on with the placement in force, and the late
// plan is dropped when it ends.
TEST(EngineTest, PlannerWatchdogFailsEveryRankAtTheSameStepOnce) {
  ASSERT_TRUE(RegisterHeldPolicy());
  KeelConfig config = TestConfig(kHeldPolicy);
  config.policy.planner_watchdog_seconds = 0.3;
  config.policy.plan_adoption = "when_ready";  // training goes on while the plan is held
  auto metrics = Metrics::Create(MetricsLayout::FromConfig(config, 1, kExperts, 2));
  ASSERT_TRUE(metrics.ok());
  // Steps of at least 20 ms: the limit passes before step 30, where the plan is let go.
  constexpr int kSteps = 40;
  const HeldRun run =
      RunHeldPlanner(config, kSteps, kSteps - 10, std::chrono::milliseconds(20), metrics->get());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(run.status[r].ok()) << "rank " << r << ": " << run.status[r].ToString();
    ASSERT_EQ(run.failed_steps[r].size(), 1u) << "rank " << r << " failed at every step listed";
    EXPECT_EQ(run.failed_steps[r], run.failed_steps[0])
        << "rank " << r << " tripped at another step";
    EXPECT_NE(run.messages[r].find("planner watchdog: the replan started at step 1 has run"),
              std::string::npos)
        << run.messages[r];
    EXPECT_NE(run.messages[r].find("policy.planner_watchdog_seconds (0.3)"), std::string::npos)
        << run.messages[r];
    EXPECT_EQ(run.stats[r].watchdog_trips, 1);
    EXPECT_EQ(run.stats[r].epoch, 0) << "the late plan must be dropped";
    EXPECT_EQ(run.stats[r].steps, kSteps);
    // Ranks start their planners within a step of each other.
    EXPECT_GE(run.seconds_to_trip[r], 0.25) << "rank " << r << " tripped early";
  }
  EXPECT_LT(run.failed_steps[0][0], kSteps - 10);
  // One replan per rank was held; the planner ran again after the late plan ended.
  EXPECT_GT(Held().replans.load(), kRanks);
  // Only the aggregating rank exports, once for all.
  const std::string text = (*metrics)->Serialize();
  EXPECT_NE(text.find("keel_watchdog_trips_total{what=\"planner\"} 1\n"), std::string::npos)
      << text;
}

// With next_step, the StepEnd after a replan started waits for the planner, but not past the
// watchdog's limit: a held plan trips the watchdog at that very step on every rank, and the
// steps after it go on with the placement in force.
TEST(EngineTest, NextStepAdoptionWaitsForThePlannerUntilTheWatchdog) {
  ASSERT_TRUE(RegisterHeldPolicy());
  KeelConfig config = TestConfig(kHeldPolicy);
  ASSERT_EQ(config.policy.plan_adoption, "next_step");
  config.policy.planner_watchdog_seconds = 0.3;
  constexpr int kSteps = 4;
  const HeldRun run =
      RunHeldPlanner(config, kSteps, /*release_step=*/-1, std::chrono::milliseconds(0));
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(run.status[r].ok()) << "rank " << r << ": " << run.status[r].ToString();
    EXPECT_EQ(run.failed_steps[r], std::vector<int>{1}) << "rank " << r;
    // The wait ends when the replan has run past the limit, and it started after this clock.
    EXPECT_GE(run.seconds_to_trip[r], 0.3) << "rank " << r << " did not wait for its planner";
    EXPECT_EQ(run.stats[r].watchdog_trips, 1);
    EXPECT_EQ(run.stats[r].epoch, 0) << "the late plan must be dropped";
    EXPECT_EQ(run.stats[r].steps, kSteps);
  }
}

// A policy that moves every expert on by one slot at each replan, so every plan is an epoch; the
// sleepy one first sleeps 20 ms on every other replan, longer than a toy step takes.
class Rotation : public PlacementPolicy {
 public:
  explicit Rotation(bool sleepy) : sleepy_(sleepy) {}
  Result<std::vector<int>> Replan(const ReplanInput& input) override {
    if (sleepy_ && replans_++ % 2 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<int> next(input.phy2log.begin(), input.phy2log.end());
    std::rotate(next.begin(), next.begin() + 1, next.end());
    return next;
  }

 private:
  bool sleepy_;
  int replans_ = 0;
};

// policy.plan_adoption next_step: every rank waits at the step after a replan started until its
// planner is done, so a slow planner makes the same epochs at the same steps as a quick one.
TEST(EngineTest, NextStepAdoptionMakesTheSameEpochsHoweverLongThePlannerTakes) {
  static const bool registered =
      RegisterPolicy(
          {"rotation", [](const PolicyShape&) { return std::make_unique<Rotation>(false); }})
          .ok() &&
      RegisterPolicy(
          {"sleepy-rotation", [](const PolicyShape&) { return std::make_unique<Rotation>(true); }})
          .ok();
  ASSERT_TRUE(registered);
  constexpr int kSteps = 12;
  KeelConfig config = TestConfig("rotation");
  ASSERT_EQ(config.policy.plan_adoption, "next_step");
  const TrainingRun quick = RunAll(config, kSteps, Memory::kHost);
  config.policy.name = "sleepy-rotation";
  const TrainingRun slow = RunAll(config, kSteps, Memory::kHost);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(quick.records[r].status.ok()) << quick.records[r].status.ToString();
    ASSERT_TRUE(slow.records[r].status.ok()) << slow.records[r].status.ToString();
    EXPECT_EQ(slow.records[r].epoch_after_step, quick.records[r].epoch_after_step) << "rank " << r;
    EXPECT_EQ(slow.records[r].final_placements, quick.records[r].final_placements);
  }
  // A replan started at the end of step s is adopted at the end of step s + 1, and its epoch
  // commits in step s + 2, at whose end the next replan starts: an epoch every 2 steps.
  const std::vector<int64_t> expected = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5};
  EXPECT_EQ(quick.records[0].epoch_after_step, expected);
  ExpectMatchesReference(quick, ComputeReference(kSteps));
  ExpectMatchesReference(slow, ComputeReference(kSteps));
}

// Found by the C API fuzzer: StepEnd before every slot was registered copied replica weights
// from a null pointer. ReduceGradients and StepEnd now refuse, like Route.
// Runs `body(rank, engine)` on two thread-ranks of a static engine: 8 experts, 4 per rank.
void OnTwoRanks(int layers, const std::function<void(int, Engine&)>& body) {
  std::unique_ptr<LocalGroup> group = MakeGroup(2);
  KeelConfig config = TestConfig("static");
  config.topology.gpus_per_node = 2;
  config.slots.persistent_per_rank = kExperts / 2;
  config.slots.transient_per_rank = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto communicator = testing::ValueOrDie(group->Join(r));
      auto engine = testing::ValueOrDie(
          Engine::Create(SmallOptions(config, layers, communicator.get(), group.get())));
      body(r, *engine);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// A sequence of 32 tokens whose top-2 rows all go to experts [first, first + 4) in each layer.
SequenceRouting SequenceOn(int first, int layers) {
  SequenceRouting sequence;
  sequence.tokens = 32;
  sequence.expert_rows.assign(static_cast<size_t>(layers) * kExperts, 0);
  for (int l = 0; l < layers; ++l) {
    for (int e = first; e < first + 4; ++e) sequence.expert_rows[l * kExperts + e] = 16;
  }
  return sequence;
}

TEST(EngineTest, PlanSequencesSwapsSequencesToTheirExpertsOnEveryRank) {
  // Rank 0's first sequence uses rank 1's experts, rank 1's first uses rank 0's; the token
  // bound (1.0) allows only a swap, and every rank gets the same plan.
  std::vector<SequencePlacement> answers(2);
  OnTwoRanks(2, [&](int rank, Engine& engine) {
    const std::vector<SequenceRouting> mine = {SequenceOn(rank == 0 ? 4 : 0, 2),
                                               SequenceOn(rank == 0 ? 0 : 4, 2)};
    SequencePlanningOptions options;
    options.max_token_imbalance = 1.0;
    answers[rank] = testing::ValueOrDie(engine.PlanSequences(0, mine, options));
  });
  for (const SequencePlacement& answer : answers) {
    EXPECT_EQ(answer.origin_rank, (std::vector<int32_t>{0, 0, 1, 1}));
    EXPECT_EQ(answer.origin_index, (std::vector<int32_t>{0, 1, 0, 1}));
    EXPECT_EQ(answer.rank, (std::vector<int32_t>{1, 0, 0, 1}));
    EXPECT_TRUE(answer.used);
    EXPECT_EQ(answer.moved_sequences, 2);
    EXPECT_LT(answer.seconds_after, answer.seconds_before);
  }
  // One layer, the second: the same swap.
  OnTwoRanks(2, [&](int rank, Engine& engine) {
    const std::vector<SequenceRouting> mine = {SequenceOn(rank == 0 ? 4 : 0, 1)};
    SequencePlanningOptions options;
    options.max_token_imbalance = 1.0;
    answers[rank] = testing::ValueOrDie(engine.PlanSequences(1, mine, options));
  });
  EXPECT_EQ(answers[0].rank, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(answers[1].rank, answers[0].rank);
}

TEST(EngineTest, PlanSequencesFailsOnEveryRankWhenOneRankPassesBadSequences) {
  std::vector<Status> statuses(2);
  OnTwoRanks(2, [&](int rank, Engine& engine) {
    std::vector<SequenceRouting> mine = {SequenceOn(0, 2)};
    if (rank == 1) mine[0].expert_rows[3] = -2;
    statuses[rank] = engine.PlanSequences(0, mine).status();
  });
  EXPECT_NE(statuses[1].message().find("sequence 0 expert_rows[3] = -2 is negative"),
            std::string::npos)
      << statuses[1].ToString();
  EXPECT_NE(statuses[0].message().find("rank 1 refused its PlanSequences(layer 0)"),
            std::string::npos)
      << statuses[0].ToString();
  OnTwoRanks(2, [&](int rank, Engine& engine) {
    // Layers out of range on rank 0; ranks that disagree on the planned layers.
    statuses[rank] =
        engine.PlanSequences(rank == 0 ? 2 : 0, std::vector{SequenceOn(0, 1)}).status();
  });
  EXPECT_NE(statuses[0].message().find("first_layer 2 is not a layer in [0, 2)"), std::string::npos)
      << statuses[0].ToString();
  EXPECT_FALSE(statuses[1].ok());
  OnTwoRanks(2, [&](int rank, Engine& engine) {
    statuses[rank] = engine.PlanSequences(0, std::vector{SequenceOn(0, rank + 1)}).status();
  });
  for (const Status& status : statuses) {
    EXPECT_NE(status.message().find("ranks disagree on the planned layers (1 and 2 layers)"),
              std::string::npos)
        << status.ToString();
  }
}

// Every slot of every layer of `engine` registered over one shared 8-byte buffer (SmallOptions'
// regions): enough for the calls that need registered slots and never read the bytes.
void RegisterScratch(Engine& engine, int layers, std::vector<std::byte>& buffer) {
  buffer.assign(8, std::byte{0});
  for (int l = 0; l < layers; ++l) {
    for (int i = 0; i < engine.local_slots(); ++i) {
      ASSERT_TRUE(engine.RegisterSlot(l, i, {buffer.data(), buffer.data(), buffer.data()}).ok());
    }
  }
}

// Two ranks whose calls differ, or one whose arguments are bad: every rank gets an error from
// the same all-reduce (no hang, no collective of another size), nothing changes, and the next
// calls that agree go on.
TEST(EngineTest, RanksThatMakeDifferentCallsFailTogetherAndGoOn) {
  const std::vector<int32_t> ids(16, 1);
  std::vector<Status> statuses(2);
  OnTwoRanks(2, [&](int rank, Engine& engine) {
    std::vector<std::byte> buffer;
    RegisterScratch(engine, 2, buffer);
    statuses[rank] = engine.Route(rank, ids).status();  // rank 0 layer 0, rank 1 layer 1
    EXPECT_EQ(statuses[rank].code(), StatusCode::kFailedPrecondition) << statuses[rank].ToString();
    EXPECT_NE(statuses[rank].message().find(
                  "rank 0 makes Route(layer 0, micro-batch 0) at step 0, rank 1 makes "
                  "Route(layer 1, micro-batch 0) at step 0"),
              std::string::npos)
        << statuses[rank].ToString();
    // A peer that restores a state while this one routes.
    statuses[rank] =
        rank == 0 ? engine.RestoreState(engine.SaveState()) : engine.Route(0, ids).status();
    EXPECT_NE(statuses[rank].message().find(
                  "rank 0 makes RestoreState at step 0, rank 1 makes Route(layer 0, "
                  "micro-batch 0) at step 0"),
              std::string::npos)
        << statuses[rank].ToString();
    // Bad expert ids on rank 1: its own error there, the refusal named on rank 0.
    std::vector<int32_t> mine = ids;
    if (rank == 1) mine[5] = kExperts;
    statuses[rank] = engine.Route(0, mine).status();
    EXPECT_EQ(statuses[rank].code(), StatusCode::kInvalidArgument) << statuses[rank].ToString();
    EXPECT_NE(statuses[rank].message().find(rank == 1 ? "topk_ids[5] = 8 is not an expert id"
                                                      : "rank 1 refused its Route(layer 0, "
                                                        "micro-batch 0)"),
              std::string::npos)
        << statuses[rank].ToString();
    // Nothing was routed: the next micro-batch is still the step's first, and it goes through.
    Result<LayerRoute> route = engine.Route(0, ids);
    ASSERT_TRUE(route.ok()) << route.status().ToString();
    EXPECT_EQ(route->send_counts[0] + route->send_counts[1], 16);
    statuses[rank] = engine.StepEnd();
    EXPECT_TRUE(statuses[rank].ok()) << statuses[rank].ToString();
  });
}

// A layer routed several times in a step (micro-batches) until ReduceGradients; a second
// ReduceGradients, or a Route after it, is refused until StepEnd.
TEST(EngineTest, MicroBatchesRouteUntilReduceGradients) {
  OnTwoRanks(1, [&](int rank, Engine& engine) {
    std::vector<std::byte> buffer;
    RegisterScratch(engine, 1, buffer);
    for (int micro_batch = 0; micro_batch < 3; ++micro_batch) {
      const std::vector<int32_t> ids(8 * (micro_batch + 1), static_cast<int32_t>(micro_batch));
      Result<LayerRoute> route = engine.Route(0, ids);
      ASSERT_TRUE(route.ok()) << route.status().ToString();
      EXPECT_EQ(route->send_counts[0] + route->send_counts[1], static_cast<int64_t>(ids.size()));
    }
    ASSERT_TRUE(engine.ReduceGradients().ok());
    const Status twice = engine.ReduceGradients();
    EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition) << twice.ToString();
    EXPECT_NE(twice.message().find("ReduceGradients was already called this step"),
              std::string::npos)
        << twice.ToString();
    const Status late = engine.Route(0, std::vector<int32_t>(8, 0)).status();
    EXPECT_NE(late.message().find("layer 0 is routed after ReduceGradients; call StepEnd first"),
              std::string::npos)
        << late.ToString();
    ASSERT_TRUE(engine.StepEnd().ok());
    EXPECT_TRUE(engine.Route(0, std::vector<int32_t>(8, rank)).ok());
  });
}

// One engine driven from two threads: the second call is refused while the first runs (here it
// waits in its all-reduce for the other rank), and the accessors wait for it.
TEST(EngineTest, AnEngineRefusesASecondThreadsCallWhileOneRuns) {
  std::atomic<bool> rank0_routing{false};
  OnTwoRanks(1, [&](int rank, Engine& engine) {
    std::vector<std::byte> buffer;
    RegisterScratch(engine, 1, buffer);
    const std::vector<int32_t> ids(8, 2);
    if (rank == 1) {
      // Rank 0's Route waits in its all-reduce until this rank joins.
      while (!rank0_routing.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      EXPECT_TRUE(engine.Route(0, ids).ok());
      return;
    }
    std::thread second;
    Status refused;
    second = std::thread([&] {
      rank0_routing.store(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      refused = engine.StepEnd();
    });
    EXPECT_TRUE(engine.Route(0, ids).ok());
    second.join();
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
    EXPECT_NE(refused.message().find("Engine::StepEnd was called while Engine::Route runs on "
                                     "another thread"),
              std::string::npos)
        << refused.ToString();
  });
}

TEST(EngineTest, StepsRefuseSlotsThatAreNotRegistered) {
  std::unique_ptr<LocalGroup> group = MakeGroup(1);
  auto communicator = testing::ValueOrDie(group->Join(0));
  KeelConfig config = OneRankStaticConfig();
  config.policy.name = "velb";  // replicas from the start: StepEnd pushes weights
  config.slots.persistent_per_rank = kExperts + 2;
  auto engine =
      testing::ValueOrDie(Engine::Create(SmallOptions(config, 1, communicator.get(), group.get())));
  std::vector<std::byte> buffer(8);
  ASSERT_TRUE(engine->RegisterSlot(0, 0, {buffer.data(), buffer.data(), buffer.data()}).ok());
  for (const Status& status : {engine->StepEnd(), engine->ReduceGradients()}) {
    EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.ToString();
    EXPECT_NE(status.message().find("only 1 of " + std::to_string(kExperts + 2) +
                                    " slots are registered"),
              std::string::npos)
        << status.ToString();
  }
}

// Runs `body(rank, engine)` on two thread-ranks of a static engine of one layer with
// `sharded` experts and `slots` persistent slots per rank; a failed creation is `body`'s status.
void ShardedOnTwoRanks(int slots, const std::vector<ShardedExpert>& sharded,
                       const std::function<void(int, Result<std::unique_ptr<Engine>>&)>& body,
                       const ShardLayout& layout = {}) {
  std::unique_ptr<LocalGroup> group = MakeGroup(2);
  KeelConfig config = TestConfig("static");
  config.topology.gpus_per_node = 2;
  config.slots.persistent_per_rank = slots;
  config.slots.transient_per_rank = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto communicator = testing::ValueOrDie(group->Join(r));
      EngineOptions options = SmallOptions(config, 1, communicator.get(), group.get());
      options.sharded_experts = sharded;
      options.shard_layout = layout;
      Result<std::unique_ptr<Engine>> engine = Engine::Create(options);
      body(r, engine);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

TEST(EngineTest, ShardedExpertOptionsAreCheckedAndNamed) {
  const struct {
    int slots;
    std::vector<ShardedExpert> sharded;
    std::string message;
  } cases[] = {
      {5, {{0, 9, 2}}, "sharded_experts[0].expert = 9 is not in [0, 8)"},
      {5, {{3, 0, 2}}, "sharded_experts[0].layer = 3 is not in [0, 1)"},
      {5, {{0, 0, 3}}, "sharded_experts[0].shards = 3 is not in [2, topology.gpus_per_node = 2]"},
      {5, {{0, 0, 2}, {0, 0, 2}}, "sharded_experts[1] shards layer 0 expert 0 a second time"},
      {4, {{0, 0, 2}}, "layer 0: expert 0's shard 1 of 2 finds no empty or replica slot"},
  };
  const auto expect_refused = [](const std::string& message) {
    return [message](int, Result<std::unique_ptr<Engine>>& engine) {
      ASSERT_FALSE(engine.ok()) << message;
      EXPECT_NE(engine.status().message().find(message), std::string::npos)
          << engine.status().ToString();
    };
  };
  for (const auto& c : cases) ShardedOnTwoRanks(c.slots, c.sharded, expect_refused(c.message));
  // The layout must cover each 8-byte region, and a shard count must divide its tensors.
  ShardLayout short_layout;
  short_layout.weights = {{2, 2, 1, false}};
  ShardedOnTwoRanks(5, {},
                    expect_refused("shard_layout.weights covers 4 bytes, but the shape's "
                                   "region has 8"),
                    short_layout);
  ShardLayout one_row;
  one_row.optimizer = {{1, 8, 1, false}};
  ShardedOnTwoRanks(5, {{0, 0, 2}},
                    expect_refused("sharded_experts[0].shards = 2 does not divide every tensor"),
                    one_row);
  one_row.optimizer[0].split_columns = true;  // 8 columns divide in 2
  ShardedOnTwoRanks(
      5, {{0, 0, 2}},
      [](int, Result<std::unique_ptr<Engine>>& engine) {
        EXPECT_TRUE(engine.ok()) << engine.status().ToString();
      },
      one_row);
}

TEST(EngineTest, ShardedExpertRoutesEveryEntryToBothShards) {
  ShardedOnTwoRanks(5, {{0, 1, 2}}, [](int rank, Result<std::unique_ptr<Engine>>& created) {
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    Engine& engine = **created;
    // Expert 1's home is rank 0 (slot 1); its shard 1 takes rank 1's free slot (local 4).
    const LayerPlacement placement = engine.placement(0);
    EXPECT_EQ(placement.num_experts, kExperts + 1);
    EXPECT_EQ(placement.phy2log[1], 1);
    EXPECT_EQ(placement.phy2log[9], 2);
    EXPECT_EQ(placement.home[2], 1);
    EXPECT_EQ(placement.unit_expert[2], 1);
    EXPECT_EQ(placement.unit_expert[3], 2);
    std::vector<std::vector<std::byte>> buffers(engine.local_slots(), std::vector<std::byte>(8));
    for (int i = 0; i < engine.local_slots(); ++i) {
      auto* b = buffers[i].data();
      ASSERT_TRUE(engine.RegisterSlot(0, i, {b, b, b}).ok());
    }
    const std::vector<HomeSlot> homes = engine.HomeSlots(0);
    const auto shard_home =
        std::find_if(homes.begin(), homes.end(), [](const HomeSlot& h) { return h.expert == 1; });
    ASSERT_NE(shard_home, homes.end());
    EXPECT_EQ(shard_home->shard, rank);
    EXPECT_EQ(shard_home->shards, 2);
    EXPECT_EQ(shard_home->local_slot, rank == 0 ? 1 : 4);

    const std::vector<int32_t> ids = {1, 0, 5, 1, -1, 1};  // 3 tokens, top-2
    EXPECT_EQ(engine.RouteCounts(0, std::vector<int32_t>(kExperts, 1)).status().code(),
              StatusCode::kFailedPrecondition);
    auto route = engine.Route(0, ids);
    ASSERT_TRUE(route.ok()) << route.status().ToString();
    EXPECT_EQ(route->row_entry, (std::vector<int32_t>{0, 0, 1, 2, 3, 3, 4, 5, 5}));
    EXPECT_EQ(route->slot, (std::vector<int32_t>{1, 9, 0, 6, 1, 9, -1, 1, 9}));
    EXPECT_EQ(route->send_counts, (std::vector<int64_t>{4, 4}));
    // Rank 1's local slot 4 holds shard 1 of expert 1 and gets each rank's 3 rows of it.
    if (rank == 1) {
      EXPECT_EQ(route->local_experts[4], 1);
      EXPECT_EQ(route->local_shard[4], 1);
      EXPECT_EQ(route->local_shards[4], 2);
      EXPECT_EQ(route->recv_counts[0 * engine.local_slots() + 4], 3);
      EXPECT_EQ(route->recv_counts[1 * engine.local_slots() + 4], 3);
    } else {
      EXPECT_EQ(route->local_shard[1], 0);
      EXPECT_EQ(route->local_shards[1], 2);
      EXPECT_EQ(route->local_shards[0], 1);
    }
    const Status planned = engine.PlanSequences(0, std::vector<SequenceRouting>{}).status();
    EXPECT_TRUE(planned.ok()) << planned.ToString();
    SequenceRouting sequence;
    sequence.tokens = 1;
    sequence.expert_rows.assign(kExperts, 0);
    const Status refused = engine.PlanSequences(0, std::vector<SequenceRouting>{sequence}).status();
    EXPECT_NE(refused.message().find("layer 0 has sharded experts"), std::string::npos)
        << refused.ToString();
  });
}

// A state carries the shards: restored into engines made without any, it brings its units back;
// shard counts outside the node are refused by name.
TEST(EngineTest, RestoreStateBringsBackTheShards) {
  EngineState sharded_state;
  ShardedOnTwoRanks(5, {{0, 1, 2}}, [&](int rank, Result<std::unique_ptr<Engine>>& created) {
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    if (rank == 0) sharded_state = (*created)->SaveState();
  });
  ASSERT_EQ(sharded_state.shards.size(), 1u);
  EXPECT_EQ(sharded_state.shards[0][1], 2);
  ShardedOnTwoRanks(5, {}, [&](int, Result<std::unique_ptr<Engine>>& created) {
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    Engine& engine = **created;
    EngineState bad = sharded_state;
    bad.shards[0][3] = 3;
    EXPECT_NE(engine.RestoreState(bad).message().find(
                  "engine state layer 0: shards[3] = 3 is not in [1, topology.gpus_per_node = 2]"),
              std::string::npos);
    ASSERT_TRUE(engine.RestoreState(sharded_state).ok());
    const LayerPlacement placement = engine.placement(0);
    EXPECT_EQ(placement.num_experts, kExperts + 1);
    EXPECT_EQ(placement.unit_shards[2], 2);
    EXPECT_EQ(engine.SaveState().shards, sharded_state.shards);
  });
}

TEST(EngineTest, RouteCountsRejectsBadCountsNamingThem) {
  std::unique_ptr<LocalGroup> group = MakeGroup(1);
  auto communicator = testing::ValueOrDie(group->Join(0));
  EngineOptions options = SmallOptions(OneRankStaticConfig(), 1, communicator.get(), group.get());
  auto engine = testing::ValueOrDie(Engine::Create(options));
  std::vector<std::byte> buffer(8);
  for (int i = 0; i < engine->local_slots(); ++i) {
    ASSERT_TRUE(engine->RegisterSlot(0, i, {buffer.data(), buffer.data(), buffer.data()}).ok());
  }
  std::vector<int32_t> counts(kExperts - 1, 1);
  EXPECT_NE(engine->RouteCounts(0, counts).status().message().find("expert_counts has 7 entries"),
            std::string::npos);
  counts.assign(kExperts, 2);
  counts[3] = -4;
  EXPECT_NE(engine->RouteCounts(0, counts).status().message().find("expert_counts[3] = -4"),
            std::string::npos);
  counts[3] = 4;
  auto route = engine->RouteCounts(0, counts);
  ASSERT_TRUE(route.ok()) << route.status().ToString();
  int64_t sent = 0;
  for (int64_t n : route->send_counts) sent += n;
  EXPECT_EQ(sent, 2 * (kExperts - 1) + 4);
}

TEST(EngineTest, CreateRejectsBadOptionsNamingTheField) {
  std::unique_ptr<LocalGroup> group = MakeGroup(1);
  auto communicator = testing::ValueOrDie(group->Join(0));
  KeelConfig config = TestConfig("keel");
  config.topology.gpus_per_node = 1;
  config.slots.persistent_per_rank = kExperts;
  EngineOptions options;
  options.config = MakeConfig(config);
  options.num_experts = kExperts;
  options.shape.weight_bytes = 8;
  options.shape.gradient_bytes = 8;
  options.communicator = communicator.get();
  options.local_group = group.get();
  {
    EngineOptions bad = options;
    bad.num_layers = 0;
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("num_layers = 0"), std::string::npos);
  }
  {
    EngineOptions bad = options;
    bad.num_experts = 2000000000;
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("num_experts = 2000000000 is more than 65536"),
              std::string::npos)
        << engine.status().ToString();
  }
  {
    EngineOptions bad = options;
    bad.mp_group_size = 2;
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find(
                  "mp_group_size = 2 does not divide topology.gpus_per_node = 1"),
              std::string::npos)
        << engine.status().ToString();
  }
  {
    EngineOptions bad = options;
    bad.shape.gradient_bytes = 6;
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("shape.gradient_bytes = 6"), std::string::npos);
  }
  {
    KeelConfig two_ranks = config;
    two_ranks.topology.gpus_per_node = 2;
    EngineOptions bad = options;
    bad.config = MakeConfig(two_ranks);
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("topology"), std::string::npos);
  }
  {
    EngineOptions bad = options;
    bad.config_path = "/nonexistent/keel.yaml";
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("more than one of config, config_yaml and "
                                              "config_path is set (config_path = "
                                              "\"/nonexistent/keel.yaml\")"),
              std::string::npos);
  }
  {
    EngineOptions bad = options;
    bad.config.reset();
    bad.config_yaml = "policy: {name: roundrobin}\n";
    auto engine = Engine::Create(bad);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("config_yaml:1"), std::string::npos)
        << engine.status().ToString();
    EXPECT_NE(engine.status().ToString().find("roundrobin"), std::string::npos);
  }
  {
    // No config: the defaults, sized to the communicator (one rank here), which the local
    // transport then needs a group or a transport for.
    EngineOptions defaults = options;
    defaults.config.reset();
    defaults.num_experts = 2;  // fits the default slots
    defaults.local_group = nullptr;
    auto engine = Engine::Create(defaults);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().ToString().find("neither options.transport nor options.local_group"),
              std::string::npos)
        << engine.status().ToString();
  }
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  std::vector<int32_t> ids = {0, 1};
  auto route = (*engine)->Route(0, ids);
  ASSERT_FALSE(route.ok());
  EXPECT_NE(route.status().ToString().find("registered"), std::string::npos);
  std::vector<std::byte> w(8), g(8);
  for (int i = 0; i < (*engine)->local_slots(); ++i) {
    ASSERT_TRUE((*engine)->RegisterSlot(0, i, {w.data(), g.data(), w.data()}).ok());
  }
  std::vector<int32_t> bad_ids = {0, kExperts};
  route = (*engine)->Route(0, bad_ids);
  ASSERT_FALSE(route.ok());
  EXPECT_NE(route.status().ToString().find("topk_ids[1] = 8"), std::string::npos);
  route = (*engine)->Route(3, ids);
  ASSERT_FALSE(route.ok());
  EXPECT_NE(route.status().ToString().find("layer = 3"), std::string::npos);
}

}  // namespace
}  // namespace keel::toy
