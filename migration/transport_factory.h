// Picks the transport that `migration.transport` names, so callers need not know which backends
// this build has: a backend that was not compiled in is a clear error, not a link failure.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "common/config.h"
#include "keel/status.hpp"
#include "keel/transport.hpp"
#include "migration/transport_local.h"

namespace keel {

// "local" needs `fabric` (ranks as threads of this process); "ucx" is collective over
// `communicator`, and in a process with a GPU it takes the current device's memory too, staged
// through page-locked host memory when UCX has no CUDA support (transport_staged.h); "nccl" is
// collective over `communicator` too, on the current CUDA device, and carries its host messages
// over `migration.nccl_host_transport` (ucx, or local over `fabric`).
Result<std::unique_ptr<Transport>> CreateTransport(const MigrationConfig& config,
                                                   Communicator& communicator,
                                                   LocalFabric* fabric = nullptr);

}  // namespace keel
