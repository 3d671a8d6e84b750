// Tests of the engine's slot exchange (engine/slot_exchange.h) on its own: every peer's pieces
// come back in the order Expect declared them, from host memory and from guarded device memory
// (staged through host memory, read back as device memory), and a read that strays from the
// declarations is an error instead of another piece's bytes.
#include "engine/slot_exchange.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "keel/device_memory.hpp"
#include "tests/common/test_util.h"

namespace keel {
namespace {

constexpr int kRanks = 3;

// The `piece`th piece rank `from` sends rank `to`: sizes differ per pair and piece, one empty.
std::vector<std::byte> Piece(int from, int to, int piece) {
  const size_t size = from == 1 && to == 2 && piece == 0 ? 0 : 5 + 3 * from + 7 * to + 11 * piece;
  std::vector<std::byte> bytes(size);
  for (size_t i = 0; i < size; ++i)
    bytes[i] = static_cast<std::byte>(from * 50 + to * 20 + piece + i);
  return bytes;
}

// Every rank sends every rank (itself included) two pieces from buffers of `memory`, and reads
// what it receives back to the host through `memory`, so no device buffer is touched from the
// CPU.
void ExchangeAndCheck(Communicator& comm, DeviceMemory& memory, bool on_device) {
  std::vector<std::byte*> buffers;
  SlotExchange exchange;
  exchange.Begin(comm.size());
  for (int to = 0; to < comm.size(); ++to) {
    for (int piece = 0; piece < 2; ++piece) {
      const std::vector<std::byte> bytes = Piece(comm.rank(), to, piece);
      buffers.push_back(testing::ValueOrDie(memory.AllocateDevice(bytes.size())));
      ASSERT_TRUE(memory.Copy(buffers.back(), bytes.data(), bytes.size()).ok());
      exchange.Add(to, buffers.back(), bytes.size());
      exchange.Expect(to, Piece(to, comm.rank(), piece).size());
    }
  }
  const Status status = exchange.Run(comm, memory, on_device);
  ASSERT_TRUE(status.ok()) << status.ToString();
  for (int from = 0; from < comm.size(); ++from) {
    for (int piece = 0; piece < 2; ++piece) {
      const std::vector<std::byte> expected = Piece(from, comm.rank(), piece);
      Result<const std::byte*> received = exchange.Received(from, expected.size());
      ASSERT_TRUE(received.ok()) << received.status().ToString();
      EXPECT_EQ(memory.IsDeviceMemory(*received), on_device);
      std::vector<std::byte> got(expected.size());
      ASSERT_TRUE(memory.Copy(got.data(), *received, got.size()).ok());
      EXPECT_TRUE(got == expected)
          << "rank " << comm.rank() << " from " << from << " piece " << piece;
    }
  }
  for (std::byte* buffer : buffers) memory.FreeDevice(buffer);
}

void RunRanks(bool device) {
  LocalCommunicatorGroup group(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&group, r, device] {
      std::unique_ptr<Communicator> comm = group.Join(r);
      std::shared_ptr<DeviceMemory> memory =
          device ? testing::ValueOrDie(CreateGuardedHostMemory()) : CreateHostMemory();
      // Twice: the second exchange reuses the first one's buffers.
      ExchangeAndCheck(*comm, *memory, device);
      ExchangeAndCheck(*comm, *memory, device);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

TEST(SlotExchangeTest, HostMemoryComesBackInTheDeclaredOrder) { RunRanks(false); }

TEST(SlotExchangeTest, GuardedDeviceMemoryComesBackAsDeviceMemory) { RunRanks(true); }

TEST(SlotExchangeTest, AReadThatStraysFromExpectIsAnError) {
  LocalCommunicatorGroup group(1);
  std::unique_ptr<Communicator> comm = group.Join(0);
  std::shared_ptr<DeviceMemory> memory = CreateHostMemory();
  std::vector<std::byte> bytes(8, std::byte{7});
  SlotExchange exchange;
  exchange.Begin(1);
  exchange.Add(0, bytes.data(), bytes.size());
  exchange.Expect(0, bytes.size());
  EXPECT_EQ(exchange.Received(0, 8).status().code(), StatusCode::kInternal);
  ASSERT_TRUE(exchange.Run(*comm, *memory, false).ok());
  Result<const std::byte*> wrong_size = exchange.Received(0, 4);
  EXPECT_EQ(wrong_size.status().code(), StatusCode::kInternal);
  EXPECT_NE(wrong_size.status().message().find(
                "piece 0 from rank 0 read as 4 bytes, but Expect declared 8 bytes"),
            std::string::npos)
      << wrong_size.status().ToString();
  EXPECT_TRUE(exchange.Received(0, 8).ok());
  Result<const std::byte*> one_too_many = exchange.Received(0, 8);
  EXPECT_NE(one_too_many.status().message().find("Expect declared 1 pieces"), std::string::npos)
      << one_too_many.status().ToString();
}

}  // namespace
}  // namespace keel
