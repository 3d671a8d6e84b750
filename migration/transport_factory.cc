// CreateTransport: the backend calls sit in a template so a backend missing from this build is
// never referenced (if constexpr discards the call), and the library still links.
#include "migration/transport_factory.h"

#include "keel/device_memory.hpp"
#include "keel/version.hpp"
#include "kernels/device.h"
#include "migration/transport_nccl.h"
#include "migration/transport_staged.h"
#include "migration/transport_ucx.h"

namespace keel {
namespace {

// `with_device`: in a process with a GPU, device buffers go through the GPU's DeviceMemory,
// staged through page-locked host memory unless UCX takes CUDA memory itself.
template <bool kUcx = kWithUcx>
Result<std::unique_ptr<Transport>> CreateUcx(Communicator& communicator, bool progress_thread,
                                             bool with_device) {
  if constexpr (kUcx) {
    UcxTransportOptions options;
    options.progress_thread = progress_thread;
    KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Transport> ucx,
                          CreateUcxTransport(communicator, options));
    if (!with_device || !kernels::GpuAvailable()) return ucx;
    KEEL_ASSIGN_OR_RETURN(std::shared_ptr<DeviceMemory> device, CreateCudaDeviceMemory());
    StagedTransportOptions staging;
    staging.stage = !UcxCarriesCudaMemory(*ucx);
    return CreateStagedTransport(std::move(ucx), std::move(device), staging);
  } else {
    return Unimplemented("migration.transport \"ucx\": this build has no UCX (KEEL_WITH_UCX)");
  }
}

// The nccl transport's host transport (control and host-memory messages), then NCCL over it.
template <bool kNccl = kWithNccl>
Result<std::unique_ptr<Transport>> CreateNccl(const MigrationConfig& config,
                                              Communicator& communicator, LocalFabric* fabric) {
  if constexpr (kNccl) {
    std::unique_ptr<Transport> host;
    if (config.nccl_host_transport == "local") {
      if (fabric == nullptr) {
        return InvalidArgument(
            "migration.nccl_host_transport \"local\" needs the ranks' shared fabric");
      }
      host = fabric->Connect(communicator.rank());
    } else if (config.nccl_host_transport == "ucx") {
      // The nccl transport's own thread drives the host transport, so UCX needs none.
      KEEL_ASSIGN_OR_RETURN(
          host, CreateUcx(communicator, /*progress_thread=*/false, /*with_device=*/false));
    } else {
      return InvalidArgument("migration.nccl_host_transport \"" + config.nccl_host_transport +
                             "\" is not one of ucx, local");
    }
    return CreateNcclTransport(communicator, std::move(host));
  } else {
    return Unimplemented("migration.transport \"nccl\": this build has no NCCL (KEEL_WITH_NCCL)");
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
  if (config.transport == "ucx") {
    return CreateUcx(communicator, config.ucx_progress_thread, /*with_device=*/true);
  }
  if (config.transport == "nccl") return CreateNccl(config, communicator, fabric);
  return InvalidArgument("migration.transport \"" + config.transport +
                         "\" is not one of local, ucx, nccl");
}

}  // namespace keel
