// Device memory over a transport that moves host memory only (UCX without CUDA support): a send
// from device memory is copied into page-locked host memory and sent from there; a receive into
// device memory lands in page-locked host memory and is copied to the device before it completes.
// Host memory passes through unchanged. The wrapped transport's peers need not stage the same
// way: what travels is the same bytes under the same tag.
#pragma once

#include <cstddef>
#include <memory>

#include "keel/device_memory.hpp"
#include "keel/status.hpp"
#include "keel/transport.hpp"

namespace keel {

struct StagedTransportOptions {
  // Whether device buffers are staged through host memory (the host transport cannot read device
  // memory) or handed to the host transport as they are (UCX built with CUDA support). Either way
  // the transport reports `device` as its device_memory(), so the migrator checksums and copies
  // device buffers on the device.
  bool stage = true;
  // Page-locked staging buffers are kept for reuse after their message, up to this many bytes in
  // all: allocating page-locked memory costs far more than a chunk's copy.
  size_t pool_bytes = size_t{256} << 20;
};

// Wraps `host` (same rank, same peers; its name labels the byte counters) with `device`.
Result<std::unique_ptr<Transport>> CreateStagedTransport(
    std::unique_ptr<Transport> host, std::shared_ptr<DeviceMemory> device,
    const StagedTransportOptions& options = {});
// The same over a host transport someone else owns, which must outlive the result.
Result<std::unique_ptr<Transport>> CreateStagedTransport(
    Transport& host, std::shared_ptr<DeviceMemory> device,
    const StagedTransportOptions& options = {});

}  // namespace keel
