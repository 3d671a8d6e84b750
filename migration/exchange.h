// The engine under the migrator and the sequence-migration primitive: every rank runs the same
// list of buffer moves through a Transport, chunked and pipelined, optionally bandwidth-capped,
// with a deadline; destinations are verified by checksum; then the ranks exchange verdicts so
// that all of them either succeed or abort with the first error that explains why.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "keel/transport.hpp"
#include "migration/observer.h"

namespace keel {

// One move of up to two regions (e.g. weights and optimizer state) from `src_rank` to
// `dst_rank`. Every rank passes the same list in the same order; a rank fills only the pointers
// it owns (`source` on the source rank, `destination` on the destination rank).
struct ExchangeItem {
  static constexpr int kMaxRegions = 2;
  int src_rank = 0;
  int dst_rank = 0;
  std::string label;  // names the move in errors: "transfer layer 3 expert 12 rank 1 -> ..."
  int num_regions = 0;
  size_t region_bytes[kMaxRegions] = {0, 0};
  const std::byte* source[kMaxRegions] = {nullptr, nullptr};
  std::byte* destination[kMaxRegions] = {nullptr, nullptr};
};

// Migration knobs, checked: see MigrationConfig for their meaning.
struct ExchangeOptions {
  size_t chunk_bytes = 4 << 20;
  int pipeline_depth = 4;
  double bandwidth_cap_bytes_per_second = 0;  // 0 = uncapped
  std::chrono::duration<double> deadline{30.0};

  // Validates `config.migration`-style values, naming the key that is wrong.
  static Result<ExchangeOptions> FromConfig(const MigrationConfig& config);
};

// Which kind of exchange runs: expert epochs and sequence migrations use separate tag spaces so
// they can share a transport.
enum class ExchangeChannel : uint8_t { kExperts = 0, kSequences = 1 };

struct ExchangeRun {
  ExchangeChannel channel = ExchangeChannel::kExperts;
  uint64_t epoch = 0;
  std::string what;  // error prefix subject: "migration epoch 7", "sequence migration 3"
  const std::atomic<bool>* cancel = nullptr;  // set to abort from another thread
  // [num_ranks] the ranks taking part (they trade verdicts); empty = all. Lets survivors of a
  // failed rank keep migrating among themselves.
  std::vector<bool> participants;
};

// Runs this rank's part of `items`. OK only when every rank reported that all its moves landed
// and verified; otherwise "<what> aborted: <label>: <why>" with the first error this rank saw or
// heard of. Returns within the deadline (plus a short grace to cancel requests) in every case.
Status RunExchange(Transport& transport, std::span<const ExchangeItem> items,
                   const ExchangeOptions& options, const ExchangeRun& run,
                   MigrationObserver* observer, MigrationReport* report);

// Tags: [channel+kind 4 bits | epoch 20 | item 20 | chunk 20]; exposed for tests.
inline constexpr int kMaxExchangeItems = 1 << 20;
inline constexpr int kMaxChunksPerItem = 1 << 20;

}  // namespace keel
