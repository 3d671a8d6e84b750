// DeviceMemory::Copy, and CreateCudaDeviceMemory for builds without CUDA (device_memory_cuda.cc
// has the one for builds with it).
#include "migration/device_memory.h"

#include <thread>

namespace keel {

Status DeviceMemory::Copy(std::byte* destination, const std::byte* source, size_t bytes) {
  KEEL_ASSIGN_OR_RETURN(const uint64_t copy, StartCopy(destination, source, bytes));
  while (true) {
    KEEL_ASSIGN_OR_RETURN(const uint64_t completed, CompletedCopies());
    if (completed > copy) return Status::Ok();
    std::this_thread::yield();
  }
}

#if !KEEL_KERNELS_CUDA
Result<std::shared_ptr<DeviceMemory>> CreateCudaDeviceMemory(int /*device*/) {
  return Unimplemented("CUDA device memory: this build has no CUDA (KEEL_WITH_CUDA)");
}
#endif

}  // namespace keel
