// Sequence migration (Luffy-style): moves a set of token/sequence buffers between ranks through
// the same transport, chunking, deadline and checksum verification as expert migration, so the
// sequence planner can rebalance work by moving sequences instead of experts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "keel/transport.hpp"
#include "migration/observer.h"

namespace keel {

// One sequence buffer moving from `src_rank` to `dst_rank`. Every rank passes the same list;
// `source` must be set on the source rank and `destination` (of `bytes` bytes) on the
// destination rank. `sequence_id` names it in errors.
struct SequenceMove {
  int64_t sequence_id = 0;
  int src_rank = 0;
  int dst_rank = 0;
  size_t bytes = 0;
  const std::byte* source = nullptr;  // [bytes] on src_rank
  std::byte* destination = nullptr;   // [bytes] on dst_rank
};

// Runs this rank's part of `moves` as batch `batch` (same number on every rank, distinct per
// batch) and returns once every rank verified its sequences, or with the error that aborted
// the batch. Blocking; call it from the thread that should drive the transport. Destinations
// hold the sequences only when OK is returned.
Status MigrateSequences(Transport& transport, uint64_t batch, std::span<const SequenceMove> moves,
                        const MigrationConfig& config, MigrationObserver* observer = nullptr,
                        MigrationReport* report = nullptr);

}  // namespace keel
