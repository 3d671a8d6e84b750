// The Transport interface: tagged, non-blocking point-to-point messages between ranks, the one
// thing migration needs from a backend. Keel's backends are chosen by name in the config
// (migration.transport: local, ucx, nccl); a trainer may pass its own implementation instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "keel/status.hpp"

namespace keel {

// Device memory as migration sees it (Keel's own backends only; see device_memory() below).
class DeviceMemory;

// Identifies one posted send or receive within its transport.
using RequestId = uint64_t;

class Transport {
 public:
  virtual ~Transport() = default;

  // "local", "ucx" or "nccl": the label of the observer's per-transport byte counters.
  virtual std::string_view name() const = 0;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;

  // Posts a send of `bytes` bytes at `data` to `peer` under `tag`. The buffer must stay valid
  // and unchanged until Test reports the request complete or Cancel returns. A send matches the
  // receive that `peer` posts with the same tag and this rank as its peer. Messages to one peer
  // should reach it in the order they were posted: a rank that aborts an exchange takes what a
  // peer sent until that peer's verdict, its last message, and cancels the rest.
  virtual Result<RequestId> PostSend(int peer, uint64_t tag, const std::byte* data,
                                     size_t bytes) = 0;
  // Posts a receive of exactly `bytes` bytes into `data` from `peer` under `tag`.
  virtual Result<RequestId> PostRecv(int peer, uint64_t tag, std::byte* data, size_t bytes) = 0;

  // Advances outstanding requests; never blocks for long. The thread that posts requests calls
  // it (the migrator's background thread is the progress thread of its transport).
  virtual void Progress() = 0;

  // nullopt while `request` is pending; once it completed, OK or the error (a failed peer, a
  // size mismatch) and the request is forgotten.
  virtual std::optional<Status> Test(RequestId request) = 0;

  // Gives up on `request`: when Cancel returns, the transport no longer touches its buffer and
  // the request is forgotten. May break the connection to the request's peer when the backend
  // cannot cancel otherwise (a send to a stalled peer); the next request to it reconnects.
  virtual void Cancel(RequestId request) = 0;

  // The device memory whose buffers PostSend and PostRecv accept besides host memory, so that
  // callers checksum and copy such buffers through it instead of touching them from the CPU;
  // nullptr when the transport moves host memory only (every transport written outside Keel).
  virtual DeviceMemory* device_memory() { return nullptr; }
};

}  // namespace keel
