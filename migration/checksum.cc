// Four independent multiply-rotate lanes over 32-byte blocks keep the CPU's multipliers busy
// (several GB/s per core), then a final avalanche mixes lanes, tail and length.
#include "migration/checksum.h"

#include <bit>
#include <cstring>

namespace keel {
namespace {

constexpr uint64_t kMulA = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio
constexpr uint64_t kMulB = 0xd6e8feb86659fd93ull;
constexpr uint64_t kMulC = 0xc2b2ae3d27d4eb4full;

uint64_t Load64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  return v;
}

uint64_t Lane(uint64_t acc, uint64_t word) {
  acc += word * kMulB;
  acc = std::rotl(acc, 29);
  return acc * kMulA;
}

uint64_t Avalanche(uint64_t h) {
  h ^= h >> 31;
  h *= kMulC;
  h ^= h >> 29;
  h *= kMulB;
  h ^= h >> 32;
  return h;
}

}  // namespace

uint64_t Checksum64(std::span<const std::byte> bytes, uint64_t seed) {
  const std::byte* p = bytes.data();
  size_t n = bytes.size();
  uint64_t a = seed + kMulA;
  uint64_t b = seed ^ kMulB;
  uint64_t c = seed - kMulC;
  uint64_t d = ~seed;
  while (n >= 32) {
    a = Lane(a, Load64(p));
    b = Lane(b, Load64(p + 8));
    c = Lane(c, Load64(p + 16));
    d = Lane(d, Load64(p + 24));
    p += 32;
    n -= 32;
  }
  uint64_t h = std::rotl(a, 1) + std::rotl(b, 7) + std::rotl(c, 12) + std::rotl(d, 18);
  while (n >= 8) {
    h = Lane(h, Load64(p));
    p += 8;
    n -= 8;
  }
  uint64_t tail = 0;
  for (size_t i = 0; i < n; ++i) tail |= static_cast<uint64_t>(p[i]) << (8 * i);
  h = Lane(h, tail ^ (static_cast<uint64_t>(n) << 56));
  return Avalanche(h ^ static_cast<uint64_t>(bytes.size()) * kMulC);
}

}  // namespace keel
