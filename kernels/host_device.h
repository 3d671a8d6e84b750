// Arithmetic that the CPU references and the CUDA kernels share word for word, so both give the
// same bits: bf16 and fp16 conversion, 16-bit gradient sums, and the checksum's word mix.
// Header-only, host and device.
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

// IEEE binary16 (fp16): 1 sign bit, 5 exponent bits (bias 15), 10 fraction bits; the largest
// finite value is 65504 and the smallest subnormal 2^-24. Every fp16 value is a float32 value, so
// widening is exact: NaN keeps its sign and payload (shifted into float32's upper fraction bits).
KEEL_HOST_DEVICE inline float Fp16ToFloat(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1fu;
  const uint32_t fraction = value & 0x3ffu;
  if (exponent == 0x1fu) return FloatFromBits(sign | 0x7f800000u | (fraction << 13));
  if (exponent == 0) {
    // Zero or subnormal: fraction * 2^-24. Both factors and the product are exact in float32
    // (the product is at least 2^-24, a normal float32), so no rounding mode or fusion with a
    // later add can change it.
    const float magnitude = static_cast<float>(fraction) * 5.9604644775390625e-8f;
    return FloatFromBits(sign | BitsFromFloat(magnitude));
  }
  // Normal: rebias the exponent from 15 to 127.
  return FloatFromBits(sign | ((exponent + 112u) << 23) | (fraction << 13));
}

// Round to nearest, ties to even, with IEEE's gradual underflow: results below 2^-14 become
// subnormals (or a signed zero), and magnitudes from 65520 (halfway between 65504 and 2^16) up
// overflow to infinity. NaN stays a (quiet) NaN with its sign and upper payload bits.
KEEL_HOST_DEVICE inline uint16_t FloatToFp16(float value) {
  const uint32_t bits = BitsFromFloat(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 2^16, inf
  if (magnitude >= 0x38800000u) {
    // A normal fp16 (>= 2^-14): rebias the exponent from 127 to 15 and drop 13 fraction bits,
    // rounding as FloatToBf16 does. A carry out of the fraction bumps the exponent, which is
    // also how [65520, 2^16) reaches infinity (0x7c00).
    const uint32_t rebiased = magnitude - (112u << 23);
    const uint32_t rounding = 0xfffu + ((rebiased >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rebiased + rounding) >> 13));
  }
  // A subnormal fp16 (or zero): the result's fraction is value * 2^24 rounded to an integer.
  // value = significand * 2^(exponent - 150) with a 24-bit significand, so that integer is the
  // significand shifted right by 126 - exponent. From a shift of 25 on (value < 2^-25, float32
  // subnormals included) it rounds to zero; a rounded-up 1023 carries into the smallest normal
  // fp16 (0x0400), which is its correct encoding.
  const uint32_t exponent = magnitude >> 23;
  const uint32_t shift = 126u - exponent;
  if (exponent == 0 || shift > 24u) return sign;
  const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
  uint32_t fraction = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (remainder > half || (remainder == half && (fraction & 1u) != 0)) ++fraction;
  return static_cast<uint16_t>(sign | fraction);
}

// The canonical quiet NaNs that every NaN gradient sum becomes. x86 and CUDA disagree on the sign
// and payload of a NaN that an add produces (x86 passes an operand's NaN on, or makes a negative
// one from inf - inf; CUDA always gives 0x7fffffff), so the sums do not pass them on.
inline constexpr uint16_t kBf16CanonicalNan = 0x7fc0u;
inline constexpr uint16_t kFp16CanonicalNan = 0x7e00u;

// One gradient add of 16-bit elements: widen both exactly, add once in float32, round once to
// nearest even. Float32's 24-bit significand is at least twice the 16-bit type's plus two bits
// (bf16: 8, fp16: 11), so rounding twice gives the exact sum rounded once to the 16-bit type.
KEEL_HOST_DEVICE inline uint16_t AddBf16(uint16_t acc, uint16_t source) {
  const float sum = Bf16ToFloat(acc) + Bf16ToFloat(source);
  return sum != sum ? kBf16CanonicalNan : FloatToBf16(sum);
}

KEEL_HOST_DEVICE inline uint16_t AddFp16(uint16_t acc, uint16_t source) {
  const float sum = Fp16ToFloat(acc) + Fp16ToFloat(source);
  return sum != sum ? kFp16CanonicalNan : FloatToFp16(sum);
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
