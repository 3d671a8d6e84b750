// The staged transport (device memory over a host-memory transport) on the CPU: ranks are threads
// over a LocalFabric, and "device" buffers are pages of a FakeDeviceMemory that the CPU cannot
// touch (PROT_NONE) outside the fake's own copies and checksums, so any code that reads or writes
// device memory directly crashes the test. Messages between any mix of device and host buffers
// arrive byte-exact; copy failures and cancels end requests with errors instead of hangs; and
// the migrator moves experts that live in device memory, checksummed on the device and
// committed through it.
#include "migration/transport_staged.h"

#include <deque>
#include <random>

#include <gtest/gtest.h>

#include "migration/migrator.h"
#include "migration/transport_local.h"
#include "tests/migration/test_util.h"

namespace keel {
namespace {

using testing::DeviceSlots;
using testing::FakeDeviceMemory;
using testing::MakeTopology;
using testing::RandomPlacement;
using testing::ValueOrDie;
using Clock = std::chrono::steady_clock;

// Ranks as threads over one fabric, each with protected fake device memory and a staged
// transport over its fabric endpoint.
class Cluster {
 public:
  explicit Cluster(int num_ranks, StagedTransportOptions options = {}, bool protect = true)
      : fabric_(num_ranks) {
    for (int r = 0; r < num_ranks; ++r) {
      memory_.push_back(std::make_shared<FakeDeviceMemory>(protect));
      transports_.push_back(
          ValueOrDie(CreateStagedTransport(fabric_.Connect(r), memory_[r], options)));
    }
  }
  int size() const { return static_cast<int>(transports_.size()); }
  Transport& transport(int r) { return *transports_[r]; }
  FakeDeviceMemory& memory(int r) { return *memory_[r]; }
  void DropTransports() { transports_.clear(); }

 private:
  LocalFabric fabric_;
  std::vector<std::shared_ptr<FakeDeviceMemory>> memory_;
  std::vector<std::unique_ptr<Transport>> transports_;
};

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> bytes(n);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

// Drives every transport of `cluster` until each (rank, request) completed or 20 s passed.
std::vector<Status> WaitAll(Cluster& cluster, const std::vector<std::pair<int, RequestId>>& ids) {
  std::vector<std::optional<Status>> done(ids.size());
  const auto limit = Clock::now() + std::chrono::seconds(20);
  size_t open = ids.size();
  while (open > 0 && Clock::now() < limit) {
    for (int r = 0; r < cluster.size(); ++r) cluster.transport(r).Progress();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (done[i]) continue;
      done[i] = cluster.transport(ids[i].first).Test(ids[i].second);
      if (done[i]) --open;
    }
  }
  std::vector<Status> statuses;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!done[i]) cluster.transport(ids[i].first).Cancel(ids[i].second);
    statuses.push_back(done[i] ? *done[i] : DeadlineExceeded("request still pending"));
  }
  return statuses;
}

// A buffer on one rank, in device or host memory.
struct Buffer {
  bool device = false;
  std::byte* data = nullptr;
  std::vector<std::byte> host;
};

Buffer MakeBuffer(Cluster& cluster, int rank, bool device, std::span<const std::byte> contents) {
  Buffer b;
  b.device = device;
  if (device) {
    b.data = cluster.memory(rank).Allocate(contents.size());
    cluster.memory(rank).Write(b.data, contents);
  } else {
    b.host.assign(contents.begin(), contents.end());
    b.data = b.host.data();
  }
  return b;
}

std::vector<std::byte> Contents(Cluster& cluster, int rank, const Buffer& b, size_t bytes) {
  if (b.device) return cluster.memory(rank).Read(b.data, bytes);
  return b.host;
}

// Random messages between three ranks, every combination of device and host on the two ends,
// random sizes (empty included) and post orders: every byte arrives, device buffers go through
// exactly one staging copy each, and the page-locked buffers are pooled, then all given back.
TEST(StagedTransportTest, AnyMixOfDeviceAndHostBuffersArrivesByteExact) {
  Cluster cluster(3);
  std::mt19937_64 rng(11);
  struct Message {
    int src, dst;
    std::vector<std::byte> payload;
    Buffer source, destination;
  };
  std::vector<Message> messages(60);
  std::vector<uint64_t> device_buffers(3, 0);
  for (size_t i = 0; i < messages.size(); ++i) {
    Message& m = messages[i];
    m.src = static_cast<int>(rng() % 3);
    m.dst = (m.src + 1 + static_cast<int>(rng() % 2)) % 3;
    const size_t sizes[] = {0, 1, 7, 4096, 100003};
    m.payload = RandomBytes(rng, sizes[rng() % 5]);
    m.source = MakeBuffer(cluster, m.src, rng() % 2 == 0, m.payload);
    m.destination =
        MakeBuffer(cluster, m.dst, rng() % 2 == 0, std::vector<std::byte>(m.payload.size()));
    device_buffers[m.src] += m.source.device;
    device_buffers[m.dst] += m.destination.device;
  }
  std::vector<size_t> order(2 * messages.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::pair<int, RequestId>> ids;
  for (size_t k : order) {
    Message& m = messages[k / 2];
    const uint64_t tag = 1000 + k / 2;
    if (k % 2 == 0) {
      ids.emplace_back(m.src, ValueOrDie(cluster.transport(m.src).PostSend(
                                  m.dst, tag, m.source.data, m.payload.size())));
    } else {
      ids.emplace_back(m.dst, ValueOrDie(cluster.transport(m.dst).PostRecv(
                                  m.src, tag, m.destination.data, m.payload.size())));
    }
  }
  for (const Status& s : WaitAll(cluster, ids)) ASSERT_TRUE(s.ok()) << s.ToString();
  for (const Message& m : messages) {
    EXPECT_EQ(Contents(cluster, m.dst, m.destination, m.payload.size()), m.payload);
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(cluster.memory(r).copies_started(), device_buffers[r]) << "rank " << r;
    EXPECT_EQ(cluster.transport(r).device_memory(), &cluster.memory(r));
    EXPECT_EQ(cluster.transport(r).name(), "local");
  }
  cluster.DropTransports();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(cluster.memory(r).host_buffers(), 0) << "rank " << r;
}

// Without staging (a host transport that takes device memory itself), device pointers go to
// the host transport unchanged: no copy, and the device memory is still reported for checksums.
TEST(StagedTransportTest, WithoutStagingDevicePointersPassThrough) {
  Cluster cluster(2, StagedTransportOptions{.stage = false}, /*protect=*/false);
  const std::vector<std::byte> payload = {std::byte{1}, std::byte{2}, std::byte{3}};
  const Buffer source = MakeBuffer(cluster, 0, true, payload);
  const Buffer destination = MakeBuffer(cluster, 1, true, std::vector<std::byte>(3));
  const RequestId send = ValueOrDie(cluster.transport(0).PostSend(1, 5, source.data, 3));
  const RequestId recv = ValueOrDie(cluster.transport(1).PostRecv(0, 5, destination.data, 3));
  for (const Status& s : WaitAll(cluster, {{0, send}, {1, recv}})) ASSERT_TRUE(s.ok());
  EXPECT_EQ(cluster.memory(1).Read(destination.data, 3), payload);
  EXPECT_EQ(cluster.memory(0).copies_started() + cluster.memory(1).copies_started(), 0u);
  EXPECT_EQ(cluster.transport(0).device_memory(), &cluster.memory(0));
}

// A device copy that fails ends its request with an error naming the peer, the tag and the
// copy; the other end's receive can be cancelled, and nothing hangs.
TEST(StagedTransportTest, FailedDeviceCopyFailsTheRequest) {
  Cluster cluster(2);
  const std::vector<std::byte> payload(5000, std::byte{7});
  const Buffer source = MakeBuffer(cluster, 0, true, payload);
  const Buffer destination = MakeBuffer(cluster, 1, true, std::vector<std::byte>(5000));
  cluster.memory(0).FailCopy(cluster.memory(0).copies_started());
  const RequestId send = ValueOrDie(cluster.transport(0).PostSend(1, 42, source.data, 5000));
  const Status sent = WaitAll(cluster, {{0, send}})[0];
  EXPECT_EQ(sent.code(), StatusCode::kInternal);
  for (const char* part : {"rank 1", "tag 42", "device copy", "copy 0 failed"}) {
    EXPECT_NE(sent.message().find(part), std::string::npos) << part << ": " << sent.ToString();
  }
  // The same failure on the receiving side: the bytes land in staging, the copy-in fails.
  cluster.memory(1).FailCopy(cluster.memory(1).copies_started());
  const std::vector<std::byte> host_payload(100, std::byte{9});
  const RequestId from_host =
      ValueOrDie(cluster.transport(0).PostSend(1, 43, host_payload.data(), 100));
  const RequestId into_device =
      ValueOrDie(cluster.transport(1).PostRecv(0, 43, destination.data, 100));
  const std::vector<Status> results = WaitAll(cluster, {{0, from_host}, {1, into_device}});
  EXPECT_TRUE(results[0].ok()) << results[0].ToString();
  EXPECT_EQ(results[1].code(), StatusCode::kInternal);
  EXPECT_NE(results[1].message().find("receive with rank 0 tag 43"), std::string::npos)
      << results[1].ToString();
}

// Cancel works in every phase: a send whose staging copy is in flight, a staged receive waiting
// for its message. Afterwards the requests are unknown and the same tags work again.
TEST(StagedTransportTest, CancelInEveryPhaseLetsGo) {
  Cluster cluster(2);
  const std::vector<std::byte> payload(3000, std::byte{3});
  const Buffer source = MakeBuffer(cluster, 0, true, payload);
  const Buffer destination = MakeBuffer(cluster, 1, true, std::vector<std::byte>(3000));
  const RequestId copying = ValueOrDie(cluster.transport(0).PostSend(1, 1, source.data, 3000));
  const RequestId waiting = ValueOrDie(cluster.transport(1).PostRecv(0, 2, destination.data, 3000));
  cluster.transport(0).Cancel(copying);
  cluster.transport(1).Cancel(waiting);
  EXPECT_EQ(cluster.transport(0).Test(copying)->code(), StatusCode::kInternal);
  EXPECT_EQ(cluster.transport(1).Test(waiting)->code(), StatusCode::kInternal);
  const RequestId send = ValueOrDie(cluster.transport(0).PostSend(1, 2, source.data, 3000));
  const RequestId recv = ValueOrDie(cluster.transport(1).PostRecv(0, 2, destination.data, 3000));
  for (const Status& s : WaitAll(cluster, {{0, send}, {1, recv}})) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ(cluster.memory(1).Read(destination.data, 3000), payload);
  EXPECT_FALSE(CreateStagedTransport(nullptr, std::make_shared<FakeDeviceMemory>()).ok());
  LocalFabric fabric(1);
  EXPECT_EQ(CreateStagedTransport(fabric.Connect(0), nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

// A host-memory message does not overtake a device one posted before it to the same peer while
// that one is still being copied out (an exchange's verdict follows its chunks), and one that is
// cancelled there holds back nothing behind it.
TEST(StagedTransportTest, MessagesToOnePeerLeaveInTheOrderTheyWerePosted) {
  Cluster cluster(2);
  const std::vector<std::byte> payload(3000, std::byte{4});
  const Buffer source = MakeBuffer(cluster, 0, true, payload);
  // Host-memory landing buffers: a receive completes as soon as its message is handed over.
  std::vector<std::byte> chunk(3000);
  uint64_t verdict = 17;
  uint64_t landed = 0;
  const RequestId chunk_recv = ValueOrDie(cluster.transport(1).PostRecv(0, 1, chunk.data(), 3000));
  const RequestId verdict_recv = ValueOrDie(
      cluster.transport(1).PostRecv(0, 2, reinterpret_cast<std::byte*>(&landed), sizeof(landed)));
  const RequestId chunk_send = ValueOrDie(cluster.transport(0).PostSend(1, 1, source.data, 3000));
  const RequestId verdict_send = ValueOrDie(cluster.transport(0).PostSend(
      1, 2, reinterpret_cast<const std::byte*>(&verdict), sizeof(verdict)));
  std::optional<Status> chunk_done;
  std::optional<Status> verdict_done;
  for (int i = 0; i < 1000 && !verdict_done; ++i) {
    if (!chunk_done) chunk_done = cluster.transport(1).Test(chunk_recv);
    verdict_done = cluster.transport(1).Test(verdict_recv);
    if (verdict_done) {
      EXPECT_TRUE(chunk_done) << "the verdict overtook the chunk";
    }
    cluster.transport(0).Progress();
  }
  ASSERT_TRUE(verdict_done && verdict_done->ok());
  EXPECT_EQ(landed, verdict);
  for (const Status& s : WaitAll(cluster, {{0, chunk_send}, {0, verdict_send}})) {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ(chunk, payload);

  const RequestId cancelled = ValueOrDie(cluster.transport(0).PostSend(1, 3, source.data, 3000));
  const RequestId behind = ValueOrDie(cluster.transport(0).PostSend(
      1, 4, reinterpret_cast<const std::byte*>(&verdict), sizeof(verdict)));
  cluster.transport(0).Cancel(cancelled);
  const RequestId taken = ValueOrDie(
      cluster.transport(1).PostRecv(0, 4, reinterpret_cast<std::byte*>(&landed), sizeof(landed)));
  for (const Status& s : WaitAll(cluster, {{0, behind}, {1, taken}})) {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
}

// An exchange whose sources and destinations are device memory, a local device-to-device move
// included: the bytes arrive, and the checksums were computed on the device (the CPU cannot
// read those pages).
TEST(StagedTransportTest, ExchangeChecksumsDeviceRegionsOnTheDevice) {
  Cluster cluster(2);
  std::mt19937_64 rng(5);
  const std::vector<std::byte> a = RandomBytes(rng, 70001);
  const std::vector<std::byte> b = RandomBytes(rng, 4096);
  const Buffer a_src = MakeBuffer(cluster, 0, true, a);
  const Buffer a_dst = MakeBuffer(cluster, 1, true, std::vector<std::byte>(a.size()));
  const Buffer b_src = MakeBuffer(cluster, 1, true, b);
  const Buffer b_dst = MakeBuffer(cluster, 1, false, std::vector<std::byte>(b.size()));
  const std::vector<Status> results =
      testing::RunTwoRankExchange(cluster.transport(0), cluster.transport(1),
                                  {.moved_source = a_src.data,
                                   .moved_destination = a_dst.data,
                                   .moved_bytes = a.size(),
                                   .local_source = b_src.data,
                                   .local_destination = b_dst.data,
                                   .local_bytes = b.size()},
                                  8192);
  for (const Status& s : results) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(cluster.memory(1).Read(a_dst.data, a.size()), a);
  EXPECT_EQ(b_dst.host, b);
  EXPECT_EQ(cluster.memory(0).checksums(), 1);  // a's source
  EXPECT_EQ(cluster.memory(1).checksums(), 2);  // a's destination and b's source
}

// The migrator over staged transports, with every rank's experts in device memory that the
// store wraps (as the engine wraps a trainer's GPU buffers): random plans land byte-exact and
// commit through the device.
TEST(StagedTransportTest, MigratorMovesExpertsThatLiveInDeviceMemory) {
  const Topology topology = MakeTopology(2, 2);
  constexpr ExpertLayout kLayout{.weight_bytes = 10000, .optimizer_bytes = 30011};
  std::mt19937_64 rng(7);
  for (int p = 0; p < 8; ++p) {
    Cluster cluster(4);
    std::vector<Placement> from, to;
    for (int l = 0; l < 2; ++l) {
      from.push_back(RandomPlacement(rng, 6, 4, 3));
      to.push_back(RandomPlacement(rng, 6, 4, 3));
    }
    auto plan =
        std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(from, to, topology, kLayout)));
    MigrationConfig config;
    config.chunk_bytes = 4096;
    config.deadline_seconds = 20;
    std::deque<DeviceSlots> slots;
    std::vector<ExpertStore> stores;
    for (int r = 0; r < 4; ++r) {
      slots.emplace_back(cluster.memory(r), r, 2, 3, kLayout);
      slots[r].Fill(from);
      stores.push_back(slots[r].Wrap(cluster.transport(r).device_memory()));
    }
    std::vector<std::unique_ptr<Migrator>> migrators;
    for (int r = 0; r < 4; ++r) {
      migrators.push_back(ValueOrDie(Migrator::Create(cluster.transport(r), stores[r], config)));
      ASSERT_TRUE(migrators[r]->Start(p + 1, plan).ok());
    }
    for (int r = 0; r < 4; ++r) {
      const Status waited = migrators[r]->Wait();
      ASSERT_TRUE(waited.ok()) << "plan " << p << " rank " << r << ": " << waited.ToString();
    }
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(migrators[r]->Commit(to).ok());
      EXPECT_EQ(slots[r].Check(to), "") << "plan " << p;
    }
  }
}

}  // namespace
}  // namespace keel
