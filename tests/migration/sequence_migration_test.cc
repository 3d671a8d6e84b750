// Sequence migration over the local transport: buffers of many sizes arrive byte-exact; a
// corrupted chunk or a stalled rank fails the batch with the sequence named.
#include "migration/sequence_migration.h"

#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "migration/transport_local.h"

namespace keel {
namespace {

struct Batch {
  std::vector<SequenceMove> moves;
  std::vector<std::vector<std::byte>> sources;
  std::vector<std::vector<std::byte>> destinations;
};

// `count` sequences between random distinct ranks; each rank sees the full list but only its own
// pointers, like in a real job.
std::vector<Batch> MakeBatches(int num_ranks, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Batch> per_rank(num_ranks);
  for (int i = 0; i < count; ++i) {
    SequenceMove move;
    move.sequence_id = 1000 + i;
    move.src_rank = static_cast<int>(rng() % num_ranks);
    move.dst_rank = static_cast<int>(rng() % num_ranks);
    move.bytes = rng() % 50000;
    std::vector<std::byte> data(move.bytes);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    for (int r = 0; r < num_ranks; ++r) {
      Batch& batch = per_rank[r];
      SequenceMove mine = move;
      batch.sources.emplace_back(r == move.src_rank ? data : std::vector<std::byte>{});
      batch.destinations.emplace_back(r == move.dst_rank ? move.bytes : 0);
      batch.moves.push_back(mine);
    }
  }
  for (int r = 0; r < num_ranks; ++r) {
    Batch& batch = per_rank[r];
    for (size_t i = 0; i < batch.moves.size(); ++i) {
      if (batch.moves[i].src_rank == r) batch.moves[i].source = batch.sources[i].data();
      if (batch.moves[i].dst_rank == r) batch.moves[i].destination = batch.destinations[i].data();
    }
  }
  return per_rank;
}

std::vector<Status> RunAll(LocalFabric& fabric, std::vector<Batch>& batches, uint64_t id,
                           const MigrationConfig& config) {
  const int n = fabric.num_ranks();
  std::vector<std::unique_ptr<Transport>> transports;
  for (int r = 0; r < n; ++r) transports.push_back(fabric.Connect(r));
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back(
        [&, r] { results[r] = MigrateSequences(*transports[r], id, batches[r].moves, config); });
  }
  for (auto& t : threads) t.join();
  return results;
}

MigrationConfig Config() {
  MigrationConfig config;
  config.chunk_bytes = 8192;
  config.pipeline_depth = 2;
  config.deadline_seconds = 10;
  return config;
}

TEST(SequenceMigrationTest, MovesBuffersByteExact) {
  LocalFabric fabric(3);
  std::vector<Batch> batches = MakeBatches(3, 40, 11);
  for (Status& s : RunAll(fabric, batches, 1, Config())) ASSERT_TRUE(s.ok()) << s.ToString();
  for (size_t i = 0; i < batches[0].moves.size(); ++i) {
    const SequenceMove& move = batches[0].moves[i];
    EXPECT_EQ(batches[move.dst_rank].destinations[i], batches[move.src_rank].sources[i])
        << "sequence " << move.sequence_id;
  }
}

TEST(SequenceMigrationTest, CorruptionNamesTheSequence) {
  LocalFabric fabric(2);
  std::vector<Batch> batches(2);
  // One sequence of 20000 bytes from rank 0 to rank 1, second chunk corrupted.
  std::vector<std::byte> source(20000, std::byte{3});
  std::vector<std::byte> destination(20000);
  SequenceMove move{.sequence_id = 77, .src_rank = 0, .dst_rank = 1, .bytes = 20000};
  batches[0].moves = {move};
  batches[0].moves[0].source = source.data();
  batches[1].moves = {move};
  batches[1].moves[0].destination = destination.data();
  fabric.CorruptChunk(0, 1, 1);
  std::vector<Status> results = RunAll(fabric, batches, 2, Config());
  ASSERT_FALSE(results[1].ok());
  EXPECT_NE(results[1].message().find("sequence migration 2 aborted: sequence 77 rank 0 -> rank 1"),
            std::string::npos)
      << results[1].message();
  EXPECT_NE(results[1].message().find("checksum mismatch"), std::string::npos);
  ASSERT_FALSE(results[0].ok());
}

TEST(SequenceMigrationTest, StalledRankHitsTheDeadline) {
  LocalFabric fabric(2);
  std::vector<std::byte> source(100, std::byte{1});
  std::vector<std::byte> destination(100);
  SequenceMove move{.sequence_id = 5, .src_rank = 1, .dst_rank = 0, .bytes = 100};
  std::vector<Batch> batches(2);
  batches[0].moves = {move};
  batches[0].moves[0].destination = destination.data();
  batches[1].moves = {move};
  batches[1].moves[0].source = source.data();
  fabric.Stall(1);
  MigrationConfig config = Config();
  config.deadline_seconds = 0.2;
  std::vector<Status> results = RunAll(fabric, batches, 3, config);
  ASSERT_FALSE(results[0].ok());
  EXPECT_NE(results[0].message().find("sequence 5 rank 1 -> rank 0: peer rank 1 did not answer "
                                      "within the deadline (0.2 s)"),
            std::string::npos)
      << results[0].message();
}

}  // namespace
}  // namespace keel
