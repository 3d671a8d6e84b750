// DeviceMemory's blocking helpers, the plain host implementation, and CreateCudaDeviceMemory for
// builds without CUDA (device_memory_cuda.cc has the one for builds with it).
#include "keel/device_memory.hpp"

#include <atomic>
#include <cstring>
#include <thread>

#include "kernels/add.h"
#include "kernels/checksum.h"

namespace keel {

Status DeviceMemory::WaitFor(uint64_t number) {
  while (true) {
    KEEL_ASSIGN_OR_RETURN(const uint64_t completed, CompletedCopies());
    if (completed > number) return Status::Ok();
    std::this_thread::yield();
  }
}

Status DeviceMemory::Copy(std::byte* destination, const std::byte* source, size_t bytes) {
  KEEL_ASSIGN_OR_RETURN(const uint64_t copy, StartCopy(destination, source, bytes));
  return WaitFor(copy);
}

Status DeviceMemory::Add(GradientType type, std::byte* acc, const std::byte* source, size_t bytes) {
  KEEL_ASSIGN_OR_RETURN(const uint64_t add, StartAdd(type, acc, source, bytes));
  return WaitFor(add);
}

namespace {

// Every operation completes before it returns; nothing is device memory.
class HostMemory final : public DeviceMemory {
 public:
  bool IsDeviceMemory(const void* /*data*/) override { return false; }
  Result<std::byte*> AllocateDevice(size_t bytes) override { return AllocateHost(bytes); }
  void FreeDevice(std::byte* data) override { FreeHost(data); }
  Result<std::byte*> AllocateHost(size_t bytes) override {
    return new std::byte[bytes == 0 ? 1 : bytes];
  }
  void FreeHost(std::byte* data) override { delete[] data; }

  Result<uint64_t> StartCopy(std::byte* destination, const std::byte* source,
                             size_t bytes) override {
    if (bytes > 0) std::memmove(destination, source, bytes);
    return started_++;
  }
  Result<uint64_t> StartAdd(GradientType type, std::byte* acc, const std::byte* source,
                            size_t bytes) override {
    KEEL_RETURN_IF_ERROR(kernels::cpu::AddInto(type, acc, source, static_cast<int64_t>(bytes)));
    return started_++;
  }
  Result<uint64_t> CompletedCopies() override { return started_.load(); }
  Result<uint64_t> Checksum(const std::byte* data, size_t bytes) override {
    return kernels::cpu::Checksum64({data, bytes});
  }

 private:
  std::atomic<uint64_t> started_{0};
};

}  // namespace

std::shared_ptr<DeviceMemory> CreateHostMemory() { return std::make_shared<HostMemory>(); }

#if !KEEL_KERNELS_CUDA
Result<std::shared_ptr<DeviceMemory>> CreateCudaDeviceMemory(int /*device*/) {
  return Unimplemented("CUDA device memory: this build has no CUDA (KEEL_WITH_CUDA)");
}
#endif

}  // namespace keel
