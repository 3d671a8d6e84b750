// A fast 64-bit checksum of byte ranges: the migrator computes it on the source and on the
// destination of every moved buffer and commits only when they agree. Not cryptographic; it
// detects corrupted, truncated, misplaced or stale chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace keel {

// Checksum of `bytes`; equal inputs give equal values on every machine (little-endian reads).
uint64_t Checksum64(std::span<const std::byte> bytes, uint64_t seed = 0);

}  // namespace keel
