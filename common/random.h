// splitmix64, the one seeded mixer every deterministic draw in Keel starts from: fully
// specified, so the same seed gives the same numbers on every machine and standard library.
#pragma once

#include <cstdint>

namespace keel {

// Advances `state` and returns the next number.
inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace keel
