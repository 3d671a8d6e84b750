// Hooks through which the monitor (or a test) watches migrations: bytes per transport, epoch
// durations and outcomes, chunks in flight. migration/ does not depend on monitor/; the engine
// plugs an observer in. Called from the migrator's background thread: implementations must be
// thread-safe and quick.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "keel/status.hpp"

namespace keel {

enum class ByteDirection { kSent, kReceived, kCopiedLocally };

// How one rank's part of an epoch (or of a sequence migration) ended.
struct MigrationReport {
  uint64_t epoch = 0;
  std::string_view transport;  // the transport's name()
  Status status;               // OK: every rank verified its transfers; else why it aborted
  double seconds = 0;          // Start to verdict
  int transfers = 0;           // transfers this rank took part in
  size_t bytes_sent = 0;
  size_t bytes_received = 0;
  size_t bytes_copied_locally = 0;
  // Ranks this rank found lost while the ranks agreed on the outcome (a coordinator that never
  // sent its view); the outcome holds for every surviving rank all the same.
  std::vector<int> lost_ranks;
};

// Points of one rank's exchange, in order, for tracing and for tests that kill a rank at each:
// its transfers are done and verified, before it tells anyone; before it posts its verdict to
// `peer`; every verdict is in (or the deadline passed), before the ranks agree; before a
// coordinator posts its view to `peer`; the outcome is agreed, before the caller commits or
// discards.
enum class ExchangePhase { kTransfersDone, kVerdictSend, kVotesIn, kAgreementSend, kDecided };

class MigrationObserver {
 public:
  virtual ~MigrationObserver() = default;
  virtual void OnEpochStarted(uint64_t /*epoch*/, int /*transfers*/, size_t /*bytes*/) {}
  // One chunk finished moving.
  virtual void OnBytes(std::string_view /*transport*/, ByteDirection /*direction*/,
                       size_t /*bytes*/) {}
  // Chunks this rank has in flight (sends + receives) changed.
  virtual void OnInFlight(int /*chunks*/) {}
  virtual void OnEpochFinished(const MigrationReport& /*report*/) {}
  // `peer` is the rank a send goes to, else -1.
  virtual void OnExchangePhase(ExchangePhase /*phase*/, int /*peer*/) {}
};

}  // namespace keel
