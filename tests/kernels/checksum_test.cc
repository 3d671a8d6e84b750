// The checksum's CPU reference: stable, sensitive to every byte, to order, length and seed, and
// equal to its definition (a keyed sum of word terms) however the words are split, which is
// what lets the GPU compute the same value.
#include "kernels/checksum.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/host_device.h"

namespace keel::kernels {
namespace {

std::vector<std::byte> Bytes(size_t n, int seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> bytes(n);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

// The definition, word by word in one sum, with no unrolling.
uint64_t Definition(std::span<const std::byte> bytes, uint64_t seed) {
  uint64_t sum = 0;
  for (size_t w = 0; w * 8 < bytes.size(); ++w) {
    uint64_t word = 0;
    for (size_t b = 0; b < 8 && w * 8 + b < bytes.size(); ++b) {
      word |= static_cast<uint64_t>(bytes[w * 8 + b]) << (8 * b);
    }
    sum += ChecksumTerm(word, w, seed);
  }
  return ChecksumFinish(sum, bytes.size(), seed);
}

TEST(ChecksumTest, DetectsChangesAndIsStable) {
  std::vector<std::byte> a(1000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::byte>(i * 7);
  const uint64_t base = cpu::Checksum64(a);
  EXPECT_EQ(base, cpu::Checksum64(a));
  for (size_t i : {size_t{0}, size_t{31}, size_t{32}, size_t{500}, size_t{999}}) {
    auto b = a;
    b[i] ^= std::byte{1};
    EXPECT_NE(cpu::Checksum64(b), base) << "byte " << i;
  }
  // Truncation, swapped words, a zero extension and another seed change it too.
  EXPECT_NE(cpu::Checksum64(std::span(a).first(999)), base);
  auto swapped = a;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
  EXPECT_NE(cpu::Checksum64(swapped), base);
  auto longer = a;
  longer.push_back(std::byte{0});
  EXPECT_NE(cpu::Checksum64(longer), base);
  EXPECT_NE(cpu::Checksum64(a, 1), base);
  EXPECT_NE(cpu::Checksum64({}), cpu::Checksum64(std::span(a).first(1)));
  EXPECT_NE(cpu::Checksum64({}, 0), cpu::Checksum64({}, 1));
}

TEST(ChecksumTest, EqualsItsDefinitionForEveryLength) {
  const std::vector<std::byte> bytes = Bytes(300, 1);
  for (size_t n = 0; n <= bytes.size(); ++n) {
    for (uint64_t seed : {uint64_t{0}, uint64_t{0x1234567890abcdefull}}) {
      ASSERT_EQ(cpu::Checksum64(std::span(bytes).first(n), seed),
                Definition(std::span(bytes).first(n), seed))
          << n << " bytes";
    }
  }
}

// Random splits at word boundaries (the last piece may end mid-word), summed in shuffled order.
TEST(ChecksumTest, PiecesInAnyOrderGiveTheWholeChecksum) {
  std::mt19937_64 rng(11);
  for (size_t n : {size_t{0}, size_t{5}, size_t{8}, size_t{203}, size_t{4096}, size_t{5003}}) {
    const std::vector<std::byte> bytes = Bytes(n, static_cast<int>(n));
    for (int trial = 0; trial < 20; ++trial) {
      const uint64_t seed = rng();
      std::vector<std::pair<size_t, size_t>> pieces;  // (first byte, bytes)
      for (size_t at = 0; at < n;) {
        const size_t length = std::min(n - at, 8 * (rng() % 64));
        if (length == 0) continue;
        pieces.push_back({at, length});
        at += length;
      }
      std::shuffle(pieces.begin(), pieces.end(), rng);
      uint64_t terms = 0;
      for (auto [at, length] : pieces) {
        terms += cpu::ChecksumTerms(std::span(bytes).subspan(at, length), at / 8, seed);
      }
      ASSERT_EQ(cpu::ChecksumFromTerms(terms, n, seed), cpu::Checksum64(bytes, seed))
          << n << " bytes in " << pieces.size() << " pieces";
    }
  }
}

TEST(ChecksumTest, SlotChecksumsEqualChecksumOfEachSlot) {
  const int64_t slots = 5, slot_bytes = 4099, stride = 4104;
  const std::vector<std::byte> bytes = Bytes(slots * stride, 2);
  std::vector<uint64_t> sums(slots, 0);
  ASSERT_TRUE(cpu::SlotChecksums(bytes.data(), slots, slot_bytes, stride, 42, sums.data()).ok());
  for (int64_t i = 0; i < slots; ++i) {
    EXPECT_EQ(sums[i], cpu::Checksum64(std::span(bytes).subspan(i * stride, slot_bytes), 42));
  }
  EXPECT_NE(sums[0], sums[1]);
  const Status status = cpu::SlotChecksums(bytes.data(), slots, 10, 8, 0, sums.data());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("stride_bytes = 8"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace keel::kernels
