// The migrator over the local transport, ranks as threads: byte-exact random plans, the
// bandwidth cap, observer counters, and fault injection (a stalled peer, a dead peer, a
// corrupted chunk) that must abort the epoch with the old state intact.
#include "migration/migrator.h"

#include <chrono>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "migration/transport_local.h"
#include "tests/migration/test_util.h"

namespace keel {
namespace {

using testing::CheckStore;
using testing::FillStore;
using testing::LiveChecksum;
using testing::MakeTopology;
using testing::RandomPlacement;
using testing::ValueOrDie;

constexpr ExpertLayout kLayout{.weight_bytes = 10000, .optimizer_bytes = 30011};

MigrationConfig SmallChunks() {
  MigrationConfig config;
  config.chunk_bytes = 4096;
  config.pipeline_depth = 3;
  config.deadline_seconds = 10;
  return config;
}

// Counts what an observer sees; thread-safe as the interface requires.
class CountingObserver : public MigrationObserver {
 public:
  void OnEpochStarted(uint64_t, int, size_t) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++started;
  }
  void OnBytes(std::string_view transport, ByteDirection direction, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    EXPECT_EQ(transport, "local");
    bytes_by_direction[static_cast<int>(direction)] += bytes;
  }
  void OnInFlight(int chunks) override {
    std::lock_guard<std::mutex> lock(mutex_);
    max_in_flight = std::max(max_in_flight, chunks);
    last_in_flight = chunks;
  }
  void OnEpochFinished(const MigrationReport& report) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++finished;
    if (!report.status.ok()) ++failed;
  }
  std::mutex mutex_;
  int started = 0;
  int finished = 0;
  int failed = 0;
  int max_in_flight = 0;
  int last_in_flight = -1;
  size_t bytes_by_direction[3] = {0, 0, 0};
};

// Ranks as threads over one LocalFabric, each with its store and migrator.
class LocalCluster {
 public:
  LocalCluster(int num_ranks, std::span<const Placement> placements, MigrationConfig config,
               MigrationObserver* observer = nullptr)
      : fabric_(num_ranks) {
    for (int r = 0; r < num_ranks; ++r) {
      transports_.push_back(fabric_.Connect(r));
      stores_.push_back(
          std::make_unique<ExpertStore>(ValueOrDie(ExpertStore::Create(r, placements, kLayout))));
      FillStore(*stores_.back(), placements);
      migrators_.push_back(
          ValueOrDie(Migrator::Create(*transports_[r], *stores_[r], config, observer)));
    }
  }

  // Runs one epoch on every rank (in parallel); returns each rank's Wait status.
  std::vector<Status> RunEpoch(uint64_t epoch, std::shared_ptr<const TransferPlan> plan,
                               std::vector<bool> participants = {},
                               const std::function<void()>& during = nullptr) {
    const int n = fabric_.num_ranks();
    std::vector<Status> results(n);
    for (int r = 0; r < n; ++r) {
      if (!participants.empty() && !participants[r]) continue;
      results[r] = migrators_[r]->Start(epoch, plan, participants);
    }
    if (during) during();
    for (int r = 0; r < n; ++r) {
      if (!participants.empty() && !participants[r]) continue;
      if (results[r].ok()) results[r] = migrators_[r]->Wait();
    }
    return results;
  }

  LocalFabric& fabric() { return fabric_; }
  ExpertStore& store(int r) { return *stores_[r]; }
  Migrator& migrator(int r) { return *migrators_[r]; }

 private:
  LocalFabric fabric_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<std::unique_ptr<ExpertStore>> stores_;
  std::vector<std::unique_ptr<Migrator>> migrators_;
};

struct RandomChange {
  std::vector<Placement> from;
  std::vector<Placement> to;
  std::shared_ptr<const TransferPlan> plan;
};

RandomChange MakeChange(std::mt19937_64& rng, const Topology& topology, int layers, int experts,
                        int slots_per_rank) {
  RandomChange change;
  for (int l = 0; l < layers; ++l) {
    change.from.push_back(RandomPlacement(rng, experts, topology.num_ranks(), slots_per_rank));
    change.to.push_back(RandomPlacement(rng, experts, topology.num_ranks(), slots_per_rank));
  }
  change.plan = std::make_shared<TransferPlan>(
      ValueOrDie(PlanTransfers(change.from, change.to, topology, kLayout)));
  return change;
}

TEST(ExpertStoreTest, DiscardKeepsLiveAndCommitSwaps) {
  // Rank 0 holds expert 0 (its home) and expert 1, whose home is rank 1.
  std::vector<Placement> from{ValueOrDie(Placement::Create(2, 2, {0, 1, 1, 0}, {0, 1}))};
  ExpertStore store = ValueOrDie(ExpertStore::Create(0, from, kLayout));
  FillStore(store, from);
  EXPECT_EQ(store.Live(0, 0, SlotRegion::kOptimizer).size(), kLayout.optimizer_bytes);
  EXPECT_TRUE(store.Live(0, 1, SlotRegion::kOptimizer).empty());
  const uint64_t before = LiveChecksum(store);
  std::fill(store.Stage(0, 1, SlotRegion::kWeights).begin(),
            store.Stage(0, 1, SlotRegion::kWeights).end(), std::byte{7});
  EXPECT_TRUE(store.has_staged());
  store.Discard();
  EXPECT_FALSE(store.has_staged());
  EXPECT_EQ(LiveChecksum(store), before);
  auto staged = store.Stage(0, 1, SlotRegion::kWeights);
  std::fill(staged.begin(), staged.end(), std::byte{7});
  ASSERT_TRUE(store.Commit(from).ok());
  EXPECT_EQ(store.Live(0, 1, SlotRegion::kWeights)[5], std::byte{7});
  EXPECT_FALSE(ExpertStore::Create(5, from, kLayout).ok());
}

TEST(MigratorLocalTest, RandomPlansAreByteExact) {
  const Topology topology = MakeTopology(2, 2);
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 20; ++trial) {
    RandomChange change = MakeChange(rng, topology, 2, 6, 3);
    CountingObserver observer;
    LocalCluster cluster(4, change.from, SmallChunks(), &observer);
    for (Status& s : cluster.RunEpoch(trial + 1, change.plan)) ASSERT_TRUE(s.ok()) << s.ToString();
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(cluster.migrator(r).Commit(change.to).ok());
      ASSERT_EQ(CheckStore(cluster.store(r), change.to), "") << "trial " << trial;
    }
    const size_t remote = change.plan->intra_node_bytes + change.plan->inter_node_bytes;
    EXPECT_EQ(observer.bytes_by_direction[0], remote);
    EXPECT_EQ(observer.bytes_by_direction[1], remote);
    EXPECT_EQ(observer.bytes_by_direction[2], change.plan->local_bytes);
    EXPECT_EQ(observer.started, 4);
    EXPECT_EQ(observer.finished, 4);
    EXPECT_EQ(observer.failed, 0);
    EXPECT_EQ(observer.last_in_flight, 0);
    if (remote > 0) {
      EXPECT_GT(observer.max_in_flight, 0);
    }
  }
}

TEST(MigratorLocalTest, ChunkAndDepthExtremesStayExact) {
  const Topology topology = MakeTopology(1, 3);
  std::mt19937_64 rng(7);
  for (auto [chunk, depth] : {std::pair{1 << 20, 1}, std::pair{97, 64}, std::pair{777, 1}}) {
    RandomChange change = MakeChange(rng, topology, 1, 4, 2);
    MigrationConfig config = SmallChunks();
    config.chunk_bytes = chunk;
    config.pipeline_depth = depth;
    LocalCluster cluster(3, change.from, config);
    for (Status& s : cluster.RunEpoch(1, change.plan)) ASSERT_TRUE(s.ok()) << s.ToString();
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(cluster.migrator(r).Commit(change.to).ok());
      ASSERT_EQ(CheckStore(cluster.store(r), change.to), "");
    }
  }
}

TEST(MigratorLocalTest, BandwidthCapSlowsTheEpoch) {
  // Expert 0 (home rank 0) moves to rank 1: 40011 bytes at 0.2 MB/s take at least ~0.15 s
  // beyond the first chunk's burst.
  const Topology topology = MakeTopology(1, 2);
  std::vector<Placement> from{ValueOrDie(Placement::Create(2, 2, {0, -1, 1, -1}))};
  std::vector<Placement> to{ValueOrDie(Placement::Create(2, 2, {-1, -1, 1, 0}, {1, 1}))};
  auto plan =
      std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(from, to, topology, kLayout)));
  MigrationConfig config = SmallChunks();
  config.bandwidth_cap_gb_per_s = 0.0002;
  LocalCluster cluster(2, from, config);
  const auto start = std::chrono::steady_clock::now();
  for (Status& s : cluster.RunEpoch(1, plan)) ASSERT_TRUE(s.ok()) << s.ToString();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, (40011.0 - 4096.0) / 0.2e6 * 0.9);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(cluster.migrator(r).Commit(to).ok());
  EXPECT_EQ(CheckStore(cluster.store(1), to), "");
}

// The plan every fault test runs: rank 1 sends to the others, and receives.
RandomChange FaultChange(const Topology& topology) {
  std::mt19937_64 rng(5);
  for (;;) {
    RandomChange change = MakeChange(rng, topology, 1, 6, 3);
    bool sends = false;
    bool receives = false;
    for (const Transfer& t : change.plan->transfers) {
      sends |= t.src_rank == 1 && t.dst_rank != 1;
      receives |= t.dst_rank == 1 && t.src_rank != 1;
    }
    if (sends && receives) return change;
  }
}

void ExpectAbortedWithOldState(LocalCluster& cluster, const std::vector<uint64_t>& before,
                               int skip_rank = -1) {
  for (int r = 0; r < static_cast<int>(before.size()); ++r) {
    if (r == skip_rank) continue;
    EXPECT_FALSE(cluster.store(r).has_staged()) << "rank " << r;
    EXPECT_EQ(LiveChecksum(cluster.store(r)), before[r]) << "rank " << r;
    EXPECT_FALSE(cluster.migrator(r).Commit({}).ok());
  }
}

TEST(MigratorLocalTest, StalledPeerAbortsWithinTheDeadline) {
  const Topology topology = MakeTopology(2, 2);
  RandomChange change = FaultChange(topology);
  MigrationConfig config = SmallChunks();
  config.deadline_seconds = 0.4;
  LocalCluster cluster(4, change.from, config);
  std::vector<uint64_t> before;
  for (int r = 0; r < 4; ++r) before.push_back(LiveChecksum(cluster.store(r)));
  cluster.fabric().Stall(1);
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> results = cluster.RunEpoch(3, change.plan);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 0.4 + 1.5);  // the deadline plus cancel grace, generous for sanitizers
  bool named_transfer = false;
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    const std::string& m = results[r].message();
    EXPECT_EQ(m.rfind("migration epoch 3 aborted: ", 0), 0u) << m;
    EXPECT_NE(m.find("within the deadline (0.4 s)"), std::string::npos) << m;
    if (r != 1 && m.find("transfer layer 0 expert") != std::string::npos &&
        m.find("peer rank 1 did not") != std::string::npos) {
      named_transfer = true;
    }
  }
  EXPECT_TRUE(named_transfer);
  ExpectAbortedWithOldState(cluster, before);
}

TEST(MigratorLocalTest, DeadPeerAbortsSurvivorsWhoThenKeepWorking) {
  const Topology topology = MakeTopology(2, 2);
  RandomChange change = FaultChange(topology);
  MigrationConfig config = SmallChunks();
  config.deadline_seconds = 5;
  config.bandwidth_cap_gb_per_s = 0.0003;  // slow enough that rank 1 dies mid-transfer
  LocalCluster cluster(4, change.from, config);
  std::vector<uint64_t> before;
  for (int r = 0; r < 4; ++r) before.push_back(LiveChecksum(cluster.store(r)));
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> results = cluster.RunEpoch(4, change.plan, {}, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    cluster.fabric().Kill(1);
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);  // a dead peer is noticed at once, not at the deadline
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    if (r == 1) continue;
    EXPECT_NE(results[r].message().find("rank 1"), std::string::npos) << results[r].message();
  }
  ExpectAbortedWithOldState(cluster, before, /*skip_rank=*/1);

  // The survivors plan a change among themselves (a swap of two slots of ranks 0 and 2/3 that
  // needs nothing from rank 1) and move it byte-exactly.
  std::shared_ptr<const TransferPlan> plan;
  std::vector<Placement> to;
  for (int a = 0; a < 3 && plan == nullptr; ++a) {
    for (int b = 6; b < 12 && plan == nullptr; ++b) {
      std::vector<int> phy2log = change.from[0].phy2log();
      if (phy2log[a] == phy2log[b]) continue;
      std::swap(phy2log[a], phy2log[b]);
      auto swapped = Placement::CreateKeepingHomes(change.from[0], phy2log);
      if (!swapped.ok()) continue;
      std::vector<Placement> candidate{*swapped};
      auto candidate_plan = std::make_shared<TransferPlan>(
          ValueOrDie(PlanTransfers(change.from, candidate, topology, kLayout)));
      bool touches_rank1 = candidate_plan->transfers.empty();
      for (const Transfer& t : candidate_plan->transfers) {
        touches_rank1 |= t.src_rank == 1 || t.dst_rank == 1;
      }
      if (touches_rank1) continue;
      plan = candidate_plan;
      to = candidate;
    }
  }
  ASSERT_NE(plan, nullptr);
  std::vector<bool> survivors{true, false, true, true};
  results = cluster.RunEpoch(5, plan, survivors);
  for (int r : {0, 2, 3}) {
    ASSERT_TRUE(results[r].ok()) << results[r].ToString();
    ASSERT_TRUE(cluster.migrator(r).Commit(to).ok());
    EXPECT_EQ(CheckStore(cluster.store(r), to), "");
  }
}

TEST(MigratorLocalTest, CorruptedChunkFailsVerification) {
  const Topology topology = MakeTopology(2, 2);
  RandomChange change = FaultChange(topology);
  const Transfer* victim = nullptr;
  for (const Transfer& t : change.plan->transfers) {
    if (t.src_rank != t.dst_rank && CarriesWeights(t.payload)) {
      victim = &t;
      break;
    }
  }
  ASSERT_NE(victim, nullptr);
  LocalCluster cluster(4, change.from, SmallChunks());
  std::vector<uint64_t> before;
  for (int r = 0; r < 4; ++r) before.push_back(LiveChecksum(cluster.store(r)));
  cluster.fabric().CorruptChunk(victim->src_rank, victim->dst_rank, 1);
  std::vector<Status> results = cluster.RunEpoch(9, change.plan);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    EXPECT_NE(results[r].message().find("checksum mismatch"), std::string::npos)
        << results[r].message();
  }
  EXPECT_NE(
      results[victim->dst_rank].message().find("rank " + std::to_string(victim->src_rank) +
                                               " -> rank " + std::to_string(victim->dst_rank)),
      std::string::npos)
      << results[victim->dst_rank].message();
  ExpectAbortedWithOldState(cluster, before);
  // The next epoch on the same fabric, without the fault, goes through.
  for (Status& s : cluster.RunEpoch(10, change.plan)) ASSERT_TRUE(s.ok()) << s.ToString();
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(cluster.migrator(r).Commit(change.to).ok());
    EXPECT_EQ(CheckStore(cluster.store(r), change.to), "");
  }
}

TEST(MigratorLocalTest, RejectsMisuseAndBadConfig) {
  const Topology topology = MakeTopology(1, 2);
  std::vector<Placement> from{ValueOrDie(Placement::Create(2, 2, {0, -1, 1, -1}))};
  LocalFabric fabric(2);
  auto transport = fabric.Connect(0);
  ExpertStore store = ValueOrDie(ExpertStore::Create(0, from, kLayout));
  MigrationConfig bad;
  bad.chunk_bytes = 0;
  auto m = Migrator::Create(*transport, store, bad);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("migration.chunk_bytes"), std::string::npos);
  bad = MigrationConfig();
  bad.deadline_seconds = 0;
  EXPECT_FALSE(Migrator::Create(*transport, store, bad).ok());
  ExpertStore other = ValueOrDie(ExpertStore::Create(1, from, kLayout));
  EXPECT_FALSE(Migrator::Create(*transport, other, MigrationConfig()).ok());

  auto migrator = ValueOrDie(Migrator::Create(*transport, store, MigrationConfig()));
  EXPECT_FALSE(migrator->Wait().ok());
  EXPECT_FALSE(migrator->Commit(from).ok());
  ExpertLayout wrong = kLayout;
  wrong.weight_bytes += 1;
  auto plan =
      std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(from, from, topology, wrong)));
  EXPECT_FALSE(migrator->Start(1, plan).ok());
  EXPECT_FALSE(migrator->Start(1, nullptr).ok());
}

TEST(MigratorLocalTest, DestructorCancelsARunningEpoch) {
  std::vector<Placement> from{ValueOrDie(Placement::Create(2, 2, {0, -1, 1, -1}))};
  std::vector<Placement> to{ValueOrDie(Placement::Create(2, 2, {0, 1, 1, 0}, {0, 1}))};
  auto plan = std::make_shared<TransferPlan>(
      ValueOrDie(PlanTransfers(from, to, MakeTopology(1, 2), kLayout)));
  LocalFabric fabric(2);
  auto transport = fabric.Connect(0);
  ExpertStore store = ValueOrDie(ExpertStore::Create(0, from, kLayout));
  MigrationConfig config;
  config.deadline_seconds = 60;
  const auto start = std::chrono::steady_clock::now();
  {
    auto migrator = ValueOrDie(Migrator::Create(*transport, store, config));
    ASSERT_TRUE(migrator->Start(1, plan).ok());
    EXPECT_FALSE(migrator->Start(2, plan).ok());  // one epoch at a time
    // Rank 1 never starts: without the cancel this would wait a minute.
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10);
  EXPECT_FALSE(store.has_staged());
}

}  // namespace
}  // namespace keel
