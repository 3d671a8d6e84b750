// CPU reference of the checksum: one pass adding word terms; the sum mod 2^64 does not depend on
// how the words are split, so this equals the GPU's value.
#include "kernels/checksum.h"

#include <bit>
#include <cstring>

#include "kernels/arguments.h"
#include "kernels/host_device.h"

namespace keel::kernels::cpu {
namespace {

uint64_t LoadWord(const std::byte* p) {
  uint64_t word;
  std::memcpy(&word, p, sizeof(word));
  if constexpr (std::endian::native == std::endian::big) word = __builtin_bswap64(word);
  return word;
}

}  // namespace

uint64_t Checksum64(std::span<const std::byte> bytes, uint64_t seed) {
  return ChecksumFromTerms(ChecksumTerms(bytes, 0, seed), bytes.size(), seed);
}

uint64_t ChecksumTerms(std::span<const std::byte> piece, uint64_t first_word, uint64_t seed) {
  const std::byte* p = piece.data();
  const uint64_t whole_words = piece.size() / 8;
  uint64_t sum = 0;
  uint64_t key = ChecksumKey(first_word, seed);
  for (uint64_t i = 0; i < whole_words; ++i, key += kChecksumMulA) {
    sum += ChecksumTermWithKey(LoadWord(p + 8 * i), key);
  }
  const size_t tail = piece.size() % 8;
  if (tail > 0) {
    uint64_t word = 0;
    for (size_t b = 0; b < tail; ++b) {
      word |= static_cast<uint64_t>(p[8 * whole_words + b]) << (8 * b);
    }
    sum += ChecksumTermWithKey(word, key);
  }
  return sum;
}

uint64_t ChecksumFromTerms(uint64_t term_sum, uint64_t total_bytes, uint64_t seed) {
  return ChecksumFinish(term_sum, total_bytes, seed);
}

Status SlotChecksums(const void* base, int64_t num_slots, int64_t slot_bytes, int64_t stride_bytes,
                     uint64_t seed, uint64_t* checksums) {
  KEEL_RETURN_IF_ERROR(
      CheckSlotChecksumArguments(base, num_slots, slot_bytes, stride_bytes, checksums));
  const auto* bytes = static_cast<const std::byte*>(base);
  for (int64_t i = 0; i < num_slots; ++i) {
    checksums[i] = Checksum64({bytes + i * stride_bytes, static_cast<size_t>(slot_bytes)}, seed);
  }
  return Status::Ok();
}

}  // namespace keel::kernels::cpu
