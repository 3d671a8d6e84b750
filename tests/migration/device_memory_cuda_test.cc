// CreateCudaDeviceMemory: a clear error where no GPU can be used; on a GPU, pointer
// classification, ordered asynchronous copies in every direction, checksums equal to the CPU's,
// and the staged transport moving device buffers between two ranks (threads sharing the GPU)
// with an exchange that checksums them on the device.
#include "keel/device_memory.hpp"

#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "kernels/checksum.h"
#include "kernels/device.h"
#include "migration/transport_local.h"
#include "migration/transport_staged.h"
#include "tests/migration/test_util.h"

#if KEEL_KERNELS_CUDA
#include "tests/migration/cuda_test_util.h"
#endif

namespace keel {
namespace {

using testing::ValueOrDie;

TEST(CudaDeviceMemoryTest, FailsCleanlyWithoutAGpu) {
  if (kernels::GpuAvailable()) GTEST_SKIP() << "a GPU is here; the tests below cover it";
  const Result<std::shared_ptr<DeviceMemory>> memory = CreateCudaDeviceMemory();
  ASSERT_FALSE(memory.ok());
  EXPECT_EQ(memory.status().code(),
            KEEL_KERNELS_CUDA ? StatusCode::kFailedPrecondition : StatusCode::kUnimplemented)
      << memory.status().ToString();
  EXPECT_NE(memory.status().message().find("CUDA"), std::string::npos)
      << memory.status().ToString();
}

#if KEEL_KERNELS_CUDA

using testing::DeviceBuffer;

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> bytes(n);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

class CudaDeviceMemoryGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kernels::GpuAvailable()) GTEST_SKIP() << "no usable CUDA device";
    memory_ = ValueOrDie(CreateCudaDeviceMemory(0));
  }
  std::shared_ptr<DeviceMemory> memory_;
};

TEST_F(CudaDeviceMemoryGpuTest, TellsDeviceFromHostMemory) {
  DeviceBuffer device(0, 64);
  std::vector<std::byte> pageable(64);
  std::byte* pinned = ValueOrDie(memory_->AllocateHost(64));
  EXPECT_TRUE(memory_->IsDeviceMemory(device.get()));
  EXPECT_TRUE(memory_->IsDeviceMemory(device.get() + 10));
  EXPECT_FALSE(memory_->IsDeviceMemory(pageable.data()));
  EXPECT_FALSE(memory_->IsDeviceMemory(pinned));
  EXPECT_FALSE(memory_->IsDeviceMemory(nullptr));
  memory_->FreeHost(pinned);
}

// Host -> device -> device -> page-locked host -> host, each started before the last finished:
// copies complete in order and the bytes come back.
TEST_F(CudaDeviceMemoryGpuTest, OrderedCopiesInEveryDirection) {
  std::mt19937_64 rng(1);
  const size_t bytes = (3u << 20) + 5;
  const std::vector<std::byte> payload = RandomBytes(rng, bytes);
  DeviceBuffer a(0, bytes);
  DeviceBuffer b(0, bytes);
  std::byte* pinned = ValueOrDie(memory_->AllocateHost(bytes));
  std::vector<std::byte> back(bytes);
  const uint64_t first = ValueOrDie(memory_->StartCopy(a.get(), payload.data(), bytes));
  ValueOrDie(memory_->StartCopy(b.get(), a.get(), bytes));
  ValueOrDie(memory_->StartCopy(pinned, b.get(), bytes));
  const uint64_t last = ValueOrDie(memory_->StartCopy(back.data(), pinned, bytes));
  EXPECT_EQ(last, first + 3);
  while (ValueOrDie(memory_->CompletedCopies()) <= last) std::this_thread::yield();
  EXPECT_EQ(back, payload);
  ASSERT_TRUE(memory_->Copy(a.get(), payload.data() + 1, bytes - 1).ok());
  ASSERT_TRUE(memory_->Copy(back.data(), a.get(), bytes - 1).ok());
  EXPECT_TRUE(std::equal(back.begin(), back.end() - 1, payload.begin() + 1));
  memory_->FreeHost(pinned);
}

// The device's checksum equals kernels::cpu::Checksum64 for any size and alignment.
TEST_F(CudaDeviceMemoryGpuTest, ChecksumMatchesTheCpu) {
  std::mt19937_64 rng(2);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, (size_t{1} << 20) + 3}) {
    for (size_t offset : {0, 3}) {
      const std::vector<std::byte> payload = RandomBytes(rng, bytes);
      DeviceBuffer buffer(0, bytes + offset);
      ASSERT_TRUE(memory_->Copy(buffer.get() + offset, payload.data(), bytes).ok());
      EXPECT_EQ(ValueOrDie(memory_->Checksum(buffer.get() + offset, bytes)),
                kernels::cpu::Checksum64(payload))
          << bytes << " bytes at offset " << offset;
    }
  }
}

// Two ranks (threads) on the one GPU, staged transports over a local fabric: an exchange of a
// device buffer to a device buffer and a local device-to-host move arrives byte-exact, verified
// by checksums computed on the device.
TEST_F(CudaDeviceMemoryGpuTest, StagedExchangeBetweenDeviceBuffers) {
  LocalFabric fabric(2);
  std::vector<std::unique_ptr<Transport>> transports;
  for (int r = 0; r < 2; ++r) {
    transports.push_back(ValueOrDie(
        CreateStagedTransport(fabric.Connect(r), ValueOrDie(CreateCudaDeviceMemory(0)))));
  }
  std::mt19937_64 rng(3);
  const std::vector<std::byte> a = RandomBytes(rng, (5u << 20) + 11);
  const std::vector<std::byte> b = RandomBytes(rng, 70001);
  DeviceBuffer a_src(0, a.size());
  DeviceBuffer a_dst(0, a.size());
  DeviceBuffer b_src(0, b.size());
  std::vector<std::byte> b_dst(b.size());
  ASSERT_TRUE(memory_->Copy(a_src.get(), a.data(), a.size()).ok());
  ASSERT_TRUE(memory_->Copy(b_src.get(), b.data(), b.size()).ok());
  const std::vector<Status> results =
      testing::RunTwoRankExchange(*transports[0], *transports[1],
                                  {.moved_source = a_src.get(),
                                   .moved_destination = a_dst.get(),
                                   .moved_bytes = a.size(),
                                   .local_source = b_src.get(),
                                   .local_destination = b_dst.data(),
                                   .local_bytes = b.size()},
                                  1 << 20);
  for (const Status& s : results) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<std::byte> got(a.size());
  ASSERT_TRUE(memory_->Copy(got.data(), a_dst.get(), a.size()).ok());
  EXPECT_EQ(got, a);
  EXPECT_EQ(b_dst, b);
}

#endif  // KEEL_KERNELS_CUDA

}  // namespace
}  // namespace keel
