// The device-memory half of the nccl transport, without CUDA: a Transport that passes host-memory
// messages to a host transport unchanged and moves device memory with a DeviceMover (NCCL in
// transport_nccl.cc), agreeing over the host transport on which operations every rank issues, in
// which group and in which order. Plain C++, so the protocol builds and is tested everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "keel/device_memory.hpp"
#include "keel/status.hpp"
#include "keel/transport.hpp"

namespace keel {

// One point-to-point operation of a device group.
struct DeviceOp {
  int peer = 0;
  bool send = false;
  std::byte* data = nullptr;  // [bytes] device memory; a send only reads it
  size_t bytes = 0;
};

// Moves device memory between the ranks of one job with the semantics of one NCCL communicator
// driven from one stream, which is all the protocol above it relies on:
// - no tags: the n-th send from rank a to rank b meets the n-th receive on b from a, and both
//   must have the same size;
// - groups run one after another, in launch order, and a group ends only when every operation in
//   it has met its counterpart;
// - the operations of one group progress independently of each other, except that operations
//   with the same peer in the same direction run in order.
// Called by one thread at a time.
class DeviceMover {
 public:
  virtual ~DeviceMover() = default;

  // Names the transport built on this mover ("nccl").
  virtual std::string_view name() const = 0;

  // Queues `ops` as one group behind the groups launched before it; never blocks for long.
  virtual Status Launch(std::span<const DeviceOp> ops) = 0;

  // How many launched groups have completed so far (they complete in launch order), or the
  // error that stopped the mover: a failed peer, a CUDA or NCCL error.
  virtual Result<uint64_t> Completed() = 0;

  // Stops every launched group for good: when Abort returns, no buffer of any group is touched
  // again, and later calls to Launch fail. For groups that can no longer complete (a peer failed,
  // stalled, or gave up on its part).
  virtual void Abort() = 0;
};

struct DeviceTransportOptions {
  // How long Cancel waits for a device transfer that both ranks already agreed on (it is in, or
  // about to join, a device group) before it aborts every device transfer of this rank: a
  // launched group cannot be taken back, only aborted as a whole.
  double cancel_grace_seconds = 1.0;
  // A thread of the transport's own runs the protocol (control messages, groups, completions)
  // while the transport exists, so this rank answers the others even while its owner does not
  // call Progress (it finished its exchange, or hashes a chunk). Without it only Progress() does,
  // and every rank must keep calling Progress while any rank moves device memory.
  bool progress_thread = true;
};

// Tags whose top byte is this value carry the transport's control messages over the host
// transport; posting a message under one of them is an InvalidArgument error.
inline constexpr uint64_t kDeviceControlTagByte = 0xFE;

// The transport of this rank over `host` (control messages and host-memory messages; its rank
// and size are the transport's; at most 65536 ranks) and `mover`, which moves the buffers that
// `memory` says are device memory (`memory` is also the transport's device_memory()). Every rank
// of `host` creates one; it takes no collective step itself. Both ends of a message must agree on
// where it lives: a device send meets a device receive, a host send a host receive.
Result<std::unique_ptr<Transport>> CreateDeviceTransport(
    std::unique_ptr<Transport> host, std::unique_ptr<DeviceMover> mover,
    std::shared_ptr<DeviceMemory> memory, const DeviceTransportOptions& options = {});

}  // namespace keel
