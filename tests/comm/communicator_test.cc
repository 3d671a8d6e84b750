// Tests of the communicators: every collective of the local backend (ranks as threads) on 1, 3
// and 8 ranks for many rounds back to back, argument errors, a rank that never arrives, the
// interface's default AllToAllVKnownSizes, and the NCCL backend where a GPU is present.
// communicator_mpi_main.cc runs the MPI backend.
#include "comm/communicator.h"
#include "tests/comm/collective_data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/device_memory.hpp"
#include "keel/version.hpp"

namespace keel {
namespace {

using namespace collective_data;  // NOLINT(build/namespaces): the seeded inputs

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

// Runs body(communicator) for every rank of a local group of `size`, one thread per rank.
void RunRanks(int size, double timeout_seconds, const std::function<void(Communicator&)>& body) {
  LocalCommunicatorGroup group(size);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.push_back(group.Join(r));
    ASSERT_NE(ranks.back(), nullptr);
    ranks.back()->set_timeout_seconds(timeout_seconds);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { body(*ranks[r]); });
  for (std::thread& thread : threads) thread.join();
}

void CheckAllGather(Communicator& comm, int round) {
  const auto mine =
      std::string(static_cast<size_t>(comm.rank() * 3 + round % 7), 'a' + comm.rank());
  Result<std::vector<std::string>> all = comm.AllGather(mine);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), static_cast<size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_EQ((*all)[r], std::string(static_cast<size_t>(r * 3 + round % 7), 'a' + r));
  }
}

void CheckAllReduceInt(Communicator& comm, int round, ReduceOp op) {
  const size_t n = 1 + round % 13;
  std::vector<int64_t> values = IntValues(round, comm.rank(), n);
  ASSERT_TRUE(comm.AllReduce(std::span<int64_t>(values), op).ok());
  std::vector<int64_t> expected = IntValues(round, 0, n);
  for (int r = 1; r < comm.size(); ++r) {
    const std::vector<int64_t> theirs = IntValues(round, r, n);
    for (size_t i = 0; i < n; ++i) {
      if (op == ReduceOp::kSum) expected[i] += theirs[i];
      if (op == ReduceOp::kMin) expected[i] = std::min(expected[i], theirs[i]);
      if (op == ReduceOp::kMax) expected[i] = std::max(expected[i], theirs[i]);
    }
  }
  EXPECT_EQ(values, expected) << ReduceOpName(op) << " round " << round;
}

void CheckAllReduceDouble(Communicator& comm, int round, ReduceOp op) {
  const size_t n = 64;
  std::vector<double> values = DoubleValues(round, comm.rank(), n);
  ASSERT_TRUE(comm.AllReduce(std::span<double>(values), op).ok());
  std::vector<double> expected = DoubleValues(round, 0, n);
  for (int r = 1; r < comm.size(); ++r) {
    const std::vector<double> theirs = DoubleValues(round, r, n);
    for (size_t i = 0; i < n; ++i) {
      if (op == ReduceOp::kSum) expected[i] += theirs[i];
      if (op == ReduceOp::kMin) expected[i] = std::min(expected[i], theirs[i]);
      if (op == ReduceOp::kMax) expected[i] = std::max(expected[i], theirs[i]);
    }
  }
  // Bitwise, not approximately.
  ASSERT_EQ(std::memcmp(values.data(), expected.data(), n * sizeof(double)), 0)
      << ReduceOpName(op) << " round " << round;
}

void CheckBroadcast(Communicator& comm, int round) {
  for (int root = 0; root < comm.size(); ++root) {
    std::string bytes = comm.rank() == root ? BroadcastPayload(round, root) : "stale";
    ASSERT_TRUE(comm.Broadcast(bytes, root).ok());
    EXPECT_EQ(bytes, BroadcastPayload(round, root)) << "root " << root << " round " << round;
  }
}

void CheckAllToAllV(Communicator& comm, int round) {
  std::vector<std::byte> send;
  std::vector<size_t> send_bytes;
  for (int to = 0; to < comm.size(); ++to) {
    const std::vector<std::byte> slice = Slice(round, comm.rank(), to, 5000);
    send.insert(send.end(), slice.begin(), slice.end());
    send_bytes.push_back(slice.size());
  }
  // Stale contents and sizes: the call must resize both.
  std::vector<std::byte> recv(7, std::byte{0xee});
  std::vector<size_t> recv_bytes(1, 99);
  ASSERT_TRUE(comm.AllToAllV(send, send_bytes, recv, recv_bytes).ok());
  std::vector<std::byte> expected;
  ASSERT_EQ(recv_bytes.size(), static_cast<size_t>(comm.size()));
  for (int from = 0; from < comm.size(); ++from) {
    const std::vector<std::byte> slice = Slice(round, from, comm.rank(), 5000);
    EXPECT_EQ(recv_bytes[from], slice.size()) << "from " << from << " round " << round;
    expected.insert(expected.end(), slice.begin(), slice.end());
  }
  ASSERT_EQ(recv.size(), expected.size());
  EXPECT_TRUE(recv == expected) << "round " << round;
}

// The seeded slices again, with every size derived on both sides: no sizes travel, and recv is
// exactly the bytes that arrive.
void CheckAllToAllVKnownSizes(Communicator& comm, int round) {
  std::vector<std::byte> send;
  std::vector<size_t> send_bytes;
  for (int to = 0; to < comm.size(); ++to) {
    const std::vector<std::byte> slice = Slice(round, comm.rank(), to, 5000);
    send.insert(send.end(), slice.begin(), slice.end());
    send_bytes.push_back(slice.size());
  }
  std::vector<std::byte> expected;
  std::vector<size_t> recv_bytes;
  for (int from = 0; from < comm.size(); ++from) {
    const std::vector<std::byte> slice = Slice(round, from, comm.rank(), 5000);
    expected.insert(expected.end(), slice.begin(), slice.end());
    recv_bytes.push_back(slice.size());
  }
  std::vector<std::byte> recv(expected.size(), std::byte{0xee});
  const Status status = comm.AllToAllVKnownSizes(send, send_bytes, recv, recv_bytes);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_TRUE(recv == expected) << "round " << round;
}

// Every collective, `rounds` times back to back, so a rendezvous that mixes up consecutive
// collectives shows.
void CheckAllCollectives(Communicator& comm, int rounds) {
  for (int round = 0; round < rounds; ++round) {
    CheckAllGather(comm, round);
    ASSERT_TRUE(comm.Barrier().ok());
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax}) {
      CheckAllReduceInt(comm, round, op);
      CheckAllReduceDouble(comm, round, op);
    }
    CheckBroadcast(comm, round);
    CheckAllToAllV(comm, round);
    CheckAllToAllVKnownSizes(comm, round + 1000);
    CheckAllToAllV(comm, round + 2000);
  }
}

// A communicator that passes every collective to another one but leaves AllToAllVKnownSizes and
// AllToAllVDevice to the interface's defaults, as one written outside Keel before they existed.
class ForwardingCommunicator final : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view name() const override { return "forwarding"; }
  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    return inner_.AllGather(mine);
  }
  Status Barrier() override { return inner_.Barrier(); }
  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return inner_.AllReduce(values, op);
  }
  Status AllReduce(std::span<double> values, ReduceOp op) override {
    return inner_.AllReduce(values, op);
  }
  Status Broadcast(std::string& bytes, int root) override { return inner_.Broadcast(bytes, root); }
  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    return inner_.AllToAllV(send, send_bytes, recv, recv_bytes);
  }

 private:
  Communicator& inner_;
};

// Rank 1 expects one byte more from rank 0 than rank 0 sends it (with more than one rank).
struct MismatchedSizes {
  std::vector<std::byte> send;
  std::vector<size_t> send_bytes;
  std::vector<std::byte> recv;
  std::vector<size_t> recv_bytes;
};
MismatchedSizes OneByteTooManyFromRank0(const Communicator& comm) {
  MismatchedSizes sizes;
  sizes.send_bytes.assign(comm.size(), 8);
  sizes.send.resize(8 * comm.size());
  sizes.recv_bytes.assign(comm.size(), 8);
  if (comm.rank() == 1) sizes.recv_bytes[0] = 9;
  sizes.recv.resize(8 * comm.size() + (comm.rank() == 1 ? 1 : 0));
  return sizes;
}

TEST(ReduceOpTest, Names) {
  EXPECT_EQ(ReduceOpName(ReduceOp::kSum), "sum");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMin), "min");
  EXPECT_EQ(ReduceOpName(ReduceOp::kMax), "max");
}

// The double sums above would not catch an unordered reduction unless order changes the bits.
TEST(LocalCommunicatorTest, DoubleTestValuesDependOnSummationOrder) {
  int differing = 0;
  for (size_t i = 0; i < 64; ++i) {
    double forward = 0;
    double backward = 0;
    for (int r = 0; r < 8; ++r) forward += DoubleValues(0, r, 64)[i];
    for (int r = 7; r >= 0; --r) backward += DoubleValues(0, r, 64)[i];
    differing += forward != backward;
  }
  EXPECT_GT(differing, 0);
}

TEST(LocalCommunicatorTest, JoinNamesTheBackendAndRejectsBadRanks) {
  LocalCommunicatorGroup group(2);
  EXPECT_EQ(group.Join(2), nullptr);
  EXPECT_EQ(group.Join(-1), nullptr);
  std::unique_ptr<Communicator> rank1 = group.Join(1);
  EXPECT_EQ(rank1->name(), "local");
  EXPECT_EQ(rank1->rank(), 1);
  EXPECT_EQ(rank1->size(), 2);
  EXPECT_EQ(rank1->timeout_seconds(), 120.0);
}

class LocalCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalCollectivesTest, EveryCollectiveManyRounds) {
  RunRanks(GetParam(), 60, [](Communicator& comm) { CheckAllCollectives(comm, 20); });
}

TEST_P(LocalCollectivesTest, ArgumentErrorsNameTheArgumentAndLeaveTheGroupUsable) {
  RunRanks(GetParam(), 60, [](Communicator& comm) {
    const int size = comm.size();
    std::vector<std::byte> send(10);
    std::vector<std::byte> recv;
    std::vector<size_t> recv_bytes;
    std::vector<size_t> too_few(size + 1, 0);
    Status status = comm.AllToAllV(send, too_few, recv, recv_bytes);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(status.message(), "send_bytes.size() " + std::to_string(size + 1)));

    std::vector<size_t> wrong_sum(size, 0);
    wrong_sum[0] = 11;
    status = comm.AllToAllV(send, wrong_sum, recv, recv_bytes);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(status.message(), "send_bytes add up to 11 but send.size() is 10"));

    std::string bytes = "x";
    status = comm.Broadcast(bytes, size);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(status.message(), "root " + std::to_string(size)));
    status = comm.Broadcast(bytes, -1);
    EXPECT_TRUE(Contains(status.message(), "root -1"));

    if (size > 1) {
      // Differing lengths and ops are only visible across ranks; every rank reports them.
      std::vector<int64_t> values(comm.rank() == 1 ? 3 : 4, 1);
      status = comm.AllReduce(std::span<int64_t>(values), ReduceOp::kSum);
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(status.message(), "values.size() is 3 on rank 1 but 4 on rank 0"));

      std::vector<double> doubles(2, 1.0);
      status = comm.AllReduce(std::span<double>(doubles),
                              comm.rank() == 1 ? ReduceOp::kMax : ReduceOp::kSum);
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(status.message(), "op is max on rank 1 but sum on rank 0"));

      status = comm.Broadcast(bytes, comm.rank() == 1 ? 1 : 0);
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(status.message(), "root is 1 on rank 1 but 0 on rank 0"));
    }
    // None of these broke the group.
    EXPECT_TRUE(comm.Barrier().ok());
    CheckAllCollectives(comm, 1);
  });
}

TEST_P(LocalCollectivesTest, KnownSizesArgumentErrorsNameTheArgument) {
  RunRanks(GetParam(), 60, [](Communicator& comm) {
    const int size = comm.size();
    std::vector<std::byte> send(10);
    std::vector<size_t> send_bytes(size, 0);
    send_bytes[0] = 10;
    std::vector<std::byte> recv(4);
    std::vector<size_t> too_many(size + 1, 0);
    Status status = comm.AllToAllVKnownSizes(send, send_bytes, recv, too_many);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(status.message(), "local AllToAllVKnownSizes: recv_bytes.size() " +
                                               std::to_string(size + 1) + " != communicator size"));
    std::vector<size_t> wrong_sum(size, 0);
    wrong_sum[0] = 5;
    status = comm.AllToAllVKnownSizes(send, send_bytes, recv, wrong_sum);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(status.message(), "recv_bytes add up to 5 but recv.size() is 4"));
    status = comm.AllToAllVKnownSizes(send, std::vector<size_t>(size, 0), recv, wrong_sum);
    EXPECT_TRUE(Contains(status.message(), "send_bytes add up to 0 but send.size() is 10"));
    EXPECT_TRUE(comm.Barrier().ok());
    CheckAllCollectives(comm, 1);
  });
}

// The local backend sees every rank's sizes, so every rank reports the same mismatch, and the
// group goes on.
TEST_P(LocalCollectivesTest, KnownSizesThatDifferAreNamedOnEveryRank) {
  if (GetParam() == 1) GTEST_SKIP() << "needs two ranks";
  RunRanks(GetParam(), 60, [](Communicator& comm) {
    MismatchedSizes sizes = OneByteTooManyFromRank0(comm);
    const Status status =
        comm.AllToAllVKnownSizes(sizes.send, sizes.send_bytes, sizes.recv, sizes.recv_bytes);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_TRUE(Contains(status.message(),
                         "local AllToAllVKnownSizes: rank 0 sends 8 bytes to "
                         "rank 1, which expects 9 (its recv_bytes[0])"));
    EXPECT_TRUE(comm.Barrier().ok());
    CheckAllCollectives(comm, 1);
  });
}

// The interface's default over a backend that only has AllToAllV: the same bytes, and a
// mismatch named on the rank that receives it.
TEST_P(LocalCollectivesTest, KnownSizesDefaultRunsAllToAllVAndComparesTheSizes) {
  RunRanks(GetParam(), 60, [](Communicator& local) {
    ForwardingCommunicator comm(local);
    for (int round = 0; round < 5; ++round) CheckAllToAllVKnownSizes(comm, round);
    if (comm.size() == 1) return;
    MismatchedSizes sizes = OneByteTooManyFromRank0(comm);
    const Status status =
        comm.AllToAllVKnownSizes(sizes.send, sizes.send_bytes, sizes.recv, sizes.recv_bytes);
    if (comm.rank() == 1) {
      EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
      EXPECT_TRUE(Contains(status.message(),
                           "forwarding AllToAllVKnownSizes: rank 0 sends 8 "
                           "bytes to rank 1, which expects 9"));
    } else {
      EXPECT_TRUE(status.ok()) << status.ToString();
    }
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalCollectivesTest, ::testing::Values(1, 3, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

TEST(LocalCommunicatorTest, MissingRankTimesOutNamingItAndBreaksTheGroup) {
  using Clock = std::chrono::steady_clock;
  RunRanks(3, 0.3, [](Communicator& comm) {
    std::vector<std::byte> recv;
    std::vector<size_t> recv_bytes;
    const std::vector<size_t> send_bytes(3, 0);
    if (comm.rank() != 2) {
      const auto start = Clock::now();
      const Status status = comm.AllToAllV({}, send_bytes, recv, recv_bytes);
      const std::chrono::duration<double> waited = Clock::now() - start;
      EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
      EXPECT_TRUE(Contains(status.message(), "AllToAllV timed out after 0.3 s on rank "));
      EXPECT_TRUE(Contains(status.message(), ": rank 2 never arrived"));
      EXPECT_GE(waited.count(), 0.25);
      EXPECT_LT(waited.count(), 5.0);  // about the timeout; generous for a loaded machine
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
    }
    // Every later call, on every rank, fails at once.
    const auto start = Clock::now();
    const Status later = comm.Barrier();
    EXPECT_EQ(later.code(), StatusCode::kAborted) << later.ToString();
    EXPECT_TRUE(Contains(later.message(), "local communicator is broken"));
    EXPECT_TRUE(Contains(later.message(), "never arrived"));
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 0.2);
  });
}

TEST(LocalCommunicatorTest, CollectivesCalledOutOfOrderBreakTheGroup) {
  RunRanks(2, 10, [](Communicator& comm) {
    const Status status = comm.rank() == 0 ? comm.Barrier() : comm.AllGather("x").status();
    EXPECT_EQ(status.code(), StatusCode::kInternal);
    EXPECT_TRUE(Contains(status.message(), "rank 1 called AllGather while rank 0 called Barrier"));
    EXPECT_EQ(comm.Barrier().code(), StatusCode::kAborted);
  });
}

// Host memory only: the engine stages device slot buffers for it.
TEST(LocalCommunicatorTest, MovesNoDeviceMemory) {
  LocalCommunicatorGroup group(1);
  std::unique_ptr<Communicator> comm = group.Join(0);
  EXPECT_FALSE(comm->MovesDeviceMemory());
  std::byte buffer{};
  const size_t bytes[] = {0};
  const Status status = comm->AllToAllVDevice(&buffer, bytes, &buffer, bytes);
  EXPECT_EQ(status.code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(status.message(), "the local communicator does not move device memory"));
}

TEST(LocalCommunicatorTest, CommunicatorsOutliveTheirGroup) {
  std::vector<std::unique_ptr<Communicator>> ranks;
  {
    LocalCommunicatorGroup group(2);
    ranks.push_back(group.Join(0));
    ranks.push_back(group.Join(1));
  }
  std::thread other([&] { EXPECT_TRUE(ranks[1]->Barrier().ok()); });
  EXPECT_TRUE(ranks[0]->Barrier().ok());
  other.join();
}

// Compiled in every build with NCCL, so the backend always builds and links; it runs its
// collectives only where a GPU is present (one rank: NCCL allows one rank per device).
TEST(NcclCommunicatorTest, CreatesOnAGpuAndFailsCleanlyWithout) {
  if constexpr (!kWithNccl) {
    GTEST_SKIP() << "built without NCCL";
  } else {
    LocalCommunicatorGroup group(1);
    std::unique_ptr<Communicator> bootstrap = group.Join(0);
    bootstrap->set_timeout_seconds(60);
    Result<std::unique_ptr<Communicator>> nccl = CreateNcclCommunicator(*bootstrap, 0);
    if (!nccl.ok()) {
      EXPECT_NE(nccl.status().code(), StatusCode::kOk);
      GTEST_SKIP() << "no usable GPU: " << nccl.status().ToString();
    }
    Communicator& comm = **nccl;
    EXPECT_EQ(comm.name(), "nccl");
    EXPECT_EQ(comm.size(), 1);
    CheckAllCollectives(comm, 3);
    std::string bytes;
    EXPECT_EQ(comm.Broadcast(bytes, 1).code(), StatusCode::kInvalidArgument);

    // Device to device, between buffers of the same GPU.
    EXPECT_TRUE(comm.MovesDeviceMemory());
    Result<std::shared_ptr<DeviceMemory>> memory = CreateCudaDeviceMemory(0);
    ASSERT_TRUE(memory.ok()) << memory.status().ToString();
    std::vector<std::byte> sent(3000);
    for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<std::byte>(i * 7 + 1);
    Result<std::byte*> send = (*memory)->AllocateDevice(sent.size());
    Result<std::byte*> recv = (*memory)->AllocateDevice(sent.size());
    ASSERT_TRUE(send.ok() && recv.ok());
    ASSERT_TRUE((*memory)->Copy(*send, sent.data(), sent.size()).ok());
    const size_t sizes[] = {sent.size()};
    const Status status = comm.AllToAllVDevice(*send, sizes, *recv, sizes);
    EXPECT_TRUE(status.ok()) << status.ToString();
    std::vector<std::byte> received(sent.size());
    ASSERT_TRUE((*memory)->Copy(received.data(), *recv, received.size()).ok());
    EXPECT_TRUE(received == sent);
    (*memory)->FreeDevice(*send);
    (*memory)->FreeDevice(*recv);
  }
}

}  // namespace
}  // namespace keel
