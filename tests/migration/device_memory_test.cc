// The DeviceMemory implementations: guarded host memory, whose device buffers fault on any direct
// CPU access (a death test proves the guard works), plain host memory, and CUDA's where a GPU is
// present. Copies, adds (float64, bf16, fp16) and checksums must equal the kernels' CPU
// references.
#include "keel/device_memory.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/add.h"
#include "kernels/checksum.h"
#include "tests/common/test_util.h"

namespace keel {
namespace {

std::byte* Bytes(void* data) { return static_cast<std::byte*>(data); }
const std::byte* Bytes(const void* data) { return static_cast<const std::byte*>(data); }

std::vector<double> RandomDoubles(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> values(count);
  for (double& v : values) v = normal(rng);
  return values;
}

// Copies in and out, adds and checksums through `memory`, against the CPU references.
void ExpectCopiesAddsAndChecksums(DeviceMemory& memory) {
  constexpr size_t kCount = 1000;
  const size_t bytes = kCount * sizeof(double);
  const std::vector<double> a = RandomDoubles(kCount, 1);
  const std::vector<double> b = RandomDoubles(kCount, 2);
  std::byte* x = testing::ValueOrDie(memory.AllocateDevice(bytes));
  std::byte* y = testing::ValueOrDie(memory.AllocateDevice(bytes));
  ASSERT_TRUE(memory.Copy(x, Bytes(a.data()), bytes).ok());
  ASSERT_TRUE(memory.Copy(y, Bytes(b.data()), bytes).ok());
  ASSERT_TRUE(memory.Add(GradientType::kFloat64, x, y, bytes).ok());

  std::vector<double> want = a;
  ASSERT_TRUE(kernels::cpu::AddInto(GradientType::kFloat64, want.data(), b.data(),
                                    static_cast<int64_t>(bytes))
                  .ok());
  std::vector<double> got(kCount);
  ASSERT_TRUE(memory.Copy(Bytes(got.data()), x, bytes).ok());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), bytes), 0);
  EXPECT_EQ(testing::ValueOrDie(memory.Checksum(x, bytes)),
            kernels::cpu::Checksum64({Bytes(want.data()), bytes}));

  // Device to device, and the operation numbers count copies and adds alike.
  const uint64_t copy = testing::ValueOrDie(memory.StartCopy(y, x, bytes));
  const uint64_t add = testing::ValueOrDie(memory.StartAdd(GradientType::kFloat64, y, x, bytes));
  EXPECT_EQ(add, copy + 1);
  ASSERT_TRUE(memory.WaitFor(add).ok());
  std::vector<double> doubled(kCount);
  ASSERT_TRUE(memory.Copy(Bytes(doubled.data()), y, bytes).ok());
  for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(doubled[i], want[i] + want[i]) << i;
  memory.FreeDevice(x);
  memory.FreeDevice(y);
}

// bf16 and fp16 adds through `memory` against the CPU reference: random bits (NaN, infinities and
// subnormals among them), an odd element count, then the sum added into the other buffer.
void ExpectSixteenBitAdds(DeviceMemory& memory) {
  constexpr size_t kCount = 1001;
  const size_t bytes = kCount * sizeof(uint16_t);
  std::mt19937 rng(3);
  for (GradientType type : {GradientType::kBFloat16, GradientType::kFloat16}) {
    SCOPED_TRACE(static_cast<int>(type));
    std::vector<uint16_t> a(kCount);
    std::vector<uint16_t> b(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      a[i] = static_cast<uint16_t>(rng());
      b[i] = static_cast<uint16_t>(rng());
    }
    std::byte* x = testing::ValueOrDie(memory.AllocateDevice(bytes));
    std::byte* y = testing::ValueOrDie(memory.AllocateDevice(bytes));
    ASSERT_TRUE(memory.Copy(x, Bytes(a.data()), bytes).ok());
    ASSERT_TRUE(memory.Copy(y, Bytes(b.data()), bytes).ok());
    ASSERT_TRUE(memory.Add(type, x, y, bytes).ok());
    ASSERT_TRUE(memory.Add(type, y, x, bytes).ok());

    std::vector<uint16_t> want_x = a;
    ASSERT_TRUE(
        kernels::cpu::AddInto(type, want_x.data(), b.data(), static_cast<int64_t>(bytes)).ok());
    std::vector<uint16_t> want_y = b;
    ASSERT_TRUE(
        kernels::cpu::AddInto(type, want_y.data(), want_x.data(), static_cast<int64_t>(bytes))
            .ok());
    std::vector<uint16_t> got(kCount);
    ASSERT_TRUE(memory.Copy(Bytes(got.data()), x, bytes).ok());
    EXPECT_EQ(got, want_x);
    ASSERT_TRUE(memory.Copy(Bytes(got.data()), y, bytes).ok());
    EXPECT_EQ(got, want_y);
    memory.FreeDevice(x);
    memory.FreeDevice(y);
  }
}

TEST(GuardedHostMemoryTest, CopiesAddsAndChecksumsEqualTheCpuReferences) {
  auto memory = testing::ValueOrDie(CreateGuardedHostMemory());
  ExpectCopiesAddsAndChecksums(*memory);
  ExpectSixteenBitAdds(*memory);
}

TEST(CudaMemoryAgainstCpuTest, CopiesAddsAndChecksumsEqualTheCpuReferences) {
  auto memory = CreateCudaDeviceMemory();
  if (!memory.ok()) GTEST_SKIP() << memory.status().ToString();
  ExpectCopiesAddsAndChecksums(**memory);
  ExpectSixteenBitAdds(**memory);
}

TEST(HostMemoryTest, CopiesAddsAndChecksumsEqualTheCpuReferences) {
  auto memory = CreateHostMemory();
  ExpectCopiesAddsAndChecksums(*memory);
  ExpectSixteenBitAdds(*memory);
  std::vector<double> host(4);
  EXPECT_FALSE(memory->IsDeviceMemory(host.data()));
}

TEST(GuardedHostMemoryTest, KnowsItsBuffersExactly) {
  auto memory = testing::ValueOrDie(CreateGuardedHostMemory());
  std::byte* device = testing::ValueOrDie(memory->AllocateDevice(100));
  std::vector<std::byte> host(100);
  EXPECT_TRUE(memory->IsDeviceMemory(device));
  EXPECT_TRUE(memory->IsDeviceMemory(device + 99));
  EXPECT_FALSE(memory->IsDeviceMemory(host.data()));
  EXPECT_FALSE(memory->IsDeviceMemory(nullptr));
  // Copies may not run past the end of the buffer as allocated.
  Status status = memory->Copy(device + 50, host.data(), 51);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("destination + 51 bytes runs past the end"), std::string::npos)
      << status.ToString();
  // Adds and checksums take device buffers only.
  status = memory->Add(GradientType::kFloat32, device, host.data(), 100);
  EXPECT_NE(status.message().find("source is not device memory"), std::string::npos)
      << status.ToString();
  EXPECT_FALSE(memory->Checksum(host.data(), 100).ok());
  memory->FreeDevice(device);
  EXPECT_FALSE(memory->IsDeviceMemory(device));
}

// The guard itself: host code that reads or writes a device buffer dies at once.
TEST(GuardedHostMemoryDeathTest, HostAccessToADeviceBufferCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto memory = testing::ValueOrDie(CreateGuardedHostMemory());
  std::byte* device = testing::ValueOrDie(memory->AllocateDevice(64));
  const std::vector<std::byte> host(64, std::byte{7});
  ASSERT_TRUE(memory->Copy(device, host.data(), 64).ok());
  EXPECT_DEATH(
      {
        volatile std::byte read = device[10];
        (void)read;
      },
      "");
  EXPECT_DEATH(std::memset(device, 0, 64), "");
  // Through the interface, the same bytes are there.
  std::vector<std::byte> back(64);
  ASSERT_TRUE(memory->Copy(back.data(), device, 64).ok());
  EXPECT_EQ(back, host);
  memory->FreeDevice(device);
}

}  // namespace
}  // namespace keel
