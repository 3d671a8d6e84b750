// Expert checkpoint files (docs/integration.md, "Expert files"): one expert's (or one shard's)
// weights and optimizer state under a header that says whose state it is and a checksum over
// header and state, so that LoadExperts refuses a corrupt, truncated or misplaced file before it
// changes any slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "keel/status.hpp"

namespace keel {

// Whose state a file holds and how large it is: what SaveExperts records, and what LoadExperts
// expects of the file it opens for a slot.
struct ExpertFileFields {
  int32_t layer = 0;
  int32_t expert = 0;  // logical id
  int32_t shard = 0;   // 0 for a whole expert
  int32_t shards = 1;  // 1 for a whole expert
  // Bytes of one element of the weights, as EngineOptions::shard_layout gives them; 0 when the
  // engine was not told (no layout, or tensors of several element sizes).
  uint32_t weight_element_bytes = 0;
  uint64_t weight_bytes = 0;
  uint64_t optimizer_bytes = 0;
};

// Version 2 ("KEELEXP2"): a header of this many bytes, then weight_bytes of weights, then
// optimizer_bytes of optimizer state, and nothing after.
inline constexpr size_t kExpertFileHeaderBytes = 56;
// Version 1 ("KEELEXP1", written before version 2): magic, weight_bytes, optimizer_bytes.
inline constexpr size_t kExpertFileV1HeaderBytes = 24;

// Fills the first kExpertFileHeaderBytes of `file` with the version-2 header of `fields`, whose
// checksum covers the header and the payload that follows it in `file` (which must have exactly
// kExpertFileHeaderBytes + weight_bytes + optimizer_bytes bytes).
void WriteExpertFileHeader(const ExpertFileFields& fields, std::span<std::byte> file);

// What a checked file holds.
struct ExpertFilePayload {
  int version = 2;    // 1: an older file, checked for its sizes only
  size_t offset = 0;  // where the weights start in the file; the optimizer state follows them
};

// Checks `contents`, the whole file read from `path`, against `expected`: magic, version,
// layer, expert, shard, shard count, weight element size (when both sides know it), sizes,
// exact length (nothing missing, nothing after the payload) and checksum. A version-1 file has
// no identity and no checksum; only its magic, sizes and length are checked. The error is
// InvalidArgument naming `path`, the field, and what was expected and found.
Result<ExpertFilePayload> CheckExpertFile(const std::string& path, std::string_view contents,
                                          const ExpertFileFields& expected);

}  // namespace keel
