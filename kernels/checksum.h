// Checksums of expert state: the migrator computes them on the source and on the destination of
// every moved buffer and commits only when they agree. Not cryptographic; it detects corrupted,
// truncated, misplaced or stale chunks. Defined so that GPU threads can share the work: the
// value is a keyed sum of per-word terms (kernels/host_device.h), identical on CPU and GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

namespace cpu {

// Checksum of `bytes`; equal inputs give equal values on every machine (little-endian words).
// Chaining (`seed` = the previous checksum) covers several ranges.
uint64_t Checksum64(std::span<const std::byte> bytes, uint64_t seed = 0);

// The same checksum in pieces, for a buffer that arrives chunk by chunk: hash each chunk while it
// is still in cache instead of the whole buffer once it is complete. A piece starts at byte
// 8 * first_word of the buffer; every piece but the last has a multiple of 8 bytes. Then
//   ChecksumFromTerms(sum over pieces of ChecksumTerms(piece, first_word, seed), total, seed)
// equals Checksum64(buffer, seed) for any split and any order of the sum (mod 2^64).
uint64_t ChecksumTerms(std::span<const std::byte> piece, uint64_t first_word, uint64_t seed = 0);
uint64_t ChecksumFromTerms(uint64_t term_sum, uint64_t total_bytes, uint64_t seed = 0);

// Per-slot checksums of `num_slots` equal regions: slot i is the `slot_bytes` bytes at
// base + i * stride_bytes (stride_bytes >= slot_bytes).
//   checksums: [num_slots] uint64, overwritten; checksums[i] = Checksum64(slot i, seed)
Status SlotChecksums(const void* base, int64_t num_slots, int64_t slot_bytes, int64_t stride_bytes,
                     uint64_t seed, uint64_t* checksums);

}  // namespace cpu

namespace gpu {

// Device memory in and out, enqueued on `stream`.
Status SlotChecksums(const void* base, int64_t num_slots, int64_t slot_bytes, int64_t stride_bytes,
                     uint64_t seed, uint64_t* checksums, Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
