// The NCCL transport: device memory moves with ncclSend/ncclRecv, grouped, on a stream of its own;
// host memory (checksum trailers, verdicts) and the control messages that order the device
// operations go over a host transport (ucx or local). The protocol and its deadlock-freedom
// argument are in device_transport.cc; this file adds NCCL. Defined only in builds with
// KEEL_WITH_NCCL (keel::kWithNccl): transport_nccl.cc.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "keel/status.hpp"
#include "keel/transport.hpp"
#include "migration/device_transport.h"

namespace keel {

struct NcclTransportOptions {
  // The CUDA device of this rank's buffers; < 0: the device current when the transport is
  // created. The transport makes it current on every thread it uses.
  int device = -1;
  // Cancel and progress-thread behaviour of the protocol (device_transport.h).
  DeviceTransportOptions protocol;
};

// Collective over `communicator` (one rank per GPU, which NCCL requires): every rank creates a
// non-blocking NCCL communicator (rank 0's unique id broadcast over `communicator`, which is used
// only here) and a stream, then wraps them with `host`, whose ranks must be the communicator's.
// A host without a usable CUDA device gets FailedPrecondition on every rank.
//
// Device transfers complete when the CUDA event recorded after their group has passed
// (cudaEventQuery) and ncclCommGetAsyncError reports no error. Cancel of a transfer that both
// ranks agreed on waits protocol.cancel_grace_seconds, then calls ncclCommAbort: every device
// request of this rank fails with an error naming its peer and tag, the peers are told and abort
// theirs, and later device requests fail at once; host messages keep working. Creating the
// transport again (collectively) restores the device path.
Result<std::unique_ptr<Transport>> CreateNcclTransport(Communicator& communicator,
                                                       std::unique_ptr<Transport> host,
                                                       const NcclTransportOptions& options = {});

}  // namespace keel
