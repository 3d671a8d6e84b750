// Arithmetic that the CPU references and the CUDA kernels share word for word, so both give the
// same bits: bf16 conversion and the checksum's word mix. Header-only, host and device.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KEEL_HOST_DEVICE __host__ __device__
#else
#define KEEL_HOST_DEVICE
#endif

namespace keel::kernels {

KEEL_HOST_DEVICE inline float FloatFromBits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

KEEL_HOST_DEVICE inline uint32_t BitsFromFloat(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

// bf16 is the upper half of a float32: widening is exact.
KEEL_HOST_DEVICE inline float Bf16ToFloat(uint16_t value) {
  return FloatFromBits(static_cast<uint32_t>(value) << 16);
}

// Round to nearest, ties to even; NaN stays a (quiet) NaN, infinities stay infinite.
KEEL_HOST_DEVICE inline uint16_t FloatToBf16(float value) {
  const uint32_t bits = BitsFromFloat(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Checksum64 (kernels/checksum.h) is a sum mod 2^64 of one term per 64-bit word, keyed by the
// word's index, so any split of the words among threads gives the same value. The term is NH
// (UMAC's hash: the product of the word's two halves, each offset by a key half), one 32 x 32 ->
// 64-bit multiply per word, plus the keyed word itself so a half whose offset sum is 0 still
// counts. Keys advance by a constant per word, so a CPU loop adds instead of multiplying.
inline constexpr uint64_t kChecksumMulA = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio
inline constexpr uint64_t kChecksumMulB = 0xd6e8feb86659fd93ull;
inline constexpr uint64_t kChecksumMulC = 0xc2b2ae3d27d4eb4full;

// A bijection of 64-bit words with full avalanche (splitmix64's finalizer).
KEEL_HOST_DEVICE inline uint64_t ChecksumMix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Key of word `index`: ChecksumKey(i + 1, seed) = ChecksumKey(i, seed) + kChecksumMulA.
KEEL_HOST_DEVICE inline uint64_t ChecksumKey(uint64_t index, uint64_t seed) {
  return (index + 1) * kChecksumMulA + seed * kChecksumMulB;
}

// Term of a word (little-endian, the last partial word zero-padded) under its key.
KEEL_HOST_DEVICE inline uint64_t ChecksumTermWithKey(uint64_t word, uint64_t key) {
  const uint32_t low = static_cast<uint32_t>(word) + static_cast<uint32_t>(key);
  const uint32_t high = static_cast<uint32_t>(word >> 32) + static_cast<uint32_t>(key >> 32);
  return static_cast<uint64_t>(low) * high + (word ^ key);
}

KEEL_HOST_DEVICE inline uint64_t ChecksumTerm(uint64_t word, uint64_t index, uint64_t seed) {
  return ChecksumTermWithKey(word, ChecksumKey(index, seed));
}

// The checksum from the sum of all terms, the byte length and the seed.
KEEL_HOST_DEVICE inline uint64_t ChecksumFinish(uint64_t term_sum, uint64_t num_bytes,
                                                uint64_t seed) {
  return ChecksumMix(term_sum + num_bytes * kChecksumMulC + ChecksumMix(seed ^ kChecksumMulB));
}

}  // namespace keel::kernels
