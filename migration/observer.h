// Hooks through which the monitor (or a test) watches migrations: bytes per transport, epoch
// durations and outcomes, chunks in flight. migration/ does not depend on monitor/; the engine
// plugs an observer in. Called from the migrator's background thread: implementations must be
// thread-safe and quick.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

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
};

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
};

}  // namespace keel
