// The UCX transport: UCP tagged messages between processes over whatever UCX_TLS allows
// (shared memory and TCP on one machine, RDMA on clusters). Worker addresses are exchanged over
// a Communicator, so no extra socket service runs. Host memory, and device memory when UCX
// supports CUDA (UcxCarriesCudaMemory). An optional progress thread of its own
// (UcxTransportOptions::progress_thread). Defined only in builds with KEEL_WITH_UCX
// (keel::kWithUcx): transport_ucx.cc.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "keel/status.hpp"
#include "keel/transport.hpp"

namespace keel {

struct UcxTransportOptions {
  // How long Cancel waits for UCX to let go of a request before it force-closes the endpoint.
  double cancel_grace_seconds = 0.2;
  // A thread of the transport's own drives UCX while requests are outstanding, so transfers
  // advance while the thread that runs the exchange hashes or copies a chunk. Without it only
  // Progress() does, from the exchange's thread.
  bool progress_thread = true;
};

// Collective over `communicator`: every rank creates its worker, all-gathers the addresses and
// connects to every peer. The communicator is used only here.
Result<std::unique_ptr<Transport>> CreateUcxTransport(Communicator& communicator,
                                                      const UcxTransportOptions& options = {});

// Whether `transport` (made by CreateUcxTransport) takes CUDA device memory itself: its UCX
// context lists CUDA among the memory types it supports (a UCX built with CUDA, and UCX_TLS lets
// it use a cuda transport). Debian's UCX does not; device buffers then need host staging
// (transport_staged.h), which CreateTransport adds.
bool UcxCarriesCudaMemory(const Transport& transport);

}  // namespace keel
