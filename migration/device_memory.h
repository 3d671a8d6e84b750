// Device memory as migration sees it: which buffers live on the GPU, and the few things migration
// does to them besides sending them: copy them, checksum them, and stage them through page-locked
// host memory for a transport that moves host memory only. The CPU never reads or writes device
// memory itself; everything goes through this interface. CUDA: CreateCudaDeviceMemory below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "keel/status.hpp"

namespace keel {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // True when `data` points into device memory (the CPU must not touch it); false for every
  // other pointer, null included.
  virtual bool IsDeviceMemory(const void* data) = 0;

  // [bytes] of page-locked host memory, which device copies read and write at full speed; give
  // it back with FreeHost.
  virtual Result<std::byte*> AllocateHost(size_t bytes) = 0;
  virtual void FreeHost(std::byte* data) = 0;

  // Starts copying `bytes` bytes from `source` to `destination` (device or host memory, in any
  // combination) and returns its number: 0 for the first copy, then 1, 2... Copies complete in
  // the order they started. Both buffers must stay valid until the copy completed.
  virtual Result<uint64_t> StartCopy(std::byte* destination, const std::byte* source,
                                     size_t bytes) = 0;
  // How many started copies have completed, or the error that stopped this device's copies (a
  // CUDA error; after it no copy completes).
  virtual Result<uint64_t> CompletedCopies() = 0;

  // The kernels::cpu::Checksum64 of `bytes` bytes of device memory at `data`, computed on the
  // device after every copy started before; blocks until it is known.
  virtual Result<uint64_t> Checksum(const std::byte* data, size_t bytes) = 0;

  // StartCopy, then waits until that copy completed.
  Status Copy(std::byte* destination, const std::byte* source, size_t bytes);
};

// CUDA device `device` (< 0: the device current on the calling thread); every call makes it
// current on its thread. IsDeviceMemory asks cudaPointerGetAttributes (device and managed memory
// count); copies run on a non-blocking stream of its own, one event each; AllocateHost is
// cudaHostAlloc; Checksum runs kernels::gpu::SlotChecksums. FailedPrecondition without a usable
// CUDA device, Unimplemented in builds without CUDA (keel::kWithCuda).
Result<std::shared_ptr<DeviceMemory>> CreateCudaDeviceMemory(int device = -1);

}  // namespace keel
