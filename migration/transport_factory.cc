// CreateTransport: the backend calls sit in a template so a backend missing from this build is
// never referenced (if constexpr discards the call), and the library still links.
#include "migration/transport_factory.h"

#include "keel/version.hpp"
#include "migration/transport_ucx.h"

namespace keel {
namespace {

template <bool kUcx = kWithUcx>
Result<std::unique_ptr<Transport>> CreateUcx(const MigrationConfig& config,
                                             Communicator& communicator) {
  if constexpr (kUcx) {
    UcxTransportOptions options;
    options.progress_thread = config.ucx_progress_thread;
    return CreateUcxTransport(communicator, options);
  } else {
    return Unimplemented("migration.transport \"ucx\": this build has no UCX (KEEL_WITH_UCX)");
  }
}

}  // namespace

Result<std::unique_ptr<Transport>> CreateTransport(const MigrationConfig& config,
                                                   Communicator& communicator,
                                                   LocalFabric* fabric) {
  if (config.transport == "local") {
    if (fabric == nullptr) {
      return InvalidArgument("migration.transport \"local\" needs the ranks' shared fabric");
    }
    return fabric->Connect(communicator.rank());
  }
  if (config.transport == "ucx") return CreateUcx(config, communicator);
  if (config.transport == "nccl") {
    return Unimplemented("migration.transport \"nccl\" is not implemented yet");
  }
  return InvalidArgument("migration.transport \"" + config.transport +
                         "\" is not one of local, ucx, nccl");
}

}  // namespace keel
