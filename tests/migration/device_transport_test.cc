// The device transport's protocol (the nccl transport without NCCL) on the CPU: ranks are threads,
// control and host messages go over one LocalFabric, "device" bytes over a LocalDeviceMover that
// behaves like NCCL on one stream (no tags, one group at a time). Random post orders must arrive
// byte-exact, a cycle of three must not deadlock, host messages pass through untouched, size
// mismatches, cancels, a dead peer and a stalled peer must fail requests with errors naming the
// peer and tag instead of hanging, and sequence migration over it must verify.
#include "migration/device_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "migration/sequence_migration.h"
#include "migration/transport_factory.h"
#include "migration/transport_local.h"
#include "tests/common/test_util.h"
#include "tests/migration/fake_device_memory.h"
#include "tests/migration/local_device_mover.h"

namespace keel {
namespace {

using testing::FakeDeviceMemory;
using testing::LocalDeviceMover;
using testing::ValueOrDie;
using Clock = std::chrono::steady_clock;

// Ranks as threads: one control fabric, one data fabric for the movers, fake device memory and
// a device transport per rank.
class Cluster {
 public:
  explicit Cluster(int num_ranks, DeviceTransportOptions options = {})
      : Cluster(num_ranks, options, {}) {}

  // With `hosts` (one per rank) as host transports instead of the control fabric's.
  Cluster(int num_ranks, DeviceTransportOptions options,
          std::vector<std::unique_ptr<Transport>> hosts)
      : control_(num_ranks), data_(num_ranks) {
    for (int r = 0; r < num_ranks; ++r) {
      auto mover = std::make_unique<LocalDeviceMover>(data_, r);
      movers_.push_back(mover.get());
      memory_.push_back(std::make_shared<FakeDeviceMemory>());
      std::unique_ptr<Transport> host = hosts.empty() ? control_.Connect(r) : std::move(hosts[r]);
      transports_.push_back(ValueOrDie(
          CreateDeviceTransport(std::move(host), std::move(mover), memory_[r], options)));
    }
  }

  int size() const { return static_cast<int>(transports_.size()); }
  Transport& transport(int r) { return *transports_[r]; }
  FakeDeviceMemory& memory(int r) { return *memory_[r]; }
  LocalDeviceMover& mover(int r) { return *movers_[r]; }
  LocalFabric& control() { return control_; }
  LocalFabric& data() { return data_; }
  size_t device_bytes_sent() const {
    size_t total = 0;
    for (const LocalDeviceMover* m : movers_) total += m->bytes_sent;
    return total;
  }

 private:
  LocalFabric control_;
  LocalFabric data_;
  std::vector<std::shared_ptr<FakeDeviceMemory>> memory_;
  std::vector<LocalDeviceMover*> movers_;  // owned by the transports
  std::vector<std::unique_ptr<Transport>> transports_;
};

// Drives `transport` until every request in `ids` completed or `seconds` passed; the statuses,
// with DeadlineExceeded for requests still pending (those are cancelled).
std::vector<Status> WaitAll(Transport& transport, const std::vector<RequestId>& ids,
                            double seconds = 20) {
  std::vector<std::optional<Status>> done(ids.size());
  const auto limit = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(seconds));
  size_t open = ids.size();
  while (open > 0 && Clock::now() < limit) {
    transport.Progress();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (done[i]) continue;
      done[i] = transport.Test(ids[i]);
      if (done[i]) --open;
    }
    if (open > 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  std::vector<Status> statuses;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!done[i]) {
      transport.Cancel(ids[i]);
      statuses.push_back(DeadlineExceeded("request still pending"));
    } else {
      statuses.push_back(*done[i]);
    }
  }
  return statuses;
}

// Keeps calling Progress on `transports` from a thread of its own until destroyed, for tests
// that run without the transports' progress threads but need a rank to answer.
class Driver {
 public:
  explicit Driver(std::vector<Transport*> transports)
      : thread_([this, transports] {
          while (!stop_) {
            for (Transport* t : transports) t->Progress();
            std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
        }) {}
  ~Driver() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

bool Mentions(const Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

// One message of a random workload. Device messages may share a tag between a pair of ranks:
// the k-th send posted under it meets the k-th receive posted under it.
struct Message {
  int src = 0;
  int dst = 0;
  uint64_t tag = 0;
  bool device = false;
  std::vector<std::byte> payload;
  std::byte* source = nullptr;
  std::byte* destination = nullptr;
};

// An operation one rank posts: the send or the receive of a message.
struct Op {
  size_t message = 0;
  bool send = false;
};

struct Workload {
  std::vector<Message> messages;
  std::vector<std::vector<Op>> posts;  // [rank] in post order
};

// `count` messages between random distinct ranks (sizes 0 to 20000, about a third on the host),
// each rank's posts in a random order. Messages of one (src, dst, tag) are numbered in the order
// their sends and receives are posted, which is the order they meet in.
Workload MakeWorkload(Cluster& cluster, std::mt19937_64& rng, int count) {
  const int n = cluster.size();
  Workload w;
  struct Slot {
    int src, dst;
    uint64_t tag;
    bool device;
  };
  std::vector<Slot> slots;
  for (int i = 0; i < count; ++i) {
    Slot s;
    s.src = static_cast<int>(rng() % n);
    do s.dst = static_cast<int>(rng() % n);
    while (s.dst == s.src);
    s.device = rng() % 3 != 0;
    // Device tags repeat (few values); host tags are unique, since the local fabric matches
    // equal host tags in no particular order.
    s.tag = s.device ? 100 + rng() % 4 : 1000 + static_cast<uint64_t>(i);
    slots.push_back(s);
  }
  std::vector<std::vector<std::pair<size_t, bool>>> order(n);  // [rank] (slot, send)
  for (size_t i = 0; i < slots.size(); ++i) {
    order[slots[i].src].push_back({i, true});
    order[slots[i].dst].push_back({i, false});
  }
  for (auto& o : order) std::shuffle(o.begin(), o.end(), rng);
  // The k-th send of a (src, dst, tag, kind) and the k-th receive of it form message k.
  std::map<std::tuple<int, int, uint64_t, bool>, std::vector<size_t>> groups;
  for (size_t i = 0; i < slots.size(); ++i) {
    groups[{slots[i].src, slots[i].dst, slots[i].tag, slots[i].device}].push_back(i);
  }
  std::map<size_t, size_t> slot_message;  // any slot of a group -> message of its k-th post
  for (auto& [key, members] : groups) {
    for (size_t k = 0; k < members.size(); ++k) {
      Message m;
      m.src = std::get<0>(key);
      m.dst = std::get<1>(key);
      m.tag = std::get<2>(key);
      m.device = std::get<3>(key);
      m.payload = RandomBytes(rng, rng() % 4 == 0 ? rng() % 64 : rng() % 20000);
      if (m.device) {
        m.source = cluster.memory(m.src).Allocate(m.payload.size());
        m.destination = cluster.memory(m.dst).Allocate(m.payload.size());
      } else {
        m.source = new std::byte[m.payload.size() + 1];
        m.destination = new std::byte[m.payload.size() + 1];
      }
      // Empty payloads are part of the workload; memcpy must not see their null data().
      if (!m.payload.empty()) std::memcpy(m.source, m.payload.data(), m.payload.size());
      slot_message[members[k]] = w.messages.size();
      w.messages.push_back(std::move(m));
    }
  }
  w.posts.resize(n);
  for (int r = 0; r < n; ++r) {
    std::map<std::tuple<int, int, uint64_t, bool, bool>, size_t> seen;
    for (auto [slot, send] : order[r]) {
      const Slot& s = slots[slot];
      const auto& members = groups[{s.src, s.dst, s.tag, s.device}];
      const size_t k = seen[{s.src, s.dst, s.tag, s.device, send}]++;
      w.posts[r].push_back({slot_message[members[k]], send});
    }
  }
  return w;
}

void FreeHostBuffers(Workload& w) {
  for (Message& m : w.messages) {
    if (m.device) continue;
    delete[] m.source;
    delete[] m.destination;
  }
}

// Every rank posts its operations in its order, progressing now and then, and waits for all;
// then it keeps progressing until every rank is done, because without progress threads the
// rounds of the others need its answers.
void RunWorkload(Cluster& cluster, Workload& w, uint64_t seed) {
  const int n = cluster.size();
  std::vector<std::vector<Status>> results(n);
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937_64 rng(seed * 31 + r);
      Transport& t = cluster.transport(r);
      std::vector<RequestId> ids;
      for (const Op& op : w.posts[r]) {
        const Message& m = w.messages[op.message];
        Result<RequestId> posted = op.send
                                       ? t.PostSend(m.dst, m.tag, m.source, m.payload.size())
                                       : t.PostRecv(m.src, m.tag, m.destination, m.payload.size());
        EXPECT_TRUE(posted.ok()) << posted.status().ToString();
        ids.push_back(posted.ok() ? *posted : 0);
        if (rng() % 4 == 0) t.Progress();
        if (rng() % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
      }
      results[r] = WaitAll(t, ids);
      ++finished;
      while (finished < n) {
        t.Progress();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < results[r].size(); ++i) {
      const Op& op = w.posts[r][i];
      EXPECT_TRUE(results[r][i].ok())
          << "seed " << seed << " rank " << r << " " << (op.send ? "send" : "receive")
          << " of message " << op.message << ": " << results[r][i].ToString();
    }
  }
  for (size_t i = 0; i < w.messages.size(); ++i) {
    const Message& m = w.messages[i];
    EXPECT_TRUE(m.payload.empty() ||
                std::memcmp(m.destination, m.payload.data(), m.payload.size()) == 0)
        << "seed " << seed << " message " << i << " (rank " << m.src << " -> " << m.dst << ", tag "
        << m.tag << ", " << m.payload.size() << " bytes, " << (m.device ? "device" : "host")
        << ") arrived wrong";
  }
}

size_t DeviceBytes(const Workload& w) {
  size_t total = 0;
  for (const Message& m : w.messages) {
    if (m.device) total += m.payload.size();
  }
  return total;
}

class DeviceTransportRandomTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(DeviceTransportRandomTest, RandomPostOrdersArriveByteExact) {
  const auto [num_ranks, progress_thread] = GetParam();
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    Cluster cluster(num_ranks, {.progress_thread = progress_thread});
    std::mt19937_64 rng(seed * 1000 + num_ranks);
    // Seed 6 posts enough messages per pair that rounds hit their per-peer cap and frames spill.
    Workload w = MakeWorkload(cluster, rng, seed == 6 ? 150 * num_ranks : 40 * num_ranks);
    RunWorkload(cluster, w, seed);
    // Every device byte took the device path, once; host bytes never did.
    EXPECT_EQ(cluster.device_bytes_sent(), DeviceBytes(w)) << "seed " << seed;
    FreeHostBuffers(w);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceTransportRandomTest,
                         ::testing::Combine(::testing::Values(2, 3, 5), ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks" +
                                  (std::get<1>(info.param) ? "Thread" : "NoThread");
                         });

// The control messages over UCX between threads: UCX matches a receive by tag alone, whoever
// sent it, so the sender's rank in the control tags is what keeps peers' frames apart.
TEST(DeviceTransportTest, RandomPostOrdersOverAUcxHostTransport) {
  constexpr int kRanks = 3;
  LocalCommunicatorGroup group(kRanks);
  MigrationConfig config;
  config.transport = "ucx";
  config.ucx_progress_thread = false;
  std::vector<std::unique_ptr<Transport>> hosts(kRanks);
  std::vector<Status> failures(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> communicator = group.Join(r);
      communicator->set_timeout_seconds(60);
      Result<std::unique_ptr<Transport>> host = CreateTransport(config, *communicator);
      if (host.ok()) {
        hosts[r] = std::move(*host);
      } else {
        failures[r] = host.status();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failures[0].code() == StatusCode::kUnimplemented) GTEST_SKIP() << failures[0].ToString();
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(failures[r].ok()) << failures[r].ToString();
  Cluster cluster(kRanks, {}, std::move(hosts));
  std::mt19937_64 rng(99);
  Workload w = MakeWorkload(cluster, rng, 60 * kRanks);
  RunWorkload(cluster, w, 99);
  EXPECT_EQ(cluster.device_bytes_sent(), DeviceBytes(w));
  FreeHostBuffers(w);
}

// Each rank sends to the next and receives from the one before, sends posted first everywhere:
// issued in post order, one group at a time, the three sends would wait for each other forever.
TEST(DeviceTransportTest, CycleOfThreeDoesNotDeadlock) {
  Cluster cluster(3);
  std::mt19937_64 rng(7);
  constexpr int kRounds = 20;
  std::vector<std::vector<std::byte>> payloads;
  std::vector<std::byte*> sources, destinations;
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < kRounds; ++i) {
      payloads.push_back(RandomBytes(rng, 5000 + i));
      sources.push_back(cluster.memory(r).Allocate(payloads.back().size()));
      std::memcpy(sources.back(), payloads.back().data(), payloads.back().size());
      destinations.push_back(cluster.memory((r + 1) % 3).Allocate(payloads.back().size()));
    }
  }
  std::vector<std::vector<Status>> results(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      Transport& t = cluster.transport(r);
      std::vector<RequestId> ids;
      const int from = (r + 2) % 3;
      for (int i = 0; i < kRounds; ++i) {
        const size_t mine = r * kRounds + i;
        ids.push_back(*t.PostSend((r + 1) % 3, i, sources[mine], payloads[mine].size()));
      }
      for (int i = 0; i < kRounds; ++i) {
        const size_t theirs = from * kRounds + i;
        ids.push_back(*t.PostRecv(from, i, destinations[theirs], payloads[theirs].size()));
      }
      results[r] = WaitAll(t, ids, 10);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    for (const Status& s : results[r]) EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s.ToString();
  }
  for (size_t i = 0; i < payloads.size(); ++i) {
    EXPECT_TRUE(payloads[i].empty() ||
                std::memcmp(destinations[i], payloads[i].data(), payloads[i].size()) == 0)
        << i;
  }
}

// Host memory goes straight to the host transport under the caller's tag: a plain local
// transport on the other end exchanges with it, and no byte takes the device path.
TEST(DeviceTransportTest, HostMessagesPassThroughWithTheirTag) {
  LocalFabric control(2);
  LocalFabric data(2);
  auto mover = std::make_unique<LocalDeviceMover>(data, 0);
  LocalDeviceMover& device = *mover;
  std::unique_ptr<Transport> mine = ValueOrDie(CreateDeviceTransport(
      control.Connect(0), std::move(mover), std::make_shared<FakeDeviceMemory>()));
  std::unique_ptr<Transport> plain = control.Connect(1);
  EXPECT_EQ(mine->name(), "device");
  EXPECT_EQ(mine->rank(), 0);
  EXPECT_EQ(mine->num_ranks(), 2);

  std::mt19937_64 rng(3);
  const std::vector<std::byte> out = RandomBytes(rng, 3000);
  const std::vector<std::byte> back = RandomBytes(rng, 77);
  std::vector<std::byte> got(out.size()), got_back(back.size());
  const uint64_t tag = 0x0123456789abcdefull;
  const RequestId send = *mine->PostSend(1, tag, out.data(), out.size());
  const RequestId recv = *plain->PostRecv(0, tag, got.data(), got.size());
  const RequestId send_back = *plain->PostSend(0, tag + 1, back.data(), back.size());
  const RequestId recv_back = *mine->PostRecv(1, tag + 1, got_back.data(), got_back.size());
  for (const Status& s : WaitAll(*mine, {send, recv_back})) EXPECT_TRUE(s.ok()) << s.ToString();
  for (const Status& s : WaitAll(*plain, {recv, send_back})) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(got, out);
  EXPECT_EQ(got_back, back);
  EXPECT_EQ(device.bytes_sent, 0u);
}

TEST(DeviceTransportTest, RejectsReservedTagsAndBadPeers) {
  Cluster cluster(2);
  Transport& t = cluster.transport(0);
  std::byte* buffer = cluster.memory(0).Allocate(8);
  const Result<RequestId> reserved = t.PostSend(1, 0xFE00000000000001ull, buffer, 8);
  EXPECT_EQ(reserved.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Mentions(reserved.status(), "0xfe00000000000001")) << reserved.status().ToString();
  for (int peer : {-1, 0, 2}) {
    const Result<RequestId> bad = t.PostRecv(peer, 1, buffer, 8);
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << peer;
    EXPECT_TRUE(Mentions(bad.status(), "peer " + std::to_string(peer))) << bad.status().ToString();
  }
  EXPECT_EQ(t.Test(12345)->code(), StatusCode::kInternal);
  EXPECT_EQ(CreateDeviceTransport(nullptr, nullptr, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

// Both ends fail at once naming the peer, the tag and both sizes; the tag stays usable.
TEST(DeviceTransportTest, SizeMismatchFailsBothEnds) {
  Cluster cluster(2);
  std::byte* source = cluster.memory(0).Allocate(100);
  std::byte* destination = cluster.memory(1).Allocate(200);
  const RequestId send = *cluster.transport(0).PostSend(1, 0x42, source, 100);
  const RequestId recv = *cluster.transport(1).PostRecv(0, 0x42, destination, 200);
  const Status sent = WaitAll(cluster.transport(0), {send})[0];
  const Status received = WaitAll(cluster.transport(1), {recv})[0];
  EXPECT_EQ(sent.code(), StatusCode::kInternal);
  EXPECT_EQ(received.code(), StatusCode::kInternal);
  for (const Status& s : {sent, received}) {
    EXPECT_TRUE(Mentions(s, "size mismatch")) << s.ToString();
    EXPECT_TRUE(Mentions(s, "tag 0x42")) << s.ToString();
    EXPECT_TRUE(Mentions(s, "100")) << s.ToString();
    EXPECT_TRUE(Mentions(s, "200")) << s.ToString();
  }
  EXPECT_TRUE(Mentions(sent, "device send to peer rank 1")) << sent.ToString();
  EXPECT_TRUE(Mentions(received, "device receive from peer rank 0")) << received.ToString();
  EXPECT_EQ(cluster.device_bytes_sent(), 0u);

  std::memset(source, 0x5a, 100);
  const RequestId again = *cluster.transport(0).PostSend(1, 0x42, source, 100);
  const RequestId landed = *cluster.transport(1).PostRecv(0, 0x42, destination, 100);
  EXPECT_TRUE(WaitAll(cluster.transport(0), {again})[0].ok());
  EXPECT_TRUE(WaitAll(cluster.transport(1), {landed})[0].ok());
  EXPECT_EQ(destination[99], std::byte{0x5a});
}

// A cancelled receive that no send met is simply gone: the next receive under its tag gets the
// data, and the cancelled buffer is never written.
TEST(DeviceTransportTest, CancelledUnmatchedReceiveIsNeverWritten) {
  Cluster cluster(2);
  std::byte* source = cluster.memory(0).Allocate(64);
  std::byte* first = cluster.memory(1).Allocate(64);
  std::byte* second = cluster.memory(1).Allocate(64);
  std::memset(source, 0x11, 64);
  const RequestId cancelled = *cluster.transport(1).PostRecv(0, 9, first, 64);
  cluster.transport(1).Cancel(cancelled);
  const RequestId recv = *cluster.transport(1).PostRecv(0, 9, second, 64);
  const RequestId send = *cluster.transport(0).PostSend(1, 9, source, 64);
  EXPECT_TRUE(WaitAll(cluster.transport(0), {send})[0].ok());
  EXPECT_TRUE(WaitAll(cluster.transport(1), {recv})[0].ok());
  EXPECT_EQ(second[63], std::byte{0x11});
  EXPECT_EQ(first[0], std::byte{0});
}

// Without progress threads each step is explicit. Rank 1 takes send A into round 1, which waits
// for rank 2; send B matches meanwhile, and cancelling its receive refuses B at the sender.
TEST(DeviceTransportTest, CancelledMatchedReceiveRefusesTheSender) {
  Cluster cluster(3, {.progress_thread = false});
  Transport& sender = cluster.transport(0);
  Transport& receiver = cluster.transport(1);
  std::byte* a = cluster.memory(0).Allocate(64);
  std::byte* b = cluster.memory(0).Allocate(64);
  std::byte* a_in = cluster.memory(1).Allocate(64);
  std::byte* b_in = cluster.memory(1).Allocate(64);
  std::memset(a, 0xa1, 64);
  const RequestId send_a = *sender.PostSend(1, 0xa, a, 64);
  const RequestId send_b = *sender.PostSend(1, 0xb, b, 64);
  receiver.Progress();                                            // the announcements land
  const RequestId recv_a = *receiver.PostRecv(0, 0xa, a_in, 64);  // taken into round 1
  const RequestId recv_b = *receiver.PostRecv(0, 0xb, b_in, 64);  // matched, not taken
  receiver.Cancel(recv_b);
  const Status refused = WaitAll(sender, {send_b}, 5)[0];
  EXPECT_EQ(refused.code(), StatusCode::kAborted);
  EXPECT_TRUE(Mentions(refused, "peer rank 1 cancelled its receive")) << refused.ToString();
  EXPECT_TRUE(Mentions(refused, "tag 0xb")) << refused.ToString();
  // Round 1 completes once rank 2 takes part.
  std::optional<Status> a_sent, a_received;
  const auto limit = Clock::now() + std::chrono::seconds(10);
  while ((!a_sent || !a_received) && Clock::now() < limit) {
    for (int r = 0; r < 3; ++r) cluster.transport(r).Progress();
    if (!a_sent) a_sent = sender.Test(send_a);
    if (!a_received) a_received = receiver.Test(recv_a);
  }
  ASSERT_TRUE(a_sent && a_received);
  EXPECT_TRUE(a_sent->ok()) << a_sent->ToString();
  EXPECT_TRUE(a_received->ok()) << a_received->ToString();
  EXPECT_EQ(a_in[0], std::byte{0xa1});
  EXPECT_EQ(b_in[0], std::byte{0});
}

// A send that its receiver has not taken is withdrawn without harm: Cancel returns well within
// the grace period, and the device path keeps working.
TEST(DeviceTransportTest, CancelledAnnouncedSendIsWithdrawn) {
  Cluster cluster(2, {.cancel_grace_seconds = 5, .progress_thread = false});
  Transport& sender = cluster.transport(0);
  Transport& receiver = cluster.transport(1);
  std::byte* stale = cluster.memory(0).Allocate(64);
  std::byte* fresh = cluster.memory(0).Allocate(64);
  std::byte* in = cluster.memory(1).Allocate(64);
  std::memset(stale, 0x01, 64);
  std::memset(fresh, 0x02, 64);
  const RequestId withdrawn = *sender.PostSend(1, 5, stale, 64);
  {
    Driver answer({&receiver});
    const auto start = Clock::now();
    sender.Cancel(withdrawn);
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  }
  const RequestId send = *sender.PostSend(1, 5, fresh, 64);
  const RequestId recv = *receiver.PostRecv(0, 5, in, 64);
  {
    Driver drive({&sender});
    EXPECT_TRUE(WaitAll(receiver, {recv})[0].ok());
  }
  EXPECT_TRUE(WaitAll(sender, {send})[0].ok());
  EXPECT_EQ(in[0], std::byte{0x02});
}

// A killed peer fails the requests with it at once, naming it; the other ranks keep moving
// device memory among themselves.
TEST(DeviceTransportTest, DeadPeerFailsItsRequestsAndOthersGoOn) {
  Cluster cluster(3);
  std::byte* from_dead = cluster.memory(0).Allocate(1000);
  std::byte* to_dead = cluster.memory(0).Allocate(1000);
  const RequestId recv = *cluster.transport(0).PostRecv(2, 1, from_dead, 1000);
  const RequestId send = *cluster.transport(0).PostSend(2, 2, to_dead, 1000);
  cluster.control().Kill(2);
  cluster.data().Kill(2);
  const auto start = Clock::now();
  for (const Status& s : WaitAll(cluster.transport(0), {recv, send}, 5)) {
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_TRUE(Mentions(s, "peer rank 2")) << s.ToString();
    EXPECT_FALSE(Mentions(s, "still pending")) << s.ToString();
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));

  std::byte* source = cluster.memory(0).Allocate(4096);
  std::byte* destination = cluster.memory(1).Allocate(4096);
  std::memset(source, 0x77, 4096);
  const RequestId out = *cluster.transport(0).PostSend(1, 3, source, 4096);
  const RequestId in = *cluster.transport(1).PostRecv(0, 3, destination, 4096);
  EXPECT_TRUE(WaitAll(cluster.transport(0), {out})[0].ok());
  EXPECT_TRUE(WaitAll(cluster.transport(1), {in})[0].ok());
  EXPECT_EQ(destination[4095], std::byte{0x77});
  const Result<RequestId> late = cluster.transport(0).PostSend(2, 4, source, 16);
  EXPECT_EQ(late.status().code(), StatusCode::kAborted);
  EXPECT_TRUE(Mentions(late.status(), "peer rank 2")) << late.status().ToString();
}

// A stalled peer never answers. Cancelling a transfer with it gives up after the grace period
// and aborts this rank's device path: Cancel returns, later device requests fail naming what
// was cancelled, the other peers abort theirs when told, and host messages still flow.
TEST(DeviceTransportTest, StalledPeerCancelAbortsTheDevicePathWithoutHanging) {
  Cluster cluster(3, {.cancel_grace_seconds = 0.3});
  cluster.control().Stall(1);
  std::byte* source = cluster.memory(0).Allocate(512);
  std::byte* waiting = cluster.memory(2).Allocate(512);
  const RequestId stuck = *cluster.transport(0).PostSend(1, 0x77, source, 512);
  const RequestId bystander = *cluster.transport(2).PostRecv(0, 0x78, waiting, 512);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = Clock::now();
  cluster.transport(0).Cancel(stuck);
  const auto took = Clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(250));
  EXPECT_LT(took, std::chrono::seconds(2));

  const Result<RequestId> later = cluster.transport(0).PostSend(2, 0x78, source, 512);
  EXPECT_EQ(later.status().code(), StatusCode::kAborted);
  EXPECT_TRUE(Mentions(later.status(), "aborted its device transfers"))
      << later.status().ToString();
  EXPECT_TRUE(Mentions(later.status(), "device send to peer rank 1 under tag 0x77"))
      << later.status().ToString();
  const Status told = WaitAll(cluster.transport(2), {bystander}, 5)[0];
  EXPECT_EQ(told.code(), StatusCode::kAborted) << told.ToString();
  EXPECT_TRUE(Mentions(told, "peer rank 0 aborted")) << told.ToString();
  EXPECT_TRUE(Mentions(told, "device receive from peer rank 0 under tag 0x78")) << told.ToString();

  std::vector<std::byte> host_out(100, std::byte{9}), host_in(100);
  const RequestId hs = *cluster.transport(0).PostSend(2, 0x79, host_out.data(), 100);
  const RequestId hr = *cluster.transport(2).PostRecv(0, 0x79, host_in.data(), 100);
  EXPECT_TRUE(WaitAll(cluster.transport(0), {hs})[0].ok());
  EXPECT_TRUE(WaitAll(cluster.transport(2), {hr})[0].ok());
  EXPECT_EQ(host_in, host_out);
}

// Sequence migration over the device transport: chunks take the device path, checksum trailers
// and verdicts the host path, and every sequence verifies byte-exact; a chunk corrupted on the
// device path fails the batch naming the sequence.
TEST(DeviceTransportTest, SequenceMigrationOverTheDevicePathVerifies) {
  constexpr int kRanks = 4;
  Cluster cluster(kRanks);
  std::mt19937_64 rng(11);
  std::vector<std::vector<SequenceMove>> moves(kRanks);
  std::vector<std::vector<std::byte>> payloads;
  std::vector<std::byte*> destinations;
  size_t remote_bytes = 0;
  for (int i = 0; i < 60; ++i) {
    SequenceMove move;
    move.sequence_id = 500 + i;
    move.src_rank = i == 0 ? 0 : static_cast<int>(rng() % kRanks);
    move.dst_rank = i == 0 ? 1 : static_cast<int>(rng() % kRanks);
    move.bytes = i == 0 ? 40000 : rng() % 40000;
    payloads.push_back(RandomBytes(rng, move.bytes));
    std::byte* source = cluster.memory(move.src_rank).Allocate(move.bytes);
    if (move.bytes > 0) std::memcpy(source, payloads.back().data(), move.bytes);
    destinations.push_back(cluster.memory(move.dst_rank).Allocate(move.bytes));
    if (move.src_rank != move.dst_rank) remote_bytes += move.bytes;
    for (int r = 0; r < kRanks; ++r) {
      SequenceMove mine = move;
      if (r == move.src_rank) mine.source = source;
      if (r == move.dst_rank) mine.destination = destinations.back();
      moves[r].push_back(mine);
    }
  }
  MigrationConfig config;
  config.chunk_bytes = 8192;
  config.pipeline_depth = 3;
  config.deadline_seconds = 20;
  auto run = [&](uint64_t batch) {
    std::vector<Status> results(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back(
          [&, r] { results[r] = MigrateSequences(cluster.transport(r), batch, moves[r], config); });
    }
    for (auto& t : threads) t.join();
    return results;
  };
  const std::vector<Status> migrated = run(1);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(migrated[r].ok()) << "rank " << r << ": " << migrated[r].ToString();
  }
  for (size_t i = 0; i < payloads.size(); ++i) {
    EXPECT_TRUE(payloads[i].empty() ||
                std::memcmp(destinations[i], payloads[i].data(), payloads[i].size()) == 0)
        << i;
  }
  EXPECT_EQ(cluster.device_bytes_sent(), remote_bytes);

  // The third chunk from rank 0 to rank 1 (the first move has five) is corrupted on the device
  // path.
  cluster.data().CorruptChunk(0, 1, 2);
  const std::vector<Status> corrupted = run(2);
  bool named = false;
  for (const Status& s : corrupted) {
    EXPECT_FALSE(s.ok());
    named |= Mentions(s, "checksum mismatch") && Mentions(s, "sequence");
  }
  EXPECT_TRUE(named) << corrupted[1].ToString();
}

}  // namespace
}  // namespace keel
